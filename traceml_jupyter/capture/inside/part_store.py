"""The stamps of the sampled steps' parts and their sums per step: flat arrays written while a
sampled step runs (step_parts.py), summed per step with numpy when columns are read, and folded
into a bounded history (every kept sampled step until the cap, then a uniform sample of them,
as the Recorder keeps steps)."""

from __future__ import annotations

from array import array
from collections.abc import Mapping

import numpy as np

from ..steps.step_history import StepHistory

FORWARD, BACKWARD, OPTIMIZER, CLOSURE = 0, 1, 2, 3  # a closure's own time is no part (it is the rest)
PARTS = ("forward", "backward", "optimizer")
PART_COLUMNS = ("forward_ms", "backward_ms", "optimizer_ms", "rest_ms")
GPU_PART_COLUMNS = ("forward_gpu_ms", "backward_gpu_ms", "optimizer_gpu_ms", "rest_gpu_ms")
FORWARD_OK, OPTIMIZER_OK = 1, 2  # a sampled step's forward, optimizer were timed whole
FOLD_RECORDS = 4096  # raw sampled steps kept before the oldest are summed into the history
KEPT_CAP = 1 << 15  # sampled steps kept in the history (then one in 2, 4, ... of them)
# A rest below zero by more than this share of the step's compute is not clock noise: NaN.
REST_TOLERANCE = 0.02


class PartStore:
    """Stamps (kind, start, own ns) and sampled steps (index, end of their stamps, validity,
    kept-out spans). A sampled step's stamps are those after the previous one's."""

    def __init__(self) -> None:
        self.kind: array[int] = array("b")
        self.t0: array[int] = array("q")
        self.own: array[int] = array("q")
        self.base = 0  # stamps folded away: a stamp's number is base + its index
        self.gpu_own: dict[int, float] = {}  # stamp number -> its own GPU ms (once read)
        self.has_gpu = False
        self.rec_step: array[int] = array("q")
        self.rec_end: array[int] = array("q")
        self.rec_flags: array[int] = array("b")
        self.rec_spans: dict[int, list[tuple[int, int]]] = {}
        self.no_forward = False  # the run's forward was not found: NaN everywhere
        self._kept = StepHistory(KEPT_CAP, "d" * (2 * len(PARTS)))  # rows as in `sums`

    # -- writing (sampled steps only) ----------------------------------------------------------
    def record(self, step: int, flags: int, spans: list[tuple[int, int]] | None) -> None:
        """Close the parts of a step record: its step, its flags and its spans (None: none)."""
        self.rec_step.append(step)
        self.rec_end.append(len(self.kind))
        self.rec_flags.append(flags)
        if spans:
            self.rec_spans[len(self.rec_step) - 1] = spans

    def merged(self, first: int, n: int, open_sampled: bool) -> int | None:
        """The steps from `first` on were merged into the open step. Returns the flags the open
        step keeps (None: it is not sampled); stamps of merged steps stay the open step's when
        it is sampled, else they go."""
        steps = np.array(self.rec_step, dtype=np.int64)  # a copy: the buffer is resized below
        keep = int(np.searchsorted(steps, first))
        dropped = range(keep, len(steps))
        flags = FORWARD_OK | OPTIMIZER_OK
        for i in dropped:
            flags &= self.rec_flags[i]
            self.rec_spans.pop(i, None)
        if len(dropped) != n:  # a merged step was not sampled: the open step is not whole
            flags = 0
        del self.rec_step[keep:]
        del self.rec_end[keep:]
        del self.rec_flags[keep:]
        self._kept.drop_from(first)
        if not open_sampled:
            self.truncate(int(self.rec_end[-1]) if len(self.rec_end) else 0)
            return None
        return flags

    def truncate(self, n_stamps: int) -> None:
        """Forget the stamps from index `n_stamps` on (and their GPU times)."""
        for buf in (self.kind, self.t0, self.own):
            del buf[n_stamps:]
        last = self.base + n_stamps
        for stamp in [s for s in self.gpu_own if s >= last]:
            del self.gpu_own[stamp]

    # -- summing ----------------------------------------------------------------------------------
    def sums(self, upto: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per recorded sampled step (the first `upto`): its index, and its parts' own time in
        ms, rows forward, backward, optimizer on the CPU clock, then on the GPU's (NaN where
        not timed or not read)."""
        n_rec = len(self.rec_step) if upto is None else upto
        steps = np.array(self.rec_step[:n_rec], dtype=np.int64)
        values = np.full((2 * len(PARTS), n_rec), np.nan)
        if not n_rec:
            return steps, values
        ends = np.array(self.rec_end[:n_rec], dtype=np.int64)
        n_stamps = int(ends[-1])
        kind = np.array(self.kind[:n_stamps], dtype=np.int64)
        own = np.array(self.own[:n_stamps], dtype=np.float64) / 1e6
        rec_of = np.repeat(np.arange(n_rec), np.diff(ends, prepend=0))
        keep = np.ones(n_stamps, dtype=bool)
        if self.rec_spans:  # stamps inside a phase kept out of the step (validation) are not its
            t0 = np.array(self.t0[:n_stamps], dtype=np.int64)
            for r, spans in self.rec_spans.items():
                if r < n_rec:
                    for s, e in spans:
                        keep &= ~((rec_of == r) & (t0 >= s) & (t0 < e))
        gpu_own = np.full(n_stamps, np.nan)
        if self.gpu_own:
            for stamp, ms in self.gpu_own.items():
                i = stamp - self.base
                if 0 <= i < n_stamps:
                    gpu_own[i] = ms
        flags = np.array(self.rec_flags[:n_rec], dtype=np.int64)
        valid = {FORWARD: (flags & FORWARD_OK) > 0, OPTIMIZER: (flags & OPTIMIZER_OK) > 0}
        for p in range(len(PARTS)):
            sel = keep & (kind == p)
            cpu = np.bincount(rec_of[sel], weights=own[sel], minlength=n_rec)[:n_rec]
            ok = valid.get(p, np.ones(n_rec, dtype=bool))
            values[p] = np.where(ok, cpu, np.nan)
            if self.has_gpu:
                g = gpu_own[sel]
                gpu = np.bincount(rec_of[sel], weights=np.nan_to_num(g), minlength=n_rec)[:n_rec]
                unread = np.bincount(rec_of[sel], weights=np.isnan(g).astype(np.float64), minlength=n_rec)[:n_rec]
                values[len(PARTS) + p] = np.where(ok & (unread == 0), gpu, np.nan)
        return steps, values

    def fold(self, n_rec: int) -> None:
        """Sum the oldest `n_rec` sampled steps into the history and forget their stamps."""
        if n_rec <= 0:
            return
        steps, values = self.sums(n_rec)
        self._kept.extend(steps, *values)
        used = int(self.rec_end[n_rec - 1])
        for buf in (self.kind, self.t0, self.own):
            del buf[:used]
        del self.rec_step[:n_rec]
        del self.rec_flags[:n_rec]
        self.rec_end[:] = array("q", (e - used for e in self.rec_end[n_rec:]))
        self.rec_spans = {r - n_rec: s for r, s in self.rec_spans.items() if r >= n_rec}
        for stamp in [s for s in self.gpu_own if s < self.base + used]:
            del self.gpu_own[stamp]
        self.base += used

    # -- reading ------------------------------------------------------------------------------------
    def per_step(self) -> tuple[np.ndarray, np.ndarray]:
        """Every sampled step kept (history and raw): its index, and its parts (rows as in
        `sums`)."""
        steps, values = self.sums()
        kept = self._kept
        if len(kept):
            steps = np.concatenate([kept.steps_from(), steps])
            values = np.concatenate([np.stack([kept.column(c) for c in range(len(kept.columns))]), values], axis=1)
        if self.no_forward:
            values[0] = values[len(PARTS)] = np.nan
        return steps, values

    def columns(self, cols: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The parts of the recorder's kept steps `cols["step"]` (NaN where a step was not
        sampled or a part not timed), and the rest: the step's compute less its three parts."""
        steps = np.asarray(cols["step"], dtype=np.int64)
        have, values = self.per_step()
        idx = np.clip(np.searchsorted(have, steps), 0, max(len(have) - 1, 0))
        hit = have[idx] == steps if len(have) else np.zeros(len(steps), dtype=bool)
        out: dict[str, np.ndarray] = {}
        for row0, clock, names in ((0, "", PART_COLUMNS), (len(PARTS), "_gpu", GPU_PART_COLUMNS)):
            total = np.zeros(len(steps))
            for p, name in enumerate(names[:3]):
                column = np.full(len(steps), np.nan)
                column[hit] = values[row0 + p][idx[hit]]
                out[name] = column
                total = total + column
            compute = np.asarray(cols.get("compute" + clock + "_ms", np.full(len(steps), np.nan)), dtype=np.float64)
            rest = compute - total
            rest = np.where((rest < 0) & (rest >= -REST_TOLERANCE * np.abs(compute)), 0.0, rest)
            out[names[3]] = np.where(rest < 0, np.nan, rest)
        return out

    def nbytes(self) -> int:
        """The memory the store holds, in bytes."""
        raw = sum(a.buffer_info()[1] * a.itemsize for a in (self.kind, self.t0, self.own, self.rec_step, self.rec_end, self.rec_flags))
        return raw + self._kept.nbytes()
