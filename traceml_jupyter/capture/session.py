"""While a traced cell (or a `trace()` block) runs: every DataLoader fetch, `backward()`, optimizer
step and iteration of the located loop goes to the step model, on the thread that runs the cell.

What it changes, for the duration only, each undone in `finally`: `DataLoader.__iter__`,
`_BaseDataLoaderIter.__next__`, `torch.autograd.backward`, and one global optimizer step hook;
on sampled steps only, the parts of the step (step_parts.py) patch the model's class and hook
the optimizers for that step.
Each of them passes straight through on any other thread, and for any other capture. On a GPU,
CUDA events follow the same boundaries (cuda_clock.py); any error there turns the GPU clock off
for the run with a note, and nothing of ours is raised into the user's code.

The hooks themselves are step_hooks.py's, and when they stamp rather than report is
stamping.py's; here: the capture's state, the patches that call the hooks, the GPU clock's
decisions and the capture's lifetime.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from threading import get_ident
from time import perf_counter_ns, process_time_ns
from typing import TYPE_CHECKING, Any

from ..failures import failure_text, never_raise
from .data.dataloaders import note_site
from .gpu import cuda_graphs, gpu_activity
from .gpu.cuda_clock import (
    CudaStepClock,
    Marks,
    allocation_counts,
    busiest_device,
    busy_devices,
    current_device,
    torch_marks,
)
from .gpu.cuda_state import cuda_initialized
from .inside.step_parts import StepParts
from .instrument import hooks
from .instrument.patches import patched
from .resources.thread_time import thread_schedstat
from .resources.watch import resources_watched
from .step_hooks import StepHooks
from .steps.stamps import Stamps
from .steps.step_model import BACKWARD, OPTIMIZER, Pass, Source, Span, StepModel

if TYPE_CHECKING:
    from ..recording import Recording

DECIDE_STEPS = 3  # the loop's device is decided from the allocations of its first steps
_tokens = iter(range(1, 1 << 62))


def new_token() -> int:
    """A serial number tying instrumented code to the run it was made for."""
    return next(_tokens)


class Capture(StepHooks):
    """Routes the training's events to a StepModel (its hooks: step_hooks.py; when they stamp:
    stamping.py); owns the GPU clock and the view's ticks."""

    def __init__(self, run: Recording, token: int | None = None, marks: Callable[[int], Marks] | None = None) -> None:
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
        self.cuda: CudaStepClock | None = None
        self.gpu_note: str | None = None
        self.optimizer_name: str | None = None
        self.backward_seen = False
        self._marks = marks or torch_marks
        self._iter_passes: dict[int, Pass] = {}  # id(DataLoader iterator) -> its pass
        self._deciding = True
        self._alloc_before: dict[int, int] = {}
        self._first_step = run.recorder.n_steps
        # forward, backward and optimizer of sampled steps; the steps where passes over a
        # DataLoader started (each epoch's start-up wait)
        self.parts = StepParts(model, self.thread, lambda: self.cuda, lambda: f"{run.cell_source}\n{run.loop_cell_source}")
        model.on_sample = self._sample_due
        self.pass_starts: list[tuple[Source, int]] = []
        self.loader_sites: dict[int, dict[str, Any]] = {}  # id(DataLoader) -> where it was built
        # Set by resources.py while the run's resources are watched: the GPU memory per step
        # (gpu_memory.GpuMemory) and who hears of DataLoader workers (host.HostSampler).
        self.memory: Any = None
        self.on_workers: Callable[[list[int], int], None] | None = None
        # CUDA graphs (cuda_graphs.py) and the loop's device without the allocator's counts
        # (gpu_activity.py): replays are steps, nothing of ours runs inside a capture.
        self.graphs = cuda_graphs.GraphWatch(self.thread, self._graph_replayed)
        self.work = gpu_activity.QueuedWork(lambda ds: busy_devices(ds), lambda: current_device(), self.thread)
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
        # Iterations of the located loop that may report at once without looking again
        # (`_look_again` chose so; zeroed when the sampler or a listener changes its reasons).
        self._at_once_left = 0
        self._events_seen = False  # hooks other than the loop's stamped since the loop last looked
        # What a stamped event can end, from the model as it was when the hooks began stamping
        # (`_defer`): its level (steps only get stronger), whether the first event of that level
        # in an iteration's body ends no step (`training_event`), and where the last one was.
        self._level = 0
        self._level_free = False
        self._level_pos = -1
        self._call_sources: dict[int, Source] = {}
        self._optimizer_calls: list[tuple[Any, Any]] = []  # optimizer steps under way: (optimizer, frame)
        self._broken = False  # the replay failed once: every event is reported at once

    # -- the hooks' callbacks -----------------------------------------------------------------------
    def _graph_replayed(self, level: int | None, optimizer: Any) -> None:
        """A CUDA graph replayed on the loop's thread: work launched on the current device, and
        the training event its capture held (an optimizer step: a step ends)."""
        if self._deciding:
            self.work.saw(current_device(), "a CUDA graph replay")
        if level is not None and self.active:
            self.training_event(level, optimizer)

    def _step_closed(self, t: int, next_serial: int) -> None:
        """A step reported when it ended closed (every one while events are reported at once;
        none while they are stamped)."""
        if self.cuda is not None or self._deciding:
            self._gpu_step_closed(self.run.recorder.n_steps - 1, t, next_serial)
        run = self.run
        if t >= run.next_tick:
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
                run.notes.append(f"GPU watch stopped: {failure_text(exc)}")
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
        from .gpu.gpu_watch import torch_cuda_api
        from .gpu.syncs import SYNC_METHODS

        try:
            api = torch_cuda_api(None)
            if api is not None:
                self.work.probe_waits(api.tensor_type, SYNC_METHODS, api.sync_points)
        except Exception:
            self.work.stop_probing()

    def _use_device(self, device: int, confirmed: bool) -> None:
        try:
            self.cuda = CudaStepClock(self.run.recorder, device, self._marks(device))
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
        run.loop_on_gpu(device)
        if self.memory is not None:
            self.memory.loop_started(device)
        if run.gpu_watch is not None:
            with never_raise(run.notes, "Copies and syncs were not watched"):
                run.gpu_watch.loop_started(device)

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
        with never_raise(self.run.notes, "The parts of the step were not read"):
            self.parts.close()
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


def _graphs_read(run: Recording, capture: Capture) -> None:
    """The cell's CUDA graphs on the run (None: it used none), with the report's note."""
    graphs = capture.graphs
    run.cuda_graphs = graphs.summary(int(run.recorder.n_steps))
    if run.cuda_graphs is not None:
        run.watch_summary["cuda_graphs_used"] = True
    note = cuda_graphs.graph_note(run.cuda_graphs)
    if note:
        run.notes.append(note)
    run.notes.extend(graphs.notes)


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


def _guarded(run: Recording, what: str, step: Callable[[], Any]) -> None:
    with never_raise(run.notes, f"traceml failed {what}"):
        step()


@contextmanager
def capture_session(run: Recording, capture: Capture | None = None) -> Iterator[Capture]:
    """Record `run` on this thread for the duration: the hook names in builtins, the patches,
    the GPU clock. Everything is undone on exit (nested captures restore the outer one)."""
    capture = capture or Capture(run)
    began = perf_counter_ns()
    cpu_began, sched_began = process_time_ns(), thread_schedstat()
    if run.recorder.n_steps == 0:
        run.recorder.origin_ns = began  # the run's time 0: its code starts now, not when it was set up
    hooks.install()
    previous = hooks.active
    run.recorded_by(capture)
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
            run.recorded_by(None)
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
            _guarded(run, "reading the capture", lambda: run.read_capture(capture, perf_counter_ns() - began))
