"""The capture's per-step hooks, on the thread that runs the cell: the located loop's iterator,
fetches (a DataLoader's `__next__`, a fetch call in the loop body), `backward()` and optimizer
steps (session.py installs the patches that call them).

Each hook either stamps (two clock reads and a few appends: stamps.py) or, where something needs
the step's boundaries at once (the GPU path, a sampled step, the first steps), reports its event
to the step model when it happens; stamping.py decides which, and when the stamps are replayed.
A fetch that raises (StopIteration at a pass's end, the user's error) is reported before it goes
on up: in a `finally` (nothing of ours catches the user's exception).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from ..failures import read_or
from .data.probes import batch_size_of, type_name
from .gpu import cuda_graphs
from .instrument import hooks
from .loop_gpu import LoopGpu
from .stamping import Stamping
from .steps.stamps import (
    BACKWARD_DONE,
    CALL_END,
    CALL_START,
    FETCH_END,
    FETCH_START,
    FIRST_STEP,
    OTHER_STEP,
)
from .steps.step_model import BACKWARD, FETCH, OPTIMIZER, Pass, Source, StepModel

if TYPE_CHECKING:
    from ..recording import Recording

MAX_PASS_STARTS = 1 << 16
_CAPTURES = cuda_graphs._STATE  # CUDA graph captures under way (read on the training-event path)


def _grad_enabled() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch.is_grad_enabled()) if torch is not None else True


def _worker_pids(it: Any) -> list[int]:
    """The worker processes of a DataLoader iterator (none for another kind, or not started)."""
    return [int(w.pid) for w in getattr(it, "_workers", None) or () if w.pid is not None]


class StepHooks:
    """The hooks, and what they saw besides the steps (the optimizer, where passes started)."""

    def __init__(self, run: Recording, model: StepModel, stamping: Stamping, gpu: LoopGpu, graphs: cuda_graphs.GraphWatch) -> None:
        self.run, self.model, self.stamping, self.gpu, self.graphs = run, model, stamping, gpu, graphs
        self.call_labels: dict[int, str] = {}  # fetch call site -> "`next(it)` on line 4"
        self.optimizer_name: str | None = None
        self.pass_starts: list[tuple[Source, int]] = []  # the steps where passes over a DataLoader started
        # Who hears of DataLoader workers (host.HostSampler), while the resources are watched.
        self.on_workers: Callable[[list[int], int], None] | None = None
        self.loop_starts: Callable[[], None] | None = None  # the capture's look at the cell when a located loop starts
        self._iter_passes: dict[int, Pass] = {}  # id(DataLoader iterator) -> its pass
        self._call_sources: dict[int, Source] = {}
        # Optimizer steps under way, (optimizer, frame): the patches' pre hook appends (`inner_step`).
        self.optimizer_calls: list[tuple[Any, Any]] = []

    def closed(self) -> None:
        """The capture closed: nothing of the user's kept."""
        self._iter_passes.clear()
        self.optimizer_calls.clear()

    # -- the located loop -------------------------------------------------------------------
    def loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """`for x in loop(it)`: each fetch is data wait, each iteration ends a step or not (see
        step_model.py)."""
        if self.loop_starts is not None:
            self.loop_starts()  # a function compiled in the cell, before its loop (session.py)
        self.run.loop_started()
        source = self.model.source("loop", "loop", "the loop's iterator", None)
        return self._loop(iterable, Pass(source), source)

    def _loop(self, iterable: Iterable[Any], pass_: Pass, source: Source) -> Iterator[Any]:
        __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
        model, clock, stamping, gpu, stamps = self.model, perf_counter_ns, self.stamping, self.gpu, self.stamping.stamps
        push, stack, iteration_end, fetch_end = stamps.loop.append, model._stack, model.iteration_end, model.fetch_end
        it: Iterator[Any] | None = None
        first = source.batch_kind is None  # the source's first batch is read once
        fetched = False  # a batch of this pass is in use: its iteration ends at the next fetch
        k = 0  # fetches still to stamp before the capture looks again (0: report each one now)
        due = 0  # when the capture looks again anyway (the run's next tick)
        stamping.live_loops += 1
        try:
            while True:
                got = False  # (the fetch gave its batch: else `finally` reports it failed)
                if k:
                    # The per-step path (stamps.py); the fetch's start ends the iteration before.
                    t = clock()
                    push(t)
                    try:
                        item = next(it)  # type: ignore[arg-type]
                        got = True
                    except StopIteration:
                        return
                    finally:
                        if not got:
                            self._loop_fetch_failed(t, clock(), pass_)
                    t = clock()
                    push(t)
                    k -= 1
                    if t >= due or not k:
                        k, due = stamping.settle_loop(t, k, pass_)
                else:
                    # Reported now, after what the other hooks stamped (on the CPU no calls).
                    if stamps.loop or stamps.events:
                        stamping.flush()
                    if fetched and stamping.active:  # (no grant at the step it ends: the loop looks after this fetch)
                        stamps.writer = pass_
                        iteration_end(clock())
                    if gpu.cuda is None:  # (on a GPU its events first: a full launch queue is no wait)
                        stack.append(0)
                    else:
                        self._fetch_begin()
                    t0 = clock()
                    try:
                        if it is None:  # the first fetch includes iter(): a loader's worker start-up
                            it = iter(iterable)
                        item = next(it)
                        got = True
                    except StopIteration:
                        return
                    finally:
                        if not got:
                            self._fetch_end(t0, clock(), None, pass_, False)
                    t = clock()
                    if gpu.cuda is None and not (stamps.loop or stamps.events):
                        fetch_end(t0, t, None, pass_, True)
                    else:
                        self._fetch_end(t0, t, None, pass_, True)
                    if first:
                        first = self._first_loop_batch(source, item, iterable)
                    model.in_iteration = fetched = True
                    if stamping.deferred:
                        k, due = stamping.settle_loop(t, 0, pass_)
                    elif stamping.at_once_left:
                        # Still at once: nothing the look depends on changed since it chose so
                        # (no sampler call, no listener, no grant), and it set the line flag.
                        stamping.at_once_left -= 1
                        stamps.writer = None
                    else:  # (what `settle_loop` does then)
                        k, due = stamping.look_again(t, 0, pass_)
                # The body: its lines timed or not (the flag `settle_loop` set), then the
                # iteration ends at the next fetch, or here when the loop is left.
                got = False  # (now: the body came back for the next fetch)
                try:
                    yield item
                    got = True
                finally:
                    if not got and stamping.active:
                        self._loop_left(clock())
        finally:
            stamping.loop_ended(pass_)

    def _first_loop_batch(self, source: Source, item: Any, iterable: Any) -> bool:
        """The located loop's first batch of its source: what it is (read once). False."""
        self._first_batch(source, item)
        self.run.note_loop_iterable(iterable)
        return False

    def _loop_fetch_failed(self, t0: int, t1: int, pass_: Pass) -> None:
        """A stamped fetch of the located loop raised (StopIteration at the end of a pass)."""
        stamping = self.stamping
        if not stamping.active:
            return
        stamping.flush()  # its start: the end of the iteration before it
        stamping.stamps.loop_fetch_failed()
        self.model.fetch_end(t0, t1, None, pass_, False)

    def _loop_left(self, t: int) -> None:
        """The located loop's body was left (break, return, an exception): its iteration ends."""
        self.stamping.flush()
        self.model.iteration_end(t)

    def aloop(self, iterable: AsyncIterable[Any]) -> AsyncIterator[Any]:
        """`async for x in aloop(it)`: the same, for an asynchronous iterator."""
        self.run.loop_started()
        source = self.model.source("loop", "loop", "the loop's iterator", None)
        return self._aloop(iterable, Pass(source), source)

    async def _aloop(self, iterable: AsyncIterable[Any], pass_: Pass, source: Source) -> AsyncIterator[Any]:
        __tracebackhide__ = True  # noqa: F841
        model, clock, stamping = self.model, perf_counter_ns, self.stamping
        it: AsyncIterator[Any] | None = None
        try:
            while True:
                self._fetch_begin()
                t0 = clock()
                got = False
                try:
                    if it is None:
                        it = aiter(iterable)
                    item = await anext(it)
                    got = True
                except StopAsyncIteration:
                    return
                finally:
                    self._fetch_end(t0, clock(), None, pass_, got)
                if source.batch_kind is None:
                    self._first_batch(source, item)
                    self.run.note_loop_iterable(iterable)
                model.in_iteration = True
                if stamping.lines is not None:
                    hooks.lines.on = stamping.lines.sample()
                try:
                    yield item
                finally:
                    if stamping.active:
                        self._loop_left(clock())
        finally:
            if stamping.active:
                stamping.flush()
                model.pass_ended(pass_)

    # -- fetches ------------------------------------------------------------------------------
    def _fetch_begin(self) -> None:
        stamping = self.stamping
        stamps = stamping.stamps
        if stamps.loop or stamps.events:  # (`flush`'s own test, without its call: on every fetch)
            stamping.flush()
        model = self.model
        if self.gpu.cuda is not None and not model._stack and not cuda_graphs.capturing():
            self.gpu.before_fetch(model.recorder.n_steps)
        model.fetch_begin()

    def _fetch_end(self, t0: int, t1: int, source: Source | None, pass_: Pass | None, batch: bool) -> None:
        stamping = self.stamping
        stamps = stamping.stamps
        if stamps.loop or stamps.events:
            stamping.flush()
        model = self.model
        model.fetch_end(t0, t1, source, pass_, batch)
        if self.gpu.cuda is not None and not model._stack and not cuda_graphs.capturing():
            self.gpu.after_fetch(model.fetch_serial - 1)

    def fetch(self, site: int, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """A fetch call in the loop body (`next(it)`, `get_batch()`): its time is data wait."""
        __tracebackhide__ = True  # noqa: F841
        source = self._call_sources.get(site)
        if source is None:
            source = self._call_sources[site] = self.model.source(
                ("call", site), "call", self.call_labels.get(site, "a fetch call")
            )
        clock = perf_counter_ns
        stamping = self.stamping
        got = False
        if stamping.deferred and source.batch_kind is not None:  # stamped (stamps.py)
            stamps = stamping.stamps
            events, refs = stamps.events, stamps.refs
            t0 = clock()
            events += (len(stamps.loop) << 3 | CALL_START, t0)
            refs.append(source)
            try:
                item = func(*args, **kwargs)
                got = True
            finally:
                if not got:
                    self._stamped_fetch_failed(t0, clock(), source, None)
            t1 = clock()
            events += (len(stamps.loop) << 3 | CALL_END, t1)
            refs.append(source)
            if t1 >= stamping.due:
                stamping.settle(t1)
            return item
        self._fetch_begin()
        t0 = clock()
        try:
            item = func(*args, **kwargs)
            got = True
        finally:
            self._fetch_end(t0, clock(), source, None, got)
        if source.batches == 1:
            self._first_batch(source, item)
        return item

    def _stamped_fetch_failed(self, t0: int, t1: int, source: Source | None, pass_: Pass | None) -> None:
        """A stamped fetch raised: what is pending is replayed (its start too), its end now."""
        stamping = self.stamping
        if not stamping.active:
            return
        stamping.flush()
        stamping.stamps.fetch_failed()
        self._fetch_end(t0, t1, source, pass_, False)

    def dataloader_iter(self, loader: Any, original: Callable[[Any], Any]) -> Any:
        """`iter(loader)`: starts a pass; its time (worker start-up) is the pass's first wait."""
        __tracebackhide__ = True  # noqa: F841
        self.stamping.flush()
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
            self._workers_of(it, id(loader))
        return it

    def _workers_of(self, it: Any, loader: int) -> None:
        """The worker processes of a DataLoader iterator, for the host sampler (once a pass)."""
        pids = read_or([], _worker_pids, it)
        if pids and self.on_workers is not None:
            self.on_workers(pids, loader)

    def dataloader_next(self, it: Any, original: Callable[[Any], Any]) -> Any:
        """`next()` on a DataLoader iterator: its time is data wait; StopIteration ends the pass."""
        __tracebackhide__ = True  # noqa: F841
        pass_ = self._iter_passes.get(id(it))
        stamping = self.stamping
        got = False
        if pass_ is not None and stamping.deferred and pass_.source.batch_kind is not None:  # stamped
            clock = perf_counter_ns
            stamps = stamping.stamps
            events, refs = stamps.events, stamps.refs
            t0 = clock()
            events += (len(stamps.loop) << 3 | FETCH_START, t0)
            refs.append(pass_)
            try:
                item = original(it)
                got = True
            except StopIteration:
                got = True  # (reported here)
                self._stamped_fetch_failed(t0, clock(), None, pass_)
                if stamping.active:
                    self.model.pass_ended(pass_)
                    self._iter_passes.pop(id(it), None)
                raise
            finally:
                if not got:
                    self._stamped_fetch_failed(t0, clock(), None, pass_)
            t1 = clock()
            events += (len(stamps.loop) << 3 | FETCH_END, t1)
            refs.append(pass_)
            if stamping.level <= FETCH:
                stamping.room -= 1  # its start ends a step (steps are DataLoader fetches)
            if stamping.room < 0 or t1 >= stamping.due:
                stamping.settle(t1)
            return item
        stamps = stamping.stamps  # reported at once
        if stamps.loop or stamps.events:
            stamping.flush()
        model = self.model
        if pass_ is None:
            pass_ = self._late_pass(it)
        source = pass_.source
        clock = perf_counter_ns
        if model.level <= FETCH and not model._stack:
            model.fetch_started(source, clock())
        if self.gpu.cuda is None:
            model._stack.append(0)  # `_fetch_begin` on the CPU, without the calls
        else:
            self._fetch_begin()
        t0 = clock()
        try:
            item = original(it)
            got = True
        except StopIteration:
            got = True  # (reported here)
            self._fetch_end(t0, clock(), None, pass_, False)
            model.pass_ended(pass_)
            self._iter_passes.pop(id(it), None)
            raise
        finally:
            if not got:
                self._fetch_end(t0, clock(), None, pass_, False)
        t1 = clock()
        if self.gpu.cuda is None and not (stamps.loop or stamps.events):
            model.fetch_end(t0, t1, None, pass_, True)  # `_fetch_end` on the CPU
        else:
            self._fetch_end(t0, t1, None, pass_, True)
        if source.batch_kind is None:
            self._first_batch(source, item)
        return item

    def _late_pass(self, it: Any) -> Pass:
        """The pass of a DataLoader iterator made before the capture started."""
        pass_ = self._iter_passes[id(it)] = Pass(self._iterator_source(it), grad_disabled=not _grad_enabled())
        if self.on_workers is not None:
            ref = pass_.source.ref() if pass_.source.ref is not None else it
            self._workers_of(it, id(ref))
        return pass_

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
        stamping = self.stamping
        if stamping.deferred and not _CAPTURES.active:  # stamped (stamps.py)
            stamps = stamping.stamps
            pos = len(stamps.loop)
            if level == BACKWARD:
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
            if kind != OTHER_STEP and level >= stamping.level:  # it may end steps (another optimizer never)
                if level > stamping.level:
                    stamping.level_free = False
                    stamping.room -= 2  # a stronger kind of step: merges, then ends two at most
                elif stamping.level_free and not (pos + (stamps._open is not None)) & 1 and pos != stamping.level_pos:
                    # The first event of the steps' own kind in the body of an iteration of the
                    # located loop (steps are its iterations): it only marks the step that the
                    # iteration's end ends.
                    stamping.level_pos = pos
                else:
                    stamping.level_free = False
                    stamping.room -= 2  # a step ends here, two when it is the iteration's second
            if stamping.room < 0 or t >= stamping.due:
                stamping.settle(t)
            return
        if level == OPTIMIZER and self.optimizer_name is None:
            self.optimizer_name = type_name(optimizer)
        if _CAPTURES.active and self.graphs.held(level, optimizer):
            return  # recorded into a CUDA graph, not run: it ends no step (its replays do)
        stamps = stamping.stamps
        if stamps.loop or stamps.events:
            stamping.flush()
        if self.gpu.deciding:
            self.gpu.work.look("work queued when a training event ended")
        model = self.model  # (`model.training_event`; the first optimizer again, without a call)
        if level < model.level and not model.open_passes:
            return  # weaker than the steps' kind, no pass to classify: nothing for the model
        ref = model._first_optimizer
        model.trained(
            level, t, level != OPTIMIZER or (ref is not None and ref() is optimizer) or model._is_first_optimizer(optimizer)
        )

    def inner_step(self, optimizer: Any, frame: Any) -> bool:
        """An optimizer's step ended (its post hooks run from torch's wrapper, `frame`): True
        when it ran inside another step of the same optimizer, still under way. A subclass whose
        `step` calls `super().step()` has torch's wrapper on both methods once the base class
        was instantiated anywhere: the hooks run twice for one step, and only the outer one is
        the step. Calls whose post hooks never ran (their step raised) are dropped here."""
        calls = self.optimizer_calls
        if not calls:
            return False
        for i in range(len(calls) - 1, -1, -1):
            if calls[i][1] is frame:
                del calls[i:]
                break
        else:
            return False  # its start was not seen (the hooks came mid-step)
        if not calls:
            return False
        outer: set[int] = set()
        f = frame.f_back
        while f is not None and len(outer) < 256:
            outer.add(id(f))
            f = f.f_back
        calls[:] = [c for c in calls if id(c[1]) in outer]
        return any(c[0] is optimizer for c in calls)
