"""StepHistory: rows kept by step with a memory bound, the one "halve when full" rule of the
package (the Recorder's kept steps, the per-step tallies, the sampled steps' parts, a rank's
backward times, the samplers' samples)."""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import numpy as np


class StepHistory:
    """Rows of values (one `array` column per typecode: "q" int64, "d" float64) by step, at most
    `cap` of them: every step while there is room, then one step in `stride`, the stride
    doubling each time a row would pass the cap (the rows of steps no longer a multiple of it
    go: every other one). What is kept is a uniform sample of a run of any length.

    Steps come in ascending order. `every_step`: the rows are the steps 0, stride,
    2 * stride, ... (the Recorder's, and the samplers' numbered samples, see `append`): no step
    column is stored. Else `steps` holds each row's step.

    Values of a kept row may be changed in place (`columns[c][i]`, `index(step)`); rows come
    only through `add`, `extend` and `append`. Readers get copies (`steps_from`, `column`)."""

    def __init__(self, cap: int, typecodes: str = "d", every_step: bool = False) -> None:
        if cap < 2:
            raise ValueError(f"a StepHistory keeps at least 2 rows, not {cap}")
        self.cap = int(cap)
        self.stride = 1
        self.every_step = every_step
        self.steps: array[int] = array("q")
        self.columns: list[array[Any]] = [array(code) for code in typecodes]

    def __len__(self) -> int:
        return len(self.columns[0])

    def keeps(self, step: int) -> bool:
        """Whether a row of `step` is kept at the current stride."""
        return step % self.stride == 0

    # -- writing ----------------------------------------------------------------------------
    def add(self, step: int, *values: Any) -> bool:
        """One row (a value per column) for `step`, after every kept one; False when the stride
        leaves it out."""
        if step % self.stride:
            return False
        while len(self) >= self.cap and self._halvable(step):
            self._halve()
            if step % self.stride:
                return False
        if not self.every_step:
            self.steps.append(step)
        for column, value in zip(self.columns, values, strict=True):
            column.append(value)
        return True

    def append(self, *values: Any) -> None:
        """The next row of an `every_step` history, always kept: a sampler that numbers its
        samples by its period (and doubles the period when the stride doubles) keeps them all."""
        if len(self) >= self.cap:
            self._halve()
        for column, value in zip(self.columns, values, strict=True):
            column.append(value)

    def extend(self, steps: np.ndarray, *columns: np.ndarray) -> None:
        """Rows for `steps` (ascending, after every kept one) at once, a numpy array per column:
        those the stride keeps, the stride doubled first as often as the cap asks."""
        steps = np.asarray(steps, dtype=np.int64)
        keep = steps % self.stride == 0
        top = int(steps[-1]) if len(steps) else 0
        while len(self) + int(np.count_nonzero(keep)) > self.cap and self._halvable(top):
            self._halve()
            keep = steps % self.stride == 0
        if not self.every_step:
            self.steps.frombytes(steps[keep].tobytes())
        for column, values in zip(self.columns, columns, strict=True):
            column.frombytes(np.asarray(values, dtype=column.typecode)[keep].tobytes())

    def add_column(self, typecode: str, fill: float) -> int:
        """A column that starts later: `fill` in the rows kept so far. Returns its index."""
        self.columns.append(array(typecode, [fill]) * len(self))
        return len(self.columns) - 1

    def drop_from(self, step: int) -> None:
        """Forget the rows of `step` and later (they were merged and come again)."""
        if self.every_step:
            first = -(-step // self.stride)
        else:
            first = bisect_left(self.steps, step)
            del self.steps[first:]
        for column in self.columns:
            del column[first:]

    def _halvable(self, top: int) -> bool:
        """A doubled stride would leave a row out (else halving cannot make room)."""
        return self.every_step or self.stride <= max(top, self.steps[-1] if self.steps else 0)

    def _halve(self) -> None:
        """Double the stride and keep the rows of the steps that are multiples of it, in place
        (the arrays stay the same objects)."""
        self.stride *= 2
        if self.every_step:
            for column in self.columns:
                column[:] = column[::2]
            return
        picked = np.flatnonzero(np.frombuffer(self.steps, dtype=np.int64) % self.stride == 0)
        for column in (self.steps, *self.columns):
            column[:] = array(column.typecode, np.frombuffer(column, dtype=column.typecode)[picked].tobytes())

    # -- reading ----------------------------------------------------------------------------
    def index(self, step: int) -> int | None:
        """The row of `step`, None when it is not kept."""
        if self.every_step:
            i, off = divmod(step, self.stride)
            return i if off == 0 and 0 <= i < len(self) else None
        i = bisect_left(self.steps, step)
        return i if i < len(self.steps) and self.steps[i] == step else None

    def steps_from(self, first: int = 0) -> np.ndarray:
        """The steps of the rows from row `first` on (a copy)."""
        if self.every_step:
            return np.arange(first, len(self), dtype=np.int64) * self.stride
        return np.array(self.steps[first:], dtype=np.int64)

    def column(self, c: int, first: int = 0) -> np.ndarray:
        """Column `c` from row `first` on (a copy)."""
        values = self.columns[c]
        return np.array(values[first:], dtype=values.typecode)

    def last(self) -> Sequence[Any] | None:
        """The newest row (a value per column), None before any."""
        return [column[-1] for column in self.columns] if len(self) else None

    def nbytes(self) -> int:
        """The memory the rows hold, in bytes."""
        return sum(a.buffer_info()[1] * a.itemsize for a in (self.steps, *self.columns))
