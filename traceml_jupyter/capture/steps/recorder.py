"""Recorder: per-step timestamps in flat columns, bounded memory for any run length."""

from __future__ import annotations

from array import array
from typing import Any, TypedDict

import numpy as np

from .step_history import StepHistory

# Steps are appended to a raw chunk of int64 timestamps (24 bytes a step). A full chunk is
# folded into the kept history, also raw int64 timestamps (arrays that grow with it): every step
# while the history has room (HISTORY_CAP), then a uniform sample (every `stride`-th step,
# a StepHistory), with exact running totals. Milliseconds are derived when read.
CHUNK = 1 << 16
HISTORY_CAP = 1 << 17
NAN = float("nan")

COLUMNS = ("step", "time_s", "data_wait_ms", "compute_ms", "step_ms")
GPU_COLUMNS = ("data_wait_gpu_ms", "compute_gpu_ms", "step_gpu_ms")
TOTALS = COLUMNS[2:] + GPU_COLUMNS


class RecorderSize(TypedDict):
    """What `Recorder.describe` says of its size."""

    n_steps: int
    stride: int
    nbytes: int


class Recorder:
    """Three timestamps a step (see `add`): its start, start + data wait, end - kept-out time.

    `add` is the only call on the per-step path; everything else runs rarely.
    """

    def __init__(self) -> None:
        self._t0: array[int] = array("q")
        self._t1: array[int] = array("q")
        self._t2: array[int] = array("q")
        self._gpu_wait: array[float] = array("d")
        self._gpu_compute: array[float] = array("d")
        self.has_gpu = False
        self.origin_ns: int | None = None
        self._base = 0  # global index of the chunk's first step
        # The kept history: the three timestamps, then (from the first GPU timing) the GPU's two.
        self._history = StepHistory(HISTORY_CAP, "qqq", every_step=True)
        self._totals_ns = [0, 0]  # exact sums of data wait and compute over folded steps
        self._totals_gpu = [0.0, 0.0]

    # -- per step -------------------------------------------------------------------------
    def add(self, t0: int, t1: int, t2: int) -> None:
        """One step: its start, its start plus its data wait, its end minus the time kept out of
        it (phases, the view's own refresh). So data wait = t1 - t0, step = t2 - t0."""
        self._t0.append(t0)
        self._t1.append(t1)
        self._t2.append(t2)
        if self.has_gpu:
            self._gpu_wait.append(NAN)
            self._gpu_compute.append(NAN)
        if len(self._t0) >= CHUNK:
            self.fold()

    def add_many(self, t0: np.ndarray, t1: np.ndarray, t2: np.ndarray) -> None:
        """Several steps at once (int64 arrays, as `add` takes them one by one): the chunk is
        folded where `add` would have folded it."""
        done, n = 0, len(t0)
        while done < n:
            take = min(n - done, CHUNK - len(self._t0))
            for col, values in ((self._t0, t0), (self._t1, t1), (self._t2, t2)):
                col.frombytes(np.ascontiguousarray(values[done : done + take], dtype=np.int64).data.cast("B"))
            if self.has_gpu:
                nans = array("d", [NAN]) * take
                self._gpu_wait.extend(nans)
                self._gpu_compute.extend(nans)
            done += take
            if len(self._t0) >= CHUNK:
                self.fold()

    def enable_gpu(self) -> None:
        """From now on steps can have GPU timings (add_gpu); earlier ones have none."""
        if not self.has_gpu:
            n = len(self._t0)
            self._gpu_wait = array("d", [NAN] * n)
            self._gpu_compute = array("d", [NAN] * n)
            self.has_gpu = True

    def add_gpu(self, step: int, wait_ms: float, compute_ms: float) -> None:
        """GPU timings of step `step` (they resolve later than the step, sometimes after its
        chunk was folded)."""
        if not self.has_gpu:
            self.enable_gpu()
        if step >= self._base:
            i = step - self._base
            if i < len(self._gpu_wait):
                self._gpu_wait[i] = wait_ms
                self._gpu_compute[i] = compute_ms
            return
        self._totals_gpu[0] += wait_ms
        self._totals_gpu[1] += compute_ms
        row = self._history.index(step)
        if row is not None:
            self._kept_gpu_columns()
            self._history.columns[3][row] = wait_ms
            self._history.columns[4][row] = compute_ms

    def _kept_gpu_columns(self) -> None:
        if len(self._history.columns) == 3:  # GPU timings from now on: NaN for the steps before
            self._history.add_column("d", NAN)
            self._history.add_column("d", NAN)

    def pop_tail(self, n: int) -> tuple[int, int, int] | None:
        """Remove the last n steps (all still in the chunk) for merging them into the step that
        follows: the first one's start, their data wait and their step time (ns). Steps are back
        to back, so their kept-out time is (next start - first start) - step time."""
        if not 0 < n <= len(self._t0):
            return None
        t0, t1, t2 = self._t0[-n:], self._t1[-n:], self._t2[-n:]
        wait = sum(b - a for a, b in zip(t0, t1, strict=True))
        steps = sum(c - a for a, c in zip(t0, t2, strict=True))
        first = t0[0]
        for arr in (self._t0, self._t1, self._t2):
            del arr[-n:]
        if self.has_gpu:
            del self._gpu_wait[-n:]
            del self._gpu_compute[-n:]
        return first, wait, steps

    # -- reading --------------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        """The steps recorded so far (kept or folded into the history)."""
        return self._base + len(self._t0)

    @property
    def stride(self) -> int:
        """1 while every step is kept; k when one step in k is kept."""
        return self._history.stride

    def _chunk_raw(self, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The chunk's timestamps (3, n) and GPU timings (2, n; NaN where not yet resolved)."""
        n = len(self._t0) - start
        t = np.empty((3, n), dtype=np.int64)
        for row, values in enumerate((self._t0, self._t1, self._t2)):
            t[row] = np.frombuffer(values, dtype=np.int64)[start:]
        gpu = np.full((2, n), np.nan)
        for row, floats in enumerate((self._gpu_wait, self._gpu_compute)):
            got = np.frombuffer(floats, dtype=np.float64)[start : start + n]
            gpu[row, : len(got)] = got
        return t, gpu

    def _derive(self, steps: np.ndarray, t: np.ndarray, gpu: np.ndarray) -> dict[str, np.ndarray]:
        origin = self.origin_ns if self.origin_ns is not None else (int(t[0, 0]) if t.shape[1] else 0)
        return {
            "step": steps,
            "time_s": (t[0] - origin) / 1e9,
            "data_wait_ms": (t[1] - t[0]) / 1e6,
            "compute_ms": (t[2] - t[1]) / 1e6,
            "step_ms": (t[2] - t[0]) / 1e6,
            "data_wait_gpu_ms": gpu[0],
            "compute_gpu_ms": gpu[1],
            "step_gpu_ms": gpu[0] + gpu[1],
        }

    def _kept(self, first: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        history = self._history
        k = len(history)
        if first >= k:
            return np.empty(0, dtype=np.int64), np.empty((3, 0), np.int64), np.empty((2, 0))
        t = np.stack([history.column(c, first) for c in range(3)])
        has_gpu = len(history.columns) == 5
        gpu = np.stack([history.column(c, first) for c in (3, 4)]) if has_gpu else np.full((2, k - first), np.nan)
        return history.steps_from(first), t, gpu

    def columns(self) -> dict[str, np.ndarray]:
        """Every kept step (all steps until the history cap, then a uniform sample)."""
        k_steps, k_t, k_gpu = self._kept()
        t, gpu = self._chunk_raw()
        sel = slice((-self._base) % self.stride, None, self.stride)
        steps = np.arange(self._base, self.n_steps, dtype=np.int64)[sel]
        return self._derive(
            np.concatenate([k_steps, steps]),
            np.concatenate([k_t, t[:, sel]], axis=1),
            np.concatenate([k_gpu, gpu[:, sel]], axis=1),
        )

    def means_from(self, first: int) -> tuple[float | None, float | None]:
        """Mean step_ms and data_wait_ms of the kept steps from index `first` on, as `columns()`
        gives them, without building every column (None: no such step)."""
        k_steps, k_t, _ = self._kept()
        t, _ = self._chunk_raw()
        sel = slice((-self._base) % self.stride, None, self.stride)
        steps = np.concatenate([k_steps, np.arange(self._base, self.n_steps, dtype=np.int64)[sel]])
        raw = np.concatenate([k_t, t[:, sel]], axis=1)
        analysed = steps >= first
        if not analysed.any():
            return None, None
        step = ((raw[2] - raw[0]) / 1e6)[analysed]
        wait = ((raw[1] - raw[0]) / 1e6)[analysed]
        return float(np.mean(step)), float(np.mean(wait))

    def tail(self, n: int) -> dict[str, np.ndarray]:
        """The last `n` steps, exact within the chunk (for the live view)."""
        have = len(self._t0)
        t, gpu = self._chunk_raw(max(0, have - n))
        steps = np.arange(self.n_steps - t.shape[1], self.n_steps, dtype=np.int64)
        if have < n and len(self._history):
            k_steps, k_t, k_gpu = self._kept(max(0, len(self._history) - (n - have)))
            steps = np.concatenate([k_steps, steps])
            t = np.concatenate([k_t, t], axis=1)
            gpu = np.concatenate([k_gpu, gpu], axis=1)
        return self._derive(steps, t, gpu)

    def totals(self) -> dict[str, float]:
        """Exact sums in ms over every step recorded (not only the kept ones)."""
        t, gpu = self._chunk_raw()
        wait_ns = self._totals_ns[0] + int((t[1] - t[0]).sum())
        compute_ns = self._totals_ns[1] + int((t[2] - t[1]).sum())
        gpu_wait = self._totals_gpu[0] + float(np.nansum(gpu[0]))
        gpu_compute = self._totals_gpu[1] + float(np.nansum(gpu[1]))
        return {
            "data_wait_ms": wait_ns / 1e6,
            "compute_ms": compute_ns / 1e6,
            "step_ms": (wait_ns + compute_ns) / 1e6,
            "data_wait_gpu_ms": gpu_wait,
            "compute_gpu_ms": gpu_compute,
            "step_gpu_ms": gpu_wait + gpu_compute,
        }

    # -- folding --------------------------------------------------------------------------
    def fold(self) -> None:
        """Move the steps recorded since the last fold into the totals and the kept history
        (one in `stride`; the stride doubles when the history is full); the raw buffers start
        empty again."""
        n = len(self._t0)
        if not n:
            return
        if self.origin_ns is None:
            self.origin_ns = self._t0[0]
        # Views on the chunk's buffers: the fold copies only what it keeps.
        t0, t1, t2 = (np.frombuffer(a, dtype=np.int64) for a in (self._t0, self._t1, self._t2))
        self._totals_ns[0] += int((t1 - t0).sum())
        self._totals_ns[1] += int((t2 - t1).sum())
        gpu: list[np.ndarray] = []
        if self.has_gpu:
            _, chunk_gpu = self._chunk_raw()
            gpu = [chunk_gpu[0], chunk_gpu[1]]
            self._totals_gpu[0] += float(np.nansum(gpu[0]))
            self._totals_gpu[1] += float(np.nansum(gpu[1]))
            self._kept_gpu_columns()
        # One step in `stride` into the history (the stride doubled first when it is full).
        self._history.extend(np.arange(self._base, self._base + n, dtype=np.int64), t0, t1, t2, *gpu)
        del t0, t1, t2  # release the views before the buffers are replaced
        self._base += n
        self._t0, self._t1, self._t2 = array("q"), array("q"), array("q")
        # GPU timings still pending for this chunk's steps arrive later (add_gpu, by index): a
        # fold never waits for the GPU.
        self._gpu_wait, self._gpu_compute = array("d"), array("d")

    def nbytes(self) -> int:
        """The memory the recorder's buffers hold, in bytes."""
        arrays: list[array[Any]] = [self._t0, self._t1, self._t2, self._gpu_wait, self._gpu_compute]
        raw = sum(a.buffer_info()[1] * a.itemsize for a in arrays)
        return raw + self._history.nbytes()

    def describe(self) -> RecorderSize:
        """Its size: steps recorded, the stride of the kept history, bytes held."""
        return {"n_steps": self.n_steps, "stride": self.stride, "nbytes": self.nbytes()}
