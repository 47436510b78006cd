"""While a traced cell (or a `trace()` block) runs: every DataLoader fetch, `backward()`, optimizer
step and iteration of the located loop goes to the step model, on the thread that runs the cell.

What it changes, for the duration only, each undone in `finally`: `DataLoader.__iter__`,
`_BaseDataLoaderIter.__next__`, `torch.autograd.backward`, and one global optimizer step hook;
on sampled steps only, the parts of the step (step_parts.py) patch the model's class and hook
the optimizers for that step.
Each of them passes straight through on any other thread, and for any other capture. On a GPU,
CUDA events follow the same boundaries (loop_gpu.py); any error there turns the GPU clock off
for the run with a note, and nothing of ours is raised into the user's code.

A `Capture` is made of parts, each with its own state: the per-step hooks (step_hooks.py), when
they stamp and when the stamps are replayed (stamping.py), the loop's GPU clock (loop_gpu.py),
the parts of sampled steps (step_parts.py). Here: how they are put together, the step model's
listeners, the patches that call the hooks, and the capture's lifetime.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from threading import get_ident
from time import perf_counter_ns, process_time_ns
from typing import TYPE_CHECKING, Any

from ..facts.loader import NotedSite
from ..failures import never_raise, read_or
from .compiled.compile_record import compile_watched
from .data.dataloaders import note_site
from .data.probes import user_namespace
from .gpu import cuda_graphs
from .gpu.cuda_clock import Marks, current_device
from .gpu.cuda_state import cuda_initialized
from .inside.line_costs import LineClock
from .inside.step_parts import StepParts
from .instrument import hooks
from .instrument.dynamo import compile_check, keep_out, reaches_compiled
from .instrument.patches import patched
from .loader.lanes import LiveLanes
from .loader.watch import LoaderInside
from .loop_gpu import LoopGpu, StepMemory
from .resources.thread_time import thread_schedstat
from .resources.watch import resources_watched
from .stamping import Stamping
from .step_hooks import StepHooks
from .steps.step_model import BACKWARD, OPTIMIZER, Source, Span, StepModel

if TYPE_CHECKING:
    from ..recording import Recording

_tokens = iter(range(1, 1 << 62))


def new_token() -> int:
    """A serial number tying instrumented code to the run it was made for."""
    return next(_tokens)


class Capture:
    """Routes the training's events to a StepModel: the hooks (`loop`, `aloop`, `fetch`,
    `dataloader_iter`, `dataloader_next`, `training_event`: step_hooks.py) and their stamping
    (stamping.py); the loop's GPU clock (loop_gpu.py); the view's ticks."""

    def __init__(self, run: Recording, token: int | None = None, marks: Callable[[int], Marks] | None = None) -> None:
        self.run = run
        self.token = token if token is not None else new_token()
        self.thread = thread = get_ident()
        self.model = model = StepModel(run.recorder, steps_at_start=run.recorder.n_steps)
        model.on_step = self._step_closed
        model.on_merge = self._steps_merged
        model.on_exclude = self._phase_excluded
        self.loader_sites: dict[int, NotedSite] = {}  # id(DataLoader) -> where it was built
        self.gpu = gpu = LoopGpu(run, thread, self.listen, marks)
        # forward, backward and optimizer of sampled steps
        self.parts = StepParts(model, thread, lambda: gpu.cuda, lambda: f"{run.cell_source}\n{run.loop_cell_source}")
        # CUDA graphs (cuda_graphs.py): replays are steps, nothing of ours runs inside a capture.
        self.graphs = cuda_graphs.GraphWatch(thread, self._graph_replayed)
        self.stamping = stamping = Stamping(run, model, self.parts, gpu)
        model.on_sample = stamping.sample_due
        self.step_hooks = step_hooks = StepHooks(run, model, stamping, gpu, self.graphs)
        # The hooks' entry points, as the patches and the rewritten code call them (no hop).
        self.loop, self.aloop, self.fetch = step_hooks.loop, step_hooks.aloop, step_hooks.fetch
        self.dataloader_iter, self.dataloader_next = step_hooks.dataloader_iter, step_hooks.dataloader_next
        self.training_event = step_hooks.training_event
        self.current_step = stamping.current_step
        # torch.compile in the cell (instrument/dynamo.py): our global optimizer hooks, to take
        # out when the cell turns out to call a compiled function; whether it does.
        self.optimizer_hooks: list[tuple[dict[int, Any], int]] = []
        self.compiled = False
        step_hooks.loop_starts = self._loop_starts

    def listen(self) -> None:
        """The run's next tick changed (an observer came, the GPU clock changed): the hooks
        and the model look at it."""
        self.stamping.listen()

    # What the traced cell, the resources' watch, the run's sources and the fork hooks set or
    # read, on its parts.
    @property
    def active(self) -> bool:
        """The capture records (between `open` and `close`)."""
        return self.stamping.active

    @property
    def lines(self) -> LineClock | None:
        """The per-line costs' clock (line_costs.py), set by the traced cell."""
        return self.stamping.lines

    @lines.setter
    def lines(self, clock: LineClock | None) -> None:
        """Set `lines`."""
        self.stamping.lines = clock

    @property
    def call_labels(self) -> dict[int, str]:
        """Fetch call site -> "`next(it)` on line 4", set by the traced cell."""
        return self.step_hooks.call_labels

    @call_labels.setter
    def call_labels(self, labels: dict[int, str]) -> None:
        """Set `call_labels`."""
        self.step_hooks.call_labels = labels

    @property
    def memory(self) -> StepMemory | None:
        """The GPU memory per step (gpu_memory.GpuMemory), while the resources are watched."""
        return self.gpu.memory

    @memory.setter
    def memory(self, memory: StepMemory | None) -> None:
        """Set `memory`."""
        self.gpu.memory = memory

    @property
    def on_workers(self) -> Callable[[list[int], int], None] | None:
        """Who hears of DataLoader workers (host.HostSampler), while the resources are watched."""
        return self.step_hooks.on_workers

    @on_workers.setter
    def on_workers(self, hear: Callable[[list[int], int], None] | None) -> None:
        """Set `on_workers`."""
        self.step_hooks.on_workers = hear

    @property
    def optimizer_name(self) -> str | None:
        """The type of the first optimizer seen stepping."""
        return self.step_hooks.optimizer_name

    @property
    def pass_starts(self) -> list[tuple[Source, int]]:
        """The steps where passes over a DataLoader started (each epoch's start-up wait)."""
        return self.step_hooks.pass_starts

    # -- torch.compile (instrument/dynamo.py) ------------------------------------------------------
    def calls_compiled(self) -> bool:
        """The traced code uses the name of a torch.compile'd function of the notebook, or of a
        function that calls one by its name."""
        namespace = user_namespace()
        if not namespace:
            return False
        used = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", self.parts.code_of()))
        return any(read_or(False, reaches_compiled, namespace[name]) for name in used if name in namespace)

    def uses_compiled_model(self) -> bool:
        """The traced code names a torch.compile'd module (an OptimizedModule of the notebook)."""
        namespace = user_namespace()
        if not namespace:
            return False
        used = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", self.parts.code_of()))
        return any(type(namespace[name]).__name__ == "OptimizedModule" for name in used if name in namespace)

    def parts_stand_aside(self) -> None:
        """The cell calls a torch.compile'd model: Dynamo guards on the classes of its modules, so
        no patch of ours may come and go on a module class (the parts are off; the optimizer's
        steps are still the steps)."""
        if not self.parts.compiled:
            self.parts.stand_aside()
            self.run.notes.append(COMPILED_MODEL_NOTE)

    def stand_aside(self) -> None:
        """The cell calls a compiled function, whose model and optimizer run in compiled code:
        no patch on a model's class and no optimizer hook (Dynamo would trace them and guard on
        them: a recompilation whenever they come or go). Its steps are its `backward()` calls
        (after Dynamo's graph break, they run as written) or its loop's iterations."""
        self.compiled = True
        self.run.notes.append(COMPILED_NOTE)
        self.parts.stand_aside()
        for hooks_dict, key in self.optimizer_hooks:
            hooks_dict.pop(key, None)
        self.optimizer_hooks.clear()

    def _loop_starts(self) -> None:
        """The located loop starts: a function the cell compiled before it is seen now."""
        keep_out()
        if not self.compiled and self.calls_compiled():
            self.stand_aside()
        elif not self.compiled and self.uses_compiled_model():
            self.parts_stand_aside()

    # -- the step model's listeners -----------------------------------------------------------
    def _graph_replayed(self, level: int | None, optimizer: Any) -> None:
        """A CUDA graph replayed on the loop's thread: work launched on the current device, and
        the training event its capture held (an optimizer step: a step ends)."""
        if self.gpu.deciding:
            self.gpu.work.saw(current_device(), "a CUDA graph replay")
        if level is not None and self.stamping.active:
            self.training_event(level, optimizer)

    def _step_closed(self, t: int, next_serial: int) -> None:
        """A step reported when it ended closed (every one while events are reported at once;
        none while they are stamped)."""
        gpu, run, stamping = self.gpu, self.run, self.stamping
        if gpu.cuda is not None or gpu.deciding:
            gpu.step_closed(run.recorder.n_steps - 1, t, next_serial)
        if t >= run.next_tick:
            stamping.tick(t)
            # The view's own time is nobody's step (what the sampler kept out of it is its own).
            ns = perf_counter_ns() - t - self.model.excluded
            if ns > 0:
                self.model.exclude_time(ns)
            gpu.open(run.recorder.n_steps)
        if stamping.stamps.writer is None and not stamping.deferred:
            stamping.grant()

    def _steps_merged(self, n: int) -> None:
        self.parts.merged(n)
        self.gpu.merged(n)

    def _phase_excluded(self, span: Span) -> None:
        self.gpu.excluded(span)

    # -- lifetime ---------------------------------------------------------------------------------
    def open(self) -> None:
        """The capture starts recording (capture_session, once the patches are in)."""
        if cuda_initialized():
            self.gpu.start()
        self.stamping.active = True
        self.listen()

    def close(self) -> None:
        """Read the pending GPU timings (one wait for the GPU) and classify what is still open."""
        stamping = self.stamping
        stamping.flush()
        stamping.active = False
        stamping.report_now()
        self.gpu.work.stop_probing()
        self.model.close()
        self.gpu.close()
        self.step_hooks.closed()
        self.parts.close()  # (last: its failure is the capture's closing note)
        if self.parts.note:
            self.run.notes.append(self.parts.note)


def _inside_read(run: Recording, inside: LoaderInside) -> None:
    try:
        if run.loader_lanes is not None:  # the live lanes' last read, before the directory goes
            run.loader_lanes.close()
    finally:  # (the directory removed whatever happened)
        run.inside_watched(inside.close(run.notes))


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
    except ImportError:
        return
    original_init = DataLoader.__dict__["__init__"]
    original_iter = DataLoader.__dict__["__iter__"]
    original_next = _BaseDataLoaderIter.__dict__["__next__"]
    thread = capture.thread
    compiling = compile_check(torch)  # (dynamo.py: torch.compile traces none of our code)

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if not compiling() and hooks.active is capture and get_ident() == thread:  # where it is built, for the checklist
            note_site(capture.loader_sites, self, sys._getframe(1))

    def __iter__(self: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        if compiling() or hooks.active is not capture or get_ident() != thread:
            return original_iter(self)
        return capture.dataloader_iter(self, original_iter)

    def __next__(self: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        if compiling() or hooks.active is not capture or get_ident() != thread:
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
    compiling = compile_check(torch)  # (dynamo.py: torch.compile traces none of our code)
    autograd = torch.autograd
    original_backward = autograd.__dict__.get("backward")
    if original_backward is not None:

        def backward(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            if compiling():  # Dynamo traces it: torch's own backward, nothing of ours
                return original_backward(*args, **kwargs)
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
    _optimizer_hooks(capture, stack, torch, compiling)


COMPILED_NOTE = (
    "The cell calls a torch.compile'd function: its model and optimizer run in compiled code, where "
    "traceml puts no hook (nothing is recompiled for it); steps are its backward() calls (or the "
    "loop's iterations), and the parts of the step are not timed."
)

COMPILED_MODEL_NOTE = (
    "The cell calls a torch.compile'd model: the parts of the step (forward, backward, optimizer) "
    "are not timed, as patching its modules' classes would make torch compile it again."
)

# Our keys in torch's dicts of global optimizer hooks: the same in every run, so that a compiled
# function that Dynamo traced with them (it guards on the dict's keys) is not compiled again in
# the next traced cell (torch's own handles count up from 0).
PRE_HOOK_KEY, POST_HOOK_KEY = -(1 << 41), -(1 << 41) - 1


def _optimizer_hooks(capture: Capture, stack: ExitStack, torch: Any, compiling: Callable[[], bool]) -> None:
    """The global optimizer step hooks: each optimizer step of the capture's thread is a
    training event. None when the cell calls a torch.compile'd function (`stand_aside`)."""
    if capture.calls_compiled():
        capture.stand_aside()
        return
    if capture.uses_compiled_model():
        capture.parts_stand_aside()
    thread, parts = capture.thread, capture.parts
    module = sys.modules.get("torch.optim.optimizer")  # (torch.optim deletes its name `optimizer`)
    pre_hooks = getattr(module, "_global_optimizer_pre_hooks", None)
    post_hooks = getattr(module, "_global_optimizer_post_hooks", None)
    if not isinstance(post_hooks, dict):  # torch < 2.0
        return
    step_hooks = capture.step_hooks
    calls = step_hooks.optimizer_calls

    def stepping(optimizer: Any, args: Any, kwargs: Any) -> None:
        if compiling():  # (dynamo.py)
            return
        if hooks.active is capture and get_ident() == thread:
            calls.append((optimizer, sys._getframe(1)))  # torch's wrapper, as in `stepped`

    def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
        if compiling():  # (dynamo.py)
            return
        if hooks.active is capture and get_ident() == thread:
            if calls and step_hooks.inner_step(optimizer, sys._getframe(1)):
                return  # `super().step()` inside the step: the outer call is the step
            if parts.on:  # a sampled step: the optimizer's time, before the step may end
                parts.optimizer_stepped(optimizer)
            capture.training_event(OPTIMIZER, optimizer)

    if isinstance(pre_hooks, dict):
        stack.enter_context(_hooked(pre_hooks, PRE_HOOK_KEY, stepping))
        capture.optimizer_hooks.append((pre_hooks, PRE_HOOK_KEY))
    stack.enter_context(_hooked(post_hooks, POST_HOOK_KEY, stepped))
    capture.optimizer_hooks.append((post_hooks, POST_HOOK_KEY))


@contextmanager
def _hooked(hooks_dict: dict[int, Any], key: int, hook: Callable[..., None]) -> Iterator[None]:
    """`hook` in one of torch's dicts of hooks under `key` for the duration (what it held
    there before, a nested capture's, put back after)."""
    before = hooks_dict.get(key)
    hooks_dict[key] = hook
    try:
        yield
    finally:
        if before is None:
            hooks_dict.pop(key, None)
        else:
            hooks_dict[key] = before


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
    keep_out()  # torch.compile traces none of our code (dynamo.py)
    previous = hooks.active
    run.recorded_by(capture)
    run.capture_thread = capture.thread
    with ExitStack() as stack:
        _dataloader_patches(capture, stack)
        _training_patches(capture, stack)
        stack.enter_context(resources_watched(run, capture))
        stack.callback(_guarded, run, "reading torch.compile's record", compile_watched(run))
        stack.enter_context(cuda_graphs.graphs_watched(capture.graphs))
        inside = LoaderInside(capture)
        run.loader_lanes = LiveLanes(inside)  # (read by the live chart's ticks only)
        _guarded(run, "watching inside the DataLoader", lambda: stack.enter_context(inside.patches()))
        capture.open()
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
            _guarded(run, "reading inside the DataLoader", lambda: _inside_read(run, inside))
            if capture.gpu.note:
                run.notes.append(capture.gpu.note)
            run.process_cpu_ms = (process_time_ns() - cpu_began) / 1e6
            sched_ended = thread_schedstat()
            if sched_began is not None and sched_ended is not None:
                run.thread_cpu_ms = sched_ended[0] - sched_began[0]
                run.thread_wait_ms = sched_ended[1] - sched_began[1]
            _guarded(run, "reading the CUDA graphs", lambda: _graphs_read(run, capture))
            _guarded(run, "reading the capture", lambda: run.read_capture(capture, perf_counter_ns() - began))
