"""What torch.compile did while the cell ran, read off torch's own record (never its log text):

- the compile callbacks (`torch._dynamo.callback.callback_handler`, torch >= 2.5): the wall
  interval of each compile, outermost only, on the run's clock; while one is open the live
  header says "compiling…";
- the compilation metrics (`torch._dynamo.utils.get_compilation_metrics()`, one record per frame
  compiled): which function, why it was compiled again (`recompile_reason`), why its graph broke
  (`restart_reasons`), a failure (the recompile limit hit), its start and duration;
- the counters (`torch._dynamo.utils.counters`): graph breaks by reason, taken as a difference;
- a few steady steps under torch's profiler (eager_share.py): the share of a step that runs
  eagerly between the compiled graphs.

Nothing here imports torch: a cell that never imported torch._dynamo compiled nothing. A
callback runs inside torch's compile: it appends a timestamp, nothing that can raise."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypedDict

from .eager_share import EagerSampler, EagerShare


class FrameCompiled(TypedDict):
    """One frame Dynamo compiled (a record of its compilation metrics), times on the run's clock."""

    id: str  # "0/1": frame 0, its second compilation (a recompilation)
    function: str  # the code's name ("forward"; "torch_dynamo_resume_in_forward_at_20" after a
    # break; "(backward)": the backward graph AOTAutograd compiled at the first backward())
    filename: str
    line: int | None  # the function's first line
    start_s: float | None  # from the run's time 0
    seconds: float | None
    recompile_reason: str | None  # the guard that failed ("tensor 'x' size mismatch at index 0...")
    break_reasons: list[str]  # why its graph broke (the restart reasons' first lines)
    failed: str | None  # why the compilation failed (the recompile limit hit: runs eagerly)


class CompileRecord(TypedDict):
    """What the capture read of torch.compile (analysis/compile.py's CompileFacts)."""

    torch: str | None
    spans: list[list[float]]  # [start_s, end_s] of each compile (the callbacks), run's clock
    frames: list[FrameCompiled]
    graph_breaks: int | None  # counters["graph_break"], summed, during the cell
    graph_break_reasons: dict[str, int]  # first line of each reason: its count
    recompile_limit: int | None  # torch._dynamo.config.recompile_limit
    eager: EagerShare | None  # the share of a step run eagerly between graphs (sampled steps)


REASON_CHARS = 240


def first_line(text: str) -> str:
    """A reason in one line: its first line, with torch's "Explanation:" line where it gives one
    ("Failed to trace builtin operator: Dynamo does not know how to trace builtin operator
    `print` ..."), without the hints and the debug context that follow."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    why = next((line.removeprefix("Explanation:").strip() for line in lines[1:] if line.startswith("Explanation:")), None)
    return (f"{lines[0]}: {why}" if why else lines[0])[:REASON_CHARS]


class CompileWatch:
    """The compile callbacks registered for one capture, and what torch recorded before it."""

    def __init__(self, origin_ns: int, changed: Callable[[], None] | None = None) -> None:
        self.origin_ns = origin_ns
        self.changed = changed  # called when a compile starts or ends (the live header's tick)
        self.epoch_offset_ns = time.time_ns() - time.perf_counter_ns()  # epoch = perf + offset
        self.spans: list[list[int]] = []
        self.open_ns: int | None = None  # a compile in progress since (perf_counter_ns)
        self.breaks_before: dict[str, int] = {}
        self.graphs_before = 0
        self.registered: Any = None

    @property
    def compiling(self) -> bool:
        """Dynamo is compiling now (the live header's "compiling…")."""
        return self.open_ns is not None

    def _started(self, args: object) -> None:
        self.open_ns = time.perf_counter_ns()
        if self.changed is not None:
            self.changed()

    def _ended(self, args: object) -> None:
        start, self.open_ns = self.open_ns, None
        if start is not None:
            self.spans.append([start, time.perf_counter_ns()])
        if self.changed is not None:
            self.changed()

    def start(self) -> None:
        """Remember torch's counters; register the compile callbacks. Only reads of plain values
        here (the records torch holds from before the cell are told apart by their start time)."""
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:  # nothing compiled before: every record the cell leaves is its own
            return
        self.breaks_before = _break_counts()
        self.graphs_before = _graphs()
        handler = getattr(getattr(dynamo, "callback", None), "callback_handler", None)
        if handler is not None and hasattr(handler, "register_start_callback"):
            handler.register_start_callback(self._started)
            handler.register_end_callback(self._ended)
            self.registered = handler

    def stop(self) -> None:
        """Remove the callbacks (a compile still open ends now). `torch._dynamo.reset()` in the
        cell removed them already: the intervals then come from the frames' own records."""
        handler, self.registered = self.registered, None
        if self.open_ns is not None:  # the cell stopped inside a compile
            self._ended(None)
        if handler is None:
            return
        starts, ends = getattr(handler, "start_callbacks", []), getattr(handler, "end_callbacks", [])
        if self._started not in starts or self._ended not in ends:
            self.spans = []  # reset() cleared the callbacks: what they saw is not the whole cell
        if self._started in starts:
            handler.remove_start_callback(self._started)
        if self._ended in ends:
            handler.remove_end_callback(self._ended)

    def compiled_here(self) -> bool:
        """Dynamo compiled during the cell (its callbacks ran, or its graph count changed)."""
        return bool(self.spans) or self.open_ns is not None or _graphs() != self.graphs_before

    def compiles(self) -> int:
        """A count that changes with every compile (the callbacks' and Dynamo's graph count)."""
        return len(self.spans) + _graphs()

    def record(self) -> CompileRecord | None:
        """What torch recorded during the cell (None: torch._dynamo never loaded, or nothing compiled)."""
        if sys.modules.get("torch._dynamo") is None:
            return None
        frames = [f for f in map(self._frame, _metrics()) if f["start_s"] is not None and f["start_s"] >= -0.001]
        breaks = _break_counts()
        new_breaks = {k: n - self.breaks_before.get(k, 0) for k, n in breaks.items() if n > self.breaks_before.get(k, 0)}
        if not frames and not self.spans and not new_breaks:
            return None
        torch = sys.modules.get("torch")
        config = getattr(sys.modules.get("torch._dynamo"), "config", None)
        limit = getattr(config, "recompile_limit", getattr(config, "cache_size_limit", None))
        return {
            "torch": str(getattr(torch, "__version__", "")) or None,
            "spans": [[self._s(a), self._s(b)] for a, b in self.spans],
            "frames": frames,
            "graph_breaks": sum(new_breaks.values()) if _counters() is not None else None,
            "graph_break_reasons": {first_line(k): n for k, n in new_breaks.items()},
            "recompile_limit": limit if isinstance(limit, int) else None,
            "eager": None,
        }

    def _s(self, perf_ns: int) -> float:
        return (perf_ns - self.origin_ns) / 1e9

    def _frame(self, m: object) -> FrameCompiled:
        start_us = getattr(m, "start_time_us", None)
        duration_us = getattr(m, "duration_us", None)
        reasons = getattr(m, "restart_reasons", None) or ()
        recompile = getattr(m, "recompile_reason", None)
        failed = getattr(m, "fail_reason", None)
        line = getattr(m, "co_firstlineno", None)
        return {
            "id": str(getattr(m, "compile_id", "") or ""),
            # no code: AOT's lazy backward, or a compile refused (the function: analysis/compile.py)
            "function": str(getattr(m, "co_name", "") or "") or ("" if failed else "(backward)"),
            "filename": str(getattr(m, "co_filename", "") or ""),
            "line": line if isinstance(line, int) else None,
            "start_s": self._s(start_us * 1000 - self.epoch_offset_ns) if isinstance(start_us, int) else None,
            "seconds": duration_us / 1e6 if isinstance(duration_us, int) else None,
            "recompile_reason": first_line(str(recompile)) if recompile else None,
            "break_reasons": sorted({first_line(str(r)) for r in reasons}),
            "failed": first_line(str(failed)) if failed else None,
        }


def _metrics() -> list[object]:
    utils = sys.modules.get("torch._dynamo.utils")
    read = getattr(utils, "get_compilation_metrics", None)
    return list(read()) if callable(read) else []


def _counters() -> Any:
    return getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)


def _graphs() -> int:
    counters = _counters()
    stats: Any = counters.get("stats") if hasattr(counters, "get") else None
    found = stats.get("unique_graphs", 0) if hasattr(stats, "get") else 0
    return int(found)


def _break_counts() -> dict[str, int]:
    counters = _counters()
    found: Any = counters.get("graph_break") if hasattr(counters, "get") else None
    return {str(k): int(n) for k, n in found.items()} if found is not None else {}


def compile_watched(run: Any) -> Callable[[], None]:
    """Watch torch.compile for the capture of `run`: the callbacks are registered now; the
    function returned (which the capture's close calls at its guarded edge, whatever the cell
    did) removes them and leaves what torch recorded on `run.compiled` (None: nothing compiled).
    The eager share's sampler watches the run's ticks meanwhile (eager_share.py)."""
    def changed() -> None:  # the observers (the live header) see "compiling…" come and go
        if threading.get_ident() == run.capture_thread:
            run.tick(time.perf_counter_ns())  # the observers' guarded edge

    watch = CompileWatch(run.recorder.origin_ns or time.perf_counter_ns(), changed)
    run.compile_watch = watch
    watch.start()
    sampler = EagerSampler(watch.compiled_here, watch.compiles, lambda: watch.compiling)
    if "torch" in sys.modules:
        run.observe(sampler)

    def finish() -> None:
        run.stop_observing(sampler)
        try:
            sampler.stop(run)  # a sample still running (before the watch stops: its count)
        finally:
            run.compile_watch = None
            watch.changed = None
            watch.stop()
            run.compiled = record = watch.record()
        if record is not None:  # (a failure reading the sample leaves the rest of the record)
            record["eager"] = sampler.read(watch.origin_ns)

    return finish
