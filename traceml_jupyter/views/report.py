"""The final report as static HTML: the cell's code (each loop-body line with its ms per step)
beside the verdict, the evidence and the evaluated checklist (kernel/code_facts.py gathers what the
checklist reads). Small functions, one per part of the page, each returning its HTML with inline
styles: JupyterLab's sanitizer drops <style> in untrusted outputs, and a template engine would be
one more dependency for a page of a dozen parts."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING, Any

from ..analysis.cell_code import CodeSite, dataloader_lines
from ..analysis.checklist import CHECK, FIX, OK, Item, per_step_bytes
from ..analysis.number_text import ms_fine
from ..analysis.number_text import pct as fmt_pct
from ..analysis.phases import phase_sentence, phase_verdict
from ..analysis.resources import mib
from ..analysis.step_parts import parts_sentence
from ..analysis.verdict import sync_sentence
from ..kernel.code_facts import CodeContext, checklist_items, source_label
from ..kernel.shell import ipython_shell

if TYPE_CHECKING:
    from ..run import Run

ROOT_CLASS = "traceml-report"

# Colours: a light card that keeps its own background in dark notebook themes.
FG, MUTED, BORDER, SUBTLE, BG = "#1f2328", "#57606a", "#d0d7de", "#f6f8fa", "#ffffff"
WAIT_COLOUR, COMPUTE_COLOUR, OTHER_COLOUR = "#e8590c", "#1c7ed6", "#adb5bd"
FORWARD_COLOUR, BACKWARD_COLOUR, OPTIMIZER_COLOUR = "#15aabf", "#37b24d", "#ae3ec9"  # the rest: compute's
LOOP_COLOUR, LOOP_BG = "#6741d9", "#f3f0ff"
LOADER_COLOUR, LOADER_BG = "#d9480f", "#fff4e6"
SEVERITY = {  # colour, background
    "info": ("#1864ab", "#e7f5ff"),
    "warn": ("#a35200", "#fff9db"),
    "critical": ("#c92a2a", "#fff5f5"),
}
BADGE = {  # colour, background
    OK: ("#2b8a3e", "#ebfbee"),
    FIX: ("#c92a2a", "#ffe3e3"),
    CHECK: ("#a35200", "#fff3bf"),
}
SANS = "-apple-system, BlinkMacSystemFont, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"
MONO = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'Liberation Mono', monospace"


# -- HTML ------------------------------------------------------------------------------------


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


BACKTICKS = re.compile(r"`([^`]+)`")


def _with_code(text: str) -> str:
    """Escaped text whose `quoted` parts show as code."""
    out, end = [], 0
    for match in BACKTICKS.finditer(text):
        out.append(_e(text[end : match.start()]))
        out.append(
            f'<code style="font-family:{MONO};font-size:12px;padding:0 3px;border-radius:3px;'
            f'background-color:{SUBTLE};color:{FG}">{_e(match.group(1))}</code>'
        )
        end = match.end()
    out.append(_e(text[end:]))
    return "".join(out)


def fmt_rate(value: float | None, unit: str) -> str:
    if value is None or value != value:
        return f"n/a {unit}"
    return f"{value:,.1f} {unit}" if value < 1000 else f"{value:,.0f} {unit}"


def _compute_name(summary: Mapping[str, Any]) -> str:
    return "GPU compute" if summary.get("clock") == "gpu" else "CPU compute"


def _badge(text: str, colour: str, background: str) -> str:
    return (
        f'<span style="display:inline-block;min-width:38px;text-align:center;padding:1px 6px;'
        f"border-radius:10px;font-size:11px;font-weight:600;letter-spacing:0.02em;"
        f'color:{colour};background-color:{background}">{_e(text)}</span>'
    )


def _section_title(text: str) -> str:
    return (
        f'<div style="margin:14px 0 6px 0;font-size:11px;font-weight:700;color:{MUTED};'
        f'text-transform:uppercase;letter-spacing:0.06em">{_e(text)}</div>'
    )


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


def line_bars(costs: Mapping[str, Any] | None, n_lines: int) -> dict[int, LineBar]:
    """Heat bars by cell line from `run.line_costs`: each timed statement's mean ms per step,
    and the loop line's data wait, on one scale (the costliest line fills the bar). On CUDA the
    bar is the GPU time (events on sampled steps) and a thin bar under it the host's time."""
    if not costs or not costs.get("statements"):
        return {}
    from ..capture.line_costs import heat

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
        f'<span class="tml-heat" title="{_e(bar.title)}" style="flex-shrink:0;display:flex;'
        f'align-items:center;width:{BAR_WIDTH_PX + LABEL_WIDTH_PX + 10}px">'
        f'<span style="flex-shrink:0;width:{BAR_WIDTH_PX}px;padding:1px 0;'
        f'background-color:{HEAT_TRACK if bar.first else "transparent"};border-radius:2px">'
        f"{main}</span>"
        f'<span class="tml-heat-ms" style="flex-shrink:0;width:{LABEL_WIDTH_PX}px;'
        f'padding-left:6px;font-size:11px;color:{MUTED};white-space:nowrap">{_e(bar.label)}'
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
            f'<div class="{" ".join(classes)}" title="{_e(title)}" style="display:flex;'
            f'border-left:3px solid {colour};background-color:{background}">'
            f'<span style="flex-shrink:0;width:14px;text-align:center;font-size:9px;'
            f'color:{BADGE[FIX][0]}">{mark}</span>'
            f'<span style="flex-shrink:0;width:26px;padding-right:10px;text-align:right;'
            f'color:{number_colour}">{number}</span>'
            f"{_heat_cell(bars.get(number)) if bars else ''}"
            f'<span style="white-space:pre;padding-right:12px">{_e(text) or " "}</span></div>'
        )
    return (
        f'<div style="display:inline-block;min-width:100%;box-sizing:border-box">'
        f'{"".join(rows)}</div>'
    )


def _legend(entries: Sequence[tuple[str, str, str]]) -> str:
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
            f"{swatch}{_e(label)}</span>"
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
            f'<span style="color:{MUTED};margin-right:10px">{site.line}</span>{_e(text)}</div>'
            if text is not None
            else ""
        )
        out.append(
            f'<div class="tml-elsewhere" style="margin-top:8px;font-size:12px">'
            f'<div style="color:{MUTED}">{_e(label)} in {_e(site.label())}</div>{code}</div>'
        )
    return "".join(out)


def heat_legend(
    costs: Mapping[str, Any], bars: Mapping[int, LineBar]
) -> list[tuple[str, str, str]]:
    """Legend entries of the bars beside the code."""
    on_gpu = bool(costs.get("gpu_ms_per_step"))
    entries = [("GPU ms per step" if on_gpu else "ms per step", COMPUTE_COLOUR, "bar")]
    if on_gpu:
        entries.append(("host ms per step", MUTED, "thin"))
    if any(b.colour == WAIT_COLOUR for b in bars.values()):
        entries.append(("data wait", WAIT_COLOUR, "bar"))
    return entries


def heat_note(costs: Mapping[str, Any]) -> str:
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


def _code_pane(run: Run, ctx: CodeContext, items: Sequence[Item]) -> str:
    where = run.loop_where or ""
    parts = [_section_title("Cell")]
    if run.cell_source is None:
        why = "this run was traced from code (traceml_jupyter.trace)."
        if "cell_source" in getattr(run, "unsaved", ()):
            why = "its saved file does not hold it (written by an older traceml_jupyter)."
        parts.append(f'<div style="color:{MUTED}">No cell source: {_e(why)}</div>')
        return "".join(parts)
    if run.loop_cell_source and run.loop_line is not None:
        parts = [_loop_cell_pane(run)] + parts
    lines = run.cell_source.splitlines()
    in_cell = run.loop_line is not None and "(" not in where and ctx.loop_cell is None
    loop_line = run.loop_line if in_cell else None
    loader_lines = set(dataloader_lines(ctx.tree)) if ctx.tree is not None else set()
    marks: dict[int, list[str]] = {}
    for item in items:
        if item.status == FIX and item.site is not None and item.site.cell is None:
            marks.setdefault(item.site.line, []).append(item.key)
    if not run.loop_cell_source:  # a resource finding's line (a kept graph) is a line of this cell
        for finding in run.summary.get("resource_findings") or []:
            if finding.get("line") is not None and finding["severity"] != "info":
                marks.setdefault(int(finding["line"]), []).append(str(finding["label"]).lower())
    costs = getattr(run, "line_costs", None) if not run.loop_cell_source else None
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
        parts.append(_legend(legend))
    if bars and costs:
        parts.append(
            f'<div class="tml-heat-note" style="margin-top:4px;font-size:11px;color:{MUTED}">'
            f"{_e(heat_note(costs))}</div>"
        )
    if run.loop_line is not None and not in_cell:
        text = f"The step loop is in {where}, line {run.loop_line}."
        parts.append(f'<div style="margin-top:8px;font-size:12px">{_e(text)}</div>')
    elif run.loop_line is None and where:
        parts.append(f'<div style="margin-top:8px;font-size:12px">Timed: {_e(where)}.</div>')
    parts.append(_elsewhere(ctx, items))
    return "".join(parts)


def _loop_cell_pane(run: Run) -> str:
    """The cell that defines the function holding the step loop, with its cost per line."""
    lines = (run.loop_cell_source or "").splitlines()
    costs = run.line_costs
    bars = line_bars(costs, len(lines))
    out = _section_title(f"The step loop: {run.loop_where}") + (
        f'<div class="tml-loop-cell" style="font-family:{MONO};font-size:12px;line-height:1.55;'
        f"overflow-x:auto;border:1px solid {BORDER};border-radius:6px;background-color:{SUBTLE};"
        f'padding:6px 0">{_code_lines(lines, run.loop_line, set(), {}, bars)}</div>'
    )
    legend = [(f"step loop (line {run.loop_line})", LOOP_COLOUR, LOOP_BG)]
    if bars and costs:
        legend += heat_legend(costs, bars)
    out += _legend(legend)
    if bars and costs:
        out += (
            f'<div class="tml-heat-note" style="margin-top:4px;font-size:11px;color:{MUTED}">'
            f"{_e(heat_note(costs))}</div>"
        )
    return out


def _banner(run: Run) -> str:
    verdict = run.verdict_detail
    colour, background = SEVERITY.get(verdict.severity, SEVERITY["info"])
    return (
        f'<div class="tml-verdict tml-{_e(verdict.severity)}" style="border-left:4px solid '
        f'{colour};background-color:{background};border-radius:6px;padding:10px 12px">'
        f'<div style="font-size:16px;font-weight:700;color:{colour}">Step Time: '
        f"{_e(verdict.label)} "
        f'<span style="font-size:11px;font-weight:600;text-transform:uppercase;'
        f'letter-spacing:0.05em;margin-left:6px">{_e(verdict.severity)}</span></div>'
        f'<div style="margin-top:6px"><b>Why</b> {_with_code(verdict.why)}</div>'
        f'<div style="margin-top:4px"><b>Next</b> {_e(verdict.next)}</div></div>'
    )


def _tiles(summary: Mapping[str, Any]) -> str:
    tiles = [
        ("Data wait", summary.get("data_wait_ms"), summary.get("data_wait_share"), WAIT_COLOUR),
        (
            _compute_name(summary),
            summary.get("compute_ms"),
            summary.get("compute_share"),
            COMPUTE_COLOUR,
        ),
        ("Step time", summary.get("step_ms"), None, FG),
    ]
    out = []
    for label, value, share, colour in tiles:
        sub = f"{fmt_pct(share)} of step" if share is not None else "median"
        if label == "GPU compute":  # not busy time: the body's span on the GPU's timeline
            sub += " (GPU span of the body)"
        out.append(
            f'<div class="tml-number" style="flex-grow:1;flex-basis:120px;margin:4px;'
            f'padding:8px 10px;border:1px solid {BORDER};border-radius:6px">'
            f'<div style="font-size:11px;color:{MUTED}">{_e(label)}</div>'
            f'<div style="font-size:18px;font-weight:700;color:{colour}">{ms_fine(value)}</div>'
            f'<div style="font-size:11px;color:{MUTED}">{_e(sub)}</div></div>'
        )
    return f'<div style="display:flex;flex-wrap:wrap;margin:8px -4px 0 -4px">{"".join(out)}</div>'


PART_LABELS = (("forward", "Forward"), ("backward", "Backward"), ("optimizer", "Optimizer"), ("rest", "The rest"))


def step_parts(summary: Mapping[str, Any]) -> list[tuple[str, float, float]] | None:
    """What a step is made of: (label, median share of the step, bar width) for data wait,
    compute (split into forward, backward, optimizer and the rest where the parts of the step
    were timed) and what none explains. Medians of shares need not add up to one, so the
    widths are scaled to fit; None when nothing was measured."""
    wait, compute = summary.get("data_wait_share"), summary.get("compute_share")
    if wait is None or compute is None:
        return None
    split = [(label, summary.get(f"{key}_share")) for key, label in PART_LABELS]
    inside: list[tuple[str, float]] = [(_compute_name(summary), compute)]
    if all(share is not None for _, share in split):
        inside = [(label, float(share)) for label, share in split if share is not None]
    known = wait + sum(share for _, share in inside)
    other = max(0.0, 1.0 - known)
    total = max(1.0, known)
    return [("Data wait", wait, wait / total)] + [(label, share, share / total) for label, share in inside] + [
        ("Other", other, other / total)
    ]


PART_COLOURS = {
    "Data wait": WAIT_COLOUR,
    "Forward": FORWARD_COLOUR,
    "Backward": BACKWARD_COLOUR,
    "Optimizer": OPTIMIZER_COLOUR,
    "The rest": COMPUTE_COLOUR,
    "Other": OTHER_COLOUR,
}


def _step_bar(summary: Mapping[str, Any]) -> str:
    parts = step_parts(summary)
    if parts is None:
        return f'<div style="color:{MUTED}">n/a: no step was analysed.</div>'
    colours = [PART_COLOURS.get(label, COMPUTE_COLOUR) for label, _, _ in parts]
    bars, legend = [], []
    for (label, share, width), colour in zip(parts, colours, strict=True):
        if width > 0:
            bars.append(
                f'<div title="{_e(label)} {fmt_pct(share)}" style="width:{100 * width:.2f}%;'
                f'background-color:{colour}"></div>'
            )
        if label != "Other" or share >= 0.005:
            legend.append((f"{label} {fmt_pct(share)}", colour, colour))
    split = parts_sentence(summary)
    caption = (
        f'<div class="tml-parts" style="margin-top:4px;font-size:11px;color:{MUTED}">'
        f"{_with_code(split)}</div>"
        if split
        else ""
    )
    return (
        f'<div class="tml-bar" style="display:flex;height:14px;border-radius:4px;'
        f'overflow:hidden;background-color:#e9ecef">{"".join(bars)}</div>'
        + _legend(legend)
        + caption
    )


def _also(run: Run) -> str:
    """The lines after the verdict: the rest of the step (its own verdict line), advice by the
    part that dominates, each epoch's start-up, the trend over the run (or that there is none)."""
    lines = run.also()
    out = "".join(
        f'<div class="tml-also tml-{_e(severity)}" style="margin-top:6px;padding:6px 10px;'
        f"border-radius:6px;color:{SEVERITY[severity][0]};background-color:{SEVERITY[severity][1]}\">"
        f"{_with_code(text)}</div>"
        for severity, text in lines
    )
    found = run.summary.get("trend")
    if found and not found.get("direction"):
        out += (
            f'<div class="tml-trend" style="margin-top:6px;font-size:11px;color:{MUTED}">Over the run: '
            f"no trend (median step {ms_fine(found['first_ms'])} in the first third of the analysed "
            f"steps, {ms_fine(found['last_ms'])} in the last; noise ±{100 * found['noise']:.1f} %)</div>"
        )
    return out


def _gpu_column(samples: Any, name: str) -> list[float]:
    """The finite values of one column of the run's NVML samples (see Run.gpu_samples)."""
    if not isinstance(samples, Mapping) or samples.get(name) is None:
        return []
    values = [float(v) for v in samples[name]]
    return [v for v in values if v == v]


def gpu_utilisation(run: Run) -> str:
    """'median 87 %, max 99 %, memory up to 10.2 GiB (40 samples)', or why there is none."""
    samples = getattr(run, "gpu_samples", None)
    values = sorted(_gpu_column(samples, "gpu_util_pct"))
    if values:
        text = f"median {values[len(values) // 2]:.0f} %, max {values[-1]:.0f} %"
        memory = _gpu_column(samples, "gpu_mem_used_mib")
        if memory:
            text += f", memory up to {max(memory) / 1024:.1f} GiB"
        return text + f" ({len(values)} samples, NVML)"
    memory = _gpu_column(samples, "gpu_mem_used_mib")
    if memory:  # NVML gave memory but no utilisation (a MIG slice, an unsupported device)
        return f"n/a (NVML reports no utilisation here), memory up to {max(memory) / 1024:.1f} GiB"
    note = getattr(run, "gpu_note", None)
    if note:  # the sampler's notes read "GPU n/a (no NVML)": the row says "GPU" already
        note = str(note).removeprefix("GPU ").strip()
        return note if note.startswith("n/a") else f"n/a ({note})"
    used = bool(getattr(run, "_gpu_used", False))
    return "n/a (not sampled)" if used else "n/a (no GPU used)"


def _yes_no(part: int, whole: int) -> str:
    if part >= whole:
        return "yes"
    return "no" if part == 0 else f"{part} of {whole} copies"


def _where(run: Run, row: Mapping[str, Any]) -> str:
    if row.get("in_cell"):
        return f"line {row['line']}"
    return f"{source_label(run, ipython_shell(), str(row['filename']))}, line {row['line']}"


COPIES_MEDIAN = "H2D copies (median per step)"  # the label the H2D-BOUND verdict uses too


def copy_rows(run: Run) -> list[tuple[str, str]]:
    """Evidence of the copies to the GPU (run.h2d): the median per step, then each copying line
    with bytes per step, bandwidth, pinned or not and non_blocking or not."""
    h2d = getattr(run, "h2d", None)
    sites = (h2d or {}).get("sites") or []
    if not sites:
        return []
    s = run.summary
    rows = []
    if s.get("h2d_ms") is not None:
        share = fmt_pct(s.get("h2d_share"))
        rows.append((COPIES_MEDIAN, f"{ms_fine(s['h2d_ms'])}, {share} of the step"))
    for site in sites[:4]:
        copies = int(site["copies"])
        rate = f" at {site['gb_per_s']:.1f} GB/s" if site.get("gb_per_s") else ""
        took = f" in {ms_fine(site['ms_per_step'])}" if site.get("ms_per_step") is not None else ""
        rows.append(
            (
                f"Copy, {_where(run, site)}",
                f"{per_step_bytes(float(site['bytes_per_step']))}/step{took}{rate}; "
                f"pinned: {_yes_no(int(site['pinned']), copies)}; "
                f"non_blocking: {_yes_no(int(site['non_blocking']), copies)}",
            )
        )
    return rows


def sync_rows(run: Run) -> list[tuple[str, str]]:
    """Evidence of the synchronising calls (run.sync_stalls): the sentence for the costliest
    line of the cell, then the other syncing lines."""
    stalls = getattr(run, "sync_stalls", None)
    sites = (stalls or {}).get("sites") or []
    if not sites:
        return []
    rows = []
    top = run.summary.get("sync_top")
    sentence = sync_sentence(top)
    if sentence:
        rows.append(("Sync stall", sentence))
    for site in sites[:4]:
        if sentence and top and site["line"] == top.get("line") and site.get("in_cell"):
            continue
        call = f"`{site['call']}`" if site.get("call") else ", ".join(site.get("kinds") or [])
        wait = site.get("wait_ms_per_step")
        waited = " (wait not timed)"
        if wait is not None:
            waited = f", host waits {ms_fine(wait)} per step"
        per = float(site["calls_per_step"])
        rows.append((f"Syncs, {_where(run, site)}", f"{call or 'sync'} {per:.2g} per step{waited}"))
    return rows


def evidence_rows(run: Run) -> list[tuple[str, str]]:
    """Label and value rows under the timing table: the run's, the verdict's own extra evidence,
    then the copies to the GPU and the syncs measured on the way (rows not already shown)."""
    s = run.summary
    steps = f"{s.get('n_analysed', 0)} of {s.get('n_steps', 0)} ({s.get('warmup_steps', 0)} warm-up)"
    clock = "GPU (CUDA events)" if s.get("clock") == "gpu" else "CPU (wall clock, perf_counter)"
    samples = fmt_rate(s.get("samples_per_s"), "samples/s")
    if s.get("batch_size"):
        samples += f" (batch {s['batch_size']})"
    compute = _compute_name(s)
    rows = [
        ("Data wait share (median)", fmt_pct(s.get("data_wait_share"))),
        (f"{compute} share (median)", fmt_pct(s.get("compute_share"))),
        ("Analysed steps", steps),
        ("Clock", clock),
        ("Throughput", f"{fmt_rate(s.get('steps_per_s'), 'steps/s')}, {samples}"),
        ("GPU utilisation", gpu_utilisation(run)),
    ]
    shown = {
        "Data wait (median)",
        f"{compute} (median)",
        "Step time (median)",
        "Data wait share",
        "Analysed steps",
        "Clock",
    }
    watched = copy_rows(run) + sync_rows(run)
    if any(k.startswith("Copy, ") for k, _ in watched):
        shown.add("Copy lines")  # each copying line has its own row
    rows += [(k, v) for k, v in run.verdict_detail.evidence if k not in shown]
    labels = {k for k, _ in rows}
    return rows + [(k, v) for k, v in watched if k not in labels]


# Notebook front-ends style tables (striped rows, right-aligned cells, theme colours): every
# table element states its own alignment, padding and colours so the card reads the same.
TABLE = (
    f"border-collapse:collapse;width:100%;font-size:12px;color:{FG};margin:0;"
    "table-layout:auto;border:none"
)
ROW = "background-color:transparent"
CELL = f"padding:3px 8px;border:none;border-bottom:1px solid {BORDER};line-height:1.4;color:{FG}"


def _evidence(run: Run) -> str:
    s = run.summary
    stats = s.get("stats") or {}
    left = CELL + ";text-align:left"
    num = CELL + ";text-align:right;white-space:nowrap"
    head = "".join(
        f'<th style="{num};color:{MUTED};font-weight:600">{h}</th>' for h in ("median", "p90", "max")
    )
    rows = [f'<tr style="{ROW}"><th style="{left}"></th>{head}</tr>']
    for key, label in (
        ("data_wait_ms", "Data wait"),
        ("compute_ms", _compute_name(s)),
        ("step_ms", "Step time"),
    ):
        st = stats.get(key) or {}
        values = "".join(
            f'<td style="{num}">{ms_fine(st.get(q))}</td>' for q in ("median", "p90", "max")
        )
        rows.append(f'<tr style="{ROW}"><td style="{left}">{_e(label)}</td>{values}</tr>')
    table = f'<table class="tml-evidence" style="{TABLE}">{"".join(rows)}</table>'
    kv = "".join(
        f'<tr style="{ROW}"><td style="{left};color:{MUTED};width:45%">{_e(k)}</td>'
        f'<td style="{left}">{_with_code(v)}</td></tr>'
        for k, v in evidence_rows(run)
    )
    more = f'<table class="tml-facts" style="{TABLE};margin-top:8px">{kv}</table>'
    return table + more


CODE_LIKE = re.compile(r"[^\s]+|[\w.]+\((?:[^()]|\([^()]*\))*\)")


def _value(text: str, strong: bool = False) -> str:
    """A value as code (`0`, `True`, `y.to(device)`), a phrase as plain text."""
    weight = "font-weight:600;" if strong else ""
    if len(text) <= 48 and CODE_LIKE.fullmatch(text):
        return (
            f'<span style="font-family:{MONO};font-size:12px;{weight}padding:0 4px;'
            f'border-radius:4px;background-color:{SUBTLE}">{_e(text)}</span>'
        )
    return f'<span style="{weight}">{_e(text)}</span>'


def _item_row(item: Item) -> str:
    colour, background = BADGE.get(item.status, BADGE[CHECK])
    change = _value(item.seen)
    if item.to_try:
        change += f" &rarr; {_value(item.to_try, strong=True)}"
    where = ""
    if item.site is not None:
        where = (
            f'<span class="tml-where" style="margin-left:8px;padding:0 6px;border-radius:4px;'
            f'border:1px solid {BORDER};font-size:11px;color:{MUTED};white-space:nowrap">'
            f"{_e(item.site.label())}</span>"
        )
    return (
        f'<div class="tml-item tml-item-{_e(item.key)} tml-{_e(item.status)}" style="display:flex;'
        f'padding:6px 0;border-top:1px solid {BORDER}">'
        f'<div style="flex-shrink:0;width:62px">{_badge(item.status, colour, background)}</div>'
        f'<div style="min-width:0;flex-grow:1">'
        f'<div><b>{_e(item.title)}</b></div>'
        f'<div style="margin-top:2px">{change}{where}</div>'
        f'<div style="margin-top:2px;color:{MUTED};font-size:12px">{_with_code(item.reason)}</div>'
        f"</div></div>"
    )


def _checklist(items: Sequence[Item]) -> str:
    main = [i for i in items if i.bears_on_verdict]
    folded = [i for i in items if not i.bears_on_verdict]
    out = "".join(_item_row(i) for i in main)
    if not main:
        out = f'<div style="color:{MUTED}">No item bears on this verdict.</div>'
    if folded:
        out += (
            f'<details class="tml-folded" style="margin-top:6px"><summary style="cursor:pointer;'
            f'color:{MUTED};font-size:12px">{len(folded)} more item(s) that do not bear on '
            f"this verdict</summary>{''.join(_item_row(i) for i in folded)}</details>"
        )
    return out


def _notes(run: Run, problem: str | None = None) -> str:
    out = ""
    if run.error:
        colour, background = SEVERITY["critical"]
        out += (
            f'<div class="tml-error" style="margin-top:12px;padding:6px 10px;border-radius:6px;'
            f'color:{colour};background-color:{background}">'
            f"<b>Stopped by:</b> {_e(run.error)} (the numbers cover the steps before it)</div>"
        )
    notes_seen = list(run.notes) + ([problem] if problem else [])
    if notes_seen:
        notes = "".join(f'<li style="margin:2px 0">{_e(n)}</li>' for n in notes_seen)
        out += f'<ul class="tml-notes" style="margin:10px 0 0 0;padding-left:18px">{notes}</ul>'
    return out


def _text_box(run: Run) -> str:
    return (
        f'<details class="tml-text" style="margin-top:12px"><summary style="cursor:pointer;'
        f'color:{MUTED};font-size:12px">Text report</summary>'
        f'<pre style="font-family:{MONO};font-size:11px;line-height:1.4;overflow-x:auto;'
        f"margin:6px 0 0 0;padding:8px;border:1px solid {BORDER};border-radius:6px;"
        f'background-color:{SUBTLE};color:{FG}">{_e(run.text())}</pre></details>'
    )


def _header(run: Run) -> str:
    bits = [f"{run.n_steps} steps"]
    if run.loop_line is not None:
        bits.append(f"loop on line {run.loop_line}")
    if run.loop_where and run.loop_where != "this cell":
        bits.append(run.loop_where)
    return (
        f'<div style="display:flex;flex-wrap:wrap;align-items:baseline;margin-bottom:8px">'
        f'<span style="font-weight:700;font-size:14px;margin-right:10px">traceml</span>'
        f'<span style="color:{MUTED}">{_e(run.name)} &middot; {_e(" · ".join(bits))}</span>'
        f'<span class="tml-step-definition" style="color:{MUTED};margin-left:10px">'
        f"({_with_code(run.step_definition)})</span></div>"
    )


def _phases(run: Run) -> str:
    """The passes kept out of the steps (validation, test, eval): their share of the cell and
    their own data wait, and a line of their own when they are what makes the cell slow."""
    if not run.phases:
        return ""
    rows = "".join(
        f'<li class="tml-phase" style="margin:2px 0">{_with_code(phase_sentence(p))}</li>'
        for p in run.phases
    )
    out = _section_title("Kept out of the steps") + (
        f'<ul class="tml-phases" style="margin:0;padding-left:18px">{rows}</ul>'
    )
    slow = phase_verdict(run.phases)
    if slow:
        colour, background = SEVERITY["warn"]
        out += (
            f'<div class="tml-phase-verdict" style="margin-top:6px;padding:6px 10px;border-radius:6px;'
            f'color:{colour};background-color:{background}">{_with_code(slow)}</div>'
        )
    return out


def render_html(run: Run, checklist: Sequence[Item] | None = None) -> str:
    """The report as one self-contained HTML fragment: inline styles only, no script, no
    external asset, so it reads the same after a reload, on nbviewer, GitHub and Kaggle."""
    shell = ipython_shell()
    problem = None
    if checklist is None and run.frozen:  # read back from its file: the checklist as evaluated
        checklist = [Item.from_dict(item) for item in run.checklist or []]
    try:  # the checklist reads live objects and history: never let it cost the report
        ctx = CodeContext.of(run, shell)
        items = list(checklist) if checklist is not None else checklist_items(run, shell, ctx)
    except Exception as exc:
        ctx, items = CodeContext(), list(checklist or [])
        problem = f"The checklist could not be evaluated: {type(exc).__name__}: {exc}"
    left = _code_pane(run, ctx, items)
    right = (
        _banner(run)
        + _tiles(run.summary)
        + _ranks(run)
        + _section_title("What a step is made of (median shares)")
        + _step_bar(run.summary)
        + _also(run)
        + _phases(run)
        + _resources(run)
        + _section_title("Evidence")
        + _evidence(run)
        + _section_title("Checklist")
        + _checklist(items)
        + _notes(run, problem)
        + _text_box(run)
    )
    pane = "flex-grow:1;flex-shrink:1;min-width:0;margin:8px"
    return (
        f'<div class="{ROOT_CLASS}" style="font-family:{SANS};font-size:13px;line-height:1.45;'
        f"color:{FG};background-color:{BG};border:1px solid {BORDER};border-radius:8px;"
        f'padding:12px 14px;max-width:1400px;box-sizing:border-box;text-align:left">'
        f"{_header(run)}"
        f'<div style="display:flex;flex-wrap:wrap;align-items:flex-start;margin:-8px">'
        f'<div class="tml-code-pane" style="{pane};flex-basis:380px">{left}</div>'
        f'<div class="tml-result-pane" style="{pane};flex-basis:440px">{right}</div>'
        f"</div></div>"
    )


def _resource_figures(run: Run) -> str:
    """One line of the run's resource figures: GPU memory peak, CPU cores busy, RSS, workers."""
    s = run.summary
    bits = []
    if s.get("gpu_mem_peak_mib") is not None:
        cap = s.get("gpu_mem_capacity_mib")
        of = f" of {mib(cap)} ({fmt_pct(s.get('gpu_mem_peak_share'))})" if cap else ""
        bits.append(f"GPU memory peak {mib(s['gpu_mem_peak_mib'])}{of}")
    if s.get("cpu_cores") is not None:
        bits.append(
            f"CPU {s['cpu_cores']:.1f} of {s.get('cpu_usable_cores') or 0:g} usable cores busy"
            + (" (saturated)" if s.get("cpu_saturated") else "")
        )
    if s.get("host_rss_mib") is not None:
        bits.append(f"process memory (RSS) up to {mib(s['host_rss_mib'])}")
    if s.get("workers_seen"):
        bits.append(f"{s['workers_seen']} DataLoader worker process(es)")
    return " · ".join(bits)


def _worker_rows(run: Run) -> str:
    workers = (run.host or {}).get("workers") or []
    if not workers:
        return ""
    num = CELL + ";text-align:right;white-space:nowrap"
    left = CELL + ";text-align:left"
    heads = ("worker pid", "CPU s", "RSS first → last", "private (USS) first → last", "")
    head = "".join(
        f'<th style="{left if i == 0 else num};color:{MUTED};font-weight:600">{h}</th>' for i, h in enumerate(heads)
    )
    rows = [f'<tr style="{ROW}">{head}</tr>']
    for w in workers[:8]:
        rss = f"{mib(w.get('rss_first_mib'))} → {mib(w.get('rss_last_mib'))}"
        uss = f"{mib(w.get('uss_first_mib'))} → {mib(w.get('uss_last_mib'))}"
        rows.append(
            f'<tr style="{ROW}"><td style="{left}">{w["pid"]}</td><td style="{num}">{w["cpu_s"]:.2f}</td>'
            f'<td style="{num}">{rss}</td><td style="{num}">{uss}</td>'
            f'<td style="{num};color:{MUTED}">{"exited" if w.get("exited") else ""}</td></tr>'
        )
    more = f'<div style="color:{MUTED};font-size:11px">and {len(workers) - 8} more</div>' if len(workers) > 8 else ""
    return f'<table class="tml-workers" style="{TABLE};margin-top:6px">{"".join(rows)}</table>{more}'


def _finding_row(f: Mapping[str, Any]) -> str:
    colour, background = SEVERITY.get(str(f["severity"]), SEVERITY["info"])
    where = (
        f'<span class="tml-where" style="margin-left:8px;padding:0 6px;border-radius:4px;'
        f'border:1px solid {BORDER};font-size:11px;color:{MUTED};white-space:nowrap">line {f["line"]}</span>'
        if f.get("line") is not None
        else ""
    )
    text = str(f["text"])
    return (
        f'<div class="tml-finding tml-{_e(f["severity"])}" style="margin-top:6px;padding:6px 10px;'
        f'border-left:4px solid {colour};border-radius:6px;background-color:{background}">'
        f'<b style="color:{colour}">{_e(f["label"])}</b>{where}'
        f'<div style="margin-top:2px">{_with_code(text[:1].upper() + text[1:])}</div>'
        + (f'<div style="margin-top:2px"><b>Next</b> {_with_code(str(f["next"]))}</div>' if f.get("next") else "")
        + "</div>"
    )


def _resources(run: Run) -> str:
    """Memory and CPU beside the time: the findings (with the lines to change), small plots
    of GPU memory per step, CPU cores busy and host memory, and the DataLoader workers."""
    from .resource_plots import cpu_svg, gpu_memory_svg, host_memory_svg

    s = run.summary
    host = run.host or {}
    samples = host.get("samples") or {}
    plots = [
        gpu_memory_svg(run.steps, s.get("gpu_mem_capacity_mib")),
        cpu_svg(samples, host.get("usable_cores")),
        host_memory_svg(samples),
    ]
    plots = [p for p in plots if p]
    findings = "".join(_finding_row(f) for f in s.get("resource_findings") or [])
    figures = _resource_figures(run)
    if not (plots or findings or figures):
        return ""
    out = _section_title("Resources")
    if figures:
        out += f'<div class="tml-resource-figures" style="color:{MUTED};font-size:12px">{_e(figures)}</div>'
    out += findings
    if plots:
        out += f'<div style="display:flex;flex-wrap:wrap;column-gap:12px;margin-top:6px">{"".join(plots)}</div>'
    out += _worker_rows(run)
    return f'<div class="tml-resources">{out}</div>'


def _ranks(run: Run) -> str:
    """Several processes: one row per rank (steps, medians per step, status), the rank that
    holds the others back highlighted, then what the numbers alone do not say."""
    if not run.ranks:
        return ""
    late = (run.straggler or {}).get("rank")
    num = CELL + ";text-align:right;white-space:nowrap"
    left = CELL + ";text-align:left"
    heads = ("rank", "steps", "data wait", "compute", "forward", "backward", "optimizer", "step time", "status")
    head = "".join(
        f'<th style="{left if i in (0, len(heads) - 1) else num};color:{MUTED};font-weight:600">{h}</th>'
        for i, h in enumerate(heads)
    )
    rows = [f'<tr style="{ROW}">{head}</tr>']
    colour, background = SEVERITY["critical"]
    for r in run.ranks:
        is_late = r.get("rank") == late
        style = f"background-color:{background}" if is_late else ROW
        name = f"rank {r.get('rank')}" + (" &larr; holds the others back" if is_late else "")
        cells = "".join(
            f'<td style="{num}">{ms_fine(r.get(key))}</td>'
            for key in ("data_wait_ms", "compute_ms", "forward_ms", "backward_ms", "optimizer_ms", "step_ms")
        )
        rows.append(
            f'<tr class="tml-rank{" tml-straggler" if is_late else ""}" style="{style}">'
            f'<td style="{left};{"color:" + colour + ";font-weight:600" if is_late else ""}">{name}</td>'
            f'<td style="{num}">{r.get("n_steps") or 0}</td>{cells}'
            f'<td style="{left}">{_e(r.get("status") or "finished")}</td></tr>'
        )
    table = f'<table class="tml-ranks" style="{TABLE}">{"".join(rows)}</table>'
    notes = run.summary.get("rank_notes") or []
    listed = "".join(f'<li style="margin:2px 0">{_e(n)}</li>' for n in notes)
    more = f'<ul class="tml-rank-notes" style="margin:6px 0 0 0;padding-left:18px">{listed}</ul>' if notes else ""
    return _section_title("Ranks (median per step)") + table + more
