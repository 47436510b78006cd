"""Pure summaries of recorded step columns: the headline means a stopwatch agrees with, medians,
tails, shares, the clock and warm-up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, cast

import numpy as np

from .noise import block_edges, student_t975
from .summary_keys import Stats, Summary

PHASES = ("data_wait_ms", "compute_ms", "step_ms")
GPU_OF = {"data_wait_ms": "data_wait_gpu_ms", "compute_ms": "compute_gpu_ms", "step_ms": "step_gpu_ms"}
MAX_AUTO_WARMUP = 5


def auto_warmup(n_steps: int) -> int:
    """A few steps, never more than a tenth of the run."""
    return min(MAX_AUTO_WARMUP, n_steps // 10)


def choose_clock(columns: Mapping[str, np.ndarray], analysed: np.ndarray, gpu_used: bool) -> Literal["gpu", "cpu"]:
    """'gpu' when every analysed step has GPU timings and the work ran on the GPU, else 'cpu'."""
    if not gpu_used or not analysed.any():
        return "cpu"
    gpu_steps = columns["step_gpu_ms"][analysed]
    return "gpu" if bool(np.all(np.isfinite(gpu_steps))) else "cpu"


def _stats(values: np.ndarray) -> Stats:
    if not len(values):
        return {"median": None, "mean": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {
        "median": float(p50),
        "mean": float(values.mean()),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(values.max()),
    }


def straggler_share(wait: np.ndarray, step: np.ndarray) -> tuple[float, int]:
    """Share of total step time lost to a minority of spiky fetches, and how many there were.

    A fetch is a spike when it waits more than three times the median wait and more than the
    median wait plus a tenth of the median step; what it waits beyond the median is the loss.
    """
    if len(wait) < 2 or step.sum() <= 0:
        return 0.0, 0
    med_wait = float(np.median(wait))
    spikes = stalls(wait, step)
    return float((wait[spikes] - med_wait).sum() / step.sum()), int(spikes.sum())


def stalls(wait: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The fetches that stall (`straggler_share`'s spikes), as a mask."""
    med_wait, med_step = float(np.median(wait)), float(np.median(step))
    spikes: np.ndarray = wait > max(3.0 * med_wait, med_wait + 0.1 * med_step)
    return spikes


def summarize(
    columns: Mapping[str, np.ndarray],
    n_steps: int,
    warmup: int | None = None,
    gpu_used: bool = False,
    totals_ms: Mapping[str, float] | None = None,
) -> Summary:
    """Numbers behind the verdict, from the kept step columns (see Recorder.columns)."""
    steps = columns["step"]
    warm = auto_warmup(n_steps) if warmup is None else max(0, int(warmup))
    analysed = steps >= warm
    clock = choose_clock(columns, analysed, gpu_used)

    def col(phase: str, on: str) -> np.ndarray:
        name = GPU_OF[phase] if on == "gpu" else phase
        return np.asarray(columns[name][analysed], dtype=np.float64)

    wait, compute, step = (col(p, clock) for p in PHASES)
    stats = {p: _stats(v) for p, v in zip(PHASES, (wait, compute, step), strict=True)}
    med = {p: stats[p]["median"] for p in PHASES}
    med_step = med["step_ms"]

    def share(phase: str) -> float | None:
        """Median over the steps of each step's share (robust when step times are bimodal)."""
        part = wait if phase == "data_wait_ms" else compute
        ok = step > 0
        if not ok.any():
            return None
        return float(np.median(part[ok] / step[ok]))

    lost, n_spikes = straggler_share(wait, step)
    n_analysed = int(analysed.sum())
    host = col("compute_ms", "cpu")
    out: Summary = {
        "clock": clock,
        "n_steps": int(n_steps),
        "n_analysed": max(0, n_steps - warm),
        "warmup_steps": min(warm, n_steps),
        "data_wait_ms": med["data_wait_ms"],
        "compute_ms": med["compute_ms"],
        "step_ms": med_step,
        "data_wait_share": share("data_wait_ms"),
        "compute_share": share("compute_ms"),
        "straggler_share": lost if n_analysed else None,
        "straggler_steps": n_spikes,
        "steps_per_s": (1000.0 / stats["step_ms"]["mean"]) if stats["step_ms"]["mean"] else None,
        "host_ms": float(np.median(host)) if clock == "gpu" and len(host) else None,
        "stats": stats,
        "totals_ms": dict(totals_ms) if totals_ms is not None else None,
    }
    out.update(gpu_work(columns, analysed, clock, med_step, out["data_wait_share"]))
    out.update(headline(columns, n_steps, clock, totals_ms, stats, max(0, n_steps - warm), step))
    return out


# Keys of the headline figures (docs/verdicts.md, "Which figure is which").
HEADLINE_KEYS = (
    "mean_data_wait_ms",  # the mean wait a step, every step recorded (warm-up included)
    "mean_compute_ms",  # the mean compute a step, every step recorded
    "mean_step_ms",  # the mean step, every step: mean_data_wait_ms + mean_compute_ms
    "loop_ms",  # the steps' whole time: n_steps x mean_step_ms
    "warmup_ms",  # the warm-up steps' time, inside loop_ms
    "data_wait_time_share",  # the analysed steps' total wait / their total time
    "mean_step_noise",  # the analysed mean step's 95 % interval, ± a share of it (blocks of steps)
    "outside_steps_ms",  # from the first step's start to the last's end, the time in no step
)


def mean_noise(step: np.ndarray) -> float | None:
    """How well the analysed steps know their mean: the half-width of its 95 % interval as a
    share of it, from the means of consecutive blocks of steps (steps drift, so single steps
    would say too little) and Student's t for few blocks; None with fewer than 2 steps."""
    values = step[np.isfinite(step)]
    if len(values) < 2 or values.mean() <= 0:
        return None
    edges = block_edges(len(values))
    if len(edges) < 3:  # one block: the steps themselves, with their own t
        edges = np.arange(len(values) + 1)
    means = np.add.reduceat(values, edges[:-1]) / np.diff(edges)
    k = len(means)
    half = student_t975(k - 1) * float(np.std(means, ddof=1)) / np.sqrt(k)
    return float(half / float(values.mean()))


def outside_steps(columns: Mapping[str, np.ndarray], step_name: str, n_steps: int, loop_ms: float) -> float | None:
    """The time between the first step's start and the last step's end that no step holds
    (phases such as validation, traceml's own set-up): the span minus the steps' sum; None when
    the first or the last step was not kept."""
    numbers = np.asarray(columns["step"])
    start = np.asarray(columns["time_s"], dtype=np.float64)
    step = np.asarray(columns[step_name], dtype=np.float64)
    if not len(numbers) or numbers[0] != 0 or numbers[-1] != n_steps - 1:
        return None
    span = 1000.0 * (start[-1] - start[0]) + float(step[-1])
    return max(0.0, span - loop_ms) if np.isfinite(span) else None


def headline(
    columns: Mapping[str, np.ndarray],
    n_steps: int,
    clock: str,
    totals_ms: Mapping[str, float] | None,
    stats: Mapping[str, Stats],
    n_analysed: int,
    analysed_step: np.ndarray,
) -> Summary:
    """HEADLINE_KEYS: the figures a user's stopwatch agrees with. Means over every step recorded
    (the exact totals when the recorder kept them, else the kept columns): wait + compute = step,
    and steps x step = the loop's time; the medians stay beside them (`step_ms`, ...)."""
    out = cast(Summary, dict.fromkeys(HEADLINE_KEYS))
    out["mean_step_noise"] = mean_noise(analysed_step)
    name = {p: GPU_OF[p] if clock == "gpu" else p for p in PHASES}
    if totals_ms is not None and n_steps:
        sums = {p: totals_ms.get(name[p]) for p in PHASES}
        count = n_steps
    else:
        kept = {p: np.asarray(columns[name[p]], dtype=np.float64) for p in PHASES}
        sums = {p: float(np.nansum(v)) for p, v in kept.items()}
        count = len(kept["step_ms"])
    if not count or any(v is None or not np.isfinite(v) for v in sums.values()):
        return out
    wait, compute = float(sums["data_wait_ms"] or 0.0), float(sums["compute_ms"] or 0.0)
    out["mean_data_wait_ms"], out["mean_compute_ms"] = wait / count, compute / count
    out["mean_step_ms"] = (wait + compute) / count
    loop = out["loop_ms"] = wait + compute
    out["outside_steps_ms"] = outside_steps(columns, name["step_ms"], count, loop)
    mean_wait, mean_step = stats["data_wait_ms"]["mean"], stats["step_ms"]["mean"]
    if mean_step is not None:
        out["warmup_ms"] = max(0.0, loop - mean_step * n_analysed)
        out["data_wait_time_share"] = (mean_wait or 0.0) / mean_step if mean_step > 0 else None
    return out


# Keys of a GPU-clock run's copies, syncs, backlog and utilisation (all None on the CPU clock,
# and each None when its optional column was not measured).
GPU_WORK_KEYS = (
    "h2d_ms",  # median GPU time of host-to-device copies per step
    "h2d_share",  # h2d_ms / step_ms
    "h2d_bytes",  # median bytes copied per step
    "h2d_gbps",  # effective bandwidth: h2d_bytes / h2d_ms (medians), GB/s
    "h2d_pinned_share",  # share of the bytes copied from pinned memory
    "h2d_non_blocking_share",  # share of the bytes copied asynchronously (non_blocking, pinned)
    "sync_ms",  # median host wait in timed synchronising calls per step
    "sync_calls",  # median synchronising calls per step
    "untimed_sync_share",  # share of the steps with a synchronising call whose wait is untimed
    # median host body time minus its wait in syncs, over the steps without an untimed sync
    # (None: syncs not watched, or most steps had an untimed one: the host's time is unknown)
    "host_issue_ms",
    "gpu_backlog_ms",  # median GPU work still queued when a step ended (sampled steps)
    "own_host_ms",  # median host time of traceml's own GPU-path hooks per step (taken out of host_issue_ms)
    "gpu_busy_share",  # median NVML utilisation / 100
    "host_share",  # 1 - busy - data wait share - h2d share: GPU idle inside steps (needs NVML)
)


def _measured(columns: Mapping[str, np.ndarray], name: str, analysed: np.ndarray) -> np.ndarray | None:
    """The finite values of an optional column over the analysed steps (None: not measured)."""
    col = columns.get(name)
    if col is None:
        return None
    values = np.asarray(col, dtype=np.float64)[analysed]
    values = values[np.isfinite(values)]
    return values if len(values) else None


def _median(values: np.ndarray | None) -> float | None:
    return float(np.median(values)) if values is not None else None


def gpu_work(
    columns: Mapping[str, np.ndarray],
    analysed: np.ndarray,
    clock: str,
    step_ms: float | None,
    data_wait_share: float | None,
) -> Summary:
    """GPU_WORK_KEYS from the optional columns h2d_ms, h2d_bytes, h2d_pinned_bytes,
    h2d_async_bytes, sync_ms, sync_calls, sync_untimed, gpu_backlog_ms and gpu_util_pct (the
    NVML samples placed on the steps; NaN when too few fell inside the loop)."""
    out = cast(Summary, dict.fromkeys(GPU_WORK_KEYS))
    if clock != "gpu" or not step_ms:
        return out
    h2d = _measured(columns, "h2d_ms", analysed)
    if h2d is not None:
        h2d_ms = out["h2d_ms"] = _median(h2d)
        out["h2d_share"] = h2d_ms / step_ms if h2d_ms is not None else None
        per_step = out["h2d_bytes"] = _median(_measured(columns, "h2d_bytes", analysed))
        ms = np.asarray(columns["h2d_ms"], dtype=np.float64)[analysed]
        sums: dict[str, float] = {}
        for name in ("h2d_bytes", "h2d_pinned_bytes", "h2d_async_bytes"):
            col = columns.get(name)
            if col is not None:
                values = np.asarray(col, dtype=np.float64)[analysed]
                sums[name] = float(values[np.isfinite(values) & np.isfinite(ms)].sum())
        nbytes = sums.get("h2d_bytes", 0.0)
        if per_step and h2d_ms:
            out["h2d_gbps"] = per_step / h2d_ms / 1e6
        if nbytes > 0:
            pinned, non_blocking = sums.get("h2d_pinned_bytes"), sums.get("h2d_async_bytes")
            out["h2d_pinned_share"] = pinned / nbytes if pinned is not None else None
            out["h2d_non_blocking_share"] = non_blocking / nbytes if non_blocking is not None else None
    sync = _measured(columns, "sync_ms", analysed)
    out["sync_ms"] = _median(sync)
    out["sync_calls"] = _median(_measured(columns, "sync_calls", analysed))
    own = columns.get("own_host_ms")
    if own is not None:
        out["own_host_ms"] = _median(_measured(columns, "own_host_ms", analysed))
    if sync is not None:  # the body minus an unknown wait would be unknown
        host = np.asarray(columns["compute_ms"], dtype=np.float64)[analysed]
        issue = host - np.asarray(columns["sync_ms"], dtype=np.float64)[analysed]
        if own is not None:  # our hooks' host time is no work of the user's
            issue = issue - np.nan_to_num(np.asarray(own, dtype=np.float64)[analysed])
        untimed = columns.get("sync_untimed")
        if untimed is not None:  # a step with an untimed wait for the GPU: its issue time is unknown
            waited = np.asarray(untimed, dtype=np.float64)[analysed] > 0
            out["untimed_sync_share"] = float(waited.mean()) if len(waited) else None
            issue = np.where(waited, np.nan, issue)
        known = issue[np.isfinite(issue)]
        out["host_issue_ms"] = _median(known) if len(known) and 2 * len(known) >= len(issue) else None
    out["gpu_backlog_ms"] = _median(_measured(columns, "gpu_backlog_ms", analysed))
    util = _measured(columns, "gpu_util_pct", analysed)
    if util is not None:
        busy_pct = float(np.median(util))
        out["gpu_busy_share"] = busy_pct / 100.0
        idle = (100.0 - busy_pct) / 100.0  # not 1 - busy: 90 % busy is exactly 10 % idle
        out["host_share"] = max(0.0, idle - (data_wait_share or 0.0) - (out.get("h2d_share") or 0.0))
    return out


def with_batch_size(summary: Summary, batch_size: int | None, batches_per_step: float | None = None) -> Summary:
    """Add the batch size read from the batches, and the samples a second it gives (a step of
    gradient accumulation takes several batches)."""
    mean = summary["stats"]["step_ms"]["mean"]
    per_step = batch_size * (batches_per_step or 1.0) if batch_size else None
    summary["batch_size"] = batch_size
    summary["samples_per_s"] = per_step * 1000.0 / mean if per_step and mean else None
    return summary
