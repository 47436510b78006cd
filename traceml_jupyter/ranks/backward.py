"""backward() timed per step on each rank (data-parallel ranks wait for each other there), and
the steps a rank's capture closed since the last tick, taken with their parts."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import numpy as np

from ..analysis.rank_verdict import backward_median
from ..capture.session import Capture
from ..capture.steps.recorder import Recorder
from ..capture.steps.step_history import StepHistory
from ..capture.steps.step_model import BACKWARD
from .wire import PART_ROWS, ROWS


class BackwardTimer:
    """Start and duration (ns) of every backward() call, handed out per step at the ticks."""

    def __init__(self) -> None:
        self.starts: array[int] = array("q")
        self.durations: array[int] = array("q")

    def wrap(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """`inner` (torch.autograd.backward) timed: each call's start and duration kept."""
        add_start, add_duration, clock = self.starts.append, self.durations.append, perf_counter_ns

        def backward(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
            t0 = clock()
            out = inner(*args, **kwargs)
            add_duration(clock() - t0)
            add_start(t0)
            return out

        backward.__doc__ = inner.__doc__
        backward.__wrapped__ = inner  # type: ignore[attr-defined]
        return backward

    def per_step(self, bounds: np.ndarray) -> np.ndarray:
        """Time in backward() (ms) of each step [bounds[i], bounds[i+1]), a call counting for the
        step it started in; NaN for a step without one. Calls that started before bounds[-1]
        are handed out and forgotten, later ones kept for the next steps."""
        n_steps = len(bounds) - 1
        out = np.full(max(0, n_steps), np.nan)
        n = min(len(self.starts), len(self.durations))
        if n == 0 or n_steps <= 0:
            return out
        starts = np.frombuffer(self.starts[:n], dtype=np.int64).copy()
        durations = np.frombuffer(self.durations[:n], dtype=np.int64).astype(np.float64)
        index = np.searchsorted(bounds, starts, side="right") - 1
        done = starts < bounds[-1]
        mine = done & (index >= 0)
        if mine.any():
            sums = np.bincount(index[mine], weights=durations[mine], minlength=n_steps)[:n_steps]
            counts = np.bincount(index[mine], minlength=n_steps)[:n_steps]
            out = np.where(counts > 0, sums / 1e6, np.nan)
        kept = ~done
        self.starts[:n] = array("q", starts[kept].tolist())
        self.durations[:n] = array("q", durations[kept].astype(np.int64).tolist())
        return out


class StepSample:
    """Values by step index, bounded: every step up to CAP, then one step in `stride` (doubled
    when full), so medians come from a uniform sample of a run of any length."""

    CAP = 1 << 17

    def __init__(self, cap: int = CAP) -> None:
        self._kept = StepHistory(cap, "d")
        self._read: tuple[np.ndarray, np.ndarray] | None = None  # numpy copies, until the next add

    @property
    def stride(self) -> int:
        """1 while every step is kept; k when one step in k is kept."""
        return self._kept.stride

    @property
    def steps(self) -> np.ndarray:
        """The kept steps (ascending)."""
        return self._arrays()[0]

    @property
    def values(self) -> np.ndarray:
        """Their values."""
        return self._arrays()[1]

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._read is None:
            self._read = (self._kept.steps_from(), self._kept.column(0))
        return self._read

    def add(self, steps: np.ndarray, values: np.ndarray) -> None:
        """Values of these steps, one step in `stride` kept (the stride doubles past CAP)."""
        self._kept.extend(np.asarray(steps).astype(np.int64), np.asarray(values, dtype=np.float64))
        self._read = None

    def drop_from(self, first: int) -> None:
        """Forget steps from `first` on (they were merged and come again)."""
        self._kept.drop_from(first)
        self._read = None

    def median(self, first_step: int) -> float | None:
        """The median from `first_step` on (after the warm-up); None without values."""
        return backward_median(self.steps, self.values, first_step)


class RankParts:
    """A forked rank's parts of its sampled steps as they arrive (forward, optimizer, the rest;
    its backward is the backward() timer's), and what the run shows of them once the run shows
    this rank's steps: columns like the capture's own (step_parts.py) and its facts."""

    def __init__(self) -> None:
        self.samples = {name: StepSample() for name in PART_ROWS}
        self.backward = StepSample()
        self.facts_seen: dict[str, object] = {}

    def add(self, rows: np.ndarray) -> None:
        """The parts of the sampled steps in `rows` (ROWS columns)."""
        sampled = np.isfinite(rows[ROWS.index("forward_ms")]) | np.isfinite(rows[ROWS.index("optimizer_ms")])
        for name in PART_ROWS:
            self.samples[name].add(rows[0][sampled], rows[ROWS.index(name)][sampled])
        self.backward.add(rows[0][sampled], rows[5][sampled])

    def drop_from(self, first: int) -> None:
        """Forget steps from `first` on (they were merged and come again)."""
        for sample in (*self.samples.values(), self.backward):
            sample.drop_from(first)

    def medians(self, first_step: int) -> dict[str, float | None]:
        """Each part's median from `first_step` on."""
        return {name: sample.median(first_step) for name, sample in self.samples.items()}

    def columns(self, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The parts as per-step columns beside `cols` (NaN on steps not sampled)."""
        steps = np.asarray(cols["step"], dtype=np.int64)
        out: dict[str, np.ndarray] = {}
        for name, sample in (*self.samples.items(), ("backward_ms", self.backward)):
            column = np.full(len(steps), np.nan)
            if len(sample.steps):
                idx = np.clip(np.searchsorted(sample.steps, steps), 0, len(sample.steps) - 1)
                hit = sample.steps[idx] == steps
                column[hit] = sample.values[idx[hit]]
            out[name] = column
        return out

    def facts(self) -> dict[str, object]:
        """What the rank said of its parts (at its end)."""
        return dict(self.facts_seen)


class StepTap:
    """At the run's ticks: the steps closed since the last tick, as ROWS, with their time in
    backward(). When backward() itself ends the steps (no optimizer step seen), the newest step
    waits for the next tick: the call that closed it returns after the tick."""

    def __init__(self, capture: Capture, timer: BackwardTimer | None) -> None:
        self.capture, self.timer = capture, timer
        self.recorder: Recorder = capture.model.recorder  # the one this process's steps go to
        self.base = self.recorder.n_steps  # steps recorded before (a rank counts from 0)
        self.sent = self.base

    def follow_merges(self, model: Any) -> Callable[[], None]:
        """Steps closed on a weaker kind of event are merged once a stronger one shows (the
        step model's on_merge): those already handed out go again. Returns the undo."""
        previous = model.on_merge

        def merged(n: int) -> None:
            self.sent = min(self.sent, self.recorder.n_steps)
            if previous is not None:
                previous(n)

        model.on_merge = merged

        def undo() -> None:
            model.on_merge = previous

        return undo

    def take(self, final: bool = False) -> np.ndarray | None:
        """The steps closed since the last take as ROWS columns (`final`: the open one too);
        None: none."""
        rec = self.recorder
        n = rec.n_steps
        self.sent = min(self.sent, n)
        upto = n if final or self.capture.model.level != BACKWARD else n - 1
        if upto <= self.sent:
            return None
        cols = rec.tail(n - self.sent)
        step = cols["step"]
        sel = (step >= self.sent) & (step < upto)
        if not sel.any():
            self.sent = upto
            return None
        starts = (rec.origin_ns or 0) + np.rint(cols["time_s"] * 1e9).astype(np.int64)
        held = step == upto
        if held.any():  # the held-back step starts where the last handed-out one ends
            end = int(starts[held][0])
        else:
            model_start = getattr(self.capture.model, "start", None)
            last = int(starts[sel][-1] + cols["step_ms"][sel][-1] * 1e6)
            end = max(last, int(model_start)) + 1 if model_start is not None else last + 1
        bounds = np.append(starts[sel], end)
        backward = self.timer.per_step(bounds) if self.timer is not None else np.full(int(sel.sum()), np.nan)
        self.sent = upto
        parts = self.parts_of(cols)
        return np.vstack(
            [
                (step[sel] - self.base).astype(np.float64),
                cols["time_s"][sel],
                cols["data_wait_ms"][sel],
                cols["compute_ms"][sel],
                cols["step_ms"][sel],
                backward,
                *(parts[name][sel] for name in PART_ROWS),
            ]
        )

    def parts_of(self, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The parts of these steps (step_parts.py), NaN where not sampled or not measured."""
        return self.capture.parts.columns(cols)


class LocalRank:
    """A torchrun rank's own backward() per step, for its summary at the end."""

    def __init__(self) -> None:
        self.backward = StepSample()

    def add(self, rows: np.ndarray) -> None:
        """Backward times of the steps in `rows` (merged steps replace theirs)."""
        self.backward.drop_from(int(rows[0, 0]))  # merged steps come again
        self.backward.add(rows[0], rows[5])
