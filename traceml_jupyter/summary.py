"""Pure summaries of recorded step columns: medians, tails, shares, the clock and warm-up."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

PHASES = ("data_wait_ms", "compute_ms", "step_ms")
GPU_OF = {"data_wait_ms": "data_wait_gpu_ms", "compute_ms": "compute_gpu_ms", "step_ms": "step_gpu_ms"}
MAX_AUTO_WARMUP = 5


def auto_warmup(n_steps: int) -> int:
    """A few steps, never more than a tenth of the run."""
    return min(MAX_AUTO_WARMUP, n_steps // 10)


def choose_clock(columns: Mapping[str, np.ndarray], analysed: np.ndarray, gpu_used: bool) -> str:
    """'gpu' when every analysed step has GPU timings and the work ran on the GPU, else 'cpu'."""
    if not gpu_used or not analysed.any():
        return "cpu"
    gpu_steps = columns["step_gpu_ms"][analysed]
    return "gpu" if bool(np.all(np.isfinite(gpu_steps))) else "cpu"


def _stats(values: np.ndarray) -> dict[str, float | None]:
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
    med_wait, med_step = float(np.median(wait)), float(np.median(step))
    spikes = wait > max(3.0 * med_wait, med_wait + 0.1 * med_step)
    return float((wait[spikes] - med_wait).sum() / step.sum()), int(spikes.sum())


def summarize(
    columns: Mapping[str, np.ndarray],
    n_steps: int,
    warmup: int | None = None,
    gpu_used: bool = False,
    totals_ms: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Numbers behind the verdict, from the kept step columns (see Recorder.columns)."""
    steps = columns["step"]
    warm = auto_warmup(n_steps) if warmup is None else max(0, int(warmup))
    analysed = steps >= warm
    clock = choose_clock(columns, analysed, gpu_used)

    def col(phase: str, on: str) -> np.ndarray:
        name = GPU_OF[phase] if on == "gpu" else phase
        return np.asarray(columns[name][analysed], dtype=np.float64)

    wait, compute, step = (col(p, clock) for p in PHASES)
    stats = {p: _stats(v) for p, v in zip(PHASES, (wait, compute, step))}
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
    out: dict[str, Any] = {
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
    return out
