"""Synthetic step columns, shaped as Recorder.columns() returns them (CPU clock)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def step_columns(wait_ms: Sequence[float] | np.ndarray, compute_ms: Sequence[float] | np.ndarray) -> dict[str, np.ndarray]:
    w, c = np.asarray(wait_ms, dtype=float), np.asarray(compute_ms, dtype=float)
    nan = np.full(len(w), np.nan)
    return {
        "step": np.arange(len(w)),
        "time_s": np.cumsum(w + c) / 1000,
        "data_wait_ms": w,
        "compute_ms": c,
        "step_ms": w + c,
        "data_wait_gpu_ms": nan,
        "compute_gpu_ms": nan,
        "step_gpu_ms": nan,
    }


def drifting_steps(n: int, phi: float, rng: np.random.Generator, mean: float = 40.0, sd: float = 2.0) -> np.ndarray:
    """Step times that drift (AR(1)): each step keeps `phi` of the last one's offset from `mean`
    plus fresh noise; their spread is `sd` whatever phi."""
    noise = rng.normal(0.0, sd * np.sqrt(1 - phi**2), n)
    x = np.empty(n)
    x[0] = rng.normal(0.0, sd)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + noise[i]
    return mean + x
