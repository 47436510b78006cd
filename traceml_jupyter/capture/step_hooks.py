"""The capture's per-step hooks, on the thread that runs the cell: the located loop's iterator,
fetches (a DataLoader's `__next__`, a fetch call in the loop body), `backward()` and optimizer
steps (recording.py installs the patches that call them).

Each hook either stamps (two clock reads and a few appends: stamps.py) or, where something needs
the step's boundaries at once (the GPU path, a sampled step, the first steps), reports its event
to the step model when it happens; stamping.py decides which, and when the stamps are replayed.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from time import perf_counter_ns
from typing import Any

from ..failures import never_raise
from .data.probes import batch_size_of, type_name
from .gpu import cuda_graphs
from .gpu.gpu_activity import QueuedWork
from .instrument import hooks
from .stamping import MIN_BUDGET, Stamping
from .steps.stamps import (
    BACKWARD_DONE,
    CALL_END,
    CALL_START,
    FETCH_END,
    FETCH_START,
    FIRST_STEP,
    OTHER_STEP,
)
from .steps.step_model import BACKWARD, FETCH, OPTIMIZER, Pass, Source

MAX_PASS_STARTS = 1 << 16
AT_ONCE_LOOKS = 64  # iterations reported at once that may skip the loop's look in a row
_CAPTURES = cuda_graphs._STATE  # CUDA graph captures under way (read on the training-event path)


def _grad_enabled() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch.is_grad_enabled()) if torch is not None else True
    except Exception:
        return True


class StepHooks(Stamping):
    """The hooks (recording.Capture sets the attributes)."""

    call_labels: dict[int, str]
    optimizer_name: str | None
    backward_seen: bool
    pass_starts: list[tuple[Source, int]]
    on_workers: Callable[[list[int], int], None] | None
    graphs: cuda_graphs.GraphWatch
    work: QueuedWork
    _iter_passes: dict[int, Pass]
    _own_ns: int
    _call_sources: dict[int, Source]

    # -- the located loop -------------------------------------------------------------------
    def loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """`for x in loop(it)`: each fetch is data wait, each iteration ends a step or not (see
        step_model.py)."""
        self.run.loop_started()
        source = self.model.source("loop", "loop", "the loop's iterator", None)
        return self._loop(iterable, Pass(source), source)

    def _loop(self, iterable: Iterable[Any], pass_: Pass, source: Source) -> Iterator[Any]:
        __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
        model, clock, stamps = self.model, perf_counter_ns, self.stamps
        push, stack, iteration_end, fetch_end = stamps.loop.append, model._stack, model.iteration_end, model.fetch_end
        it: Iterator[Any] | None = None
        first = source.batch_kind is None  # the source's first batch is read once
        fetched = False  # a batch of this pass is in use: its iteration ends at the next fetch
        k = 0  # fetches still to stamp before the capture looks again (0: report each one now)
        due = 0  # when the capture looks again anyway (the run's next tick)
        self._live_loops += 1
        try:
            while True:
                if k:
                    # The per-step path: two clock reads, two appends (stamps.py). The fetch's
                    # start is also where the iteration before it ended.
                    t = clock()
                    push(t)
                    try:
                        item = next(it)  # type: ignore[arg-type]
                    except BaseException as exc:
                        self._loop_fetch_failed(t, clock(), pass_)
                        if isinstance(exc, StopIteration):
                            return
                        raise
                    t = clock()
                    push(t)
                    k -= 1
                    if t >= due or not k:
                        k, due = self._settle_loop(t, k, pass_)
                else:
                    # Reported now (the GPU path, sampled steps, the first steps), after what
                    # the other hooks stamped. On the CPU no `_fetch_begin`/`_fetch_end` calls.
                    if stamps.loop or stamps.events:
                        self.flush()
                    if fetched and self.active:  # (no grant at the step it ends: the loop looks after this fetch)
                        stamps.writer = pass_
                        iteration_end(clock())
                    if self.cuda is None:  # (on a GPU its events first: a full launch queue is no wait)
                        stack.append(0)
                    else:
                        self._fetch_begin()
                    t0 = clock()
                    try:
                        if it is None:  # the first fetch includes iter(): a loader's worker start-up
                            it = iter(iterable)
                        item = next(it)
                    except BaseException as exc:
                        self._fetch_end(t0, clock(), None, pass_, False)
                        if isinstance(exc, StopIteration):
                            return
                        raise
                    t = clock()
                    if self.cuda is None and not (stamps.loop or stamps.events):
                        fetch_end(t0, t, None, pass_, True)
                    else:
                        self._fetch_end(t0, t, None, pass_, True)
                    if first:
                        first = self._first_loop_batch(source, item, iterable)
                    model.in_iteration = fetched = True
                    if self.deferred:
                        k, due = self._settle_loop(t, 0, pass_)
                    elif self._at_once_left:
                        # Still at once: nothing the look depends on changed since it chose so
                        # (no sampler call, no listener, no grant), and it set the line flag.
                        self._at_once_left -= 1
                        stamps.writer = None
                    else:  # (what `_settle_loop` does then)
                        k, due = self._look_again(t, 0, pass_)
                # The body: its lines timed or not (the flag `_settle_loop` set), then the
                # iteration ends at the next fetch, or here when the loop is left.
                try:
                    yield item
                except BaseException:
                    if self.active:
                        self._loop_left(clock())
                    raise
        finally:
            self._loop_ended(pass_)

    def _loop_ended(self, pass_: Pass) -> None:
        """A pass of the located loop is over (its end, `break`, an exception, closed)."""
        self._live_loops -= 1
        self._untake_at_once()
        if not self.deferred:  # the next step end grants the hooks again (`_budget`)
            self.model.notify_every_step = True
        if self.active:
            self.flush()
            self.model.pass_ended(pass_)
        if self.stamps.writer is pass_:
            self.stamps.writer = None

    def _first_loop_batch(self, source: Source, item: Any, iterable: Any) -> bool:
        """The located loop's first batch of its source: what it is (read once). False."""
        self._first_batch(source, item)
        self.run.note_loop_iterable(iterable)
        return False

    def _loop_fetch_failed(self, t0: int, t1: int, pass_: Pass) -> None:
        """A stamped fetch of the located loop raised (StopIteration at the end of a pass)."""
        if not self.active:
            return
        self.flush()  # its start: the end of the iteration before it
        self.stamps.loop_fetch_failed()
        self.model.fetch_end(t0, t1, None, pass_, False)

    def _loop_left(self, t: int) -> None:
        """The located loop's body was left (break, return, an exception): its iteration ends."""
        self.flush()
        self.model.iteration_end(t)

    def _settle_loop(self, t: int, left: int, pass_: Pass) -> tuple[int, int]:
        """After a fetch of the located loop gave its batch (at t): set the line flag for the
        iterations to come, and say how many of the next fetches may be stamped before the
        capture looks again (0: report each one now) and until when. `left`: fetches granted
        that did not run (a tick is due before them)."""
        stamps = self.stamps
        if not left and t < self.due and self.deferred and self.room >= 0 and stamps.writer is pass_:
            loop_room = self._loop_room
            if loop_room <= 0 < self.room:  # the step ends the other hooks left: granted again, no replay
                room = self.room // 4 if self._events_seen or stamps.events else 0
                loop_room, self.room = self.room - room, room
            if loop_room > 0:  # the line flag's next run only: the per-step path's one call
                if (lines := self.lines) is None:
                    self._loop_room = 0
                    return loop_room, self.due
                hooks.lines.on, n = lines.take(loop_room)
                self._loop_room = loop_room - n
                return n, self.due
        return self._look_again(t, left, pass_)

    def _look_again(self, t: int, left: int, pass_: Pass) -> tuple[int, int]:
        """`_settle_loop` when the stamps are due: replay them, tick if due, grant again. (After
        each fetch while events are reported at once: then nothing is pending, and each step's
        end ticks, so this is the budget and the line flag.)"""
        lines, stamps, model = self.lines, self.stamps, self.model
        if left and lines is not None:
            lines.untake(left)
        self._untake_at_once()
        worked = bool(stamps.loop or stamps.events)
        began = kept_out = 0
        if worked or not model.notify_every_step:  # (else no tick is due here: `_tick_due`)
            began, kept_out = perf_counter_ns(), model.kept_out_ns
            if worked:
                self.flush()
            if self._tick_due(t):
                self._tick(t)
                worked = True
        budget = self._budget()
        k = 0
        at_once = budget < MIN_BUDGET
        if not at_once:
            room = budget // 4 if self._events_seen else 0
            k = budget - room
            self._defer(room, loop=True)
            stamps.writer = pass_
        else:
            self._report_now()
        self._events_seen = False
        self._loop_room = 0
        if at_once:
            # Until the sampler is called or a listener changes something, the loop's next
            # looks would decide the same: the next iterations that share the line flag skip
            # them (AT_ONCE_LOOKS at most).
            self._at_once_left = AT_ONCE_LOOKS - 1
            if lines is not None:
                hooks.lines.on, n = lines.take(AT_ONCE_LOOKS)
                self._at_once_left = n - 1
        elif lines is not None:
            hooks.lines.on, n = lines.take(k)
            k, self._loop_room = n, k - n
        if worked:
            self._own_time(began, kept_out)
        return k, self.due

    def aloop(self, iterable: AsyncIterable[Any]) -> AsyncIterator[Any]:
        """`async for x in aloop(it)`: the same, for an asynchronous iterator."""
        self.run.loop_started()
        source = self.model.source("loop", "loop", "the loop's iterator", None)
        return self._aloop(iterable, Pass(source), source)

    async def _aloop(self, iterable: AsyncIterable[Any], pass_: Pass, source: Source) -> AsyncIterator[Any]:
        __tracebackhide__ = True  # noqa: F841
        model, clock = self.model, perf_counter_ns
        it: AsyncIterator[Any] | None = None
        try:
            while True:
                self._fetch_begin()
                t0 = clock()
                try:
                    if it is None:
                        it = aiter(iterable)
                    item = await anext(it)
                except StopAsyncIteration:
                    self._fetch_end(t0, clock(), None, pass_, False)
                    return
                except BaseException:
                    self._fetch_end(t0, clock(), None, pass_, False)
                    raise
                self._fetch_end(t0, clock(), None, pass_, True)
                if source.batch_kind is None:
                    self._first_batch(source, item)
                    self.run.note_loop_iterable(iterable)
                model.in_iteration = True
                if self.lines is not None:
                    hooks.lines.on = self.lines.sample()
                try:
                    yield item
                finally:
                    if self.active:
                        self._loop_left(clock())
        finally:
            if self.active:
                self.flush()
                model.pass_ended(pass_)

    # -- fetches ------------------------------------------------------------------------------
    def _fetch_begin(self) -> None:
        stamps = self.stamps
        if stamps.loop or stamps.events:  # (`flush`'s own test, without its call: on every fetch)
            self.flush()
        model = self.model
        if self.cuda is not None and not model._stack and not cuda_graphs.capturing():
            t_in = perf_counter_ns()
            try:
                self.cuda.before_fetch(model.recorder.n_steps)
            except Exception as exc:
                self._gpu_failed(exc)
            self._own_ns += perf_counter_ns() - t_in
        model.fetch_begin()

    def _fetch_end(self, t0: int, t1: int, source: Source | None, pass_: Pass | None, batch: bool) -> None:
        stamps = self.stamps
        if stamps.loop or stamps.events:
            self.flush()
        model = self.model
        model.fetch_end(t0, t1, source, pass_, batch)
        if self.cuda is not None and not model._stack and not cuda_graphs.capturing():
            t_in = perf_counter_ns()
            try:
                self.cuda.after_fetch(model.fetch_serial - 1)
            except Exception as exc:
                self._gpu_failed(exc)
            self._own_ns += perf_counter_ns() - t_in

    def fetch(self, site: int, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """A fetch call in the loop body (`next(it)`, `get_batch()`): its time is data wait."""
        __tracebackhide__ = True  # noqa: F841
        source = self._call_sources.get(site)
        if source is None:
            source = self._call_sources[site] = self.model.source(
                ("call", site), "call", self.call_labels.get(site, "a fetch call")
            )
        clock = perf_counter_ns
        if self.deferred and source.batch_kind is not None:  # stamped (stamps.py)
            stamps = self.stamps
            events, refs = stamps.events, stamps.refs
            t0 = clock()
            events += (len(stamps.loop) << 3 | CALL_START, t0)
            refs.append(source)
            try:
                item = func(*args, **kwargs)
            except BaseException:
                self._stamped_fetch_failed(t0, clock(), source, None)
                raise
            t1 = clock()
            events += (len(stamps.loop) << 3 | CALL_END, t1)
            refs.append(source)
            if t1 >= self.due:
                self._settle(t1)
            return item
        self._fetch_begin()
        t0 = clock()
        try:
            item = func(*args, **kwargs)
        except BaseException:
            self._fetch_end(t0, clock(), source, None, False)
            raise
        self._fetch_end(t0, clock(), source, None, True)
        if source.batches == 1:
            self._first_batch(source, item)
        return item

    def _stamped_fetch_failed(self, t0: int, t1: int, source: Source | None, pass_: Pass | None) -> None:
        """A stamped fetch raised: what is pending is replayed (its start too), its end now."""
        if not self.active:
            return
        self.flush()
        self.stamps.fetch_failed()
        self._fetch_end(t0, t1, source, pass_, False)

    def dataloader_iter(self, loader: Any, original: Callable[[Any], Any]) -> Any:
        """`iter(loader)`: starts a pass; its time (worker start-up) is the pass's first wait."""
        __tracebackhide__ = True  # noqa: F841
        self.flush()
        model = self.model
        source = model.sources.get(id(loader))
        if source is None:
            source = model.source(id(loader), "dataloader", "DataLoader", loader)
            self.run.note_dataloader(source, loader)
        pass_ = Pass(source, grad_disabled=not _grad_enabled())
        if len(self.pass_starts) < MAX_PASS_STARTS:
            self.pass_starts.append((source, model.recorder.n_steps))
        clock = perf_counter_ns
        self._fetch_begin()
        t0 = clock()
        try:
            it = original(loader)
        finally:
            self._fetch_end(t0, clock(), None, pass_, False)
        self._iter_passes[id(it)] = pass_
        if self.on_workers is not None:
            self._workers_of(it, loader)
        return it

    def _workers_of(self, it: Any, loader: Any) -> None:
        """The worker processes of a DataLoader iterator, for the host sampler (once a pass)."""
        with never_raise():  # an iterator of another kind, a worker not started: nothing to watch
            pids = [int(w.pid) for w in getattr(it, "_workers", None) or () if w.pid is not None]
            if pids and self.on_workers is not None:
                self.on_workers(pids, id(loader))

    def dataloader_next(self, it: Any, original: Callable[[Any], Any]) -> Any:
        """`next()` on a DataLoader iterator: its time is data wait; StopIteration ends the pass."""
        __tracebackhide__ = True  # noqa: F841
        pass_ = self._iter_passes.get(id(it))
        if pass_ is not None and self.deferred and pass_.source.batch_kind is not None:  # stamped
            clock = perf_counter_ns
            stamps = self.stamps
            events, refs = stamps.events, stamps.refs
            t0 = clock()
            events += (len(stamps.loop) << 3 | FETCH_START, t0)
            refs.append(pass_)
            try:
                item = original(it)
            except BaseException as exc:
                self._stamped_fetch_failed(t0, clock(), None, pass_)
                if isinstance(exc, StopIteration) and self.active:
                    self.model.pass_ended(pass_)
                    self._iter_passes.pop(id(it), None)
                raise
            t1 = clock()
            events += (len(stamps.loop) << 3 | FETCH_END, t1)
            refs.append(pass_)
            if self._level <= FETCH:
                self.room -= 1  # its start ends a step (steps are DataLoader fetches)
            if self.room < 0 or t1 >= self.due:
                self._settle(t1)
            return item
        stamps = self.stamps
        if stamps.loop or stamps.events:
            self.flush()
        model = self.model
        if pass_ is None:  # an iterator made before the capture started
            pass_ = self._iter_passes[id(it)] = Pass(self._iterator_source(it), grad_disabled=not _grad_enabled())
            if self.on_workers is not None:
                self._workers_of(it, pass_.source.ref() if pass_.source.ref is not None else it)
        source = pass_.source
        clock = perf_counter_ns
        if model.level <= FETCH and not model._stack:
            model.fetch_started(source, clock())
        if self.cuda is None:
            model._stack.append(0)  # `_fetch_begin` on the CPU, without the calls
        else:
            self._fetch_begin()
        t0 = clock()
        try:
            item = original(it)
        except StopIteration:
            self._fetch_end(t0, clock(), None, pass_, False)
            model.pass_ended(pass_)
            self._iter_passes.pop(id(it), None)
            raise
        except BaseException:
            self._fetch_end(t0, clock(), None, pass_, False)
            raise
        t1 = clock()
        if self.cuda is None and not (stamps.loop or stamps.events):
            model.fetch_end(t0, t1, None, pass_, True)  # `_fetch_end` on the CPU
        else:
            self._fetch_end(t0, t1, None, pass_, True)
        if source.batch_kind is None:
            self._first_batch(source, item)
        return item

    def _iterator_source(self, it: Any) -> Source:
        """The source of an iterator made before the run: its DataLoader when the namespace
        still holds it, else the iterator itself."""
        from .data.dataloaders import loader_of_iterator
        from .data.probes import user_namespace

        loader = loader_of_iterator(it, user_namespace())
        model = self.model
        if loader is not None:
            source = model.sources.get(id(loader))
            if source is None:
                source = model.source(id(loader), "dataloader", "DataLoader", loader)
                self.run.note_dataloader(source, loader)
            return source
        return model.source(("iterator", id(it)), "dataloader", "DataLoader iterator", None)

    def _first_batch(self, source: Source, item: Any) -> None:
        source.batch_kind = type_name(item)
        source.batch_size = batch_size_of(item)

    # -- training events --------------------------------------------------------------------------
    def training_event(self, level: int, optimizer: Any = None) -> None:
        """`backward()` or an optimizer's step ended (`level`): it may end a step."""
        t = perf_counter_ns()
        if self.deferred and not _CAPTURES.active:  # stamped (stamps.py)
            stamps = self.stamps
            pos = len(stamps.loop)
            if level == BACKWARD:
                self.backward_seen = True
                kind = BACKWARD_DONE
            else:
                if self.optimizer_name is None:
                    self.optimizer_name = type_name(optimizer)
                # which optimizer is the first is known now (the first one alive now)
                ref = self.model._first_optimizer  # (the first one again: no call)
                first = (ref is not None and ref() is optimizer) or self.model._is_first_optimizer(optimizer)
                kind = FIRST_STEP if first else OTHER_STEP
            stamps.events += (pos << 3 | kind, t)
            stamps.refs.append(None)
            if kind != OTHER_STEP and level >= self._level:  # it may end steps (another optimizer never)
                if level > self._level:
                    self._level_free = False
                    self.room -= 2  # a stronger kind of step: merges, then ends two at most
                elif self._level_free and not (pos + (stamps._open is not None)) & 1 and pos != self._level_pos:
                    # The first event of the steps' own kind in the body of an iteration of the
                    # located loop (steps are its iterations): it only marks the step that the
                    # iteration's end ends.
                    self._level_pos = pos
                else:
                    self._level_free = False
                    self.room -= 2  # a step ends here, two when it is the iteration's second
            if self.room < 0 or t >= self.due:
                self._settle(t)
            return
        if level == OPTIMIZER and self.optimizer_name is None:
            self.optimizer_name = type_name(optimizer)
        elif level == BACKWARD:
            self.backward_seen = True
        if _CAPTURES.active and self.graphs.held(level, optimizer):
            return  # recorded into a CUDA graph, not run: it ends no step (its replays do)
        stamps = self.stamps
        if stamps.loop or stamps.events:
            self.flush()
        if self._deciding:
            self.work.look("work queued when a training event ended")
        model = self.model  # (`model.training_event`; the first optimizer again, without a call)
        if level < model.level and not model.open_passes:
            return  # weaker than the steps' kind, no pass to classify: nothing for the model
        ref = model._first_optimizer
        model.trained(
            level, t, level != OPTIMIZER or (ref is not None and ref() is optimizer) or model._is_first_optimizer(optimizer)
        )
