"""torch.compile's facts in words (pure): how long compiling took and in which steps, each
recompilation with its cause and the fix that fits, each graph break with its reason, the user's
line and its fix, and the recompile limit hit (the model runs eagerly from then on).

The facts are what the capture read off torch's own record (capture/compiled/compile_record.py; the
JSON's `compile`, docs/compile.md): compile intervals on the run's clock, one record per frame
compiled, the graph-break counter."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from .number_text import pct
from .summary_keys import Summary
from .verdict import Verdict, VerdictLabel

# A step is "compiling" when compiling took at least this share of it: kept out of the steady
# state like the warm-up (run_summary), with the reason "compiling".
COMPILING_SHARE = 0.25
# Most of the cell compiled: the verdict says so instead of judging the few steps left.
MOSTLY_COMPILING = 0.5
# traceml's own code (its hooks) that Dynamo traced into: kept apart from the user's findings.
OWN_CODE = re.compile(r"[/\\]traceml_jupyter[/\\]")
# The share of a step run eagerly between graphs that makes an Also line (below it, the
# Compile section alone says it).
EAGER_LARGE = 0.10
RESUME = re.compile(r"torch_dynamo_resume_in_(?P<function>\w+?)_at_(?P<line>\d+)$")


class FrameCompiled(TypedDict):
    """One frame Dynamo compiled (docs/compile.md, "frames")."""

    id: str
    function: str
    filename: str
    line: int | None
    start_s: float | None
    seconds: float | None
    recompile_reason: str | None
    break_reasons: list[str]
    failed: str | None


class EagerShare(TypedDict):
    """The share of a step run eagerly between compiled graphs, over a few sampled steps
    (docs/compile.md, "eager"; capture/compiled/eager_share.py)."""

    share: float | None  # None: not measured (`note` says why)
    eager_s: float | None
    graphs_s: float | None
    steps_s: float | None
    steps: list[int]  # the measured steps [first, last], from 0
    profiled: list[int]  # the steps the profiler ran in [first, last]: kept out of the steady state
    clock: str  # "cpu": host time
    note: str | None


class CompileFacts(TypedDict):
    """What torch recorded of torch.compile during the cell (the JSON's `compile`; `eager` is
    absent from files written before it was measured)."""

    torch: str | None
    spans: list[list[float]]
    frames: list[FrameCompiled]
    graph_breaks: int | None
    graph_break_reasons: dict[str, int]
    recompile_limit: int | None
    eager: EagerShare | None


@dataclass(frozen=True)
class Recompile:
    """A recompilation: when (the step), what it cost, why (the guard that failed) and the fix."""

    step: int | None
    seconds: float | None
    function: str
    reason: str
    cause: str
    fix: str


@dataclass(frozen=True)
class GraphBreak:
    """A graph break: where (file, line: the line Dynamo resumed at), why and the fix."""

    filename: str
    line: int
    function: str
    reason: str
    fix: str


@dataclass(frozen=True)
class CompileReading:
    """The compile facts of a run read against its steps."""

    seconds: float  # compiling, in all
    per_step: dict[int, float]  # step index -> seconds compiling inside it (-1: outside every step)
    share_of_cell: float | None  # of the cell's wall time
    compiling_steps: tuple[int, ...]  # steps kept out of the steady state ("compiling")
    recompiles: tuple[Recompile, ...]
    breaks: tuple[GraphBreak, ...]
    graph_breaks: int | None  # torch's counter
    unplaced: tuple[tuple[str, int], ...]  # breaks torch counted that no compiled frame places: reason, count
    own_frames: int  # compiles of traceml's own hooks (Dynamo traced into them)
    limit_hit: str | None  # the function whose compiled code was abandoned at the recompile limit
    eager: EagerShare | None = None  # the share of a step run eagerly between graphs (sampled)

    @property
    def kept_out(self) -> tuple[int, ...]:
        """The steps kept out of the steady state: those that compiled, and those the eager
        share's profiler ran in (they pay its overhead)."""
        return tuple(sorted({*self.compiling_steps, *profiled_steps(self.eager)}))

    @property
    def mostly_compiling(self) -> bool:
        """Compiling took most of the cell (MOSTLY_COMPILING)."""
        return self.share_of_cell is not None and self.share_of_cell >= MOSTLY_COMPILING


def profiled_steps(eager: EagerShare | None) -> range:
    """The steps the eager share's profiler ran in (none: an empty range)."""
    if eager is None or len(eager["profiled"]) != 2:
        return range(0)
    return range(eager["profiled"][0], eager["profiled"][1] + 1)


def spans(facts: CompileFacts) -> list[tuple[float, float]]:
    """The compile intervals (s, on the run's clock): the callbacks' where torch gave them, else
    each frame's start and duration (torch's compilation metrics)."""
    if facts["spans"]:
        return [(float(a), float(b)) for a, b in facts["spans"]]
    return [
        (f["start_s"], f["start_s"] + f["seconds"])
        for f in facts["frames"]
        if f["start_s"] is not None and f["seconds"] is not None
    ]


def step_at(t: float, starts: np.ndarray, ends: np.ndarray) -> int | None:
    """The index (in the columns) of the step whose interval holds time `t`, None if none does."""
    inside = np.nonzero((starts <= t) & (t <= ends))[0]
    return int(inside[0]) if len(inside) else None


def compile_per_step(facts: CompileFacts, columns: Mapping[str, np.ndarray]) -> dict[int, float]:
    """Seconds of compiling inside each step (by step number), -1 for what fell in no step."""
    steps = np.asarray(columns.get("step", ()), dtype=np.int64)
    starts = np.asarray(columns.get("time_s", ()), dtype=np.float64)
    ends = starts + np.asarray(columns.get("step_ms", ()), dtype=np.float64) / 1e3
    out: dict[int, float] = {}
    for a, b in spans(facts):
        left = b - a
        for i in range(len(steps)):
            overlap = min(b, ends[i]) - max(a, starts[i])
            if overlap > 0:
                out[int(steps[i])] = out.get(int(steps[i]), 0.0) + overlap
                left -= overlap
        if left > 1e-6:
            out[-1] = out.get(-1, 0.0) + left
    return out


def recompile_cause(reason: str) -> tuple[str, str]:
    """A recompilation's cause and its fix, from the guard that failed."""
    size = re.search(r"size mismatch at index (\d+)\. expected (\d+), actual (\d+)", reason)
    if size and size.group(1) == "0":
        return (
            f"a batch of another size ({size.group(3)} instead of {size.group(2)}: often the last one)",
            "drop_last=True on the DataLoader, or torch._dynamo.mark_dynamic(x, 0) on the batch",
        )
    if size:
        return (
            f"a dimension {size.group(1)} that varies ({size.group(3)} instead of {size.group(2)}: sequence lengths?)",
            f"pad to a few lengths (buckets), torch._dynamo.mark_dynamic(x, {size.group(1)}), or torch.compile(dynamic=True)",
        )
    if "dtype mismatch" in reason or "device mismatch" in reason or "dispatch key set mismatch" in reason:
        return "a tensor of a new dtype or device", "cast and move the inputs once, the same way every step"
    if "grad_mode" in reason or ".training" in reason:
        return "train()/eval() or no_grad switched", "expected once per mode; keep one mode inside the loop"
    if "___check_obj_id" in reason or "ID_MATCH" in reason or "id(" in reason:
        return "a new object each step (a module, a function)", "build it once, outside the loop"
    if re.search(r"___stack\d+ *(==|!=|<=|>=|<|>)", reason):
        return (
            "a value read into Python at a graph break (an .item()) was guarded on",
            "keep the value a tensor (the graph break's fix)",
        )
    if re.search(r"==|!=", reason):
        return "a Python value guarded on changed (an int, a flag)", "pass it as a tensor, or keep it constant"
    return "a guard failed", "read the reason: keep what it names the same from step to step"


def break_fix(reason: str) -> str:
    """What to change for a graph break, from its reason."""
    text = reason.lower()
    if "print" in text or "logging" in text:
        return "take the print out of the compiled code (or log outside forward)"
    if "item" in text or "scalar" in text or "data-dependent" in text and "branch" not in text:
        return ".item() reads a value into Python: keep it a tensor (or torch._dynamo.config.capture_scalar_outputs = True)"
    if "backward()" in text:
        return "backward() is not traced: compile the model (torch.compile(model)) rather than the training step"
    if "optimizer" in text or "zero_grad" in text:
        return "the optimizer is not traced here: keep opt.step() and opt.zero_grad() out of the compiled function"
    if "jump" in text or "branch" in text or "control flow" in text:
        return "an if on a tensor's value: use torch.where or torch.cond"
    return "a call Dynamo cannot trace: move it out of the model, or wrap it in torch.compiler.disable"


def graph_breaks(facts: CompileFacts) -> list[GraphBreak]:
    """Each graph break once, at the line Dynamo resumed at (its resume function's name), with
    the reason of the frame that broke before it."""
    found: dict[tuple[str, int], GraphBreak] = {}
    frames = facts["frames"]
    for i, frame in enumerate(frames):
        resume = RESUME.match(frame["function"])
        if resume is None or OWN_CODE.search(frame["filename"]):
            continue
        key = (frame["filename"], int(resume.group("line")))
        if key in found:
            continue
        before = [f for f in frames[:i] if f["filename"] == frame["filename"] and f["break_reasons"]]
        reason = before[-1]["break_reasons"][0] if before else next(iter(facts["graph_break_reasons"]), "")
        found[key] = GraphBreak(key[0], key[1], resume.group("function"), reason, break_fix(reason))
    return list(found.values())


def unplaced_breaks(facts: CompileFacts, placed: Sequence[GraphBreak]) -> tuple[tuple[str, int], ...]:
    """The graph breaks torch counted whose reason no placed break gives: Dynamo compiled no
    frame after them (a break in a library's code, `logging` in a trainer), so no line is
    known; each reason with torch's count."""
    named = {b.reason for b in placed}
    return tuple((r, n) for r, n in facts["graph_break_reasons"].items() if r and r not in named)


def read_compile(
    facts: CompileFacts, columns: Mapping[str, np.ndarray], wall_ms: float | None
) -> CompileReading:
    """The facts against the steps: where compiling went, the recompilations, the breaks."""
    per_step = compile_per_step(facts, columns)
    seconds = sum(b - a for a, b in spans(facts))
    steps = np.asarray(columns.get("step", ()), dtype=np.int64)
    step_s = np.asarray(columns.get("step_ms", ()), dtype=np.float64) / 1e3
    lengths = {int(s): float(v) for s, v in zip(steps, step_s, strict=False)}
    compiling = tuple(
        sorted(s for s, v in per_step.items() if s >= 0 and v >= COMPILING_SHARE * lengths.get(s, v))
    )
    starts = np.asarray(columns.get("time_s", ()), dtype=np.float64)
    ends = starts + step_s
    recompiles = []
    for frame in facts["frames"]:
        if frame["recompile_reason"] is None or frame["failed"] or OWN_CODE.search(frame["filename"]):
            continue  # a refused compile is no recompile; traceml's own hooks: own_frames
        at = step_at(frame["start_s"], starts, ends) if frame["start_s"] is not None else None
        cause, fix = recompile_cause(frame["recompile_reason"])
        recompiles.append(Recompile(
            int(steps[at]) if at is not None else None, frame["seconds"], frame["function"],
            frame["recompile_reason"], cause, fix,
        ))
    limit = next((_named(f, facts["frames"]) for f in facts["frames"] if f["failed"] and "limit" in f["failed"].lower()), None)
    placed = graph_breaks(facts)
    return CompileReading(
        seconds=seconds, per_step=per_step,
        share_of_cell=seconds / (wall_ms / 1e3) if wall_ms else None,
        compiling_steps=compiling, recompiles=tuple(recompiles), breaks=tuple(placed),
        graph_breaks=facts["graph_breaks"], unplaced=unplaced_breaks(facts, placed), limit_hit=limit,
        own_frames=sum(1 for f in facts["frames"] if OWN_CODE.search(f["filename"])),
        eager=facts.get("eager"),
    )


def _named(frame: FrameCompiled, frames: Sequence[FrameCompiled]) -> str:
    """A frame's function, or (a refused compile names none) that of the frame's earlier compiles."""
    number = frame["id"].split("/")[0]
    same = [f["function"] for f in frames if f["id"].split("/")[0] == number and f["function"]]
    return frame["function"] or (same[0] if same else "a function")


def step_list(steps: Sequence[int]) -> str:
    """Steps as people count them (from 1): "step 1", "steps 1 and 5", "steps 1, 5 and 9"."""
    named = [str(s + 1) for s in steps]
    if len(named) == 1:
        return f"step {named[0]}"
    return "steps " + ", ".join(named[:-1]) + f" and {named[-1]}"


def compile_lines(reading: CompileReading, cell_filename: str | None = None) -> list[str]:
    """The compile findings as lines (the text box's Also lines, the report's Compile section):
    the time compiling, the recompile limit (loudly), each recompilation's cause and fix, each
    graph break's line and fix; the share of a step run eagerly between graphs, when large."""
    lines = []
    where = [s for s in sorted(reading.per_step) if s >= 0]
    if reading.seconds > 0:
        share = f", {pct(reading.share_of_cell, 0)} of this cell" if reading.share_of_cell is not None else ""
        inside = f" in {step_list(where)}" if where else " before the first step"
        lines.append(f"compiling: {reading.seconds:.1f} s{inside}{share} (kept out of the steady state)")
    if reading.limit_hit:
        lines.append(
            f"RECOMPILE LIMIT HIT: torch.compile gave up on {reading.limit_hit}(): it runs eagerly "
            "(uncompiled) from then on — fix the recompilations below"
        )
    for (step, cause, fix), group in _by_step_and_cause(reading.recompiles).items():
        at = f" at {step_list([step])}" if step is not None else ""
        costs = [r.seconds for r in group if r.seconds is not None]
        cost = f", {sum(costs):.1f} s" if costs else ""
        names = " and ".join(dict.fromkeys(function_name(r.function) for r in group))
        lines.append(f"recompiled {names}{at}{cost}: {cause} — {fix}")
    if reading.own_frames:
        lines.append(
            f"Dynamo compiled traceml's own hooks {reading.own_frames} time(s): they run inside your "
            "compiled code and add graph breaks and compiles of their own (see docs/compile.md)"
        )
    eager = reading.eager
    if eager is not None and eager["share"] is not None and eager["share"] >= EAGER_LARGE:
        fix = "fix the graph breaks below" if reading.breaks else "compile more of the step"
        lines.append(f"eager between graphs: {eager_words(eager)} — {fix}")
    for b in reading.breaks:
        place = f"line {b.line}" if b.filename == cell_filename else f"{_short(b.filename)}:{b.line}"
        lines.append(f"graph break in {b.function}() at {place}: {b.reason} — {b.fix}")
    for reason, n in reading.unplaced:
        times = f" ×{n}" if n > 1 else ""
        lines.append(f"graph break{times}, no line (torch compiled nothing after it): {reason} — {break_fix(reason)}")
    return lines


def eager_words(eager: EagerShare) -> str:
    """The eager share in words: "35 % of a step runs eagerly between the compiled graphs
    (host time, sampled over steps 41–43)"; why it was not measured, where it was not."""
    if eager["share"] is None:
        return f"the share of a step run eagerly between graphs was not measured: {eager['note'] or 'no sample'}"
    first, last = (s + 1 for s in eager["steps"])
    over = f"step {first}" if first == last else f"steps {first}–{last}"
    return f"{pct(eager['share'], 0)} of a step runs eagerly between the compiled graphs (host time, sampled over {over})"


def function_name(name: str) -> str:
    """A compiled function as people read it: "forward()", "forward() after line 9" for the
    resume function Dynamo compiles after a graph break."""
    resume = RESUME.match(name)
    return f"{resume.group('function')}() after line {resume.group('line')}" if resume else f"{name}()"


def _by_step_and_cause(recompiles: Sequence[Recompile]) -> dict[tuple[int | None, str, str], list[Recompile]]:
    """The recompilations of one step for one cause together (a forward and its resume)."""
    out: dict[tuple[int | None, str, str], list[Recompile]] = {}
    for r in recompiles:
        out.setdefault((r.step, r.cause, r.fix), []).append(r)
    return out


def _short(filename: str) -> str:
    return filename.replace("\\", "/").rsplit("/", 1)[-1]


def compiling_verdict(reading: CompileReading, summary: Summary, judged: Verdict) -> Verdict:
    """Most of the cell compiled: the verdict says so (and what a longer run would show)
    instead of judging the few steps left; the verdict those steps gave stays in the evidence."""
    where = [s for s in sorted(reading.per_step) if s >= 0]
    inside = f" in {step_list(where)}" if where else ""
    n, step = int(summary["n_analysed"]), summary["step_ms"]
    pace = f", {step:.1f} ms each (median)" if step is not None else ""
    return Verdict(
        VerdictLabel.WARMUP,
        "info",
        f"Compiling took {reading.seconds:.1f} s{inside}, {pct(reading.share_of_cell, 0)} of this cell: "
        f"most of this cell compiled, so its pace is not yet the training's. {n} step(s) ran "
        f"compiled after it{pace}.",
        "Run more steps: a longer run pays the compile once and shows the steady pace. "
        f"The steps after compiling alone read {judged.label}: {judged.why}",
        [("Compiling", f"{reading.seconds:.1f} s"), *judged.evidence],
    )
