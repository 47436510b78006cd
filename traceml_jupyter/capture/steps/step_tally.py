"""Per-step sums of something measured inside steps (copy time, bytes, sync waits), kept as
flat columns with the Recorder's memory bound, and aligned to the Recorder's steps on demand."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from .recorder import HISTORY_CAP
from .step_history import StepHistory


class StepTally:
    """Sums by step index. `add(step, value)` is the only call on the measuring path.

    Steps arrive in order (copies resolve in stream order, syncs happen in host order), so a
    value for the newest step accumulates in place and one for a later step appends. When more
    than `cap` steps are kept, only steps that are multiples of a doubled stride stay (as in the
    Recorder); `total` stays exact.

    `dense`: every step from `first_step` on was watched, so a step without an entry measured
    zero. Otherwise (sampled measurements) a step without an entry was not measured (NaN).
    """

    def __init__(self, dense: bool = True, cap: int = HISTORY_CAP) -> None:
        self.dense = dense
        self.cap = cap
        self.first_step: int | None = None  # the first step watched (dense tallies)
        self.total = 0.0
        self._kept = StepHistory(cap, "d")
        self._steps = self._kept.steps  # the same arrays for the whole run (halved in place)
        self._values = self._kept.columns[0]

    @property
    def stride(self) -> int:
        """1 while every step is kept; k when one step in k is kept."""
        return self._kept.stride

    def watch_from(self, step: int) -> None:
        """Steps from `step` on are watched (dense: a step with nothing added measured 0.0)."""
        if self.first_step is None:
            self.first_step = step

    def add(self, step: int, value: float) -> None:
        """Add `value` to step `step` (and to the total)."""
        self.total += value
        steps = self._steps
        if steps and steps[-1] == step:
            self._values[-1] += value
            return
        if steps and step < steps[-1]:
            i = bisect_left(steps, step)
            if i < len(steps) and steps[i] == step:
                self._values[i] += value
            return
        self._kept.add(step, value)

    def merge_from(self, step: int) -> None:
        """The steps from `step` on became one step, `step` (the capture's step model merges
        micro-steps once it sees what a step is): a dense tally sums their values there, a
        sampled one keeps none of them (a probe of a part of a step says nothing of it)."""
        steps, values = self._steps, self._values
        i = bisect_left(steps, step)
        if self.first_step is not None and self.first_step > step:
            self.first_step = step
        if i == len(steps):
            return
        merged = sum(values[i:])
        del steps[i:]
        del values[i:]
        if self.dense and step % self.stride == 0:
            steps.append(step)
            values.append(merged)

    def __len__(self) -> int:
        return len(self._steps)

    def column(self, steps: np.ndarray) -> np.ndarray:
        """The sums at `steps` (the Recorder's kept step indices): the value where one was added,
        0.0 where a dense tally watched the step and saw nothing, NaN where it was not measured."""
        steps = np.asarray(steps, dtype=np.int64)
        have = np.frombuffer(self._steps, dtype=np.int64) if len(self._steps) else np.empty(0, np.int64)
        values = np.frombuffer(self._values, dtype=np.float64) if len(self._values) else np.empty(0)
        out = np.full(len(steps), np.nan)
        if self.dense and self.first_step is not None:
            watched = (steps >= self.first_step) & (steps % self.stride == 0)
            out[watched] = 0.0
        if len(have):
            idx = np.clip(np.searchsorted(have, steps), 0, len(have) - 1)
            hit = have[idx] == steps
            out[hit] = values[idx[hit]]
        return out
