"""torchrun: at the end of trace(), every rank's summary gathered on every rank in one all_gather
of a fixed vector of numbers over the process group already there."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..analysis.rank_evidence import COLUMNS, paired_evidence
from ..analysis.rank_verdict import RANK_NUMBERS, compare_ranks, holds_back, rank_summary
from ..analysis.summary_keys import RankRow
from ..failures import never_raise
from .backward import LocalRank
from .identity import dist_rank, distributed_env, loader_facts, process_group

if TYPE_CHECKING:
    from ..recording import Recording


INTEGERS = {"rank", "pid", "n_steps", "n_analysed", "warmup_steps", "num_workers", "batch_size"}
GATHERED_STEPS = 2048  # a rank's last steps in the gather, for the per-step evidence (80 KiB a rank)

def encode(summary: Mapping[str, Any]) -> list[float]:
    """A rank's summary as a fixed vector of numbers (NaN: not measured) for all_gather."""
    values = []
    for key in RANK_NUMBERS:
        value = summary.get(key)
        values.append(float(value) if isinstance(value, (int, float)) and value is not None else float("nan"))
    values.append(1.0 if summary.get("clock") == "gpu" else 0.0)
    return values


def decode(values: Any) -> RankRow:
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
    return cast(RankRow, out)


def encode_steps(columns: Mapping[str, Any], n: int = GATHERED_STEPS) -> np.ndarray:
    """A rank's last `n` steps as a fixed block of numbers, column after column (COLUMNS; NaN
    where it has fewer steps)."""
    block = np.full((len(COLUMNS), n), np.nan)
    steps = np.asarray(columns.get("step", ()), dtype=np.float64)[-n:]
    for i, name in enumerate(COLUMNS):
        values = np.asarray(columns.get(name, np.full(len(steps), np.nan)), dtype=np.float64)[-n:]
        block[i, n - len(values) :] = values
    return block.ravel()


def decode_steps(values: Any, n: int = GATHERED_STEPS) -> dict[str, np.ndarray]:
    """The steps back from the block `encode_steps` made."""
    block = np.asarray(values, dtype=np.float64).reshape(len(COLUMNS), n)
    kept = np.isfinite(block[0])
    out = {name: block[i, kept] for i, name in enumerate(COLUMNS)}
    out["step"] = out["step"].astype(np.int64)
    return out


def local_steps(run: Recording) -> dict[str, np.ndarray]:
    """This rank's steps with its time in backward() per step (rank_evidence's COLUMNS)."""
    cols = run.recorder.columns()
    steps = np.asarray(cols["step"], dtype=np.int64)
    sync = np.full(len(steps), np.nan)
    feed = run.rank_collector
    if isinstance(feed, LocalRank) and len(feed.backward.steps) and len(steps):
        sample = feed.backward
        idx = np.clip(np.searchsorted(sample.steps, steps), 0, len(sample.steps) - 1)
        hit = sample.steps[idx] == steps
        sync[hit] = sample.values[idx[hit]]
    return {"step": steps, "sync_ms": sync, "data_wait_ms": cols["data_wait_ms"], "compute_ms": cols["compute_ms"], "step_ms": cols["step_ms"]}


def with_evidence(summaries: list[RankRow], steps: list[dict[str, np.ndarray]]) -> None:
    """Each gathered rank's per-step evidence against the others (`paired`), after the latest
    warm-up among them."""
    first = max((int(x.get("warmup_steps") or 0) for x in summaries), default=0)
    evidence = paired_evidence({int(x["rank"]): cols for x, cols in zip(summaries, steps, strict=True)}, first)
    for entry in summaries:
        if entry["rank"] in evidence:
            entry["paired"] = evidence[entry["rank"]]


def local_summary(run: Recording, rank: int) -> RankRow:
    """This rank's summary (its own steps, before any other rank's is known)."""
    summary = run.result.summary
    feed = run.rank_collector
    backward = feed.backward.median(int(summary["warmup_steps"])) if isinstance(feed, LocalRank) else None
    loader = run.loader_ref() if run.loader_ref is not None else None
    return rank_summary(rank, summary, backward, pid=os.getpid(), loader=loader_facts(run.loader_info, loader))


def gather(run: Recording, error: BaseException | None) -> None:
    """At the end of trace() on one rank of several: every rank's summary on every rank, in one
    all_gather over the existing process group. Not after an error (the others may never come
    to the collective)."""
    dist = process_group()
    torch = sys.modules.get("torch")
    if torch is None or dist is None:
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
        mine = encode(local_summary(run, rank)) + encode_steps(local_steps(run)).tolist()
        device = torch.device("cpu")
        if str(dist.get_backend()) == "nccl" and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())
        tensor = torch.tensor(mine, dtype=torch.float64, device=device)
        out = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(out, tensor)
        size = len(RANK_NUMBERS) + 1
        values = [t.cpu().tolist() for t in out]
        run.ranks = [decode(v[:size]) for v in values]
        with_evidence(run.ranks, [decode_steps(v[size:]) for v in values])
        found = compare_ranks(run.ranks)
        if found is not None and holds_back(found) and found["rank"] != rank:
            run.notes.append(
                f"The box shows the medians of rank {found['rank']} (the rank that holds the "
                f"others back); the steps and the evidence are this rank's (rank {rank})."
            )


def shows_report(run: object) -> bool:
    """Among several ranks only rank 0 prints the report (every rank has `run.ranks`)."""
    rank, world = dist_rank()
    return world is None or world < 2 or not rank


