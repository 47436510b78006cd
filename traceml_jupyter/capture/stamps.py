"""The per-step path's raw stamps, and their replay into the step model.

While nothing needs a step's boundaries at once (the CPU clock, no sampled step, no view due),
the capture's hooks only read the clock and append:

- the located loop, two stamps an iteration to `loop`: where its fetch began (which is also
  where the iteration before it ended) and where it gave its batch;
- every other hook one record to `events`: where it falls among the loop's stamps, its kind,
  its time and its pass or source (a DataLoader's or a fetch call's start and end, a
  `backward()`, an optimizer step of the first optimizer or of another one).

`replay` feeds them to the step model in their order, exactly as if each had been reported
when it happened; a run of plain iterations of a steady loop goes in bulk
(`StepModel.iterations`, numpy). The capture (recording.py) decides when the hooks may stamp
and when the stamps are replayed (the run's ticks, a sampled step coming, the end).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .step_model import BACKWARD, FETCH, OPTIMIZER, Pass, StepModel

# Kinds of `events`. The first optimizer's step and another one's are told apart when they
# happen (the first optimizer is the one alive then).
FETCH_START, FETCH_END, CALL_START, CALL_END, BACKWARD_DONE, FIRST_STEP, OTHER_STEP = range(7)
BULK = 16  # iterations in a row from which the bulk replay pays

Event = tuple[int, int, int, Any]  # (position among the loop's stamps, kind, time ns, pass or source)


class Stamps:
    """What the hooks appended since the last replay (see the module docstring)."""

    __slots__ = ("loop", "events", "writer", "_open", "_fetches", "_replaying")

    def __init__(self) -> None:
        self.loop: list[int] = []
        self.events: list[Event] = []
        self.writer: Pass | None = None  # the located loop's pass whose stamps `loop` holds
        self._open: int | None = None  # start of a loop fetch replayed without its end yet
        self._fetches: list[int] = []  # starts of other fetches replayed without their end yet
        self._replaying = False

    def pending(self) -> bool:
        return bool(self.loop or self.events)

    def discard(self) -> None:
        self.loop.clear()
        self.events.clear()

    def fetch_failed(self) -> None:
        """The fetch whose start was replayed last raised: the caller reports its end itself."""
        if self._fetches:
            self._fetches.pop()

    def loop_fetch_failed(self) -> None:
        """The loop's fetch whose start was replayed raised: the caller reports its end itself."""
        self._open = None

    def replay(self, model: StepModel) -> None:
        """Report everything pending to `model`, in order, then forget it."""
        if self._replaying:
            return
        loop, events = self.loop, self.events
        self._replaying = True
        try:
            done = 0
            for pos, kind, t, ref in events:
                if pos > done:
                    self._iterations(model, done, pos)
                    done = pos
                self._event(model, kind, t, ref)
            if len(loop) > done:
                self._iterations(model, done, len(loop))
        finally:
            loop.clear()
            events.clear()
            self._replaying = False

    def _iterations(self, model: StepModel, i: int, end: int) -> None:
        """The loop's stamps i..end-1: fetch starts (each one ends the iteration before it) and
        fetch ends, alternating; a start may have been replayed already (`_open`)."""
        loop, writer = self.loop, self.writer
        assert writer is not None, "loop stamps without the pass that wrote them"
        if self._open is not None and i < end:
            model.fetch_end(self._open, loop[i], None, writer, True)
            model.in_iteration = True
            self._open = None
            i += 1
        stack = model._stack
        bulk = True
        while i < end:
            # In bulk while the model is steady, up to the step that calls the sampler (that
            # one by itself, below).
            pairs = min((end - i) // 2, model.sample_in - 1)
            if bulk and pairs >= BULK and model.start is not None and model.steady(writer):
                both = np.fromiter(loop[i : i + 2 * pairs], dtype=np.int64, count=2 * pairs)
                if model.iterations(both[0::2], both[1::2], writer):
                    i += 2 * pairs
                    continue
                bulk = False  # a listener to call at each step: one by one
            s = loop[i]
            model.iteration_end(s)
            stack.append(0)
            if i + 1 == end:
                self._open = s
                return
            model.fetch_end(s, loop[i + 1], None, writer, True)
            model.in_iteration = True
            i += 2

    def _event(self, model: StepModel, kind: int, t: int, ref: Any) -> None:
        if kind == FETCH_START:
            if model.level <= FETCH and not model._stack:
                model.fetch_started(ref.source, t)
            model._stack.append(0)
            self._fetches.append(t)
        elif kind == FETCH_END:
            model.fetch_end(self._fetches.pop(), t, None, ref, True)
        elif kind == CALL_START:
            model._stack.append(0)
            self._fetches.append(t)
        elif kind == CALL_END:
            model.fetch_end(self._fetches.pop(), t, ref, None, True)
        elif kind == BACKWARD_DONE:
            model.trained(BACKWARD, t)
        else:
            model.trained(OPTIMIZER, t, kind == FIRST_STEP)
