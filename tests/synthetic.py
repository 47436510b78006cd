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
