"""The per-step path's raw stamps, and their replay into the step model.

While nothing needs a step's boundaries at once (the CPU clock, no sampled step, no view due),
the capture's hooks only read the clock and append:

- the located loop, two stamps an iteration to `loop`: where its fetch began (which is also
  where the iteration before it ended) and where it gave its batch;
- every other hook two ints to `events` (where it falls among the loop's stamps with its kind,
  `pos << 3 | kind`, then its time) and its pass or source to `refs`: a DataLoader's or a
  fetch call's start and end, a `backward()`, an optimizer step of the first optimizer or of
  another one.

`replay` feeds them to the step model in their order, exactly as if each had been reported
when it happened. While the model is steady (every pass classified, no listener, no sampler
due), iterations go in bulk with numpy: plain ones (`StepModel.iterations`), and training ones
whose fetches and training events have the usual shape (`_training_window`); otherwise the
model's transitions are run inline (`_steady`), or, where a pass must be classified or steps
merged, by the model's own methods. The hooks (step_hooks.py) stamp; stamping.py decides when
they may, and when the stamps are replayed (the run's ticks, a sampled step coming, the end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .step_model import BACKWARD, FETCH, ITERATION, NEVER, OPTIMIZER, Pass, StepModel

# Kinds of `events` (the order matters: fetch kinds first, a start just before its end). The
# first optimizer's step and another one's are told apart when they happen (the first
# optimizer is the one alive then).
FETCH_START, FETCH_END, CALL_START, CALL_END, BACKWARD_DONE, FIRST_STEP, OTHER_STEP = range(7)
BULK = 16  # iterations in a row from which the bulk replay pays
# Training iterations in a row from which their numpy window (`_training_window`, some forty
# numpy calls, about 0.1 ms however short) beats `_steady`'s inline transitions.
WINDOW = 64


def _fetched(source: Any, d: int, stack: list[int]) -> bool:
    """A fetch of `source` that took `d` ns ended (its entry on `stack` holds the time of the
    fetches inside it): its own time and batch counted. True when it was inside no other fetch
    (its time is the step's data wait), else its time goes to the fetch around it."""
    source.wait_ns += d - stack.pop()
    source.batches += 1
    if stack:
        stack[-1] += d
        return False
    return True


def _closed(model: StepModel, ends: list[tuple[int, int, int]]) -> None:
    """The steps `_steady` closed, to the recorder (a few one call each: cheaper than arrays)."""
    if len(ends) >= BULK:
        t0, t1, t2 = np.array(ends, dtype=np.int64).T
        model.recorder.add_many(t0, t1, t2)
    else:
        add = model.recorder.add
        for t0_, t1_, t2_ in ends:
            add(t0_, t1_, t2_)
    if ends and model.spans:
        model.spans.clear()


def _steady_model(model: StepModel, writer: Pass | None) -> bool:
    """Steps end at iterations or at the training events of the model's level, every pass is
    classified, no listener and no sampler due: what `Stamps._steady` writes out on locals."""
    return not (
        model.level < ITERATION
        or not model.iterations_are_steps
        or model.open_passes
        or model._outer_passes
        or (writer is not None and not writer.trained)
        or (model.on_step is not None and (model.notify_every_step or model.notify_from < NEVER))
    )


@dataclass
class _Window:
    """Training iterations in a row, as `_training_window` takes them: `n_pairs` iterations
    (their loop stamps `s` and `e`: each fetch's start and end) and their `n_ev` events (each
    one's iteration `pair`, whether it falls in the body, its kind and time), and which of the
    iterations' ends end a step (`closes`)."""

    n_pairs: int
    n_ev: int
    s: np.ndarray
    e: np.ndarray
    pair: np.ndarray
    in_body: np.ndarray
    kind: np.ndarray
    t: np.ndarray
    closes: np.ndarray
    n_body_fetches: int = 0  # the fetches in the iterations' bodies (counted by `_window_waits`)


def _window(model: StepModel, loop_stamps: list[int], events: list[int], li: int, ei: int) -> _Window | None:
    """The training iterations from loop stamp `li` and event `ei` on that go in bulk (up to
    the step that calls the sampler), or None when fewer than WINDOW of them have the shape."""
    level = model.level
    loop = np.fromiter(loop_stamps[li:], dtype=np.int64)
    n_pairs = len(loop) // 2
    ev = np.fromiter(events[2 * ei :], dtype=np.int64).reshape(-1, 2)
    at_pos = ev[:, 0] >> 3
    for _ in range(2):  # the second time for fewer iterations, the sampler's step left out
        if n_pairs < WINDOW:
            return None
        # the events of pairs 0 .. n_pairs-1, not the last one's body
        n_ev = int(np.searchsorted(at_pos, li + 2 * n_pairs - 1, side="right"))
        pos, kind, t = at_pos[:n_ev] - li - 1, ev[:n_ev, 0] & 7, ev[:n_ev, 1]
        pair, in_body = pos >> 1, (pos & 1).astype(bool)
        level_kind = FIRST_STEP if level == OPTIMIZER else BACKWARD_DONE
        if level == ITERATION:
            if ((kind == BACKWARD_DONE) | (kind == FIRST_STEP)).any():
                return None  # a stronger kind of step: merges
            closes = np.ones(n_pairs, dtype=bool)
        else:
            if (kind == FIRST_STEP).any() and level == BACKWARD:
                return None
            marks = kind == level_kind
            if (marks & ~in_body).any():
                return None  # the steps' kind inside a fetch ends a step there
            held = np.bincount(pair[marks], minlength=n_pairs)
            if (held > 1).any():
                return None  # two in one iteration: each ends a step
            closes = np.empty(n_pairs, dtype=bool)
            closes[0] = model.deferred is not None
            closes[1:] = held[:-1] > 0
        done = np.cumsum(closes)
        if not n_pairs or done[-1] < model.sample_in:
            break
        n_pairs = int(np.searchsorted(done, model.sample_in - 1, side="right"))  # before the call
    if n_pairs < WINDOW:
        return None
    s, e = loop[0 : 2 * n_pairs : 2], loop[1 : 2 * n_pairs : 2]
    return _Window(n_pairs, n_ev, s, e, pair, in_body, kind, t, closes[:n_pairs])


def _window_waits(w: _Window, refs: list[Any], writer: Pass) -> np.ndarray | None:
    """Each iteration's data wait: its fetch, then its body's fetches (each source's own time
    and batches counted); None, counting nothing, when the fetches are not the usual shape (a
    start right before its end, none inside another but in the loop's own fetch, classified
    passes)."""
    kind, t = w.kind, w.t
    f_at = np.flatnonzero(kind <= CALL_END)
    starts_at, ends_at = f_at[0::2], f_at[1::2]
    if (
        len(starts_at) != len(ends_at)
        or (ends_at != starts_at + 1).any()
        or (kind[starts_at] & 1).any()
        or (kind[ends_at] != kind[starts_at] + 1).any()
    ):
        return None
    fetched = set(refs)  # the passes and sources fetched from (a few), None for the rest
    fetched.discard(None)
    if any(isinstance(ref, Pass) and not ref.trained for ref in fetched):
        return None
    nested = ~w.in_body[starts_at]
    duration = t[ends_at] - t[starts_at]
    d = w.e - w.s
    if len(fetched) == 1:
        masks: list[tuple[Any, Any]] = [(fetched.pop(), slice(None))]
    else:
        ids = np.fromiter(map(id, refs), dtype=np.int64, count=w.n_ev)[starts_at]
        masks = [(ref, ids == id(ref)) for ref in fetched]
    for ref, mask in masks:
        src, picked = (ref.source if isinstance(ref, Pass) else ref), duration[mask]
        src.wait_ns += int(picked.sum())
        src.batches += len(picked)
    loop_source = writer.source
    loop_source.wait_ns += int(d.sum()) - int(duration[nested].sum())
    loop_source.batches += w.n_pairs
    body = ~nested
    per_pair: np.ndarray = d.copy()
    np.add.at(per_pair, w.pair[starts_at[body]], duration[body])
    w.n_body_fetches = int(body.sum())
    return per_pair


def _window_steps(model: StepModel, w: _Window, per_pair: np.ndarray) -> None:
    """The window's steps to the recorder, and the model's state after its last iteration's
    fetch (its body is still to come)."""
    assert model.start is not None, "a window starts in an open step"
    waited = np.concatenate(([0], np.cumsum(per_pair)))
    at = np.flatnonzero(w.closes)
    total = int(waited[-1])
    if len(at):
        t0 = np.empty(len(at), dtype=np.int64)
        t0[0], t0[1:] = model.start, w.s[at[:-1]]
        wait = np.diff(waited[at], prepend=0)
        wait[0] += model.wait
        t2 = w.s[at].copy()
        t2[0] -= model.excluded
        model.recorder.add_many(t0, t0 + wait, t2)
        last = int(at[-1])
        model.step_wait_base = model.wait_total + int(waited[last])
        model.start, model.wait, model.excluded = int(w.s[last]), total - int(waited[last]), 0
        if model.spans:
            model.spans.clear()
    else:
        model.wait += total
    model.wait_total += total
    model.fetch_serial += w.n_pairs + w.n_body_fetches
    model.sample_in -= len(at)
    model.in_iteration, model.deferred = True, None


class Stamps:
    """What the hooks appended since the last replay (see the module docstring)."""

    __slots__ = ("loop", "events", "refs", "writer", "_open", "_fetches", "_replaying")

    def __init__(self) -> None:
        self.loop: list[int] = []
        self.events: list[int] = []  # (position among the loop's stamps << 3 | kind, time ns) each
        self.refs: list[Any] = []  # each event's pass (a DataLoader's fetch), source (a call) or None
        self.writer: Pass | None = None  # the located loop's pass whose stamps `loop` holds
        self._open: int | None = None  # start of a loop fetch replayed without its end yet
        self._fetches: list[int] = []  # starts of other fetches replayed without their end yet
        self._replaying = False

    def stamp(self, kind: int, t: int, ref: Any = None) -> None:
        """What a hook appends (the hooks on the per-step path write it out)."""
        self.events += (len(self.loop) << 3 | kind, t)
        self.refs.append(ref)

    def pending(self) -> bool:
        """Something is stamped and not replayed yet."""
        return bool(self.loop or self.events)

    def discard(self) -> None:
        """Forget what is stamped, unreplayed (the run ended, or a replay failed)."""
        self.loop.clear()
        self.events.clear()
        self.refs.clear()

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
        self._replaying = True
        try:
            self._replay(model)
        finally:
            self.discard()
            self._replaying = False

    def _replay(self, model: StepModel) -> None:
        """Whichever applies at each point: plain iterations in bulk, training iterations in
        bulk, a steady model's transitions inline, else one item by the model's methods."""
        loop, events, writer = self.loop, self.events, self.writer
        n_loop, n_events = len(loop), len(events) // 2
        li = ei = 0  # the next loop stamp, the next event (an event at pos p comes before loop[p])
        window_from = 0  # a training window is tried again from this loop stamp on
        while li < n_loop or ei < n_events:
            upto = min(events[2 * ei] >> 3, n_loop) if ei < n_events else n_loop
            pairs = min((upto - li) // 2, model.sample_in - 1)  # up to the step that calls the sampler
            bulk = writer is not None and self._open is None and model.start is not None
            if bulk and pairs >= BULK and model.steady(writer):  # type: ignore[arg-type]
                both = np.fromiter(loop[li : li + 2 * pairs], dtype=np.int64, count=2 * pairs)
                if model.iterations(both[0::2], both[1::2], writer):  # type: ignore[arg-type]
                    li += 2 * pairs
                    continue
            if bulk and li >= window_from and ei < n_events and n_loop - li >= 2 * WINDOW:
                went = self._training_window(model, li, ei)
                if went != (li, ei):
                    li, ei = went
                    continue
                if events[2 * ei] >> 3 > li:  # (else the open iteration's body first, then again)
                    window_from = li + 2 * WINDOW  # one by one for a while, then try again
            went = self._steady(model, li, ei, window_from)
            if went != (li, ei):
                li, ei = went
                continue
            if ei < n_events and events[2 * ei] >> 3 <= li:
                self._event(model, events[2 * ei] & 7, events[2 * ei + 1], self.refs[ei])
                ei += 1
            else:
                self._loop_stamp(model, loop[li])
                li += 1

    def _loop_stamp(self, model: StepModel, t: int) -> None:
        """A stamp of the located loop by the model's methods: a fetch's start (the iteration
        before it ends there) or its end."""
        writer = self.writer
        assert writer is not None, "loop stamps without the pass that wrote them"
        if self._open is None:
            model.iteration_end(t)
            model._stack.append(0)
            self._open = t
        else:
            model.fetch_end(self._open, t, None, writer, True)
            model.in_iteration = True
            self._open = None

    def _steady(self, model: StepModel, li: int, ei: int, window_from: int = 0) -> tuple[int, int]:
        """From loop stamp `li` and event `ei` on, while the model is steady (`_steady_model`):
        its transitions written out, on locals; stops before an item that needs the model's own
        methods and returns where. This is `iteration_end`, `fetch_end`, `trained` and `boundary`
        of step_model.py for that state, item for item (test_stamps.py holds them to it)."""
        writer, start = self.writer, model.start
        if start is None or not _steady_model(model, writer):
            return li, ei
        level = model.level
        loop, events, refs = self.loop, self.events, self.refs
        n_loop, n_events = len(loop), len(events) // 2
        wait, excluded, sample_in = model.wait, model.excluded, model.sample_in
        wait_total, serial, base = model.wait_total, model.fetch_serial, model.step_wait_base
        in_iteration, held, opened = model.in_iteration, model.deferred, self._open
        stack, starts = model._stack, self._fetches  # child time / start of each open fetch
        ends: list[tuple[int, int, int]] = []  # the steps closed: the recorder's three stamps each
        loop_source = writer.source if writer is not None else None
        at = events[2 * ei] >> 3 if ei < n_events else n_loop + 1  # where the next event falls
        while True:
            if at <= li:
                e = 2 * ei
                kind, t, ref = events[e] & 7, events[e + 1], refs[ei]
                if kind <= FETCH_END and not ref.trained:
                    break  # a pass to classify
                if kind == FETCH_START or kind == CALL_START:
                    stack.append(0)
                    starts.append(t)
                elif kind == FETCH_END or kind == CALL_END:
                    d = t - starts.pop()
                    if _fetched(ref.source if kind == FETCH_END else ref, d, stack):
                        wait, wait_total, serial = wait + d, wait_total + d, serial + 1
                elif kind != OTHER_STEP:  # backward() or the first optimizer's step
                    event_level = BACKWARD if kind == BACKWARD_DONE else OPTIMIZER
                    if event_level > level:
                        break  # a stronger kind of step: merges
                    if event_level == level:
                        if in_iteration:
                            if held is not None:
                                break  # two in one iteration: each ends a step
                            held = (t, wait, excluded, serial)
                        else:
                            if sample_in <= 1:
                                break  # the sampler is called
                            ends.append((start, start + wait, t - excluded))
                            start, wait, excluded, base = t, 0, 0, wait_total
                            sample_in -= 1
                ei += 1
                at = events[e + 2] >> 3 if ei < n_events else n_loop + 1
                continue
            if li == n_loop:
                break
            t = loop[li]
            if opened is None:  # a fetch starts: the iteration before it ends
                if sample_in > BULK and li + 2 * BULK <= n_loop:
                    if level == ITERATION and li + 2 * BULK <= min(at, n_loop):
                        break  # plain iterations ahead: in bulk
                    if li >= window_from and at <= n_loop and level > ITERATION and sample_in > WINDOW and li + 2 * WINDOW <= n_loop:
                        break  # training iterations ahead: in bulk
                if level == ITERATION or held is not None:
                    if sample_in <= 1:
                        break  # the sampler is called
                    ends.append((start, start + wait, t - excluded))
                    start, wait, excluded, base = t, 0, 0, wait_total
                    sample_in -= 1
                    held = None
                in_iteration = False
                stack.append(0)
                opened = t
            else:  # it gave its batch (loop stamps come with their writer: `loop_source` is set)
                d = t - opened
                if _fetched(loop_source, d, stack):
                    wait, wait_total, serial = wait + d, wait_total + d, serial + 1
                in_iteration = True
                opened = None
            li += 1
        _closed(model, ends)
        model.start, model.wait, model.excluded, model.sample_in = start, wait, excluded, sample_in
        model.wait_total, model.fetch_serial, model.step_wait_base = wait_total, serial, base
        model.in_iteration, model.deferred, self._open = in_iteration, held, opened
        return li, ei

    def _training_window(self, model: StepModel, li: int, ei: int) -> tuple[int, int]:
        """Training iterations in bulk (numpy), from loop stamp `li` (a fetch's start) and
        event `ei` on, when the model is steady and the iterations have the usual shape: in
        the loop's fetch at most DataLoader fetches of classified passes, in the body fetch
        calls and DataLoader fetches (none inside another), `backward()`s and optimizer steps
        with at most one of the steps' own kind. Each iteration's end then ends the step when
        the iteration before it held that event (or always, when iterations are the steps).
        The last iteration's body is left to `_steady`. Returns where it stopped."""
        writer = self.writer
        if (
            writer is None
            or model.start is None
            or self._open is not None
            or self.events[2 * ei] >> 3 <= li  # an event before the first fetch: by itself first
            or not model.settled(writer)
            or (model.on_step is not None and (model.notify_every_step or model.notify_from < NEVER))
        ):
            return li, ei
        window = _window(model, self.loop, self.events, li, ei)
        if window is None:
            return li, ei
        waited = _window_waits(window, self.refs[ei : ei + window.n_ev], writer)
        if waited is None:
            return li, ei
        _window_steps(model, window, waited)
        return li + 2 * window.n_pairs, ei + window.n_ev

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
