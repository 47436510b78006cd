"""The text renderers of a run's result: the verdict box, the lines after the verdict, the text
box a terminal prints. The HTML report (views/report.py), the JSON (codec.py) and the live
chart's final state render the same value."""

from __future__ import annotations

from ..analysis.compile import CompileReading, compile_lines, read_compile
from ..analysis.loader_inside import inside_lines
from ..analysis.phases import phase_sentence, phase_verdict
from ..analysis.resources import finding_lines
from ..analysis.step_parts import also_lines, parts_sentence
from ..analysis.verdict_box import rank_table, report_text, verdict_box
from .value import RunResult


def box(result: RunResult) -> str:
    """The verdict box alone."""
    return verdict_box(result.verdict.label, result.summary)


def lines_after_verdict(result: RunResult) -> list[tuple[str, str]]:
    """(severity, text) of the lines after the verdict: torch.compile's (compile time, the
    recompile limit hit, recompilations, graph breaks), the rest of the step, advice by the part
    that dominates, each epoch's start-up, the trend over the run."""
    loop = result.loop
    source = loop.loop_cell_source if loop.loop_cell_source else loop.cell_source
    return compiled_lines(result) + also_lines(result.summary, result.line_costs, (source or "").splitlines())


def compile_reading(result: RunResult) -> CompileReading | None:
    """What torch.compile did in the run, read against its steps (None: nothing compiled)."""
    if result.compiled is None:
        return None
    return read_compile(result.compiled, result.steps.columns, result.loop.wall_ms)


def compiled_lines(result: RunResult) -> list[tuple[str, str]]:
    """torch.compile's lines (docs/compile.md): the time compiling is information, the recompile
    limit hit critical (the model runs uncompiled), the rest a warning (each costs time on every
    run of the cell)."""
    reading = compile_reading(result)
    if reading is None:
        return []
    return [(_severity(line), line) for line in compile_lines(reading, result.loop.cell_filename)]


def _severity(line: str) -> str:
    if line.startswith("compiling:"):
        return "info"
    return "critical" if line.startswith("RECOMPILE LIMIT HIT") else "warn"


def text(result: RunResult) -> str:
    """The text box: the verdict with its numbers, then the parts, the ranks, the phases, the
    findings, what stopped the cell and the notes (what a terminal prints)."""
    v, summary = result.verdict, result.summary
    loop = result.loop
    head = f"traceml: {result.name} - {result.n_steps} steps ({result.steps.definition})"
    if loop.line is not None:
        head += f", loop on line {loop.line}"
    if loop.where and loop.where != "this cell":
        head += f" of {loop.where}"
    lines = [report_text(head, v.label, v.why, v.next, summary)]
    split = parts_sentence(summary)
    if split:
        lines.append(f"Parts: {split}")
    lines.extend(f"Also: {line}" for _, line in lines_after_verdict(result))
    if result.ranks:
        lines.append(rank_table(result.ranks, result.straggler, summary.get("rank_notes") or []))
    lines.extend(f"Phase: {phase_sentence(phase)}" for phase in result.data.phases)
    slow_phase = phase_verdict(result.data.phases)
    if slow_phase:
        lines.append(f"Also: {slow_phase}")
    lines.extend(f"Also: {line}" for line in finding_lines(summary))
    lines.extend(f"Also: {line}" for line in inside_lines(result.data.inside))
    if result.error:
        lines.append(f"Stopped by: {result.error}")
    lines.extend(f"Note: {note}" for note in result.notes)
    return "\n".join(lines)
