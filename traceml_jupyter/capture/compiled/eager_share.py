"""How much of a compiled step runs eagerly, between its graphs: a few steady steps sampled
under torch's profiler (CPU activity only), read off the marks torch itself puts in a trace.

- each call of Dynamo's compiled code is a "Torch-Compiled Region: <compile id>" (the guarded
  code's annotation: a resume function after a graph break is a region nested in its caller's);
- each call of a compiled graph is a "CompiledFunction" (AOTAutograd's autograd function, its
  backward an autograd node "CompiledFunctionBackward"), a "## Call CompiledFxGraph <key> ##"
  (Inductor's generated code, with or without grad) or AOTAutograd's runtime wrapper.

What runs eagerly because of the graph breaks is the time inside the regions and outside the
graphs (the breaking call, the code Dynamo hands back to Python: a `print`, an `.item()`, a call
it cannot trace, a `backward()` inside a compiled step function), plus the backward of the
operations run there (the autograd nodes whose sequence number is that of an operation in that
time). A region's start up to its first graph, where Dynamo's "Pregraph bytecode" lies in it,
is the compiled code's own preparation (the user's code before a graph is in the graph), not
eager code. Its share is over the whole steps that lie inside the regions the sample saw
complete (a region the profiler's start or stop cut is not seen whole), against their step time.

On CUDA the figure is host time (when the CPU ran eager code between graphs); the GPU's work
runs asynchronously and is not read, and on a torch built for CUDA no profiler starts before
the cell initialised CUDA itself. A backend that marks no graph call (`backend="eager"`: its
graphs run as plain Python; `aot_eager` without grad) gives no figure, nor does a cell whose own code runs a profiler.
The sampler's ticks run with Dynamo's frame callback off; Kineto's start and stop lines are kept
off the process's stderr.

The sample starts at a tick of the run's observers (at most four a second, time kept out of the
steps) once MIN_STEPS steps ran and no compile happened since the last tick, and stops at the
first tick WINDOW_STEPS steps later; a compile inside it discards it (tried again, TRIES in
all). The steps it ran in (they pay the profiler's overhead) are kept out of the steady state.
Nothing here imports torch: torch.profiler is what the cell's torch already loaded."""

from __future__ import annotations

import bisect
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

REGION = "Torch-Compiled Region"
# the graphs' calls, and the machinery of compiled code (Dynamo's cache lookup, its bytecode
# before a graph, AOTAutograd's wrapper): no eager code of the user's
GRAPH_MARKS = (
    "CompiledFunction", "## Call CompiledFxGraph", "AOTDispatcher Runtime Wrapper", "Pregraph bytecode",
    "TorchDynamo Cache Lookup",
)
PREGRAPH = GRAPH_MARKS[3]
GRAPH_CALLS = GRAPH_MARKS[:2]  # a graph's call marked: the backend marks its graphs
BACKWARD_NODE = "autograd::engine::evaluate_function: "
MARK = "traceml_jupyter: eager sample"
MIN_STEPS = 10  # the sample starts after this many steps (the compile and the warm-up behind)
WINDOW_STEPS = 6  # and stops this many steps later (the first and last are cut)
TRIES = 3  # samples that saw a compile inside them are discarded: at most this many tries
PROFILING_WORDS = ("profile", "Profiler")  # a cell that may run a profiler of its own

Interval = tuple[float, float]


class EagerShare(TypedDict):
    """The share of a step that ran eagerly between compiled graphs (the JSON's `compile.eager`)."""

    share: float | None  # eager_s / steps_s (None: not measured, `note` says why)
    eager_s: float | None  # inside compiled code, outside its graphs, and their backward
    graphs_s: float | None  # inside the compiled graphs
    steps_s: float | None  # the measured steps' time
    steps: list[int]  # the measured steps [first, last] (from 0); [] when none
    profiled: list[int]  # the steps the profiler ran in [first, last], kept out of the steady state
    clock: str  # "cpu": host time (on CUDA the GPU runs asynchronously)
    note: str | None  # why it was not measured


@dataclass(frozen=True)
class Event:
    """One profiler event as the measure reads it (µs on the profile's clock)."""

    name: str
    start: float
    end: float
    sequence_nr: int = -1
    thread: int = 0
    fwd_thread: int = 0


@dataclass(frozen=True)
class GraphTime:
    """A profile read: the eager intervals, the graphs' and the span of whole regions (µs)."""

    eager: list[Interval]
    graphs: list[Interval]
    span: Interval | None  # the first whole outermost region's start to the last one's end
    marked: bool  # any graph call was marked (else the backend marks none: not measured)


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged where they overlap, sorted."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def minus(keep: Sequence[Interval], cut: Sequence[Interval]) -> list[Interval]:
    """`keep` less `cut` (both merged, sorted), in one pass over each."""
    out, j = [], 0
    for a, b in keep:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        at, k = a, j
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > at:
                out.append((at, cut[k][0]))
            at = max(at, cut[k][1])
            k += 1
        if at < b:
            out.append((at, b))
    return out


def within(intervals: Sequence[Interval], a: float, b: float) -> float:
    """The length of `intervals` (merged) inside [a, b]."""
    return sum(max(0.0, min(d, b) - max(c, a)) for c, d in intervals)


def graph_time(events: Sequence[Event], stop: float) -> GraphTime:
    """The profile's eager time between graphs, its graphs' time and its whole regions' span.
    `stop`: when the profiler was told to stop (a region still open then is cut)."""
    regions = [e for e in events if e.name.startswith(REGION)]
    graphs = union([
        *((e.start, e.end) for e in events
          if e.name.startswith(GRAPH_MARKS) or e.name == BACKWARD_NODE + "CompiledFunctionBackward"),
        *prologues(regions, events),
    ])
    between = minus(union((e.start, e.end) for e in regions), graphs)
    ran_there = {
        (e.thread, e.sequence_nr) for e in events
        if e.sequence_nr >= 0 and not e.name.startswith(BACKWARD_NODE) and _inside(e.start, between)
    }
    their_backward = [
        (e.start, e.end) for e in events
        if e.name.startswith(BACKWARD_NODE) and (e.fwd_thread, e.sequence_nr) in ran_there
    ]
    eager = minus(union([*between, *their_backward]), graphs)
    outermost, reach = [], float("-inf")
    for e in sorted(regions, key=lambda e: (e.start, -e.end)):
        if e.end > reach:  # not inside one that started before it
            outermost.append(e)
            reach = e.end
    whole = [e for e in outermost if e.end < stop]
    span = (whole[0].start, max(e.end for e in whole)) if whole else None
    marked = any(e.name.startswith(GRAPH_CALLS) for e in events)
    return GraphTime(eager, graphs, span, marked)


def prologues(regions: Sequence[Event], events: Sequence[Event]) -> list[Interval]:
    """Each region's start up to its first graph call, where Dynamo's bytecode before a graph
    ("Pregraph bytecode") lies in it and no nested region starts before: the compiled code's
    own preparation of the graph's inputs (and AOTAutograd's), no user code (which Dynamo put in
    the graph)."""
    calls = sorted(e.start for e in events if e.name.startswith(GRAPH_CALLS))
    before = sorted((e.start, e.end) for e in events if e.name.startswith(PREGRAPH))
    starts = sorted(r.start for r in regions)
    out = []
    for r in regions:
        at = bisect.bisect_left(calls, r.start)
        if at == len(calls) or calls[at] >= r.end:
            continue
        first = calls[at]
        nested = bisect.bisect_right(starts, r.start)
        if nested < len(starts) and starts[nested] < first:
            continue  # a region inside this one starts before its first graph: a break before it
        pre = bisect.bisect_left(before, (r.start, r.start))
        if pre < len(before) and before[pre][1] <= first:
            out.append((r.start, first))
    return out


def _inside(t: float, intervals: Sequence[Interval]) -> bool:
    """`t` lies in one of `intervals` (merged, sorted)."""
    at = bisect.bisect_right(intervals, (t, float("inf"))) - 1
    return at >= 0 and intervals[at][0] <= t < intervals[at][1]


def share_of_steps(
    read: GraphTime, to_run_s: Callable[[float], float], columns: Mapping[str, Any]
) -> tuple[list[int], float, float, float] | None:
    """The whole steps inside the read's span (the columns of the sampled steps, on the run's
    clock): their [first, last], eager seconds, graph seconds and step seconds (None: none)."""
    if read.span is None:
        return None
    a, b = to_run_s(read.span[0]), to_run_s(read.span[1])
    steps, starts, lengths = (list(map(float, columns.get(k, ()))) for k in ("step", "time_s", "step_ms"))
    inside = [i for i in range(len(steps)) if starts[i] >= a and starts[i] + lengths[i] / 1e3 <= b]
    if not inside:
        return None
    first, last = inside[0], inside[-1]
    lo, hi = starts[first], starts[last] + lengths[last] / 1e3
    eager = [(to_run_s(c), to_run_s(d)) for c, d in read.eager]
    graphs = [(to_run_s(c), to_run_s(d)) for c, d in read.graphs]
    return (
        [int(steps[first]), int(steps[last])], within(eager, lo, hi), within(graphs, lo, hi),
        sum(lengths[i] for i in inside) / 1e3,
    )


def not_measured(note: str, profiled: list[int] | None = None) -> EagerShare:
    """An EagerShare that says why there is no figure."""
    return {
        "share": None, "eager_s": None, "graphs_s": None, "steps_s": None, "steps": [],
        "profiled": profiled or [], "clock": "cpu", "note": note,
    }


def _quietly(call: Callable[[], Any]) -> Any:
    """`call` with the process's stderr (fd 2) closed to it: Kineto prints a line to it at each
    start and stop of a profiler ("USDT: ... profiler_start"), which a notebook shows."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return call()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def user_profiling() -> bool:
    """A profiler of the user's (or anyone's) is on: ours must not start."""
    profiler = sys.modules.get("torch.autograd.profiler")
    autograd = getattr(getattr(sys.modules.get("torch"), "_C", None), "_autograd", None)
    enabled = getattr(autograd, "_profiler_enabled", None)
    return bool(getattr(profiler, "_is_profiler_enabled", False)) or (callable(enabled) and bool(enabled()))


def profiled_events(profile: Any) -> list[Event]:
    """The events the measure reads, off the profiler's raw results (Kineto's events: a tenth
    of the time `profile.events()` takes to build its FunctionEvents, which a torch without
    them gives)."""
    wanted = (REGION, *GRAPH_MARKS, BACKWARD_NODE, MARK)
    results = getattr(getattr(profile, "profiler", None), "kineto_results", None)
    if results is None or not hasattr(results, "events"):
        return [
            Event(e.name, e.time_range.start, e.time_range.end, e.sequence_nr, e.thread, e.fwd_thread)
            for e in profile.events()
            if e.name.startswith(wanted) or e.sequence_nr >= 0
        ]
    base = results.trace_start_ns() if hasattr(results, "trace_start_ns") else 0  # (µs as floats: exact)
    out = []
    for e in results.events():
        name, seq = e.name(), e.sequence_nr()
        if name.startswith(wanted) or seq >= 0:
            start, end = (e.start_ns() - base) / 1e3, (e.end_ns() - base) / 1e3
            out.append(Event(name, start, end, seq, e.start_thread_id(), e.fwd_thread_id()))
    return out


def dynamo_aside(call: Callable[[Any], None], arg: Any) -> None:
    """`call(arg)` with Dynamo's frame callback off, as `torch.compiler.disable` runs a function:
    a tick can come inside a compiled function (after its graph break at `backward()`), where
    Dynamo would look at every frame of the profiler's start and stop (its frame count)."""
    set_eval_frame = getattr(sys.modules.get("torch._dynamo.eval_frame"), "set_eval_frame", None)
    if set_eval_frame is None:
        call(arg)
        return
    prior = set_eval_frame(None)
    try:
        call(arg)
    finally:
        set_eval_frame(prior)


def cuda_untouched() -> bool:
    """This torch was built for CUDA (or ROCm) and the cell has not initialised it: the
    profiler's library (Kineto, with CUPTI) could initialise the driver, which a later
    fork-based launcher cannot undo. Asked without initialising anything."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    built = getattr(version, "cuda", None) or getattr(version, "hip", None)
    initialized = getattr(getattr(torch, "cuda", None), "is_initialized", None)
    return bool(built) and not (callable(initialized) and initialized())


class EagerSampler:
    """The run's observer that profiles a few steady steps once, and reads them at the end.

    `compiled_here()` says whether the cell compiled (or ran) compiled code; `compile_count()`
    how many compiles the cell's watch has seen (a compile inside the sample discards it)."""

    def __init__(self, compiled_here: Callable[[], bool], compile_count: Callable[[], int], compiling: Callable[[], bool]) -> None:
        self.compiled_here, self.compile_count, self.compiling = compiled_here, compile_count, compiling
        self.profile: Any = None  # torch.profiler.profile while it runs or until read
        self.running = False
        self.tries = TRIES
        self.n_start = 0
        self.compiles_seen = -1  # at the last tick: a compile since then is no steady step
        self.compiles_at_start = 0
        self.mark_ns: int | None = None  # perf_counter_ns of our marker in the profile (the clocks' link)
        self.stop_ns: int | None = None
        self.columns: Mapping[str, Any] = {}  # the sampled steps' columns (recorder.tail)
        self.profiled: list[int] = []
        # why there is no figure, until there is one
        self.note: str | None = f"the run was too short (a sample needs {MIN_STEPS} steps and about half a second of steps after compiling)"
        self.done = False

    def __call__(self, recording: Any, /) -> None:
        """A tick of the run's observers: start the sample when it is due, stop it when done."""
        if not (self.done or getattr(recording, "finished", False)):
            dynamo_aside(self._tick, recording)

    def _tick(self, recording: Any) -> None:
        n = int(recording.recorder.n_steps)
        compiles = self.compile_count()
        if not self.running:
            steady = compiles == self.compiles_seen and not self.compiling()
            self.compiles_seen = compiles
            if not steady or n < MIN_STEPS:
                return
            if not self.compiled_here():
                self.note = "no compiled code ran in this cell's steps"
            elif self._may_start(recording):
                self._start(n, compiles)
        elif n - self.n_start >= WINDOW_STEPS:
            self.stop(recording)

    def _may_start(self, recording: Any) -> bool:
        source = f"{getattr(recording, 'cell_source', '') or ''}\n{getattr(recording, 'loop_cell_source', '') or ''}"
        if any(word in source for word in PROFILING_WORDS):
            self.note, self.done = "the cell runs a profiler of its own: traceml does not start one", True
            return False
        if user_profiling():
            self.note, self.done = "a profiler was running: traceml does not start one", True
            return False
        if cuda_untouched():
            self.note, self.done = "CUDA is not initialised, and a profiler might initialise it", True
            return False
        autograd = sys.modules.get("torch.autograd")
        return sys.modules.get("torch.profiler") is not None and bool(getattr(autograd, "kineto_available", bool)())

    def _start(self, n: int, compiles: int) -> None:
        profiler = sys.modules["torch.profiler"]
        self.profile = profile = profiler.profile(activities=[profiler.ProfilerActivity.CPU])
        _quietly(profile.start)
        self.running = True
        self.n_start, self.compiles_at_start = n, compiles
        began = time.perf_counter_ns()
        with profiler.record_function(MARK):
            pass
        self.mark_ns = (began + time.perf_counter_ns()) // 2

    def stop(self, recording: Any) -> None:
        """The sample ends now (at a tick, or the capture's close): the profiler stops, the
        sampled steps' columns are kept; a compile inside the sample discards it."""
        profile, n = self.profile, int(recording.recorder.n_steps)
        if not self.running:
            return
        self.stop_ns = time.perf_counter_ns()
        _quietly(profile.stop)
        self.running = False
        self.profiled = [self.n_start, n]
        if self.compile_count() != self.compiles_at_start:
            self.profile, self.tries = None, self.tries - 1
            self.note = "torch compiled inside each sample (not steady)"
            self.done = self.tries <= 0
            return
        self.columns = dict(recording.recorder.tail(n - self.n_start + 1))
        self.done = True

    def read(self, origin_ns: int) -> EagerShare | None:
        """The figure of the sample (None: nothing sampled and nothing to say)."""
        profile = self.profile
        at_ns = self.mark_ns
        if profile is None or at_ns is None or self.stop_ns is None:
            return not_measured(self.note, self.profiled) if self.note else None
        events = profiled_events(profile)
        self.profile = None
        mark = next((e.start for e in events if e.name == MARK), None)
        if mark is None:
            return not_measured("the profiler recorded nothing", self.profiled)

        def to_run_s(us: float) -> float:
            return (at_ns - origin_ns) / 1e9 + (us - mark) / 1e6

        stop_us = mark + (self.stop_ns - at_ns) / 1e3
        read = graph_time(events, stop_us)
        if not read.marked:
            return not_measured(
                "no call of a compiled graph was marked (backend=\"eager\", or aot_eager without grad)", self.profiled
            )
        measured = share_of_steps(read, to_run_s, self.columns)
        if measured is None:
            return not_measured("no whole step ran inside the compiled calls the sample saw", self.profiled)
        steps, eager_s, graphs_s, steps_s = measured
        return {
            "share": min(1.0, eager_s / steps_s) if steps_s > 0 else None, "eager_s": eager_s,
            "graphs_s": graphs_s, "steps_s": steps_s, "steps": steps, "profiled": self.profiled,
            "clock": "cpu", "note": None,
        }
