"""Recorder: per-step timestamps in flat columns, bounded memory for any run length."""

from __future__ import annotations

from array import array
from typing import Any, Callable

import numpy as np

# Steps are appended to a raw chunk of int64 timestamps (24 bytes a step). A full chunk is
# folded into the kept history: every step while the history is under HISTORY_CAP, then a
# uniform sample (every `stride`-th step), with exact running totals.
CHUNK = 1 << 16
HISTORY_CAP = 1 << 17

COLUMNS = ("step", "time_s", "data_wait_ms", "compute_ms", "step_ms")
GPU_COLUMNS = ("data_wait_gpu_ms", "compute_gpu_ms", "step_gpu_ms")
TOTALS = COLUMNS[2:] + GPU_COLUMNS


class Recorder:
    """Timestamps of each step: fetch start, fetch end (body start), body end.

    `add` is the only call on the per-step path; everything else runs rarely.
    """

    def __init__(self) -> None:
        self._t0: array[int] = array("q")
        self._t1: array[int] = array("q")
        self._t2: array[int] = array("q")
        self._gpu: list[array[float]] = [array("d") for _ in GPU_COLUMNS]
        self.has_gpu = False
        self.origin_ns: int | None = None
        self._base = 0  # global index of the chunk's first step
        self._stride = 1
        self._kept: dict[str, np.ndarray] = {c: np.empty(0) for c in COLUMNS + GPU_COLUMNS}
        self._kept["step"] = np.empty(0, dtype=np.int64)
        self.totals_ms: dict[str, float] = {c: 0.0 for c in TOTALS}
        # Called before a chunk is folded, so pending GPU timings can be resolved first.
        self.before_fold: Callable[[], None] | None = None

    # -- per step -------------------------------------------------------------------------
    def add(self, t0: int, t1: int, t2: int) -> None:
        self._t0.append(t0)
        self._t1.append(t1)
        self._t2.append(t2)
        if len(self._t0) >= CHUNK:
            self.fold()

    def add_gpu(self, wait_ms: float, compute_ms: float) -> None:
        """GPU timings of the oldest step that has none yet (they resolve in step order)."""
        w, c, s = self._gpu
        w.append(wait_ms)
        c.append(compute_ms)
        s.append(wait_ms + compute_ms)
        self.has_gpu = True

    # -- reading --------------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        return self._base + len(self._t0)

    @property
    def stride(self) -> int:
        """1 while every step is kept; k when one step in k is kept."""
        return self._stride

    def _chunk_columns(self, start: int = 0) -> dict[str, np.ndarray]:
        t0 = np.frombuffer(self._t0, dtype=np.int64)[start:]
        t1 = np.frombuffer(self._t1, dtype=np.int64)[start:]
        t2 = np.frombuffer(self._t2, dtype=np.int64)[start:]
        origin = self.origin_ns if self.origin_ns is not None else (int(t0[0]) if len(t0) else 0)
        n = len(t0)
        cols: dict[str, np.ndarray] = {
            "step": np.arange(self._base + start, self._base + start + n, dtype=np.int64),
            "time_s": (t0 - origin) / 1e9,
            "data_wait_ms": (t1 - t0) / 1e6,
            "compute_ms": (t2 - t1) / 1e6,
            "step_ms": (t2 - t0) / 1e6,
        }
        for name, values in zip(GPU_COLUMNS, self._gpu):
            col = np.full(n, np.nan)
            got = np.frombuffer(values, dtype=np.float64)[start:]
            col[: len(got)] = got[:n]
            cols[name] = col
        return cols

    def columns(self) -> dict[str, np.ndarray]:
        """Every kept step (all steps until the history cap, then a uniform sample)."""
        chunk = self._chunk_columns()
        keep = chunk["step"] % self._stride == 0
        return {c: np.concatenate([self._kept[c], chunk[c][keep]]) for c in COLUMNS + GPU_COLUMNS}

    def tail(self, n: int) -> dict[str, np.ndarray]:
        """The last `n` steps, exact (for the live view)."""
        have = len(self._t0)
        cols = self._chunk_columns(max(0, have - n))
        if have >= n or not len(self._kept["step"]):
            return cols
        more = n - have
        return {c: np.concatenate([self._kept[c][-more:], cols[c]]) for c in cols}

    def totals(self) -> dict[str, float]:
        """Exact sums in ms over every step recorded (not only the kept ones)."""
        out = dict(self.totals_ms)
        chunk = self._chunk_columns()
        for c in TOTALS:
            out[c] += float(np.nansum(chunk[c]))
        return out

    # -- folding --------------------------------------------------------------------------
    def fold(self) -> None:
        if self.before_fold is not None:
            self.before_fold()
        if not len(self._t0):
            return
        if self.origin_ns is None:
            self.origin_ns = self._t0[0]
        chunk = self._chunk_columns()
        for c in TOTALS:
            self.totals_ms[c] += float(np.nansum(chunk[c]))
        keep = chunk["step"] % self._stride == 0
        kept = {c: np.concatenate([self._kept[c], chunk[c][keep]]) for c in COLUMNS + GPU_COLUMNS}
        while len(kept["step"]) > HISTORY_CAP:
            self._stride *= 2
            sel = kept["step"] % self._stride == 0
            kept = {c: v[sel] for c, v in kept.items()}
        self._kept = kept
        n = len(self._t0)
        n_gpu = [len(g) for g in self._gpu]
        self._base += n
        self._t0, self._t1, self._t2 = array("q"), array("q"), array("q")
        # GPU timings of steps past the chunk (none after before_fold) carry over.
        self._gpu = [array("d", g[n:]) if k > n else array("d") for g, k in zip(self._gpu, n_gpu)]

    def nbytes(self) -> int:
        arrays: list[array[Any]] = [self._t0, self._t1, self._t2, *self._gpu]
        raw = sum(a.buffer_info()[1] * a.itemsize for a in arrays)
        return raw + sum(v.nbytes for v in self._kept.values())

    def describe(self) -> dict[str, Any]:
        return {"n_steps": self.n_steps, "stride": self._stride, "nbytes": self.nbytes()}
