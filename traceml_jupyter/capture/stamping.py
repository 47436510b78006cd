"""When the capture's hooks stamp and when their stamps are replayed (the per-step path's
decisions; stamps.py holds the stamps and the replay).

While `deferred`, the hooks (step_hooks.py) stamp instead of reporting each event to the step
model; `room` is how many step ends their stamps may still hold (each hook takes what it can end)
and `_loop_room` the located loop's iterations not yet granted to it, so that a sampled step is
never missed; `due` is the run's next tick. The stamps are replayed (`flush`) before anything
reports an event at once, before anyone reads the model, at the ticks and at the end.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from ..failures import failure_text
from .steps.stamps import Stamps
from .steps.step_model import BACKWARD, ITERATION, NEVER, StepModel

if TYPE_CHECKING:
    from ..recording import Recording
    from .gpu.cuda_clock import CudaStepClock
    from .inside.step_parts import StepParts

# Step ends (and other hooks' stamps) held before a replay: bounded memory. The stamps are Python
# ints in lists (an `array` append costs ~50 ns more a stamp), 80 B a step end while pending, so
# this bound is most of a short run's memory: 2048 keeps a 10,000-step run under 64 B a step
# (bench_memory.py: 52 vs 77 B at 4096) for about the same per-step cost (hook-only loop,
# fastest of 11: 0.273 vs 0.265 µs).
MAX_PENDING = 2048
MIN_BUDGET = 2  # fewer step ends before a sampled step: report each event at once
# Training steps (ending at `backward()` or an optimizer step) are stamped only when at least
# this many remain before a sampled step: below stamps.WINDOW `_steady` replays them one
# transition at a time (2-3 µs an iteration, more than reporting at once); above it a numpy
# window's fixed cost (0.1 ms or so) is shared, and under some 500 steps that share plus the
# stamps cost as much as reporting at once (measured with bench_hooks_with_model.py). So with
# the parts sampler on (one step in 16 to 256) a training loop reports at once, as 9fc1c6f did;
# without it (no model found), its steps are stamped.
TRAINING_BUDGET = 512


class Stamping:
    """The capture's stamping state and decisions (recording.Capture sets the attributes)."""

    run: Recording
    model: StepModel
    stamps: Stamps
    parts: StepParts
    cuda: CudaStepClock | None
    gpu_note: str | None
    active: bool
    deferred: bool
    room: int
    due: int
    _loop_room: int
    _live_loops: int
    _events_seen: bool
    _level: int
    _level_free: bool
    _level_pos: int
    _deciding: bool
    _broken: bool
    _at_once_left: int
    lines: Any

    def flush(self) -> None:
        """Report what the hooks stamped to the step model (stamps.py): before anything reports
        an event now, before anyone reads the model, at the ticks and at the end."""
        stamps = self.stamps
        if not (stamps.loop or stamps.events):
            return
        if not self.active:  # stamped after the run ended (code that outlived its cell)
            stamps.discard()
            return
        if stamps.events:
            self._events_seen = True
        try:
            stamps.replay(self.model)
            # pos restarts at 0: an event of the steps' kind already held in this iteration?
            self._level_pos = 0 if self.model.deferred is not None else -1
        except Exception as exc:  # ours: never raised into the user's loop
            stamps.discard()
            self.run.notes.append(f"traceml failed replaying the steps' stamps: {failure_text(exc)}")
            self._broken = True
            self._report_now()

    def _budget(self) -> int:
        """How many step ends the stamps may hold before the capture must look again: 0 when
        each event must be reported when it happens (the GPU path, the device not yet known,
        a sampled step under way or next, several located loops under way)."""
        if not self.active or self.cuda is not None or self._deciding or self.parts.on or self._broken:
            return 0
        if self._live_loops > 1:
            return 0
        # The step end that arms the sampler may be stamped only as the last one before a look.
        model = self.model
        budget = model.sample_in - (1 if self._events_seen else 0)
        if budget < TRAINING_BUDGET and model.level > ITERATION:
            # Fewer training steps than pay for their bulk replay (stamps.py): replayed one
            # transition at a time, or in a numpy window whose fixed cost is shared by few
            # steps, they would cost more than each event reported at once.
            return 0
        return min(budget, MAX_PENDING)

    def _defer(self, room: int, loop: bool) -> None:
        """From now on the hooks stamp, until they have stamped `room` step ends (`loop`: in
        the located loop's iterations, which the loop counts itself)."""
        model = self.model
        self._untake_at_once()
        self.deferred = True
        self.room = room
        self._level = model.level
        self._level_free = loop and model.iterations_are_steps and model.level >= BACKWARD
        self._level_pos = 0 if model.deferred is not None else -1
        model.notify_every_step = False  # the ticks are the stamps' (no step end is heard)
        model.notify_from = NEVER

    def _report_now(self) -> None:
        """From now on each event is reported when it happens. Each step end is heard where
        our bookkeeping needs every one (the GPU clock, the loop's device being decided); else
        those at the run's ticks, and the one the sampler is called at (`_sample_due`): what
        the hooks may stamp (`_budget`) changes only then."""
        self.deferred = False
        self.room = 0
        self.stamps.writer = None
        model = self.model
        model.notify_every_step = self.cuda is not None or self._deciding
        model.notify_from = self.run.next_tick

    def _grant(self) -> None:
        """The hooks alone (no located loop stamping): stamp while the budget allows."""
        if self.stamps.writer is not None:
            self._report_now_hooks()
            return
        budget = self._budget()
        if budget >= MIN_BUDGET:
            self._defer(budget, loop=False)
        else:
            self._report_now()

    def _report_now_hooks(self) -> None:
        """The hooks report at once; the located loop's stamps go on until it looks again."""
        self.deferred = False
        self.room = 0

    def _settle(self, t: int) -> None:
        """A hook's stamps are due (its room is used up, or a tick is): replay, tick, grant.
        Inside another fetch (a DataLoader's inside the loop's `next()`) our time is that
        fetch's wait: no tick there, and nothing kept out of the step."""
        began, kept_out = perf_counter_ns(), self.model.kept_out_ns
        self.flush()
        outside = not self.model._stack
        if outside and self._tick_due(t):
            self._tick(t)
        self._grant()
        if outside:
            self._own_time(began, kept_out)

    def _own_time(self, began: int, kept_out: int) -> None:
        """Our own time since `began` (the replay, the views) is no step's: kept out of the open
        step, less what was kept out meanwhile (a sampled step's bookkeeping keeps out its own)."""
        model = self.model
        ns = perf_counter_ns() - began - (model.kept_out_ns - kept_out)
        if ns > 0:
            model.exclude_time(ns)

    def _tick_due(self, t: int) -> bool:
        """The run's views are due and no step end tells them (the model is silent while the
        hooks stamp: its steps close in a replay). They start with a step."""
        model = self.model
        return t >= self.run.next_tick and not model.notify_every_step and model.recorder.n_steps > 0

    def _tick(self, t: int) -> None:
        run = self.run
        run.tick(t)
        self.due = run.next_tick
        if not self.deferred:  # (stamping, the model is silent: `_defer`)
            self.model.notify_from = self.due

    def current_step(self) -> int | None:
        """Index of the open step (what is stamped replayed first)."""
        self.flush()
        return self.model.current_step

    def _sample_due(self, start: int, end: int) -> None:
        """The step model's sampler callback (step_parts.py): it arms the sampler or sets the
        steps to the next sampled one. Where the hooks report at once and may now stamp, the
        located loop looks again at its next fetch, and this step's end is heard (it grants
        the other hooks); while stamping, a look or grant follows the replay anyway."""
        self.parts.sample_due(start, end)
        if not self.deferred and self._budget() >= MIN_BUDGET:
            self._untake_at_once()
            self.model.notify_every_step = True

    def _untake_at_once(self) -> None:
        """The located loop looks again at its next fetch: the iterations its last look let
        report at once without looking, not run yet, give their line flag back."""
        if self._at_once_left:
            if self.lines is not None:
                self.lines.untake(self._at_once_left)
            self._at_once_left = 0

    def listen(self) -> None:
        """The run's next tick changed (an observer came, the GPU clock changed): the hooks
        and the model look at it."""
        self._untake_at_once()
        self.due = self.run.next_tick
        if not self.deferred:
            self.model.notify_every_step = True

    def _gpu_failed(self, exc: BaseException) -> None:
        """Any error in the GPU bookkeeping: the run goes on the CPU clock, with a note."""
        self.cuda = None
        self._deciding = False
        self.gpu_note = f"GPU timings turned off: {failure_text(exc)}"
        self.listen()
