"""The report's "Compile" section: what torch.compile compiled during the run, one row per
frame compiled (the step it fell in, the function, the seconds, why: the first compile, the
guard that failed, the graph break, the limit hit), and above them the graph breaks with the
share of a step they leave to run eagerly (sampled steps). The findings themselves (compile time
apart, each recompile's and break's fix) are the Also lines above it (docs/compile.md)."""

from __future__ import annotations

import numpy as np

from ..analysis.compile import RESUME, FrameCompiled, eager_words, function_name, step_at
from ..result.value import RunResult
from .report_style import CELL, MUTED, ROW, TABLE, esc, section_title, with_code

MAX_ROWS = 12  # frames shown; the rest counted


def _why(frame: FrameCompiled) -> str:
    if frame["failed"]:
        return f"failed: {frame['failed']}"
    if frame["recompile_reason"]:
        return f"recompiled: {frame['recompile_reason']}"
    resume = RESUME.match(frame["function"])
    if resume is not None:
        return f"after a graph break at line {resume.group('line')}"
    if frame["break_reasons"]:
        return f"graph break: {frame['break_reasons'][0]}"
    return "first compile"


def _function(frame: FrameCompiled) -> str:
    return function_name(frame["function"])


def compile_section(result: RunResult) -> str:
    """The Compile section (empty when nothing compiled)."""
    facts = result.compiled
    if facts is None or not facts["frames"]:
        return ""
    cols = result.steps.columns
    starts = np.asarray(cols.get("time_s", ()), dtype=np.float64)
    ends = starts + np.asarray(cols.get("step_ms", ()), dtype=np.float64) / 1e3
    steps = np.asarray(cols.get("step", ()), dtype=np.int64)
    num = CELL + ";text-align:right;white-space:nowrap"
    left = CELL + ";text-align:left"
    heads = ("step", "function", "seconds", "why")
    head = "".join(
        f'<th style="{num if h in ("step", "seconds") else left};color:{MUTED};font-weight:600">{h}</th>' for h in heads
    )
    rows = [f'<tr style="{ROW}">{head}</tr>']
    for frame in facts["frames"][:MAX_ROWS]:
        at = step_at(frame["start_s"], starts, ends) if frame["start_s"] is not None else None
        step = str(int(steps[at]) + 1) if at is not None else "–"
        seconds = f"{frame['seconds']:.2f}" if frame["seconds"] is not None else "–"
        rows.append(
            f'<tr class="tml-compiled" style="{ROW}"><td style="{num}">{step}</td>'
            f'<td style="{left}"><code>{esc(_function(frame))}</code></td><td style="{num}">{seconds}</td>'
            f'<td style="{left}">{with_code(_why(frame))}</td></tr>'
        )
    more = len(facts["frames"]) - MAX_ROWS
    tail = f'<div style="font-size:11px;color:{MUTED}">and {more} more</div>' if more > 0 else ""
    breaks = facts["graph_breaks"]
    counted = f" — graph breaks (torch's counter): {breaks}" if breaks else ""
    eager = facts.get("eager")
    said = ""
    if eager is not None:  # under the breaks' count: how much of a step they leave to run eagerly
        colour = "inherit" if eager["share"] is not None else MUTED
        words = eager_words(eager)
        said = f'<div class="tml-eager" style="margin:0 0 6px 0;color:{colour}">{esc(words[0].upper() + words[1:])}</div>'
    return (
        section_title(f"Compile (torch {facts['torch'] or '?'}){counted}")
        + said
        + f'<table class="tml-compile" style="{TABLE}">{"".join(rows)}</table>{tail}'
    )
