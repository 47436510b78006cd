"""When the capture's hooks stamp and when their stamps are replayed (the per-step path's
decisions; stamps.py holds the stamps and the replay).

While `deferred`, the hooks (step_hooks.py) stamp instead of reporting each event to the step
model; `room` is how many step ends their stamps may still hold (each hook takes what it can end)
and `loop_room` the located loop's iterations not yet granted to it, so that a sampled step is
never missed; `due` is the run's next tick. The stamps are replayed (`flush`) before anything
reports an event at once, before anyone reads the model, at the ticks and at the end.

Each event is reported at once instead where something needs the step's boundaries when they
happen: the GPU clock or the loop's device being decided (loop_gpu.py), a sampled step under way
or next (step_parts.py), several located loops under way, or a training loop whose sampled steps
come too often for the stamps to pay (TRAINING_BUDGET).
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import TYPE_CHECKING

from ..failures import failure_text, raised_by_a_signal_handler
from .inside.line_costs import LineClock
from .inside.step_parts import StepParts
from .instrument import hooks
from .loop_gpu import LoopGpu
from .steps.stamps import Stamps
from .steps.step_model import BACKWARD, ITERATION, NEVER, Pass, StepModel

if TYPE_CHECKING:
    from ..recording import Recording

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


AT_ONCE_LOOKS = 64  # iterations reported at once that may skip the loop's look in a row


class Stamping:
    """Whether the hooks stamp or report, and the replay of their stamps (see the module
    docstring). The hooks read and count down `deferred`, `room`, `due` and the `level` fields."""

    def __init__(self, run: Recording, model: StepModel, parts: StepParts, gpu: LoopGpu) -> None:
        self.run, self.model, self.parts, self.gpu = run, model, parts, gpu
        self.stamps = Stamps()
        self.lines: LineClock | None = None  # the per-line costs' clock, set by the traced cell
        self.active = False  # the capture records (stamps after it closed are dropped)
        self.deferred = False
        self.room = 0
        self.due = 0
        self.loop_room = 0
        self.live_loops = 0  # passes of located loops under way (stamped only when one)
        # Iterations of the located loop that may report at once without looking again
        # (`look_again` chose so; zeroed when the sampler or a listener changes its reasons).
        self.at_once_left = 0
        self.events_seen = False  # hooks other than the loop's stamped since the loop last looked
        # What a stamped event can end, from the model as it was when the hooks began stamping
        # (`defer`): its level (steps only get stronger), whether the first event of that level
        # in an iteration's body ends no step (`training_event`), and where the last one was.
        self.level = 0
        self.level_free = False
        self.level_pos = -1
        self.broken = False  # the replay failed once: every event is reported at once

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
            self.events_seen = True
        try:
            stamps.replay(self.model)
            # pos restarts at 0: an event of the steps' kind already held in this iteration?
            self.level_pos = 0 if self.model.deferred is not None else -1
        except Exception as exc:  # ours: never raised into the user's loop
            stamps.discard()
            if raised_by_a_signal_handler(exc):  # (torch's when a DataLoader worker died: the user's)
                raise
            self.run.notes.append(f"traceml failed replaying the steps' stamps: {failure_text(exc)}")
            self.broken = True
            self.report_now()

    def budget(self) -> int:
        """How many step ends the stamps may hold before the capture must look again: 0 when
        each event must be reported when it happens (the GPU path, the device not yet known,
        a sampled step under way or next, several located loops under way)."""
        if not self.active or self.gpu.cuda is not None or self.gpu.deciding or self.parts.on or self.broken:
            return 0
        if self.live_loops > 1:
            return 0
        # The step end that arms the sampler may be stamped only as the last one before a look.
        model = self.model
        budget = model.sample_in - (1 if self.events_seen else 0)
        if budget < TRAINING_BUDGET and model.level > ITERATION:
            # Fewer training steps than pay for their bulk replay (stamps.py): replayed one
            # transition at a time, or in a numpy window whose fixed cost is shared by few
            # steps, they would cost more than each event reported at once.
            return 0
        return min(budget, MAX_PENDING)

    def defer(self, room: int, loop: bool) -> None:
        """From now on the hooks stamp, until they have stamped `room` step ends (`loop`: in
        the located loop's iterations, which the loop counts itself)."""
        model = self.model
        self.untake_at_once()
        self.deferred = True
        self.room = room
        self.level = model.level
        self.level_free = loop and model.iterations_are_steps and model.level >= BACKWARD
        self.level_pos = 0 if model.deferred is not None else -1
        model.notify_every_step = False  # the ticks are the stamps' (no step end is heard)
        model.notify_from = NEVER

    def report_now(self) -> None:
        """From now on each event is reported when it happens. Each step end is heard where
        our bookkeeping needs every one (the GPU clock, the loop's device being decided); else
        those at the run's ticks, and the one the sampler is called at (`sample_due`): what
        the hooks may stamp (`budget`) changes only then."""
        self.deferred = False
        self.room = 0
        self.stamps.writer = None
        model = self.model
        model.notify_every_step = self.gpu.cuda is not None or self.gpu.deciding
        model.notify_from = self.run.next_tick

    def grant(self) -> None:
        """The hooks alone (no located loop stamping): stamp while the budget allows."""
        if self.stamps.writer is not None:
            self.report_now_hooks()
            return
        budget = self.budget()
        if budget >= MIN_BUDGET:
            self.defer(budget, loop=False)
        else:
            self.report_now()

    def report_now_hooks(self) -> None:
        """The hooks report at once; the located loop's stamps go on until it looks again."""
        self.deferred = False
        self.room = 0

    def settle(self, t: int) -> None:
        """A hook's stamps are due (its room is used up, or a tick is): replay, tick, grant.
        Inside another fetch (a DataLoader's inside the loop's `next()`) our time is that
        fetch's wait: no tick there, and nothing kept out of the step."""
        began, kept_out = perf_counter_ns(), self.model.kept_out_ns
        self.flush()
        outside = not self.model._stack
        if outside and self.tick_due(t):
            self.tick(t)
        self.grant()
        if outside:
            self.own_time(began, kept_out)

    def own_time(self, began: int, kept_out: int) -> None:
        """Our own time since `began` (the replay, the views) is no step's: kept out of the open
        step, less what was kept out meanwhile (a sampled step's bookkeeping keeps out its own)."""
        model = self.model
        ns = perf_counter_ns() - began - (model.kept_out_ns - kept_out)
        if ns > 0:
            model.exclude_time(ns)

    def tick_due(self, t: int) -> bool:
        """The run's views are due and no step end tells them (the model is silent while the
        hooks stamp: its steps close in a replay). They start with a step."""
        model = self.model
        return t >= self.run.next_tick and not model.notify_every_step and model.recorder.n_steps > 0

    def tick(self, t: int) -> None:
        """The run's views, now (at t); the next look is at their next tick."""
        run = self.run
        run.tick(t)
        self.due = run.next_tick
        if not self.deferred:  # (stamping, the model is silent: `defer`)
            self.model.notify_from = self.due

    def current_step(self) -> int | None:
        """Index of the open step (what is stamped replayed first)."""
        self.flush()
        return self.model.current_step

    def sample_due(self, start: int, end: int) -> None:
        """The step model's sampler callback (step_parts.py): it arms the sampler or sets the
        steps to the next sampled one. Where the hooks report at once and may now stamp, the
        located loop looks again at its next fetch, and this step's end is heard (it grants
        the other hooks); while stamping, a look or grant follows the replay anyway."""
        self.parts.sample_due(start, end)
        if not self.deferred and self.budget() >= MIN_BUDGET:
            self.untake_at_once()
            self.model.notify_every_step = True

    def untake_at_once(self) -> None:
        """The located loop looks again at its next fetch: the iterations its last look let
        report at once without looking, not run yet, give their line flag back."""
        if self.at_once_left:
            if self.lines is not None:
                self.lines.untake(self.at_once_left)
            self.at_once_left = 0

    def listen(self) -> None:
        """The run's next tick changed (an observer came, the GPU clock changed): the hooks
        and the model look at it."""
        self.untake_at_once()
        self.due = self.run.next_tick
        if not self.deferred:
            self.model.notify_every_step = True

    # -- the located loop ------------------------------------------------------------------
    def loop_ended(self, pass_: Pass) -> None:
        """A pass of the located loop is over (its end, `break`, an exception, closed)."""
        self.live_loops -= 1
        self.untake_at_once()
        if not self.deferred:  # the next step end grants the hooks again (`budget`)
            self.model.notify_every_step = True
        if self.active:
            self.flush()
            self.model.pass_ended(pass_)
        if self.stamps.writer is pass_:
            self.stamps.writer = None

    def settle_loop(self, t: int, left: int, pass_: Pass) -> tuple[int, int]:
        """After a fetch of the located loop gave its batch (at t): set the line flag for the
        iterations to come, and say how many of the next fetches may be stamped before the
        capture looks again (0: report each one now) and until when. `left`: fetches granted
        that did not run (a tick is due before them)."""
        stamps = self.stamps
        if not left and t < self.due and self.deferred and self.room >= 0 and stamps.writer is pass_:
            loop_room = self.loop_room
            if loop_room <= 0 < self.room:  # the step ends the other hooks left: granted again, no replay
                room = self.room // 4 if self.events_seen or stamps.events else 0
                loop_room, self.room = self.room - room, room
            if loop_room > 0:  # the line flag's next run only: the per-step path's one call
                if (lines := self.lines) is None:
                    self.loop_room = 0
                    return loop_room, self.due
                hooks.lines.on, n = lines.take(loop_room)
                self.loop_room = loop_room - n
                return n, self.due
        return self.look_again(t, left, pass_)

    def look_again(self, t: int, left: int, pass_: Pass) -> tuple[int, int]:
        """`settle_loop` when the stamps are due: replay them, tick if due, grant again. (After
        each fetch while events are reported at once: then nothing is pending, and each step's
        end ticks, so this is the budget and the line flag.)"""
        lines, stamps, model = self.lines, self.stamps, self.model
        if left and lines is not None:
            lines.untake(left)
        self.untake_at_once()
        worked = bool(stamps.loop or stamps.events)
        began = kept_out = 0
        if worked or not model.notify_every_step:  # (else no tick is due here: `tick_due`)
            began, kept_out = perf_counter_ns(), model.kept_out_ns
            if worked:
                self.flush()
            if self.tick_due(t):
                self.tick(t)
                worked = True
        budget = self.budget()
        k = 0
        at_once = budget < MIN_BUDGET
        if not at_once:
            room = budget // 4 if self.events_seen else 0
            k = budget - room
            self.defer(room, loop=True)
            stamps.writer = pass_
        else:
            self.report_now()
        self.events_seen = False
        self.loop_room = 0
        if at_once:
            # Until the sampler is called or a listener changes something, the loop's next
            # looks would decide the same: the next iterations that share the line flag skip
            # them (AT_ONCE_LOOKS at most).
            self.at_once_left = AT_ONCE_LOOKS - 1
            if lines is not None:
                hooks.lines.on, n = lines.take(AT_ONCE_LOOKS)
                self.at_once_left = n - 1
        elif lines is not None:
            hooks.lines.on, n = lines.take(k)
            k, self.loop_room = n, k - n
        if worked:
            self.own_time(began, kept_out)
        return k, self.due
