"""The report's code pane: the traced cell's lines, each loop-body line with its host (and GPU)
time per step as a heat bar, the lines the checklist points at marked, and the loop's own cell
when the loop is in another cell."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..analysis.cell_code import CodeSite, dataloader_lines
from ..analysis.checklist import FIX, Item
from ..analysis.number_text import ms_fine
from ..analysis.summary_keys import LineCosts
from ..kernel.code_facts import CodeContext
from .report_style import (
    BADGE,
    BORDER,
    COMPUTE_COLOUR,
    LOADER_BG,
    LOADER_COLOUR,
    LOOP_BG,
    LOOP_COLOUR,
    MONO,
    MUTED,
    SUBTLE,
    WAIT_COLOUR,
    esc,
    section_title,
)

if TYPE_CHECKING:
    from ..result import RunResult


@dataclass(frozen=True)
class LineBar:
    """The heat bar beside one code line: a statement's cost per step (its first line carries
    the label; its other lines a lighter bar of the same length), or the loop line's data wait."""

    width: float  # 0..1 of the costliest line: GPU time on CUDA, else wall-clock time
    host_width: float | None  # CUDA: the host's (wall-clock) time, drawn as a thin bar
    label: str  # "5.12 ms" on a statement's first line, "" on the lines it continues on
    title: str
    colour: str
    first: bool = True


def _fraction(value: float | None, top: float) -> float:
    return min(1.0, max(0.0, value / top)) if value is not None and top > 0 else 0.0


def line_bars(costs: LineCosts | None, n_lines: int) -> dict[int, LineBar]:
    """Heat bars by cell line from `run.line_costs`: each timed statement's mean ms per step,
    and the loop line's data wait, on one scale (the costliest line fills the bar). On CUDA the
    bar is the GPU time (events on sampled steps) and a thin bar under it the host's time."""
    if not costs or not costs.get("statements"):
        return {}
    from ..capture.inside.line_costs import heat

    rows = costs["statements"]
    on_gpu = bool(costs.get("gpu_ms_per_step"))
    loop_line, fetch = costs.get("loop_line"), costs.get("fetch_ms_per_step")
    if on_gpu:
        pairs = [(r["ms_per_step"], r["gpu_ms_per_step"]) for r in rows]
        values = [v for pair in pairs for v in pair if v is not None]
        top = max([*values, fetch or 0.0], default=0.0)
        scale = {int(r["line"]): _fraction(r["gpu_ms_per_step"], top) for r in rows}
        if loop_line is not None and fetch is not None:
            scale[int(loop_line)] = _fraction(fetch, top)
    else:
        scale, top = heat(dict(costs)), 0.0
    bars: dict[int, LineBar] = {}
    for r in rows:
        line, end = int(r["line"]), int(r.get("end_line") or r["line"])
        host, gpu = r["ms_per_step"], r.get("gpu_ms_per_step")
        shown = gpu if on_gpu else host
        title = f"line {line}: {ms_fine(host)} per step"
        if on_gpu:
            title = f"line {line}: GPU {ms_fine(gpu)}, host {ms_fine(host)} per step"
        width = scale.get(line, 0.0)
        host_width = _fraction(host, top) if on_gpu else None
        for number in range(line, min(end, n_lines) + 1):
            first = number == line
            bars[number] = LineBar(
                width, host_width, ms_fine(shown) if first else "", title, COMPUTE_COLOUR, first
            )
    if loop_line is not None and fetch is not None and 0 < int(loop_line) <= n_lines:
        line = int(loop_line)
        bars[line] = LineBar(
            scale.get(line, 0.0),
            None,
            ms_fine(fetch),
            f"line {line}: data wait {ms_fine(fetch)} per step (waiting in next() for the batch)",
            WAIT_COLOUR,
        )
    return {n: b for n, b in bars.items() if 0 < n <= n_lines}


HEAT_TRACK = "#e9ecef"
BAR_WIDTH_PX, LABEL_WIDTH_PX = 56, 64
MIN_THIN_BAR = 0.02  # a thinner host bar would read as a dot under the main one


def _heat_cell(bar: LineBar | None) -> str:
    """The gutter between a line's number and its code: bar track, then ms per step."""
    if bar is None:
        return f'<span style="flex-shrink:0;width:{BAR_WIDTH_PX + LABEL_WIDTH_PX + 10}px"></span>'
    opacity = "" if bar.first else "opacity:0.35;"
    main = (
        f'<span class="tml-heat-bar" style="display:block;width:{100 * bar.width:.1f}%;'
        f'height:{6 if bar.host_width is not None else 9}px;border-radius:2px;'
        f'background-color:{bar.colour};{opacity}"></span>'
    )
    if bar.host_width is not None and bar.host_width >= MIN_THIN_BAR:
        main += (
            f'<span class="tml-heat-host" style="display:block;margin-top:1px;'
            f"width:{100 * bar.host_width:.1f}%;height:2px;border-radius:1px;"
            f'background-color:{MUTED};{opacity}"></span>'
        )
    return (
        f'<span class="tml-heat" title="{esc(bar.title)}" style="flex-shrink:0;display:flex;'
        f'align-items:center;width:{BAR_WIDTH_PX + LABEL_WIDTH_PX + 10}px">'
        f'<span style="flex-shrink:0;width:{BAR_WIDTH_PX}px;padding:1px 0;'
        f'background-color:{HEAT_TRACK if bar.first else "transparent"};border-radius:2px">'
        f"{main}</span>"
        f'<span class="tml-heat-ms" style="flex-shrink:0;width:{LABEL_WIDTH_PX}px;'
        f'padding-left:6px;font-size:11px;color:{MUTED};white-space:nowrap">{esc(bar.label)}'
        f"</span></span>"
    )


def _code_lines(
    lines: Sequence[str],
    loop_line: int | None,
    loader: set[int],
    marks: Mapping[int, list[str]],
    bars: Mapping[int, LineBar] | None = None,
) -> str:
    rows = []
    for number, text in enumerate(lines, start=1):
        classes, colour, background = ["tml-line"], "transparent", "transparent"
        if number in loader:
            classes.append("tml-dataloader")
            colour, background = LOADER_COLOUR, LOADER_BG
        if number == loop_line:
            classes.append("tml-loop")
            colour, background = LOOP_COLOUR, LOOP_BG
        title, mark, number_colour = f"line {number}", "", MUTED
        if number in marks:
            classes.append("tml-change")
            title += ": change " + ", ".join(marks[number])
            mark, number_colour = "&#9679;", BADGE[FIX][0]
        rows.append(
            f'<div class="{" ".join(classes)}" title="{esc(title)}" style="display:flex;'
            f'border-left:3px solid {colour};background-color:{background}">'
            f'<span style="flex-shrink:0;width:14px;text-align:center;font-size:9px;'
            f'color:{BADGE[FIX][0]}">{mark}</span>'
            f'<span style="flex-shrink:0;width:26px;padding-right:10px;text-align:right;'
            f'color:{number_colour}">{number}</span>'
            f"{_heat_cell(bars.get(number)) if bars else ''}"
            f'<span style="white-space:pre;padding-right:12px">{esc(text) or " "}</span></div>'
        )
    return (
        f'<div style="display:inline-block;min-width:100%;box-sizing:border-box">'
        f'{"".join(rows)}</div>'
    )


def legend_html(entries: Sequence[tuple[str, str, str]]) -> str:
    """Labelled swatches; a background of "dot" draws a dot instead of a line swatch."""
    out = []
    for label, colour, background in entries:
        if background == "dot":
            swatch = f'<span style="color:{colour};font-size:9px;margin-right:5px">&#9679;</span>'
        elif background in ("bar", "thin"):
            swatch = (
                f'<span style="display:inline-block;width:14px;vertical-align:middle;'
                f'height:{9 if background == "bar" else 2}px;margin-right:5px;border-radius:2px;'
                f'background-color:{colour}"></span>'
            )
        else:
            swatch = (
                f'<span style="display:inline-block;width:10px;height:10px;vertical-align:middle;'
                f'margin-right:5px;border-left:3px solid {colour};background-color:{background}">'
                f"</span>"
            )
        out.append(
            f'<span style="display:inline-block;margin-right:14px;white-space:nowrap">'
            f"{swatch}{esc(label)}</span>"
        )
    return f'<div style="margin-top:6px;font-size:11px;color:{MUTED}">{"".join(out)}</div>'


def _elsewhere(ctx: CodeContext, items: Sequence[Item]) -> str:
    """Lines of other cells the report points at (the loop or the DataLoader)."""
    shown: list[tuple[str, CodeSite, str, str]] = []
    if ctx.loop is not None and ctx.loop_cell is not None:
        shown.append(("step loop", CodeSite(ctx.loop.lineno, ctx.loop_cell), LOOP_COLOUR, LOOP_BG))
    site = ctx.loader_site
    if site is not None and site.cell is not None:
        shown.append(("DataLoader", site, LOADER_COLOUR, LOADER_BG))
    for item in items:
        if item.status == FIX and item.site is not None and item.site.cell is not None:
            if all(s != item.site for _, s, _, _ in shown):
                shown.append((f"fix: {item.key}", item.site, BADGE[FIX][0], BADGE[FIX][1]))
    out = []
    for label, site, colour, background in shown:
        text = ctx.cell_line(site)
        code = (
            f'<div style="font-family:{MONO};white-space:pre;overflow-x:auto;padding:2px 6px;'
            f'border-left:3px solid {colour};background-color:{background}">'
            f'<span style="color:{MUTED};margin-right:10px">{site.line}</span>{esc(text)}</div>'
            if text is not None
            else ""
        )
        out.append(
            f'<div class="tml-elsewhere" style="margin-top:8px;font-size:12px">'
            f'<div style="color:{MUTED}">{esc(label)} in {esc(site.label())}</div>{code}</div>'
        )
    return "".join(out)


def heat_legend(
    costs: LineCosts, bars: Mapping[int, LineBar]
) -> list[tuple[str, str, str]]:
    """Legend entries of the bars beside the code."""
    on_gpu = bool(costs.get("gpu_ms_per_step"))
    entries = [("GPU ms per step" if on_gpu else "ms per step", COMPUTE_COLOUR, "bar")]
    if on_gpu:
        entries.append(("host ms per step", MUTED, "thin"))
    if any(b.colour == WAIT_COLOUR for b in bars.values()):
        entries.append(("data wait", WAIT_COLOUR, "bar"))
    return entries


def heat_note(costs: LineCosts) -> str:
    """How the bars beside the code were measured."""
    clock = "CUDA events" if costs.get("gpu_ms_per_step") else "wall clock"
    note = (
        f"Bars: mean time per step of each statement of the loop body ({clock}), over "
        f"{costs.get('timed_steps') or 0} timed steps after the warm-up: "
        f"{costs.get('sampling') or 'sampled'}."
    )
    if costs.get("gpu_ms_per_step"):
        note += (
            f" GPU time on {costs.get('gpu_sampled_steps') or 0} of those steps; the thin "
            "bar is the host's time."
        )
    return note


def code_pane(result: RunResult, ctx: CodeContext, items: Sequence[Item]) -> str:
    """The report's left pane: the traced cell's lines (the loop and the DataLoader marked, the
    lines the checklist `items` point at, each loop-body line's cost per step), the loop's own
    cell above it when the loop is in another one (`ctx`: the code the kernel read)."""
    where = result.loop.where or ""
    parts = [section_title("Cell")]
    if result.loop.cell_source is None:
        why = "this run was traced from code (traceml_jupyter.trace)."
        if "loop.cell_source" in result.unsaved:
            why = "its saved file does not hold it (written by an older traceml_jupyter)."
        parts.append(f'<div style="color:{MUTED}">No cell source: {esc(why)}</div>')
        return "".join(parts)
    if result.loop.loop_cell_source and result.loop.line is not None:
        parts = [_loop_cell_pane(result)] + parts
    lines = result.loop.cell_source.splitlines()
    in_cell = result.loop.line is not None and "(" not in where and ctx.loop_cell is None
    loop_line = result.loop.line if in_cell else None
    loader_lines = set(dataloader_lines(ctx.tree)) if ctx.tree is not None else set()
    marks: dict[int, list[str]] = {}
    for item in items:
        if item.status == FIX and item.site is not None and item.site.cell is None:
            marks.setdefault(item.site.line, []).append(item.key)
    if not result.loop.loop_cell_source:  # a resource finding's line (a kept graph) is a line of this cell
        for finding in result.summary.get("resource_findings") or []:
            line = finding["line"]
            if line is not None and finding["severity"] != "info":
                marks.setdefault(line, []).append(finding["label"].lower())
    costs = result.line_costs if not result.loop.loop_cell_source else None
    bars = line_bars(costs, len(lines))
    parts.append(
        f'<div style="font-family:{MONO};font-size:12px;line-height:1.55;overflow-x:auto;'
        f'border:1px solid {BORDER};border-radius:6px;background-color:{SUBTLE};padding:6px 0">'
        f"{_code_lines(lines, loop_line, loader_lines, marks, bars)}</div>"
    )
    legend = []
    if loop_line is not None:
        legend.append((f"step loop (line {loop_line})", LOOP_COLOUR, LOOP_BG))
    if loader_lines:
        shown = ", ".join(str(n) for n in sorted(loader_lines))
        legend.append((f"DataLoader built (line {shown})", LOADER_COLOUR, LOADER_BG))
    if marks:
        legend.append(("line to change (see the checklist)", BADGE[FIX][0], "dot"))
    if bars and costs:
        legend += heat_legend(costs, bars)
    if legend:
        parts.append(legend_html(legend))
    if bars and costs:
        parts.append(
            f'<div class="tml-heat-note" style="margin-top:4px;font-size:11px;color:{MUTED}">'
            f"{esc(heat_note(costs))}</div>"
        )
    if result.loop.line is not None and not in_cell:
        text = f"The step loop is in {where}, line {result.loop.line}."
        parts.append(f'<div style="margin-top:8px;font-size:12px">{esc(text)}</div>')
    elif result.loop.line is None and where:
        parts.append(f'<div style="margin-top:8px;font-size:12px">Timed: {esc(where)}.</div>')
    parts.append(_elsewhere(ctx, items))
    return "".join(parts)


def _loop_cell_pane(result: RunResult) -> str:
    """The cell that defines the function holding the step loop, with its cost per line."""
    lines = (result.loop.loop_cell_source or "").splitlines()
    costs = result.line_costs
    bars = line_bars(costs, len(lines))
    out = section_title(f"The step loop: {result.loop.where}") + (
        f'<div class="tml-loop-cell" style="font-family:{MONO};font-size:12px;line-height:1.55;'
        f"overflow-x:auto;border:1px solid {BORDER};border-radius:6px;background-color:{SUBTLE};"
        f'padding:6px 0">{_code_lines(lines, result.loop.line, set(), {}, bars)}</div>'
    )
    legend = [(f"step loop (line {result.loop.line})", LOOP_COLOUR, LOOP_BG)]
    if bars and costs:
        legend += heat_legend(costs, bars)
    out += legend_html(legend)
    if bars and costs:
        out += (
            f'<div class="tml-heat-note" style="margin-top:4px;font-size:11px;color:{MUTED}">'
            f"{esc(heat_note(costs))}</div>"
        )
    return out
