"""Where host and GPU wait for each other while a traced cell runs on a GPU: synchronising calls
(counted per step and per cell line, with the host's wait where it can be timed), host-to-device
copies (see h2d.py), and the GPU's backlog when each step ends.

Nothing is patched unless the step loop really runs on CUDA: the watch starts when the loop
starts on the GPU path and is undone, all of it, when the cell ends.

How the pieces are measured:

- Syncs: `Tensor.item`, `.tolist`, `.cpu`, `bool()`, `float()` and `int()` of a CUDA tensor are
  timed on the host (their wait for the GPU), and blocking host-to-device copies too. Every other
  synchronising call torch knows of is counted through `torch.cuda.set_sync_debug_mode("warn")`:
  its warning names no time, only the place, found in the cell by walking the caller's frames.
- Backlog: every BACKLOG_EVERY-th step end, an event is recorded; the GPU reaches it later
  by as much work as was queued. GPU and host clocks are tied by one synchronize when the loop
  starts and one when the cell ends (their drift is corrected linearly between the two).
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

from .h2d import CopyWatch, cell_line, copies_timed
from .patches import patched
from .step_tally import StepTally

SYNC_MESSAGE = "called a synchronizing CUDA operation"
SYNC_METHODS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")
SYNC_COLUMNS = ("sync_ms", "sync_calls")
BACKLOG_EVERY = 4  # a backlog probe every 4th step: one event record, read when done
# Each sync warning costs the host 5-15 µs; past this many, sync debug mode is switched off
# again (timed calls are still timed; other syncs are no longer counted) and a note says so.
MAX_SYNC_WARNINGS = 20_000
EVERY_STEP = 0.9  # a line that syncs in at least 90 % of the steps "synchronises every step"
# Methods whose call call_text() quotes: the syncing ones and the copying ones.
CALL_NAMES = frozenset({"item", "tolist", "cpu", "numpy", "synchronize", "to", "cuda"})


@dataclass
class CudaApi:
    """The parts of torch.cuda the watch uses (a stand-in in CPU tests)."""

    event_factory: Callable[[], Any]
    synchronize: Callable[[], None]
    get_sync_debug_mode: Callable[[], int]
    set_sync_debug_mode: Callable[[int], None]
    tensor_type: Any
    on_side_stream: Callable[[], bool]
    compiling: Callable[[], bool] = lambda: False  # torch.compile is tracing: stay out of it


def torch_cuda_api() -> CudaApi | None:
    """torch's CUDA, when torch is imported and a CUDA device exists (CUDA is not initialised)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
    except Exception:
        return None
    cuda = torch.cuda

    def event() -> Any:
        return cuda.Event(enable_timing=True)

    def on_side_stream() -> bool:
        return bool(cuda.current_stream() != cuda.default_stream())

    compiler = getattr(torch, "compiler", None)
    return CudaApi(
        event,
        cuda.synchronize,
        cuda.get_sync_debug_mode,
        cuda.set_sync_debug_mode,
        torch.Tensor,
        on_side_stream,
        getattr(compiler, "is_compiling", lambda: False),
    )


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
    """Counts synchronising calls per step and per line; sums the host's wait where timed."""

    def __init__(
        self,
        current_step: Callable[[], int | None],
        cell_filename: str | None,
        clock: Callable[[], int] = perf_counter_ns,
    ) -> None:
        self.current_step = current_step
        self.cell_filename = cell_filename
        self.clock = clock
        self.inside = [0]  # timed calls in progress: their sync warning is not counted again
        self.tallies = {name: StepTally() for name in SYNC_COLUMNS}
        self.sites: dict[tuple[str, int], SyncSite] = {}
        self.compiling: Callable[[], bool] = lambda: False
        self.warnings = 0
        self.stop_warnings: Callable[[], None] | None = None  # set while sync warnings count
        self.notes: list[str] = []

    def synced(self, step: int, kind: str, ns: int | None, frame: FrameType | None) -> None:
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

    def blocking_copy(self, step: int, ns: int, frame: FrameType | None) -> None:
        self.synced(step, "blocking copy", ns, frame)

    def warned(self, frame: FrameType | None) -> None:
        """torch warned of a synchronising call that no timed method made."""
        step = self.current_step()
        if step is not None:
            self.synced(step, "implicit", None, frame)
        self.warnings += 1
        if self.warnings >= MAX_SYNC_WARNINGS and self.stop_warnings is not None:
            self.stop_warnings()
            self.stop_warnings = None
            self.notes.append(
                f"Synchronising calls were counted for the first {MAX_SYNC_WARNINGS:,} only "
                "(item, tolist, cpu, bool, float, int and blocking copies are still timed)."
            )

    def watch_from(self, step: int) -> None:
        for tally in self.tallies.values():
            tally.watch_from(step)

    def result(self, n_steps: int, step_ms_total: float, cell_source: str | None) -> dict[str, Any]:
        """The syncing lines, longest wait first, each with the call as written in the cell."""
        per = max(1, n_steps)
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
                    "calls_per_step": s.calls / per,
                    "steps": s.steps,
                    "every_step": s.steps >= EVERY_STEP * n_steps if n_steps else False,
                    "wait_ms_per_step": wait_ms / per if wait_ms is not None else None,
                    "share": wait_ms / step_ms_total
                    if wait_ms is not None and step_ms_total > 0
                    else None,
                }
            )
        return {"calls": sum(s.calls for s in sites), "steps": n_steps, "sites": rows}


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
    clock, busy, compiling = watch.clock, watch.inside, watch.compiling

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.is_cuda or compiling():
            return method(self, *args, **kwargs)
        step = watch.current_step()
        if step is None:
            return method(self, *args, **kwargs)
        busy[0] += 1
        t0 = clock()
        try:
            return method(self, *args, **kwargs)
        finally:
            ns = clock() - t0
            busy[0] -= 1
            watch.synced(step, kind, ns, sys._getframe(1))

    timed.__doc__ = method.__doc__
    return timed


@contextmanager
def syncs_timed(watch: SyncWatch, tensor_type: Any) -> Iterator[None]:
    """The tensor methods that wait for the GPU (SYNC_METHODS) are timed for the duration."""
    names = [name for name in SYNC_METHODS if hasattr(tensor_type, name)]
    timed = {name: _timed_sync(watch, name, getattr(tensor_type, name)) for name in names}
    with patched(tensor_type, timed):
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
    thread = threading.get_ident()
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
            if threading.get_ident() == thread and not watch.inside[0]:
                frame: FrameType | None = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename == warnings_file:
                    frame = frame.f_back  # the warnings module's own frames
                watch.warned(frame)
            return
        original(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    watch.stop_warnings = lambda: api.set_sync_debug_mode(previous)
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


# -- the watch of one traced cell ----------------------------------------------------------------


class GpuWatch:
    """Copies, syncs and backlog of one traced cell's step loop on a GPU.

    The Run calls `loop_started()` when a pass of the loop starts on the CUDA path and
    `step_ended(t2)` after each step there; `close()` (the cell's end) undoes every patch,
    reads what is pending and leaves the results on the run.
    """

    def __init__(self, run: Any, api: CudaApi, clock: Callable[[], int] = perf_counter_ns) -> None:
        self.run = run
        self.api = api
        self.clock = clock
        self.copies = CopyWatch(
            self.current_step, api.event_factory, run.cell_filename, api.on_side_stream
        )
        self.syncs = SyncWatch(self.current_step, run.cell_filename, clock)
        self.syncs.compiling = api.compiling
        self.backlog_raw = StepTally(dense=False)  # GPU minus host time of each probe, ms
        self.backlog_at = StepTally(dense=False)  # host ms since the anchor, per probe
        self.drift = 0.0  # GPU clock ms gained per host ms (from the two anchors)
        self.started = False
        self.counting_sync_warnings = False
        self.notes: list[str] = []
        self._patches = ExitStack()
        self._anchor: tuple[Any, int] | None = None
        self._probes: deque[tuple[int, int, Any]] = deque()
        self._free: list[Any] = []
        self._steps_seen = 0

    def current_step(self) -> int | None:
        """The step being run, or None outside the step loop."""
        run = self.run
        return int(run.recorder.n_steps) if run.in_loop else None

    # -- called by the run ---------------------------------------------------------------
    def loop_started(self) -> None:
        if self.started:
            return
        self.started = True
        step = int(self.run.recorder.n_steps)
        self.copies.watch_from(step)
        self.syncs.watch_from(step)
        api, patches = self.api, self._patches
        try:
            patches.enter_context(
                copies_timed(
                    self.copies,
                    api.tensor_type,
                    self.syncs.blocking_copy,
                    self.syncs.inside,
                    self.clock,
                    api.compiling,
                )
            )
            patches.enter_context(syncs_timed(self.syncs, api.tensor_type))
            self.counting_sync_warnings = patches.enter_context(
                sync_warnings_counted(self.syncs, api)
            )
            self._anchor = self._tie_clocks()
        except Exception as exc:  # never stop the user's loop for a measurement
            patches.close()
            self.notes.append(f"Copies and syncs were not watched: {type(exc).__name__}: {exc}")
            return
        self.run.extra_columns.update(self.columns())

    def step_ended(self, t2: int) -> None:
        self._steps_seen += 1
        if self._steps_seen % BACKLOG_EVERY == 0 and self._anchor is not None:
            self._probe_backlog()

    # -- backlog ---------------------------------------------------------------------------
    def _tie_clocks(self) -> tuple[Any, int]:
        """An event the GPU reaches at once (it has just finished everything), with host time."""
        self.api.synchronize()
        ev = self.api.event_factory()
        t = self.clock()
        ev.record()
        self.api.synchronize()
        return ev, t

    def _probe_backlog(self) -> None:
        ev = self._free.pop() if self._free else self.api.event_factory()
        t = self.clock()
        ev.record()
        self._probes.append((int(self.run.recorder.n_steps) - 1, t, ev))
        self._poll_backlog()

    def _poll_backlog(self) -> None:
        if self._anchor is None:
            return
        origin, h0 = self._anchor
        probes, raw, at = self._probes, self.backlog_raw, self.backlog_at
        while probes and probes[0][2].query():
            step, t, ev = probes.popleft()
            since = (t - h0) / 1e6
            raw.add(step, float(origin.elapsed_time(ev)) - since)
            at.add(step, since)
            self._free.append(ev)

    def backlog_column(self, steps: np.ndarray) -> np.ndarray:
        """How far behind the host the GPU was when each probed step ended (ms); NaN elsewhere."""
        lag = self.backlog_raw.column(steps) - self.drift * self.backlog_at.column(steps)
        return np.maximum(lag, 0.0)

    def columns(self) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
        cols: dict[str, Callable[[np.ndarray], np.ndarray]] = {
            name: tally.column for name, tally in self.copies.tallies.items()
        }
        cols.update({name: tally.column for name, tally in self.syncs.tallies.items()})
        cols["gpu_backlog_ms"] = self.backlog_column
        return cols

    # -- the end ---------------------------------------------------------------------------
    def close(self) -> None:
        """Read every pending copy and probe, tie the clocks again, undo every patch, and leave
        the results on the run. Never raises."""
        try:
            if self._anchor is not None:
                self.copies.synchronize()
                end, t_end = self._tie_clocks()
                self._poll_backlog()
                origin, h0 = self._anchor
                since = (t_end - h0) / 1e6
                if since > 0:
                    self.drift = (float(origin.elapsed_time(end)) - since) / since
        except Exception as exc:
            self.notes.append(f"GPU timings of copies and syncs incomplete: {type(exc).__name__}: {exc}")
        finally:
            self._patches.close()
        if self.started:
            try:
                self._publish()
            except Exception as exc:  # it runs as the cell ends: never mask the user's error
                self.run.notes.append(f"Copies and syncs not reported: {type(exc).__name__}: {exc}")

    def _publish(self) -> None:
        run = self.run
        n = int(run.recorder.n_steps)
        total = float(run.recorder.totals().get("step_ms", 0.0))
        run.h2d = self.copies.result(n)
        run.sync_stalls = self.syncs.result(n, total, run.cell_source)
        run.sync_stalls["counted_implicit"] = self.counting_sync_warnings
        run.watch_summary.update(watch_summary(run.h2d, run.sync_stalls))
        run.notes.extend(self.notes + self.syncs.notes)


def watch_summary(h2d: dict[str, Any] | None, syncs: dict[str, Any] | None) -> dict[str, Any]:
    """The few facts of the copy and sync watches that the verdict quotes: the cell lines that
    copy to the GPU, and the line whose syncs cost the host most."""
    out: dict[str, Any] = {"h2d_lines": [], "sync_top": None}
    if h2d:
        out["h2d_lines"] = sorted({s["line"] for s in h2d["sites"] if s["in_cell"]})
    if syncs and syncs["sites"]:
        top = syncs["sites"][0]
        out["sync_top"] = {
            k: top[k]
            for k in ("line", "in_cell", "call", "calls_per_step", "every_step", "wait_ms_per_step", "share")
        }
    return out


@contextmanager
def gpu_watched(
    run: Any, api: CudaApi | None = None, clock: Callable[[], int] = perf_counter_ns
) -> Iterator[GpuWatch | None]:
    """Watch copies, syncs and backlog for the duration of a traced cell, if a GPU exists.

    Sets `run.gpu_watch` (the run starts it when its loop runs on CUDA) and closes it on exit.
    """
    if api is None:
        api = torch_cuda_api()
    if api is None:
        yield None
        return
    watch = GpuWatch(run, api, clock)
    run.gpu_watch = watch
    try:
        yield watch
    finally:
        run.gpu_watch = None
        watch.close()
