"""Synchronising calls while a traced cell runs on a GPU, per step and per cell line: `Tensor.item`,
`.tolist`, `.cpu`, `bool()`, `float()`, `int()` of a CUDA tensor, `.to("cpu")` and the synchronize
calls timed on the host (their wait for the GPU); every other sync torch knows of counted through
`torch.cuda.set_sync_debug_mode("warn")`, untimed. Any error of ours turns the watch off, with a
note; the user's call always runs. The edge: every hook (a timed call, a sync warning, a copy
that waits) records through `SyncWatch.synced`, its one guard."""

from __future__ import annotations

import ast
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from time import perf_counter_ns
from types import FrameType
from typing import Any, Protocol, cast

from ...facts import gpu as gpu_facts
from ...failures import failure_text
from ..instrument.patches import patched
from ..steps.step_tally import StepTally
from .copy_calls import cell_line

SYNC_MESSAGE = "called a synchronizing CUDA operation"
SYNC_METHODS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")
SYNC_COLUMNS = ("sync_ms", "sync_calls", "sync_untimed")
# Each sync warning costs the host 5-15 µs; past this many, sync debug mode is switched off
# again (timed calls are still timed; other syncs are no longer counted) and a note says so.
MAX_SYNC_WARNINGS = 20_000
EVERY_STEP = 0.9  # a line that syncs in at least 90 % of the steps "synchronises every step"
# Methods whose call call_text() quotes: the syncing ones and the copying ones.
CALL_NAMES = frozenset({"item", "tolist", "cpu", "numpy", "synchronize", "to", "cuda", "empty_cache"})
EMPTY_CACHE = "torch.cuda.empty_cache"


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
        # Our own host time (ns) inside a step: the GPU watch sums it per step (gpu_watch.OWN_COLUMN).
        self.own: Callable[[int, int], None] = lambda step, ns: None
        self.warning_ns = 0  # host cost of one sync warning in this process (measured at start)

    def synced(self, step: int, kind: str, ns: int | None, frame: FrameType | None) -> None:
        """One synchronising call on `step`: timed (`ns`) or not (None). Never raises."""
        try:  # the edge of every sync hook: a measurement never stops the user's loop
            self._add(step, kind, ns, frame)
        except Exception as exc:
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
        """A blocking copy on `step` made the host wait `ns`: counted as a synchronising call."""
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
        """Stop watching syncs after an error of ours (`off` says which); the calls themselves still
        run."""
        if self.off is None:
            self.off = f"Synchronising calls were not watched after an error: {failure_text(exc)}"

    def watch_from(self, step: int) -> None:
        """Steps from `step` on are watched: a step without a sync counts as 0, not unmeasured."""
        for tally in self.tallies.values():
            tally.watch_from(step)

    def result(self, n_steps: int, step_ms_total: float, cell_source: str | None) -> gpu_facts.SyncStalls:
        """The syncing lines, longest wait first, each with the call as written in the cell. Per
        step means per watched step (the watch starts once the loop is seen on the GPU)."""
        watched = max(0, n_steps - (self.tallies["sync_calls"].first_step or 0))
        per = max(1, watched)
        sites = sorted(self.sites.values(), key=lambda s: (-s.wait_ns, -s.calls, s.line))
        rows: list[gpu_facts.SyncSite] = []
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
        if watch.compiling() or not self.is_cuda or watch.off is not None or get_ident() != watch.thread:
            return method(self, *args, **kwargs)  # (torch.compile tracing: instrument/dynamo.py)
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
    return str(frame.f_globals.get("__name__", "")).startswith("traceml_jupyter.capture")


def _timed_call(watch: SyncWatch, kind: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """A function or method that waits for the GPU (torch.cuda.synchronize, Event.synchronize,
    Stream.synchronize), timed in a step on the loop's thread."""
    clock, busy, get_ident = watch.clock, watch.inside, threading.get_ident

    def timed(*args: Any, **kwargs: Any) -> Any:
        if watch.compiling() or watch.off is not None or get_ident() != watch.thread:
            return function(*args, **kwargs)  # (torch.compile tracing: instrument/dynamo.py)
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


class SyncDebugMode(Protocol):
    """What the sync warnings need of the GPU watch's CudaApi (gpu_watch.py): torch's sync debug
    mode, read and set. gpu_watch imports this module, so this one names no type of gpu_watch's."""

    @property
    def get_sync_debug_mode(self) -> Callable[[], int]:
        """torch.cuda.get_sync_debug_mode."""

    @property
    def set_sync_debug_mode(self) -> Callable[[int], None]:
        """torch.cuda.set_sync_debug_mode."""


@contextmanager
def sync_warnings_counted(watch: SyncWatch, api: SyncDebugMode) -> Iterator[bool]:
    """torch's sync debug mode set to "warn" for the duration, its warnings counted (not shown).

    Yields False, changing nothing, when the user already chose a sync debug mode."""
    previous = int(api.get_sync_debug_mode())  # torch answers once CUDA is initialised
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
