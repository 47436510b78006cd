"""torchrun: at the end of trace(), every rank's summary gathered on every rank in one all_gather
of a fixed vector of numbers over the process group already there."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..analysis.rank_verdict import RANK_NUMBERS, compare_ranks, rank_summary
from ..analysis.verdict import WARN_SHARE
from ..failures import never_raise
from .backward import LocalRank
from .identity import dist_rank, distributed_env, loader_facts

if TYPE_CHECKING:
    from ..run import Run


INTEGERS = {"rank", "pid", "n_steps", "n_analysed", "warmup_steps", "num_workers", "batch_size"}

def encode(summary: Mapping[str, Any]) -> list[float]:
    """A rank's summary as a fixed vector of numbers (NaN: not measured) for all_gather."""
    values = []
    for key in RANK_NUMBERS:
        value = summary.get(key)
        values.append(float(value) if isinstance(value, (int, float)) and value is not None else float("nan"))
    values.append(1.0 if summary.get("clock") == "gpu" else 0.0)
    return values


def decode(values: Any) -> dict[str, Any]:
    """A rank's summary back from the vector `encode` made (NaN: None)."""
    numbers = [float(v) for v in values]
    out: dict[str, Any] = {}
    for key, value in zip(RANK_NUMBERS, numbers, strict=False):
        if value != value:
            out[key] = None
        else:
            out[key] = int(value) if key in INTEGERS else value
    out["clock"] = "gpu" if numbers[len(RANK_NUMBERS)] else "cpu"
    out.update(status="finished", error=None, loader=None)
    return out


def local_summary(run: Run, rank: int) -> dict[str, Any]:
    """This rank's summary (its own steps, before any other rank's is known)."""
    summary = run.summary
    feed = run.rank_collector
    backward = feed.backward.median(int(summary["warmup_steps"])) if isinstance(feed, LocalRank) else None
    loader = run.loader_ref() if run.loader_ref is not None else None
    return rank_summary(rank, summary, backward, pid=os.getpid(), loader=loader_facts(run.loader_info, loader))


def gather(run: Run, error: BaseException | None) -> None:
    """At the end of trace() on one rank of several: every rank's summary on every rank, in one
    all_gather over the existing process group. Not after an error (the others may never come
    to the collective)."""
    dist = sys.modules.get("torch.distributed")
    torch = sys.modules.get("torch")
    try:
        ready = bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:
        ready = False
    if not ready or torch is None or dist is None:
        if distributed_env():
            run.notes.append("The ranks were not gathered: no process group at the end of trace().")
        return
    with never_raise(run.notes, "The ranks were not gathered"):
        world, rank = int(dist.get_world_size()), int(dist.get_rank())
        if world < 2:
            return
        if error is not None:
            run.notes.append(
                "The ranks were not gathered: this rank stopped with an error (a collective now "
                "could wait for ranks that never come)."
            )
            return
        mine = encode(local_summary(run, rank))
        device = torch.device("cpu")
        if str(dist.get_backend()) == "nccl" and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())
        tensor = torch.tensor(mine, dtype=torch.float64, device=device)
        out = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(out, tensor)
        run.ranks = [decode(t.cpu().tolist()) for t in out]
        found = compare_ranks(run.ranks)
        if found is not None and found["score"] >= WARN_SHARE and found["rank"] != rank:
            run.notes.append(
                f"The box shows the medians of rank {found['rank']} (the rank that holds the "
                f"others back); the steps and the evidence are this rank's (rank {rank})."
            )


def shows_report(run: Run) -> bool:
    """Among several ranks only rank 0 prints the report (every rank has `run.ranks`)."""
    rank, world = dist_rank()
    return world is None or world < 2 or not rank


