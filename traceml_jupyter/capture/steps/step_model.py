"""The step model: what the training does (fetches, backward, optimizer steps, loop iterations),
turned into steps online. Bookkeeping on timestamps only: no torch, no clock of its own.

A step ends at the strongest kind of event the run has shown (LEVELS): each `optimizer.step()` of
the first optimizer seen stepping; without one, each `backward()`; without either, each iteration
of the located loop; last, the start of the next fetch on the first DataLoader read. Inside the
located loop, a step that ends at a training event ends with the loop iteration it happened in
(so what the body does after `opt.step()` belongs to that step), unless one iteration holds
several such events. When a stronger kind shows up after steps were closed on a weaker one (the
micro-batches of gradient accumulation, each with its `backward()`), those steps are merged.

Data wait is the time blocked fetching a batch (outermost fetches only: a DataLoader read inside
the loop's own `next()` counts once). Fetches are grouped in passes (one `iter()` of a source);
a pass that begins and ends between two training events without feeding one (validation, test,
eval) is a phase of its own: its span is kept out of the step it ran in.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .recorder import Recorder

NONE, FETCH, ITERATION, BACKWARD, OPTIMIZER = range(5)
LEVEL_NAMES = {NONE: "none", FETCH: "fetch", ITERATION: "iteration", BACKWARD: "backward", OPTIMIZER: "optimizer"}
MERGE_MAX = 1024  # steps closed on a weaker kind that a stronger one may still merge
NEVER = 1 << 62  # `sample_in` when no step is to be sampled


def _no_sample(start: int, end: int) -> None:
    """The default `on_sample`: nothing samples steps."""


@dataclass(eq=False)
class Source:
    """Where batches come from: a DataLoader, the located loop's iterator, or a fetch call in the
    loop body (`next(it)`, `get_batch()`). Totals split into training and other phases."""

    key: Hashable
    kind: str  # "dataloader", "loop" or "call"
    label: str  # "DataLoader", "the loop's iterator", "next() on line 4", ...
    ref: Callable[[], Any] | None = None  # weak reference to the DataLoader
    wait_ns: int = 0  # time blocked in its own fetches that fed training steps (exclusive)
    batches: int = 0
    passes: int = 0
    phase_wait_ns: int = 0  # ... in passes kept out of the steps (validation and the like)
    phase_batches: int = 0
    phase_span_ns: int = 0
    phase_passes: int = 0
    grad_disabled: bool = False  # a phase pass started with autograd off (torch.no_grad)
    batch_size: int | None = None  # of its first batch (None: not read, or not tensors)
    batch_kind: str | None = None  # type name of its first batch


@dataclass(eq=False)
class Pass:
    """One pass over a source: from its first fetch to its end (StopIteration or abandoned)."""

    source: Source
    trained: bool = False  # it fed a training event (or is done with: see `_exclude`)
    batches: int = 0
    wait_ns: int = 0  # its own fetch time (exclusive of nested fetches)
    first_serial: int = -1  # serial number of the outermost fetch holding its first fetch
    last_serial: int = -1
    start_ns: int = 0  # start of that outermost fetch
    end_ns: int = 0
    wait_before: int = 0  # the model's running wait total before its first fetch
    wait_after: int = 0
    grad_disabled: bool = False  # autograd was off when it started (torch.no_grad)


@dataclass
class Span:
    """Time kept out of the open step: a phase, as outermost-fetch serial numbers and times."""

    first_serial: int
    last_serial: int
    start_ns: int
    end_ns: int
    wait_before: int
    wait_after: int


# A training event inside a loop iteration: the step ends with the iteration, unless the
# iteration holds a second one (then it ends here, with these totals): (t, wait, excluded,
# fetch_serial). A plain tuple: one is made every step of a training loop.
Deferred = tuple[int, int, int, int]


@dataclass
class StepModel:
    """Online state: the open step, the level of step boundaries, the passes not yet classified."""

    recorder: Recorder
    level: int = NONE
    start: int | None = None  # open step's start (ns)
    wait: int = 0  # outermost fetch time in the open step, phases taken out
    excluded: int = 0  # time in the open step that is not the step's (phases, the view's own time)
    fetch_serial: int = 0  # outermost fetches so far (the next one's serial number)
    wait_total: int = 0  # outermost fetch time so far
    step_wait_base: int = 0  # wait_total when the open step started
    in_iteration: bool = False
    iterations_are_steps: bool = True
    deferred: Deferred | None = None
    primary: Source | None = None  # fetch level: the DataLoader whose fetches start steps
    steps_at_start: int = 0  # recorder steps before this model's first (a reused recorder)
    sources: dict[Hashable, Source] = field(default_factory=dict)
    open_passes: list[Pass] = field(default_factory=list)  # unclassified passes with a fetch
    spans: list[Span] = field(default_factory=list)  # phases kept out of the open step
    kept_out_ns: int = 0  # all the time `exclude_time` kept out (so that no time is kept out twice)
    # Listeners (the capture): a step closed (its end, the serial number of the first fetch that
    # is not its own; its index is the recorder's last); the last n closed steps were merged into
    # the open one; a phase was kept out of the open step.
    on_step: Callable[[int, int], None] | None = None
    notify_every_step: bool = True  # else on_step only for a step ending at or after notify_from
    notify_from: int = 0
    on_merge: Callable[[int], None] | None = None
    on_exclude: Callable[[Span], None] | None = None
    # A sampler of steps (step_parts.py): `on_sample(start, end)` when the `sample_in`-th step
    # from now has closed (its index is the recorder's last; its phases still in `spans`; the
    # next step open, so that the sampler's own time can be kept out of it). One decrement a
    # step; the sampler sets `sample_in` again from its callback.
    sample_in: int = NEVER
    on_sample: Callable[[int, int], None] = _no_sample
    _first_optimizer: Callable[[], Any] | None = None
    _stack: list[int] = field(default_factory=list)  # child fetch time of each open fetch
    _outer_passes: list[Pass] = field(default_factory=list)

    # -- sources ------------------------------------------------------------------------------
    def source(self, key: Hashable, kind: str, label: str, obj: Any = None) -> Source:
        """The source with that key, made on first use (`obj`, the DataLoader or iterator, is
        held by a weak reference when it takes one)."""
        found = self.sources.get(key)
        if found is None:
            ref = None
            if obj is not None:
                try:
                    ref = weakref.ref(obj)
                except TypeError:
                    ref = None
            found = self.sources[key] = Source(key, kind, label, ref)
        return found

    # -- fetches ----------------------------------------------------------------------------
    def fetch_begin(self) -> None:
        """A fetch begins (fetch_end() ends it): fetches nested in it are its own time."""
        self._stack.append(0)

    def fetch_end(self, t0: int, t1: int, source: Source | None, pass_: Pass | None, batch: bool) -> None:
        """A fetch that began with fetch_begin() at t0 ended at t1; `batch`: it delivered one.
        Its own time goes to its pass (or source); an outermost fetch's time is data wait.
        On the per-step path: the common case (a pass already feeding the steps) is short."""
        d = t1 - t0
        stack = self._stack
        exclusive = d - stack.pop()
        if pass_ is not None:
            if pass_.trained:
                src = pass_.source
                src.wait_ns += exclusive
                src.batches += batch
            else:
                pass_.wait_ns += exclusive
                pass_.batches += batch
                self._outer_passes.append(pass_)
        elif source is not None:
            source.wait_ns += exclusive
            source.batches += batch
        if stack:
            stack[-1] += d
            return
        if self.start is None:
            self.start = t0
            self.step_wait_base = self.wait_total
        self.wait += d
        self.wait_total += d
        serial = self.fetch_serial
        self.fetch_serial = serial + 1
        if self._outer_passes:
            self._place(t0, t1, d, serial)

    def _place(self, t0: int, t1: int, d: int, serial: int) -> None:
        """The passes not yet classified that the outermost fetch held: where they are."""
        for p in self._outer_passes:
            if p.first_serial < 0:
                p.first_serial = serial
                p.start_ns = t0
                p.wait_before = self.wait_total - d
                self.open_passes.append(p)
            p.last_serial = serial
            p.end_ns = t1
            p.wait_after = self.wait_total
        self._outer_passes = []

    def pass_ended(self, pass_: Pass) -> None:
        """A pass is over (StopIteration, or the located loop's iterator closed). Once steps are
        defined by training or loop iterations, a pass that fed no training event is a phase."""
        if pass_.trained or pass_ not in self.open_passes:
            return
        if self.level >= ITERATION:
            self.open_passes.remove(pass_)
            self._exclude(pass_)

    # -- classifying ------------------------------------------------------------------------------
    def _classify_at_event(self) -> None:
        """A training event: each open pass fed it, unless it was left behind after two or more
        batches for another source's fetch (an abandoned validation pass)."""
        if not self.open_passes:  # the common case: every pass already classified
            return
        latest = self.fetch_serial - 1
        for p in list(self.open_passes):
            self.open_passes.remove(p)
            if p.batches >= 2 and p.last_serial < latest:
                self._exclude(p)
            else:
                self._train(p)

    def _classify_at_boundary(self) -> None:
        """A step ends. With training events, passes still open fed none of them (a pass that
        fed one was classified then). With loop iterations, a pass that gave more than one batch
        inside one iteration is a nested pass of its own. At the fetch level: not yet known."""
        if self.level <= FETCH:
            return
        for p in list(self.open_passes):
            self.open_passes.remove(p)
            if self.level >= BACKWARD or p.batches >= 2:
                self._exclude(p)
            else:
                self._train(p)

    def _train(self, p: Pass) -> None:
        p.trained = True
        src = p.source
        src.wait_ns += p.wait_ns
        src.batches += p.batches
        src.passes += 1
        p.wait_ns = p.batches = 0

    def _exclude(self, p: Pass) -> None:
        """Keep the pass's span out of the open step; it is a phase of its own."""
        p.trained = True  # done with it: later fetches of this pass (if any) count as training
        src = p.source
        src.phase_wait_ns += p.wait_ns
        src.phase_batches += p.batches
        src.phase_passes += 1
        src.grad_disabled = src.grad_disabled or p.grad_disabled
        p.wait_ns = p.batches = 0
        span = Span(p.first_serial, p.last_serial, p.start_ns, p.end_ns, p.wait_before, p.wait_after)
        if self.start is not None and span.start_ns < self.start:  # began in a closed step
            span.start_ns, span.wait_before = self.start, max(span.wait_before, self.step_wait_base)
        if span.end_ns <= span.start_ns:
            return
        for other in list(self.spans):  # a pass nested in another's fetches has the same span
            if other.first_serial <= span.last_serial and span.first_serial <= other.last_serial:
                self.spans.remove(other)
                self._account(other, -1)
                src.phase_span_ns -= other.end_ns - other.start_ns
                span = Span(
                    min(span.first_serial, other.first_serial),
                    max(span.last_serial, other.last_serial),
                    min(span.start_ns, other.start_ns),
                    max(span.end_ns, other.end_ns),
                    min(span.wait_before, other.wait_before),
                    max(span.wait_after, other.wait_after),
                )
        self.spans.append(span)
        self._account(span, 1)
        src.phase_span_ns += span.end_ns - span.start_ns
        if self.on_exclude is not None:
            self.on_exclude(span)

    def _account(self, span: Span, sign: int) -> None:
        self.excluded += sign * (span.end_ns - span.start_ns)
        self.wait -= sign * (span.wait_after - span.wait_before)

    # -- training events and iterations -----------------------------------------------------------
    def training_event(self, level: int, t: int, optimizer: Any = None) -> bool:
        """`backward()` (BACKWARD) or an optimizer's step (OPTIMIZER) ended at t. True when it
        closed a step."""
        return self.trained(level, t, level != OPTIMIZER or self._is_first_optimizer(optimizer))

    def trained(self, level: int, t: int, first: bool = True) -> bool:
        """`training_event` once the optimizer is known to be the first one seen stepping or
        not (`first`; the capture asks `_is_first_optimizer` when the step happens and may
        report it later)."""
        if not first:
            self._classify_at_event()  # a second optimizer (GANs) feeds the same step
            return False
        if level > self.level:
            self._upgrade(level)
        if self.open_passes:  # (`_classify_at_event`'s own test, without its call: every event)
            self._classify_at_event()
        if level < self.level:
            return False
        if self.in_iteration and self.iterations_are_steps:
            if self.deferred is None:
                self.deferred = (t, self.wait, self.excluded, self.fetch_serial)
                return False
            self.iterations_are_steps = False  # two steps in one iteration: each ends here
            held, self.deferred = self.deferred, None
            self._close(*held)
        return self.boundary(t)

    def _is_first_optimizer(self, optimizer: Any) -> bool:
        ref = self._first_optimizer
        first = ref() if ref is not None else None
        if first is None:  # none yet, or it is gone (a new optimizer made each epoch)
            try:
                self._first_optimizer = weakref.ref(optimizer)
            except TypeError:
                self._first_optimizer = lambda: optimizer
            return True
        return first is optimizer

    def iteration_begin(self) -> None:
        """An iteration of the located loop begins (its body runs)."""
        self.in_iteration = True

    def iteration_end(self, t: int) -> bool:
        """An iteration of the located loop ended at t. True when it closed a step."""
        self.in_iteration = False
        level = self.level
        if level == ITERATION or self.deferred is not None:
            self.deferred = None
            start = self.start
            if self.open_passes or start is None:
                return self.boundary(t)
            # boundary(t), written out: this runs once a step on the per-step path
            self.recorder.add(start, start + self.wait, t - self.excluded)
            self.start = t
            self.wait = self.excluded = 0
            self.step_wait_base = self.wait_total
            n = self.sample_in - 1
            self.sample_in = n
            if not n:
                self.on_sample(start, t)
            if self.spans:
                self.spans.clear()
            if self.on_step is not None and (self.notify_every_step or t >= self.notify_from):
                self.on_step(t, self.fetch_serial)
            return True
        if level < ITERATION:
            self._upgrade(ITERATION)
            return self.boundary(t)
        return False

    def iterations(self, starts: np.ndarray, ends: np.ndarray, pass_: Pass) -> bool:
        """Several iterations of the located loop reported at once, in bulk: iteration i ended
        at starts[i] (where its successor's fetch began) and that fetch, of `pass_`, gave a batch
        at ends[i]; the last one is open. The same as `iteration_end(starts[i])`, then the fetch
        `(starts[i], ends[i])`, for each i, when the model is steady (iterations are the steps,
        nothing to classify, no listener due); False (nothing done) otherwise."""
        m = len(starts)
        start = self.start
        if (
            not m
            or start is None
            or not self.steady(pass_)
            or self.sample_in <= m
            or (self.on_step is not None and (self.notify_every_step or int(starts[-1]) >= self.notify_from))
        ):
            return False
        t0 = np.empty(m, dtype=np.int64)
        t1 = np.empty(m, dtype=np.int64)
        t0[0], t1[0] = start, start + self.wait
        t0[1:], t1[1:] = starts[:-1], ends[:-1]
        t2 = starts.copy()
        t2[0] -= self.excluded
        self.recorder.add_many(t0, t1, t2)
        waits = ends - starts
        total = int(waits.sum())
        last = int(waits[-1])
        src = pass_.source
        src.wait_ns += total
        src.batches += m
        self.wait_total += total
        self.fetch_serial += m
        self.start = int(starts[-1])
        self.wait, self.excluded = last, 0
        self.step_wait_base = self.wait_total - last
        self.sample_in -= m
        self.in_iteration = True
        if self.spans:
            self.spans.clear()
        return True

    def steady(self, pass_: Pass) -> bool:
        """Iterations of the located loop over `pass_` can go in bulk (`iterations`): they are
        the steps, and nothing waits to be classified."""
        return self.level == ITERATION and self.deferred is None and self.settled(pass_)

    def settled(self, pass_: Pass) -> bool:
        """Steps end at iterations of the located loop over `pass_` or at the training events
        of the steps' kind held by them, and nothing waits to be classified (stamps.py replays
        such iterations in bulk)."""
        return (
            self.level >= ITERATION
            and self.iterations_are_steps
            and pass_.trained
            and not self.open_passes
            and not self._stack
            and not self._outer_passes
        )

    def fetch_started(self, source: Source, t0: int) -> bool:
        """A DataLoader fetch outside any other fetch begins: at the fetch level (no loop and no
        training event seen), each fetch of the first DataLoader read starts a step."""
        if self.level > FETCH or self._stack:
            return False
        if self.primary is None:
            self.primary = source
            self.level = FETCH
        if source is not self.primary:
            return False
        return self.boundary(t0)

    # -- steps ----------------------------------------------------------------------------------
    def boundary(self, t: int) -> bool:
        """Close the open step at t (the first boundary only opens one)."""
        if self.open_passes:
            self._classify_at_boundary()
        start = self.start
        if start is None:
            self.start = t
            self.step_wait_base = self.wait_total
            return False
        self.recorder.add(start, start + self.wait, t - self.excluded)
        self.start = t
        self.wait = self.excluded = 0
        self.step_wait_base = self.wait_total
        n = self.sample_in - 1
        self.sample_in = n
        if not n:
            self.on_sample(start, t)
        if self.spans:
            self.spans.clear()
        if self.on_step is not None and (self.notify_every_step or t >= self.notify_from):
            self.on_step(t, self.fetch_serial)
        return True

    def _close(self, t: int, wait: int, excluded: int, next_serial: int) -> None:
        """Record the open step as ending at an earlier training event t, with the totals it had
        then; what came after t stays in the new open step."""
        assert self.start is not None
        start = self.start
        self.recorder.add(start, start + wait, t - excluded)
        self.start = t
        self.wait -= wait
        self.excluded -= excluded
        self.step_wait_base = self.wait_total - self.wait
        self.sample_in -= 1
        if not self.sample_in:
            self.on_sample(start, t)
        self.spans.clear()
        if self.on_step is not None:
            self.on_step(t, next_serial)

    def _upgrade(self, level: int) -> None:
        """Steps closed on a weaker kind of event are micro-steps of the first real one: merge
        them into the open step (when few enough of them are still in the recorder's chunk)."""
        self.level = level
        self.iterations_are_steps = True
        self.deferred = None
        closed = self.recorder.n_steps - self.steps_at_start
        if not 0 < closed <= MERGE_MAX or self.start is None:
            return
        merged = self.recorder.pop_tail(closed)
        if merged is None:
            return
        first_start, wait_ns, steps_ns = merged
        self.excluded += (self.start - first_start) - steps_ns
        self.start = first_start
        self.wait += wait_ns
        self.step_wait_base = self.wait_total - self.wait
        self.spans.clear()
        if self.on_merge is not None:
            self.on_merge(closed)

    def exclude_time(self, ns: int) -> None:
        """Time in the open step that is nobody's (the live view's own refresh)."""
        self.excluded += ns
        self.kept_out_ns += ns

    # -- the end ----------------------------------------------------------------------------------
    def close(self) -> None:
        """The capture ended: classify what is still open as a boundary would (the fetch level:
        everything read fed the steps)."""
        self._classify_at_boundary()
        for p in list(self.open_passes):
            self.open_passes.remove(p)
            self._train(p)
        self.deferred = None
        primary = self.primary
        if self.level == FETCH and primary is not None and not (primary.batches or primary.phase_batches):
            # Steps between fetches of a DataLoader that never gave a batch (an empty one, a
            # first fetch that raised) are no steps: what `iter()` took is all they held.
            closed = self.recorder.n_steps - self.steps_at_start
            if 0 < closed <= MERGE_MAX and self.recorder.pop_tail(closed) is not None:
                self.level, self.primary, self.start = NONE, None, None

    @property
    def current_step(self) -> int | None:
        """Index of the open step, None before the first one."""
        return self.recorder.n_steps if self.start is not None else None
