"""Where host and GPU wait for each other while a traced cell runs on a GPU: synchronising calls
(counted per step and per cell line, with the host's wait where it can be timed), host-to-device
copies (see h2d.py), and the GPU's backlog when each step ends.

Nothing touches CUDA until the capture says the loop runs on a CUDA device (`loop_started`),
and CUDA is then already initialised by the user's code: entering the watch, or a CPU loop,
never initialises CUDA (a later fork-started DDP launch must still work). Everything is undone
when the cell ends.

How the pieces are measured:

- Syncs: `Tensor.item`, `.tolist`, `.cpu`, `bool()`, `float()` and `int()` of a CUDA tensor,
  `.to("cpu")`, `torch.cuda.synchronize()`, `Event.synchronize()`, `Stream.synchronize()`,
  blocking host-to-device copies and pageable `non_blocking` ones (CUDA makes the host wait for
  those) are timed on the host: their wait for the GPU. Every other synchronising call torch
  knows of is counted through `torch.cuda.set_sync_debug_mode("warn")`, untimed: its warning
  names no time, only the place. A step with an untimed sync has an unknown host issue time.
- Backlog: every BACKLOG_EVERY-th step end, an event is recorded on the loop's stream; the GPU
  reaches it later by as much work as was queued. The GPU times of the probes are chained
  (each one from the previous, summed in float64: an event's own `elapsed_time` is a float32).
  GPU and host clocks are tied by one synchronize when the loop starts on the GPU and one when
  the cell ends (their drift is corrected linearly between the two).
- Only the thread that runs the steps is timed (DataParallel's replica threads pass through),
  events are kept per device, and any error of ours turns that watch off with a note: nothing
  of ours is raised into the user's code.
"""

from __future__ import annotations

import ast
import sys
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from time import perf_counter_ns
from types import FrameType
from typing import Any, cast

import numpy as np

from . import hidden_waits
from .copy_calls import cell_line
from .cuda_graphs import capturing
from .cuda_state import cuda_initialized, torch_cuda
from .h2d import COPY_COLUMNS, CopyWatch, EventPool, copies_timed
from .patches import patched
from .step_tally import StepTally

SYNC_MESSAGE = "called a synchronizing CUDA operation"
SYNC_METHODS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")
SYNC_COLUMNS = ("sync_ms", "sync_calls", "sync_untimed")
BACKLOG_EVERY = 4  # a backlog probe every 4th step: one event record, read when done
# Each sync warning costs the host 5-15 µs; past this many, sync debug mode is switched off
# again (timed calls are still timed; other syncs are no longer counted) and a note says so.
MAX_SYNC_WARNINGS = 20_000
EVERY_STEP = 0.9  # a line that syncs in at least 90 % of the steps "synchronises every step"
# Methods whose call call_text() quotes: the syncing ones and the copying ones.
CALL_NAMES = frozenset({"item", "tolist", "cpu", "numpy", "synchronize", "to", "cuda", "empty_cache"})
EMPTY_CACHE = "torch.cuda.empty_cache"
OWN_COLUMN = "own_host_ms"  # traceml's own host time inside each step on the GPU path


@dataclass
class CudaApi:
    """The parts of torch.cuda the watches use, for the loop's device (a stand-in in CPU tests).
    Made only once CUDA is initialised (see `cuda_api`)."""

    device: int  # the loop's CUDA device
    event_factory: Callable[[], Any]  # a timing event (bound to a device at its first record)
    current_stream: Callable[[int], Any]  # the current stream of a device
    current_device: Callable[[], int]
    synchronize: Callable[[int], None]  # wait for everything queued on a device
    get_sync_debug_mode: Callable[[], int]
    set_sync_debug_mode: Callable[[int], None]
    tensor_type: Any
    # (owner, attribute, kind): calls that wait for the GPU without a sync warning, or whose
    # wait is worth a time: torch.cuda.synchronize, Event.synchronize, Stream.synchronize.
    sync_points: tuple[tuple[Any, str, str], ...] = ()
    compiling: Callable[[], bool] = lambda: False  # torch.compile is tracing: stay out of it
    stream_type: Any = None  # torch.cuda.Stream: its wait_stream tells when the loop waits for a copy
    event_type: Any = None  # torch.cuda.Event: record and wait tell when the loop waits for a copy (wait_event)


# The CUDA module the copy and sync watches read (a seam: tests put a fake GPU here).
cuda_module = torch_cuda


def cuda_api(
    cuda: Any, tensor_type: Any, device: int | None = None, compiling: Callable[[], bool] | None = None
) -> CudaApi | None:
    """The watches' CudaApi from a torch.cuda-like module, for `device` (the current device if
    None); None while CUDA is not initialised."""
    if not cuda_initialized(cuda):
        return None
    try:
        index = int(cuda.current_device()) if device is None else int(device)
    except Exception:
        return None

    def event() -> Any:
        return cuda.Event(enable_timing=True)

    points = tuple(
        (owner, "synchronize", kind)
        for owner, kind in (
            (cuda, "torch.cuda.synchronize"),
            (getattr(cuda, "Event", None), "Event.synchronize"),
            (getattr(cuda, "Stream", None), "Stream.synchronize"),
        )
        if owner is not None and callable(getattr(owner, "synchronize", None))
    )
    if callable(getattr(cuda, "empty_cache", None)):  # it waits for the device, without a warning
        points += ((cuda, "empty_cache", EMPTY_CACHE),)
    return CudaApi(
        index,
        event,
        cuda.current_stream,
        cuda.current_device,
        cuda.synchronize,
        cuda.get_sync_debug_mode,
        cuda.set_sync_debug_mode,
        tensor_type,
        points,
        compiling or (lambda: False),
        getattr(cuda, "Stream", None),
        getattr(cuda, "Event", None),
    )


def torch_cuda_api(device: int | None = None) -> CudaApi | None:
    """torch's CUDA for `device`, only when torch is imported and CUDA already initialised."""
    cuda = cuda_module()
    if cuda is None:
        return None
    torch = sys.modules["torch"]
    compiler = getattr(torch, "compiler", None)
    return cuda_api(cuda, torch.Tensor, device, getattr(compiler, "is_compiling", None))


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# -- syncs ---------------------------------------------------------------------------------------


@dataclass
class SyncSite:
    """The synchronising calls made by one line of code."""

    filename: str
    line: int
    calls: int = 0
    timed: int = 0  # calls whose host wait is in wait_ns
    wait_ns: int = 0
    steps: int = 0  # distinct steps with at least one call
    last_step: int = -1
    kinds: set[str] = field(default_factory=set)


class SyncWatch:
    """Counts synchronising calls per step and per line; sums the host's wait where timed.

    Only calls on `thread` (the thread that runs the steps) are timed and counted."""

    def __init__(
        self,
        current_step: Callable[[], int | None],
        cell_filename: str | None,
        clock: Callable[[], int] = perf_counter_ns,
    ) -> None:
        self.current_step = current_step
        self.cell_filename = cell_filename
        self.clock = clock
        self.thread = threading.get_ident()
        self.inside = [0]  # timed calls in progress: their sync warning is not counted again
        self.tallies = {name: StepTally() for name in SYNC_COLUMNS}
        self.sites: dict[tuple[str, int], SyncSite] = {}
        self.compiling: Callable[[], bool] = lambda: False
        self.warnings = 0
        self.stop_warnings: Callable[[], None] | None = None  # set while sync warnings count
        self.all_counted = True  # False once untimed syncs stop being counted
        self.off: str | None = None  # why the watch turned itself off
        self.notes: list[str] = []
        # Our own host time (ns) inside a step: the GPU watch sums it per step (OWN_COLUMN).
        self.own: Callable[[int, int], None] = lambda step, ns: None
        self.warning_ns = 0  # host cost of one sync warning in this process (measured at start)

    def synced(self, step: int, kind: str, ns: int | None, frame: FrameType | None) -> None:
        """One synchronising call on `step`: timed (`ns`) or not (None). Never raises."""
        try:
            self._add(step, kind, ns, frame)
        except Exception as exc:  # a measurement must never stop the user's loop
            self.turn_off(exc)

    def _add(self, step: int, kind: str, ns: int | None, frame: FrameType | None) -> None:
        where = cell_line(frame, self.cell_filename)
        site = self.sites.get(where)
        if site is None:
            site = self.sites[where] = SyncSite(*where)
        site.calls += 1
        if step != site.last_step:
            site.steps += 1
            site.last_step = step
        site.kinds.add(kind)
        self.tallies["sync_calls"].add(step, 1.0)
        if ns is not None:
            site.timed += 1
            site.wait_ns += ns
            self.tallies["sync_ms"].add(step, ns / 1e6)
        else:
            self.tallies["sync_untimed"].add(step, 1.0)

    def blocking_copy(self, step: int, ns: int, frame: FrameType | None) -> None:
        self.synced(step, "blocking copy", ns, frame)

    def warned(self, frame: FrameType | None, t_in: int | None = None) -> None:
        """torch warned of a synchronising call that no timed method made (`t_in`: when our
        warning hook was entered: its time, and a warning's own cost, are ours)."""
        step = self.current_step()
        if step is not None:
            self.synced(step, "implicit", None, frame)
            if t_in is not None:
                self.own(step, self.clock() - t_in + self.warning_ns)
        self.warnings += 1
        if self.warnings >= MAX_SYNC_WARNINGS and self.stop_warnings is not None:
            self.stop_warnings()
            self.stop_warnings = None
            self.all_counted = False
            self.notes.append(
                f"Synchronising calls were counted for the first {MAX_SYNC_WARNINGS:,} only "
                "(item, tolist, cpu, bool, float, int, synchronize and copies are still timed)."
            )

    def turn_off(self, exc: BaseException) -> None:
        if self.off is None:
            self.off = f"Synchronising calls were not watched after an error: {_why(exc)}"

    def watch_from(self, step: int) -> None:
        for tally in self.tallies.values():
            tally.watch_from(step)

    def result(self, n_steps: int, step_ms_total: float, cell_source: str | None) -> dict[str, Any]:
        """The syncing lines, longest wait first, each with the call as written in the cell. Per
        step means per watched step (the watch starts once the loop is seen on the GPU)."""
        watched = max(0, n_steps - (self.tallies["sync_calls"].first_step or 0))
        per = max(1, watched)
        sites = sorted(self.sites.values(), key=lambda s: (-s.wait_ns, -s.calls, s.line))
        rows = []
        for s in sites:
            in_cell = s.filename == self.cell_filename
            wait_ms = s.wait_ns / 1e6 if s.timed else None
            rows.append(
                {
                    "filename": s.filename,
                    "line": s.line,
                    "in_cell": in_cell,
                    "call": call_text(cell_source, s.line) if in_cell else None,
                    "kinds": sorted(s.kinds),
                    "calls": s.calls,
                    "untimed": s.calls - s.timed,
                    "calls_per_step": s.calls / per,
                    "steps": s.steps,
                    "every_step": s.steps >= EVERY_STEP * watched if watched else False,
                    "wait_ms_per_step": wait_ms / per if wait_ms is not None else None,
                    "share": wait_ms / step_ms_total
                    if wait_ms is not None and step_ms_total > 0
                    else None,
                }
            )
        return {
            "calls": sum(s.calls for s in sites),
            "untimed": sum(s.calls - s.timed for s in sites),
            "steps": watched,
            "sites": rows,
        }


def call_text(cell_source: str | None, line: int) -> str | None:
    """The synchronising or copying call written on `line` of the cell (`loss.item()`), else the
    line's own text. The `%%traceml` line is line 1 (it is blanked before parsing)."""
    if not cell_source:
        return None
    lines = cell_source.splitlines()
    if not 0 < line <= len(lines):
        return None
    text = lines[line - 1].strip()
    source = "\n".join([""] + lines[1:]) if lines[0].lstrip().startswith("%") else cell_source
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return text
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and node.lineno == line
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CALL_NAMES
    ]
    if calls:
        call = min(calls, key=lambda c: c.col_offset)
        written = ast.unparse(call)
        return written if len(written) <= 60 else text
    return text


def _timed_sync(watch: SyncWatch, kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` of a tensor, timed when it runs on a CUDA tensor in a step on the loop's thread."""
    clock, busy, get_ident = watch.clock, watch.inside, threading.get_ident

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.is_cuda or watch.off is not None or get_ident() != watch.thread:
            return method(self, *args, **kwargs)
        t_in = clock()
        step = watch.current_step()
        if step is None or watch.compiling():
            return method(self, *args, **kwargs)
        busy[0] += 1
        t0 = clock()
        try:
            return method(self, *args, **kwargs)
        finally:
            t1 = clock()
            busy[0] -= 1
            watch.synced(step, kind, t1 - t0, sys._getframe(1))
            watch.own(step, t0 - t_in + clock() - t1)

    timed.__doc__ = method.__doc__
    return timed


def _ours(frame: FrameType) -> bool:
    """The caller is this package (the GPU clock reading its events at the end, say)."""
    return str(frame.f_globals.get("__name__", "")).startswith(__package__ or "traceml_jupyter")


def _timed_call(watch: SyncWatch, kind: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """A function or method that waits for the GPU (torch.cuda.synchronize, Event.synchronize,
    Stream.synchronize), timed in a step on the loop's thread."""
    clock, busy, get_ident = watch.clock, watch.inside, threading.get_ident

    def timed(*args: Any, **kwargs: Any) -> Any:
        if watch.off is not None or get_ident() != watch.thread:
            return function(*args, **kwargs)
        t_in = clock()
        step = watch.current_step()
        if step is None or _ours(sys._getframe(1)):  # the capture's own waits are no user sync
            return function(*args, **kwargs)
        busy[0] += 1
        t0 = clock()
        try:
            return function(*args, **kwargs)
        finally:
            t1 = clock()
            busy[0] -= 1
            watch.synced(step, kind, t1 - t0, sys._getframe(1))
            watch.own(step, t0 - t_in + clock() - t1)

    timed.__doc__ = function.__doc__
    timed.__wrapped__ = function  # type: ignore[attr-defined]
    return timed


@contextmanager
def syncs_timed(
    watch: SyncWatch, tensor_type: Any, sync_points: tuple[tuple[Any, str, str], ...] = ()
) -> Iterator[None]:
    """The tensor methods that wait for the GPU (SYNC_METHODS), and `sync_points` (see CudaApi),
    are timed for the duration."""
    names = [name for name in SYNC_METHODS if hasattr(tensor_type, name)]
    timed = {name: _timed_sync(watch, name, getattr(tensor_type, name)) for name in names}
    with ExitStack() as stack:
        stack.enter_context(patched(tensor_type, timed))
        for owner, name, kind in sync_points:
            stack.enter_context(patched(owner, {name: _timed_call(watch, kind, getattr(owner, name))}))
        yield


def _drop_filter(entry: Any) -> None:
    filters = cast(list[Any], warnings.filters)  # a list at run time, typed as a Sequence
    try:
        filters.remove(entry)
    except ValueError:
        return
    mutated = getattr(warnings, "_filters_mutated", None) or getattr(
        warnings, "_filters_mutated_lock_held", None
    )
    if mutated is not None:
        mutated()


@contextmanager
def sync_warnings_counted(watch: SyncWatch, api: CudaApi) -> Iterator[bool]:
    """torch's sync debug mode set to "warn" for the duration, its warnings counted (not shown).

    Yields False, changing nothing, when the user already chose a sync debug mode."""
    try:
        previous = int(api.get_sync_debug_mode())
    except Exception:
        yield False
        return
    if previous != 0:
        yield False
        return
    warnings.filterwarnings("always", message=SYNC_MESSAGE)
    entry = warnings.filters[0]
    original = warnings.showwarning
    thread = watch.thread
    warnings_file = warnings.__file__

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if str(message).startswith(SYNC_MESSAGE):
            # Another thread's syncs (DataParallel replicas) are neither counted nor shown: the
            # user did not ask for these warnings.
            if threading.get_ident() == thread and not watch.inside[0] and watch.off is None and not calibrating:
                t_in = watch.clock()
                frame: FrameType | None = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename == warnings_file:
                    frame = frame.f_back  # the warnings module's own frames
                watch.warned(frame, t_in)
            return
        original(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    watch.stop_warnings = lambda: api.set_sync_debug_mode(previous)
    calibrating = True
    watch.warning_ns = _warning_cost(watch.clock)
    calibrating = False
    try:
        api.set_sync_debug_mode(1)
        yield True
    finally:
        watch.stop_warnings = None
        try:
            api.set_sync_debug_mode(previous)
        finally:
            if warnings.showwarning is showwarning:
                warnings.showwarning = original
            _drop_filter(entry)


def _warning_cost(clock: Callable[[], int], n: int = 16) -> int:
    """Host ns of one sync warning's trip through Python's warnings machinery to our hook (the
    hook's own work is timed where it runs): the median of `n`, measured with the hook in place."""
    costs = []
    for _ in range(n):
        t0 = clock()
        warnings.warn(SYNC_MESSAGE + " (traceml: measuring a warning's cost)", UserWarning, stacklevel=1)
        costs.append(clock() - t0)
    costs.sort()
    return int(costs[len(costs) // 2])


# -- the watch of one traced cell ----------------------------------------------------------------


class GpuWatch:
    """Copies, syncs and backlog of one traced cell's step loop on a GPU.

    The capture calls `loop_started(device)` once, on the thread that runs the steps, when it
    has decided the loop runs on CUDA device `device` (CUDA is initialised then), and
    `step_ended(t_ns)` after each step; `close()` (the cell's end) undoes every patch, reads what
    is pending and leaves the results on the run. Before `loop_started` nothing is touched.
    """

    def __init__(
        self, run: Any, api: CudaApi | None = None, clock: Callable[[], int] = perf_counter_ns
    ) -> None:
        self.run = run
        self.api = api  # None: torch's, made in loop_started
        self.clock = clock
        self.current_step: Callable[[], int | None] = run.current_step  # the step running now
        self.device: int | None = None
        self.thread: int | None = None
        self.copies: CopyWatch | None = None
        self.syncs: SyncWatch | None = None
        self.backlog_raw = StepTally(dense=False)  # GPU minus host time of each probe, ms
        self.backlog_at = StepTally(dense=False)  # host ms since the anchor, per probe
        self.drift = 0.0  # GPU clock ms gained per host ms (from the two anchors)
        self.backlog_off: str | None = None
        self.backlog_on = False  # the clocks were tied: probes are read
        self.started = False
        self.counting_sync_warnings = False
        self.notes: list[str] = []
        # Waits nobody reports (hidden_waits.py), and traceml's own host time per step.
        self.hidden: list[str] = []
        self._frees_before: dict[str, int] = {}
        self.own_tally = StepTally()
        self._patches = ExitStack()
        self._pool: EventPool | None = None
        self._stream: Any = None  # the loop's stream, read every BACKLOG_EVERY steps
        self._h0 = 0  # host ns of the anchor
        self._last: tuple[Any, float] | None = None  # newest resolved probe: event, GPU ms since h0
        self._probes: deque[tuple[int, int, Any]] = deque()
        self._steps_seen = 0

    # -- called by the capture -----------------------------------------------------------
    def loop_started(self, device: int | None = None) -> None:
        """The loop runs on CUDA `device`: patch, and tie the GPU clock to the host's. Never
        raises: on an error nothing stays patched and a note says why."""
        if self.started:
            return
        self.started = True
        run = self.run
        try:
            if device is None:
                device = getattr(run, "cuda_device", None)
            api = self.api if self.api is not None else torch_cuda_api(device)
            if api is None:
                self.notes.append("Copies and syncs were not watched: CUDA is not initialised.")
                return
            self.api = api
            self.device = api.device if device is None else int(device)
            self.thread = getattr(run, "capture_thread", None) or threading.get_ident()
            first = self.current_step()
            if first is None:
                first = int(run.recorder.n_steps)
            self._pool = pool = EventPool(api.event_factory)
            copies = CopyWatch(
                self.current_step,
                pool,
                getattr(run, "cell_filename", None),
                api.current_stream,
                api.current_device,
                self.device,
            )
            syncs = SyncWatch(self.current_step, getattr(run, "cell_filename", None), self.clock)
            copies.thread = syncs.thread = self.thread
            syncs.compiling = api.compiling
            copies.watch_from(first)
            syncs.watch_from(first)
            self._watch_hidden_and_own(syncs, first)
            self.copies, self.syncs = copies, syncs
            patches = self._patches
            patches.enter_context(
                copies_timed(
                    copies,
                    api.tensor_type,
                    syncs.synced,
                    syncs.inside,
                    self.clock,
                    api.compiling,
                    api.stream_type,
                    api.event_type,
                    syncs.own,
                )
            )
            patches.enter_context(syncs_timed(syncs, api.tensor_type, api.sync_points))
            self.counting_sync_warnings = patches.enter_context(sync_warnings_counted(syncs, api))
            syncs.all_counted = self.counting_sync_warnings
        except Exception as exc:  # never stop the user's loop for a measurement
            self._patches.close()
            self.copies = self.syncs = None
            self.notes.append(f"Copies and syncs were not watched: {_why(exc)}")
            return
        try:
            self._tie_clocks()
        except Exception as exc:
            self._backlog_failed(exc)
        run.extra_columns.update(self.columns())

    def step_ended(self, t_ns: int | None = None, step: int | None = None) -> None:
        """Step `step` (the one that just closed) ended at host time `t_ns`. Never raises."""
        if self._last is None or self.backlog_off is not None:
            return
        self._steps_seen += 1
        if self._steps_seen % BACKLOG_EVERY or capturing(True):
            return
        try:
            if step is None:
                step = int(self.run.recorder.n_steps) - 1
            self._probe(step)
        except Exception as exc:
            self._backlog_failed(exc)

    # -- waits nobody reports, and our own host time (issue 23) ---------------------------
    def _watch_hidden_and_own(self, syncs: SyncWatch, first: int) -> None:
        self.hidden = hidden_waits.at_loop_start()
        self._frees_before = self._allocator_frees()
        self.own_tally.watch_from(first)
        syncs.own = self.own_at

    def _allocator_frees(self) -> dict[str, int]:
        from .gpu_activity import memory_stats

        return hidden_waits.allocator_frees(memory_stats().get(self.device or 0))

    def own_at(self, step: int, ns: int) -> None:
        """`ns` of traceml's own host time inside step `step` (a hook on the GPU path)."""
        if ns > 0:
            self.own_tally.add(step, ns / 1e6)

    def own_time(self, ns: int) -> None:
        """`ns` of traceml's own host time in the step running now."""
        step = self.current_step()
        if step is not None:
            self.own_at(step, ns)

    def merged(self, n: int) -> None:
        """The capture merged its last `n` closed steps into the open one (now step
        `recorder.n_steps`): what the watch summed for them moves there. Never raises."""
        try:
            first = int(self.run.recorder.n_steps)
            for part in (self.copies, self.syncs):
                if part is not None:
                    for tally in part.tallies.values():
                        tally.merge_from(first)
            self.own_tally.merge_from(first)
            self.backlog_raw.merge_from(first)
            self.backlog_at.merge_from(first)
        except Exception as exc:
            self.notes.append(f"Copies and syncs of merged steps misplaced: {_why(exc)}")

    # -- backlog ---------------------------------------------------------------------------
    def _tie_clocks(self) -> None:
        """The one wait when the loop starts: an event the GPU reaches at once (it has just
        finished everything), with its host time. Probes are measured from it."""
        api, pool = self.api, self._pool
        assert api is not None and pool is not None and self.device is not None
        api.synchronize(self.device)
        self._stream = stream = api.current_stream(self.device)
        if self.copies is not None:
            self.copies.loop_stream = stream
        t = self.clock()
        ev = pool.record(self.device, stream)
        self._h0 = t
        self._last = (ev, 0.0)
        self.backlog_on = True

    def _probe(self, step: int) -> None:
        api, pool = self.api, self._pool
        assert api is not None and pool is not None and self.device is not None
        # The loop's stream, read once every BACKLOG_EVERY steps (a `set_stream` in the loop is
        # followed): probes and the copies' "same stream as the loop" test use it.
        self._stream = stream = api.current_stream(self.device)
        if self.copies is not None:
            self.copies.loop_stream = stream
        t = self.clock()
        ev = pool.record(self.device, stream)
        self._probes.append((step, t, ev))
        self._poll_backlog()

    def _poll_backlog(self) -> None:
        """Read the probes that are done, oldest first; each GPU time is the previous probe's
        plus the elapsed time between the two (float64 sums of short float32 spans)."""
        if self._last is None or self._pool is None or self.device is None:
            return
        last_ev, last_gpu = self._last
        probes, raw, at, h0 = self._probes, self.backlog_raw, self.backlog_at, self._h0
        while probes:
            step, t, ev = probes[0]
            if not (ev.query() and last_ev.query()):
                break
            gpu = last_gpu + float(last_ev.elapsed_time(ev))
            probes.popleft()
            since = (t - h0) / 1e6
            raw.add(step, gpu - since)
            at.add(step, since)
            self._pool.give(self.device, last_ev)
            last_ev, last_gpu = ev, gpu
            self._last = (last_ev, last_gpu)

    def _backlog_failed(self, exc: BaseException) -> None:
        if self.backlog_off is None:
            self.backlog_off = f"The GPU backlog was not measured after an error: {_why(exc)}"
        self._probes.clear()
        self._last = None
        self.run.extra_columns.pop("gpu_backlog_ms", None)

    def backlog_column(self, steps: np.ndarray) -> np.ndarray:
        """How far behind the host the GPU was when each probed step ended (ms); NaN elsewhere."""
        lag = self.backlog_raw.column(steps) - self.drift * self.backlog_at.column(steps)
        return np.maximum(lag, 0.0)

    def columns(self) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
        cols: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
        if self.copies is not None and self.copies.off is None:
            cols.update({name: tally.column for name, tally in self.copies.tallies.items()})
        if self.syncs is not None and self.syncs.off is None:
            cols.update({name: tally.column for name, tally in self.syncs.tallies.items()})
        if self.backlog_on and self.backlog_off is None:
            cols["gpu_backlog_ms"] = self.backlog_column
        if self.syncs is not None:
            cols[OWN_COLUMN] = self.own_tally.column
        return cols

    # -- the end ---------------------------------------------------------------------------
    def close(self) -> None:
        """Undo every patch, wait once for the GPU, read every pending copy and probe, tie the
        clocks again, and leave the results on the run. Never raises. No CUDA event stays
        referenced afterwards (the run outlives the cell, in `_RUNS`)."""
        try:
            self._patches.close()
        except Exception as exc:
            self.notes.append(f"Restoring the GPU watch's patches: {_why(exc)}")
        if not self.started or self.api is None or self.device is None:
            self._release()
            self.run.notes.extend(self.notes)
            return
        try:
            if capturing():  # a capture left open: a wait now would invalidate it
                raise RuntimeError("a CUDA graph capture was still under way when the cell ended")
            self._read_at_end(self.api, self.device)
        except Exception as exc:
            self.notes.append(f"GPU timings of copies and syncs incomplete: {_why(exc)}")
        finally:
            self._release()
        try:
            self._publish()
        except Exception as exc:  # it runs as the cell ends: never mask the user's error
            self.run.notes.append(f"Copies and syncs not reported: {_why(exc)}")

    def _read_at_end(self, api: CudaApi, device: int) -> None:
        api.synchronize(device)  # the one wait at the end: every copy and probe is done
        if self.copies is not None and self.copies.off is None:
            self.copies.poll_all()
        if self._last is None or self._pool is None:
            return
        self._poll_backlog()
        last_ev, last_gpu = self._last
        t_end = self.clock()
        end = self._pool.record(device, api.current_stream(device))
        end.synchronize()  # an idle GPU: it completes at once
        since = (t_end - self._h0) / 1e6
        if since > 0:
            gpu_end = last_gpu + float(last_ev.elapsed_time(end))
            self.drift = (gpu_end - since) / since

    def _release(self) -> None:
        """Drop every CUDA event (pools, probes, pending copies) and the CUDA API."""
        if self._pool is not None:
            self._pool.clear()
        self._probes.clear()
        self._last = None
        self._stream = None
        if self.copies is not None:
            self.copies.release()
        self.api = None

    def _publish(self) -> None:
        run = self.run
        n = int(run.recorder.n_steps)
        total = float(run.recorder.totals().get("step_ms", 0.0))
        copies, syncs = self.copies, self.syncs
        notes = list(self.notes)
        for part in (copies, syncs):
            if part is not None and part.off is not None:
                notes.append(part.off)
        if self.backlog_off is not None:
            notes.append(self.backlog_off)
        # A part that turned itself off measured nothing reliable: its columns go.
        dropped = (
            (COPY_COLUMNS if copies is not None and copies.off is not None else ())
            + (SYNC_COLUMNS if syncs is not None and syncs.off is not None else ())
            + (("gpu_backlog_ms",) if self.backlog_off is not None else ())
        )
        for name in dropped:
            run.extra_columns.pop(name, None)
        run.h2d = copies.result(n) if copies is not None and copies.off is None else None
        if syncs is not None and syncs.off is None:
            run.sync_stalls = syncs.result(n, total, run.cell_source)
            run.sync_stalls["counted_implicit"] = self.counting_sync_warnings
            run.sync_stalls["all_counted"] = syncs.all_counted
            run.sync_stalls["hidden"] = self.hidden_reasons(syncs)
            run.sync_stalls["warning_us"] = syncs.warning_ns / 1e3 if self.counting_sync_warnings else None
            notes.extend(syncs.notes)
        else:
            run.sync_stalls = None
        summary = watch_summary(run.h2d, run.sync_stalls)
        summary["host_top_line"] = costliest_host_line(getattr(run, "line_costs", None))
        run.watch_summary.update(summary)
        run.notes.extend(notes)


    def hidden_reasons(self, syncs: SyncWatch) -> list[str]:
        """Why some waits for the GPU may have gone unseen (empty: none known)."""
        emptied = sum(s.calls for s in syncs.sites.values() if EMPTY_CACHE in s.kinds)
        try:
            after = self._allocator_frees()
        except Exception:
            after = self._frees_before
        return self.hidden + hidden_waits.at_loop_end(self._frees_before, after, emptied)


def costliest_host_line(costs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The body line that takes the host most time per step (line_costs), for HOST-BOUND's why:
    often a fetch or Python work in the body, not the kernels' launches."""
    rows = [r for r in (costs or {}).get("statements") or [] if r.get("ms_per_step") is not None]
    if not rows:
        return None
    top = max(rows, key=lambda r: float(r["ms_per_step"]))
    return {k: top.get(k) for k in ("line", "text", "ms_per_step", "share", "gpu_ms_per_step")}


def watch_summary(h2d: dict[str, Any] | None, syncs: dict[str, Any] | None) -> dict[str, Any]:
    """The few facts of the copy and sync watches that the verdict quotes: the cell lines that
    copy to the GPU, the line whose syncs cost the host most, and whether every synchronising
    call was seen (else the host's issue time is not known)."""
    out: dict[str, Any] = {"h2d_lines": [], "sync_top": None, "syncs_all_seen": False}
    if h2d:
        out["h2d_lines"] = sorted({s["line"] for s in h2d["sites"] if s["in_cell"]})
        out["h2d_pageable_non_blocking"] = sorted(
            {s["line"] for s in h2d["sites"] if s["in_cell"] and s.get("pageable_non_blocking")}
        )
        # side-stream copies the loop's stream waited for most of (a prefetch that hides little)
        out["h2d_side_stream_waited"] = sorted(
            {
                s["line"]
                for s in h2d["sites"]
                if s["in_cell"] and s.get("waited") and (s.get("waited_ms_per_step") or 0.0) * 2 >= (s["ms_per_step"] or 0.0)
            }
        )
    if syncs:
        out["syncs_hidden"] = list(syncs.get("hidden") or [])
        out["syncs_all_seen"] = bool(
            syncs.get("counted_implicit") and syncs.get("all_counted", True) and not out["syncs_hidden"]
        )
        if syncs["sites"]:
            top = syncs["sites"][0]
            out["sync_top"] = {
                k: top[k]
                for k in ("line", "in_cell", "call", "calls_per_step", "every_step", "wait_ms_per_step", "share")
            }
    return out


@contextmanager
def gpu_watched(
    run: Any, api: CudaApi | None = None, clock: Callable[[], int] = perf_counter_ns
) -> Iterator[GpuWatch]:
    """Watch copies, syncs and backlog for the duration of a traced cell.

    Sets `run.gpu_watch` (the capture starts it when its loop runs on CUDA) and closes it on
    exit. Entering touches nothing of CUDA (a CPU loop never initialises it)."""
    watch = GpuWatch(run, api, clock)
    run.gpu_watch = watch
    try:
        yield watch
    finally:
        run.gpu_watch = None
        watch.close()
