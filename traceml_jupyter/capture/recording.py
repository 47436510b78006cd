"""While a traced cell (or a `trace()` block) runs: every DataLoader fetch, `backward()`, optimizer
step and iteration of the located loop goes to the step model, on the thread that runs the cell.

What it changes, for the duration only, each undone in `finally`: `DataLoader.__iter__`,
`_BaseDataLoaderIter.__next__`, `torch.autograd.backward`, and one global optimizer step hook;
on sampled steps only, the parts of the step (step_parts.py) patch the model's class and hook
the optimizers for that step.
Each of them passes straight through on any other thread, and for any other capture. On a GPU,
CUDA events follow the same boundaries (cuda_clock.py); any error there turns the GPU clock off
for the run with a note, and nothing of ours is raised into the user's code.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from threading import get_ident
from time import perf_counter_ns, process_time_ns
from typing import TYPE_CHECKING, Any

from . import cuda_graphs, gpu_activity, hooks
from .cuda_clock import (
    CudaSteps,
    Marks,
    allocation_counts,
    busiest_device,
    busy_devices,
    current_device,
    torch_marks,
)
from .cuda_state import cuda_initialized
from .dataloaders import note_site
from .patches import patched
from .probes import batch_size_of, type_name
from .resources import resources_watched
from .stamps import (
    BACKWARD_DONE,
    CALL_END,
    CALL_START,
    FETCH_END,
    FETCH_START,
    FIRST_STEP,
    OTHER_STEP,
    Stamps,
)
from .step_model import BACKWARD, FETCH, NEVER, OPTIMIZER, Pass, Source, Span, StepModel
from .step_parts import StepParts
from .thread_time import thread_schedstat

if TYPE_CHECKING:
    from ..run import Run

DECIDE_STEPS = 3  # the loop's device is decided from the allocations of its first steps
MAX_PASS_STARTS = 1 << 16
MAX_PENDING = 4096  # step ends (and other hooks' stamps) held before a replay: bounded memory
MIN_BUDGET = 2  # fewer step ends before a sampled step: report each event at once
_CAPTURES = cuda_graphs._STATE  # CUDA graph captures under way (read on the training-event path)
_tokens = iter(range(1, 1 << 62))


def new_token() -> int:
    """A serial number tying instrumented code to the run it was made for."""
    return next(_tokens)


class Capture:
    """Routes the training's events to a StepModel; owns the GPU clock and the view's ticks."""

    def __init__(self, run: Run, token: int | None = None, marks: Callable[[int], Marks] | None = None) -> None:
        self.run = run
        self.token = token if token is not None else new_token()
        self.thread = get_ident()
        self.model = model = StepModel(run.recorder, steps_at_start=run.recorder.n_steps)
        model.on_step = self._step_closed
        model.on_merge = self._steps_merged
        model.on_exclude = self._phase_excluded
        self.lines: Any = None  # line_costs.LineClock, set by the traced cell
        self.call_labels: dict[int, str] = {}  # fetch call site -> "`next(it)` on line 4"
        self.active = False
        self.cuda: CudaSteps | None = None
        self.gpu_note: str | None = None
        self.optimizer_name: str | None = None
        self.backward_seen = False
        self.loop_passes = 0  # passes of the located loop
        self._marks = marks or torch_marks
        self._iter_passes: dict[int, Pass] = {}  # id(DataLoader iterator) -> its pass
        self._deciding = True
        self._alloc_before: dict[int, int] = {}
        self._first_step = run.recorder.n_steps
        # forward, backward and optimizer of sampled steps; the steps where passes over a
        # DataLoader started (each epoch's start-up wait)
        self.parts = StepParts(model, self.thread, lambda: self.cuda, lambda: f"{run.cell_source}\n{run.loop_cell_source}")
        model.on_sample = self.parts.sample_due
        self.pass_starts: list[tuple[Source, int]] = []
        self.loader_sites: dict[int, dict[str, Any]] = {}  # id(DataLoader) -> where it was built
        # Set by resources.py while the run's resources are watched: the GPU memory per step
        # (gpu_memory.GpuMemory) and who hears of DataLoader workers (host.HostSampler).
        self.memory: Any = None
        self.on_workers: Callable[[list[int], int], None] | None = None
        # CUDA graphs (cuda_graphs.py) and the loop's device without the allocator's counts
        # (gpu_activity.py): replays are steps, nothing of ours runs inside a capture.
        self.graphs = cuda_graphs.GraphWatch(self.thread, self._graph_replayed)
        self.work = gpu_activity.WorkSeen(lambda ds: busy_devices(ds), lambda: current_device(), self.thread)
        self._bytes_before: dict[int, tuple[int, int]] = {}
        self._own_ns = 0  # our GPU bookkeeping's host time in the open step (the GPU watch sums it)
        # The per-step path (stamps.py): while `deferred`, the hooks stamp instead of reporting;
        # `room` is how many step ends their stamps may still hold (each hook takes what it can
        # end) and `_loop_room` the located loop's iterations not yet granted to it, so that a
        # sampled step is never missed; `due` is the run's next tick.
        self.stamps = Stamps()
        self.deferred = False
        self.room = 0
        self.due = 0
        self._loop_room = 0
        self._live_loops = 0  # passes of located loops under way (stamped only when one)
        self._events_seen = False  # hooks other than the loop's stamped since the loop last looked
        # What a stamped event can end, from the model as it was when the hooks began stamping
        # (`_defer`): its level (steps only get stronger), whether the first event of that level
        # in an iteration's body ends no step (`_ends_no_step`), and where the last one was.
        self._level = 0
        self._level_free = False
        self._level_pos = -1
        self._call_sources: dict[int, Source] = {}
        self._optimizer_calls: list[tuple[Any, Any]] = []  # optimizer steps under way: (optimizer, frame)
        self._broken = False  # the replay failed once: every event is reported at once

    # -- the located loop -------------------------------------------------------------------
    def loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """`for x in loop(it)`: each fetch is data wait, each iteration ends a step or not (see
        step_model.py)."""
        self.loop_passes += 1
        self.run._loops_started = self.loop_passes
        source = self.model.source("loop", "loop", "the loop's iterator", None)
        return self._loop(iterable, Pass(source), source)

    def _loop(self, iterable: Iterable[Any], pass_: Pass, source: Source) -> Iterator[Any]:
        __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
        model, clock = self.model, perf_counter_ns
        push = self.stamps.loop.append
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
                    except StopIteration:
                        self._loop_fetch_failed(t, clock(), pass_)
                        return
                    except BaseException:
                        self._loop_fetch_failed(t, clock(), pass_)
                        raise
                    t = clock()
                    push(t)
                    k -= 1
                    if t >= due or not k:
                        k, due = self._settle_loop(t, k, pass_)
                else:
                    # Reported now, one call each (the GPU path, sampled steps, the first steps).
                    self.flush()
                    if fetched and self.active:  # (no grant at the step it ends: the loop looks after this fetch)
                        self.stamps.writer = pass_
                        model.iteration_end(clock())
                    # On a GPU its events first: a full launch queue blocking the record is not
                    # data wait.
                    self._fetch_begin()
                    t0 = clock()
                    try:
                        if it is None:  # the first fetch includes iter(): a loader's worker start-up
                            it = iter(iterable)
                        item = next(it)
                    except StopIteration:
                        self._fetch_end(t0, clock(), None, pass_, False)
                        return
                    except BaseException:
                        self._fetch_end(t0, clock(), None, pass_, False)
                        raise
                    t = clock()
                    self._fetch_end(t0, t, None, pass_, True)
                    if first:
                        first = False
                        self._first_batch(source, item)
                        self.run.note_loop_iterable(iterable)
                    model.in_iteration = True
                    fetched = True
                    k, due = self._settle_loop(t, 0, pass_)
                # The body: its lines timed or not (the flag `_settle_loop` set), then the
                # iteration ends at the next fetch, or here when the loop is left.
                try:
                    yield item
                except BaseException:
                    if self.active:
                        self._loop_left(clock())
                    raise
        finally:
            self._live_loops -= 1
            if self.active:
                self.flush()
                model.pass_ended(pass_)
            if self.stamps.writer is pass_:
                self.stamps.writer = None

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
        """`_settle_loop` when the stamps are due: replay them, tick if due, grant again."""
        lines, stamps = self.lines, self.stamps
        if left and lines is not None:
            lines.untake(left)
        began, kept_out = perf_counter_ns(), self.model.kept_out_ns
        worked = stamps.pending()
        self.flush()
        if self._tick_due(t):
            self._tick(t)
            worked = True
        budget = self._budget()
        k = 0
        if budget >= MIN_BUDGET:
            room = budget // 4 if self._events_seen else 0
            k = budget - room
            self._defer(room, loop=True)
            stamps.writer = pass_
        else:
            self._report_now()
        self._events_seen = False
        self._loop_room = 0
        if lines is not None:
            hooks.lines.on, n = lines.take(k or 1)
            k, self._loop_room = (n, k - n) if k else (0, 0)
        if worked:
            self._own_time(began, kept_out)
        return k, self.due

    def aloop(self, iterable: AsyncIterable[Any]) -> AsyncIterator[Any]:
        """`async for x in aloop(it)`: the same, for an asynchronous iterator."""
        self.loop_passes += 1
        self.run._loops_started = self.loop_passes
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
        try:
            pids = [int(w.pid) for w in getattr(it, "_workers", None) or () if w.pid is not None]
            if pids and self.on_workers is not None:
                self.on_workers(pids, id(loader))
        except Exception:  # an iterator of another kind, a worker not started: nothing to watch
            pass

    def dataloader_next(self, it: Any, original: Callable[[Any], Any]) -> Any:
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
        self._fetch_end(t0, clock(), None, pass_, True)
        if source.batch_kind is None:
            self._first_batch(source, item)
        return item

    def _iterator_source(self, it: Any) -> Source:
        """The source of an iterator made before the run: its DataLoader when the namespace
        still holds it, else the iterator itself."""
        from .dataloaders import loader_of_iterator
        from .probes import user_namespace

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
                kind = FIRST_STEP if self.model._is_first_optimizer(optimizer) else OTHER_STEP
            stamps.events += (pos << 3 | kind, t)
            stamps.refs.append(None)
            if kind != OTHER_STEP and level >= self._level:  # it may end steps (another optimizer never)
                if level > self._level:
                    self._level_free = False
                    self.room -= 2  # a stronger kind of step: merges, then ends two at most
                elif not self._ends_no_step(pos):
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
        self.flush()
        if self._deciding:
            self.work.look("work queued when a training event ended")
        self.model.training_event(level, t, optimizer)

    def _graph_replayed(self, level: int | None, optimizer: Any) -> None:
        """A CUDA graph replayed on the loop's thread: work launched on the current device, and
        the training event its capture held (an optimizer step: a step ends)."""
        if self._deciding:
            self.work.saw(current_device(), "a CUDA graph replay")
        if level is not None and self.active:
            self.training_event(level, optimizer)

    # -- stamps and steps ----------------------------------------------------------------------
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
            self.run.notes.append(f"traceml failed replaying the steps' stamps: {type(exc).__name__}: {exc}")
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
        budget = self.model.sample_in - (1 if self._events_seen else 0)
        return min(budget, MAX_PENDING)

    def _defer(self, room: int, loop: bool) -> None:
        """From now on the hooks stamp, until they have stamped `room` step ends (`loop`: in
        the located loop's iterations, which the loop counts itself)."""
        model = self.model
        self.deferred = True
        self.room = room
        self._level = model.level
        self._level_free = loop and model.iterations_are_steps and model.level >= BACKWARD
        self._level_pos = 0 if model.deferred is not None else -1
        model.notify_every_step = False  # the ticks are the stamps' (no step end is heard)
        model.notify_from = NEVER

    def _ends_no_step(self, pos: int) -> bool:
        """A training event of the steps' own kind at `pos` among the loop's stamps: True when
        it only marks its iteration's step, which the iteration's end ends (it is the first
        such event in the body of an iteration of the located loop, and steps are iterations)."""
        if not self._level_free or (pos + (self.stamps._open is not None)) & 1 or pos == self._level_pos:
            self._level_free = False
            return False
        self._level_pos = pos
        return True

    def _report_now(self) -> None:
        """From now on each event is reported when it happens, and each step end is heard."""
        self.deferred = False
        self.room = 0
        self.stamps.writer = None
        self.model.notify_every_step = True

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
        return t >= self.run._next_tick and not model.notify_every_step and model.recorder.n_steps > 0

    def _tick(self, t: int) -> None:
        run = self.run
        run._tick(t)
        self.due = run._next_tick

    def current_step(self) -> int | None:
        """Index of the open step (what is stamped replayed first)."""
        self.flush()
        return self.model.current_step

    def _step_closed(self, t: int, next_serial: int) -> None:
        """A step reported when it ended closed (every one while events are reported at once;
        none while they are stamped)."""
        if self.cuda is not None or self._deciding:
            self._gpu_step_closed(self.run.recorder.n_steps - 1, t, next_serial)
        run = self.run
        if t >= run._next_tick:
            self._tick(t)
            # The view's own time is nobody's step (what the sampler kept out of it is its own).
            ns = perf_counter_ns() - t - self.model.excluded
            if ns > 0:
                self.model.exclude_time(ns)
            if self.cuda is not None and not cuda_graphs.capturing():
                try:
                    self.cuda.open(run.recorder.n_steps)
                except Exception as exc:
                    self._gpu_failed(exc)
        if self.stamps.writer is None and not self.deferred:
            self._grant()

    def listen(self) -> None:
        """The run's next tick changed (an observer came): the hooks and the model look at it."""
        self.due = self.run._next_tick
        if not self.deferred:
            self.model.notify_every_step = True

    def _gpu_step_closed(self, index: int, t: int, next_serial: int) -> None:
        t_in = perf_counter_ns()
        self._gpu_bookkeeping(index, t, next_serial)
        # Our host time in the step that closed goes to the GPU watch (it is taken out of the
        # host's issue time); this bookkeeping's own lands in the next step.
        watch = self.run.gpu_watch
        if self.cuda is not None and watch is not None and watch.syncs is not None:
            watch.own_at(index, self._own_ns)
        self._own_ns = perf_counter_ns() - t_in

    def _gpu_bookkeeping(self, index: int, t: int, next_serial: int) -> None:
        if cuda_graphs.notice_foreign_capture():  # no CUDA call of ours inside a graph capture
            if self.cuda is not None:
                self.cuda.step_captured(index, next_serial)
            return
        if self.cuda is not None:
            try:
                self.cuda.step_closed(index, next_serial)
            except Exception as exc:
                self._gpu_failed(exc)
            if self.memory is not None:  # the allocator's figures of the step (never raises)
                self.memory.step_ended(index, t)
        if self._deciding:
            if index - self._first_step < DECIDE_STEPS:
                self._decide_device(index)
            else:
                self._deciding = False
                self.work.stop_probing()
        run = self.run
        if self.cuda is not None and run.gpu_watch is not None:
            try:
                run.gpu_watch.step_ended(t)
            except Exception as exc:
                run.notes.append(f"GPU watch stopped: {type(exc).__name__}: {exc}")
                run.gpu_watch = None

    def _steps_merged(self, n: int) -> None:
        self.parts.merged(n)
        if self.memory is not None:
            self.memory.merged(self.run.recorder.n_steps)
        if self.cuda is not None:
            self.cuda.merged(n)
            watch = self.run.gpu_watch
            if watch is not None:
                watch.merged(n)

    def _phase_excluded(self, span: Span) -> None:
        if self.cuda is not None:
            try:
                self.cuda.exclude(span.first_serial, span.last_serial)
            except Exception as exc:
                self._gpu_failed(exc)

    # -- the GPU ----------------------------------------------------------------------------------
    def _start_gpu(self) -> None:
        """At the start: if CUDA is already initialised, time the first steps on the current
        device until the loop shows where it runs (never initialises CUDA)."""
        self._alloc_before = allocation_counts()
        self._bytes_before = gpu_activity.bytes_in_use()
        self._probe_waits()
        device = current_device()
        if device is not None:
            self._use_device(device, confirmed=False)

    def _probe_waits(self) -> None:
        """While the loop's device is decided, its waits for the GPU look for queued work."""
        from .gpu_watch import torch_cuda_api
        from .syncs import SYNC_METHODS

        try:
            api = torch_cuda_api(None)
            if api is not None:
                self.work.probe_waits(api.tensor_type, SYNC_METHODS, api.sync_points)
        except Exception:
            self.work.stop_probing()

    def _use_device(self, device: int, confirmed: bool) -> None:
        try:
            self.cuda = CudaSteps(self.run.recorder, device, self._marks(device))
        except Exception as exc:
            self._gpu_failed(exc)
            return
        if confirmed:
            self._gpu_confirmed(device)
        self.listen()

    def _decide_device(self, index: int) -> None:
        """After each of the first steps: the device the loop allocated on is the loop's; else
        one that still has the loop's work queued (in-place kernels, a CUDA graph replayed)."""
        counts = allocation_counts()
        device = busiest_device(self._alloc_before, counts)
        if device is None and counts:
            device = self._device_without_allocations(counts)
        if device is None:
            if index - self._first_step >= DECIDE_STEPS - 1:
                self._deciding = False
                self.work.stop_probing()
                self.cuda = None  # a CPU loop: no GPU clock, whatever sits on the GPU
                self.run.recorder.has_gpu = False
                self._cpu_loop_noted(counts)
                self.listen()
            return
        self._deciding = False
        self.work.stop_probing()
        if self.cuda is not None and self.cuda.device == device:
            self._gpu_confirmed(device)
            return
        self._use_device(device, confirmed=True)
        if self.cuda is not None:
            self.cuda.open(index + 1)

    def _device_without_allocations(self, counts: dict[int, int]) -> int | None:
        """No allocation counted: the device whose bytes in use moved (cudaMallocAsync counts
        nothing), else the one the loop was seen working on (gpu_activity.py)."""
        current = current_device()
        moved = gpu_activity.bytes_moved(self._bytes_before, gpu_activity.bytes_in_use())
        if moved:
            return current if current in moved else min(moved)
        candidates = [d for d, n in counts.items() if n > 0 or d == current]
        self.work.look("work queued when a step ended", candidates)
        seen = self.work.seen
        if not seen:
            return None
        return max(seen, key=lambda d: (seen[d], d == current, -d))

    def _cpu_loop_noted(self, counts: dict[int, int]) -> None:
        """A loop taken for a CPU loop while CUDA is initialised says so (never in silence)."""
        if not counts:
            return
        backend = gpu_activity.allocator_backend()
        why = " (the cudaMallocAsync allocator counts no allocations)" if backend == "cudaMallocAsync" else ""
        self.run.notes.append(
            f"CUDA is initialised, but the loop's first {DECIDE_STEPS} steps showed no work on a GPU "
            f"(nothing allocated{why}, no graph replayed, no work queued when a step ended or the "
            "host waited for the GPU): it was timed on the CPU clock."
        )

    def _gpu_confirmed(self, device: int) -> None:
        run = self.run
        run.cuda_device = device
        run._gpu_used = True
        if self.memory is not None:
            self.memory.loop_started(device)
        if run.gpu_watch is not None:
            try:
                run.gpu_watch.loop_started(device)
            except Exception as exc:
                run.notes.append(f"Copies and syncs were not watched: {type(exc).__name__}: {exc}")

    def _gpu_failed(self, exc: BaseException) -> None:
        """Any error in the GPU bookkeeping: the run goes on the CPU clock, with a note."""
        self.cuda = None
        self._deciding = False
        self.gpu_note = f"GPU timings turned off: {type(exc).__name__}: {exc}"
        self.listen()

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Read the pending GPU timings (one wait for the GPU) and classify what is still open."""
        self.flush()
        self.active = False
        self._report_now()
        self.work.stop_probing()
        self.model.close()
        if self.cuda is not None and cuda_graphs.capturing():
            self._gpu_failed(RuntimeError("a CUDA graph capture was still under way when the cell ended"))
        if self.cuda is not None:
            try:
                self.cuda.close()
            except Exception as exc:
                self._gpu_failed(exc)
        try:
            self.parts.close()
        except Exception as exc:
            self.run.notes.append(f"The parts of the step were not read: {type(exc).__name__}: {exc}")
        if self.parts.note:
            self.run.notes.append(self.parts.note)
        self._iter_passes.clear()
        self._optimizer_calls.clear()

    def _inner_step(self, optimizer: Any, frame: Any) -> bool:
        """An optimizer's step ended (its post hooks run from torch's wrapper, `frame`): True
        when it ran inside another step of the same optimizer, still under way. A subclass whose
        `step` calls `super().step()` has torch's wrapper on both methods once the base class
        was instantiated anywhere: the hooks run twice for one step, and only the outer one is
        the step. Calls whose post hooks never ran (their step raised) are dropped here."""
        calls = self._optimizer_calls
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


def _graphs_read(run: Run, capture: Capture) -> None:
    """The cell's CUDA graphs on the run (None: it used none), with the report's note."""
    graphs = capture.graphs
    run.cuda_graphs = graphs.summary(int(run.recorder.n_steps))
    if run.cuda_graphs is not None:
        run.watch_summary["cuda_graphs_used"] = True
    note = cuda_graphs.graph_note(run.cuda_graphs)
    if note:
        run.notes.append(note)
    run.notes.extend(graphs.notes)


def _grad_enabled() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch.is_grad_enabled()) if torch is not None else True
    except Exception:
        return True


# -- the patches ----------------------------------------------------------------------------------


def _dataloader_patches(capture: Capture, stack: ExitStack) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        from torch.utils.data import DataLoader
        from torch.utils.data.dataloader import _BaseDataLoaderIter
    except Exception:
        return
    original_init = DataLoader.__dict__["__init__"]
    original_iter = DataLoader.__dict__["__iter__"]
    original_next = _BaseDataLoaderIter.__dict__["__next__"]
    thread = capture.thread

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if hooks.active is capture and get_ident() == thread:  # where it is built, for the checklist
            note_site(capture.loader_sites, self, sys._getframe(1))

    def __iter__(self: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        if hooks.active is not capture or get_ident() != thread:
            return original_iter(self)
        return capture.dataloader_iter(self, original_iter)

    def __next__(self: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        if hooks.active is not capture or get_ident() != thread:
            return original_next(self)
        return capture.dataloader_next(self, original_next)

    stack.enter_context(patched(DataLoader, {"__init__": __init__, "__iter__": __iter__}))
    stack.enter_context(patched(_BaseDataLoaderIter, {"__next__": __next__}))


def _training_patches(capture: Capture, stack: ExitStack) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    thread = capture.thread
    parts = capture.parts
    autograd = torch.autograd
    original_backward = autograd.__dict__.get("backward")
    if original_backward is not None:

        def backward(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            if parts.on and hooks.active is capture and get_ident() == thread:  # a sampled step
                out = parts.backward(original_backward, args, kwargs)
                capture.training_event(BACKWARD)
                return out
            out = original_backward(*args, **kwargs)
            if hooks.active is capture and get_ident() == thread:
                capture.training_event(BACKWARD)
            return out

        backward.__doc__ = original_backward.__doc__
        backward.__wrapped__ = original_backward  # type: ignore[attr-defined]
        stack.enter_context(patched(autograd, {"backward": backward}))
    register: Callable[..., Any] | None
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook as register
    except Exception:  # torch < 2.0
        register = None
    if register is not None:
        calls = capture._optimizer_calls

        def stepping(optimizer: Any, args: Any, kwargs: Any) -> None:
            if hooks.active is capture and get_ident() == thread:
                calls.append((optimizer, sys._getframe(1)))  # torch's wrapper, as in `stepped`

        def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
            if hooks.active is capture and get_ident() == thread:
                if calls and capture._inner_step(optimizer, sys._getframe(1)):
                    return  # `super().step()` inside the step: the outer call is the step
                if parts.on:  # a sampled step: the optimizer's time, before the step may end
                    parts.optimizer_stepped(optimizer)
                capture.training_event(OPTIMIZER, optimizer)

        try:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
        except Exception:
            pass
        else:
            stack.callback(register_optimizer_step_pre_hook(stepping).remove)
        handle = register(stepped)
        stack.callback(handle.remove)


def _guarded(run: Run, what: str, step: Callable[[], Any]) -> None:
    try:
        step()
    except Exception as exc:
        run.notes.append(f"traceml failed {what}: {type(exc).__name__}: {exc}")


@contextmanager
def capturing(run: Run, capture: Capture | None = None) -> Iterator[Capture]:
    """Record `run` on this thread for the duration: the hook names in builtins, the patches,
    the GPU clock. Everything is undone on exit (nested captures restore the outer one)."""
    capture = capture or Capture(run)
    began = perf_counter_ns()
    cpu_began, sched_began = process_time_ns(), thread_schedstat()
    if run.recorder.n_steps == 0:
        run.recorder.origin_ns = began  # the run's time 0: its code starts now, not when it was set up
    hooks.install()
    previous = hooks.active
    run._capture = capture
    run.capture_thread = capture.thread
    with ExitStack() as stack:
        _dataloader_patches(capture, stack)
        _training_patches(capture, stack)
        stack.enter_context(resources_watched(run, capture))
        stack.enter_context(cuda_graphs.graphs_watched(capture.graphs))
        if cuda_initialized():
            capture._start_gpu()
        capture.active = True
        capture.listen()
        run.step_parts = capture.parts
        _guarded(run, "timing the parts of the step", capture.parts.begin)
        hooks.active = capture
        lines_before = hooks.lines.use(capture.token, capture.thread, capture.lines)
        try:
            yield capture
        finally:
            hooks.active = previous
            hooks.lines.use(*lines_before)
            run._capture = None
            # Each step of the wrap-up is guarded: this runs while the user's error (if any)
            # goes up, and nothing of ours may replace it.
            _guarded(run, "closing the capture", capture.close)
            if capture.gpu_note:
                run.notes.append(capture.gpu_note)
            run.process_cpu_ms = (process_time_ns() - cpu_began) / 1e6
            sched_ended = thread_schedstat()
            if sched_began is not None and sched_ended is not None:
                run.thread_cpu_ms = sched_ended[0] - sched_began[0]
                run.thread_wait_ms = sched_ended[1] - sched_began[1]
            _guarded(run, "reading the CUDA graphs", lambda: _graphs_read(run, capture))
            _guarded(run, "reading the capture", lambda: run.captured(capture, perf_counter_ns() - began))
