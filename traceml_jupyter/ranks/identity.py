"""Who this process is among several: its rank and world size, and what a rank reports of its
end and its training loader."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from ..capture.data.probes import attribute, plain_count, safe_len, type_name
from ..facts.loader import RankLoader


def process_group() -> Any:
    """torch.distributed when this process has an initialised process group, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def dist_rank() -> tuple[int | None, int | None]:
    """(rank, world size) from an initialised process group, else from RANK / WORLD_SIZE."""
    dist = process_group()
    if dist is not None:
        return int(dist.get_rank()), int(dist.get_world_size())
    return env_count("RANK"), env_count("WORLD_SIZE")


def env_count(name: str) -> int | None:
    """A count from the environment (torchrun sets RANK, WORLD_SIZE as decimal strings)."""
    text = os.environ.get(name, "").strip()
    return plain_count(int(text)) if text.isdecimal() else None


def distributed_env() -> bool:
    """This process is one rank of several (torchrun, or a process group already set up)."""
    rank, world = dist_rank()
    return world is not None and world > 1


def describe_error(exc: BaseException | None) -> str | None:
    """`ValueError: the last line of its message`, or None."""
    if exc is None:
        return None
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1]}" if text else type(exc).__name__


def loader_facts(info: Mapping[str, Any] | None, loader: Any) -> RankLoader | None:
    """What the per-rank table compares of a rank's training loader: workers, batch size,
    sampler (and its shard for a DistributedSampler), samples."""
    if info is None and loader is None:
        return None
    info = info or {}
    sampler = attribute(loader, "sampler") if loader is not None else None
    name = type_name(sampler) if sampler is not None else None
    replicas, rank = attribute(sampler, "num_replicas"), attribute(sampler, "rank")
    if name and plain_count(replicas) is not None and plain_count(rank) is not None:
        name += f" (shard {rank} of {replicas})"
    return {
        "num_workers": info.get("num_workers"),
        "batch_size": info.get("batch_size"),
        "sampler": name,
        "samples": safe_len(sampler) if sampler is not None else info.get("n_samples"),
    }


