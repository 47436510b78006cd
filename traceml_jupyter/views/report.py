"""The final report as static HTML, a renderer of the run's result (result.RunResult): the cell's
code (each loop-body line with its ms per step) beside the verdict, the evidence and the evaluated
checklist; what the result does not hold (the code around the run, the checklist) is the kernel's
reading (kernel/code_facts.KernelReading). A run of this kernel and one read back from its file
take the same path (`report_html`). Small functions, one per part of the page, each returning its
HTML with inline
styles: JupyterLab's sanitizer drops <style> in untrusted outputs, and a template engine would be
one more dependency for a page of a dozen parts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import result as render
from ..analysis.checklist import CHECK, Item
from ..analysis.number_text import ms_fine
from ..analysis.number_text import pct as fmt_pct
from ..analysis.phases import phase_sentence, phase_verdict
from ..analysis.resources import mib
from ..analysis.step_parts import parts_sentence
from ..analysis.summary_keys import Summary, part_figures
from ..analysis.verdict_box import headline_ms
from ..kernel.code_facts import CodeContext, KernelReading, kernel_reading
from .report_code import code_pane, legend_html
from .report_compile import compile_section
from .report_evidence import evidence_table
from .report_loader import loader_inside_html
from .report_style import (
    BACKWARD_COLOUR,
    BADGE,
    BG,
    BORDER,
    CELL,
    COMPUTE_COLOUR,
    FG,
    FORWARD_COLOUR,
    MONO,
    MUTED,
    OPTIMIZER_COLOUR,
    OTHER_COLOUR,
    ROW,
    SANS,
    SEVERITY,
    SUBTLE,
    TABLE,
    WAIT_COLOUR,
    badge,
    compute_name,
    esc,
    section_title,
    value_html,
    with_code,
)

if TYPE_CHECKING:
    from ..kernel.cells import FinishedRun
    from ..result import RunResult


ROOT_CLASS = "traceml-report"


def _banner(result: RunResult) -> str:
    verdict = result.verdict
    colour, background = SEVERITY.get(verdict.severity, SEVERITY["info"])
    return (
        f'<div class="tml-verdict tml-{esc(verdict.severity)}" style="border-left:4px solid '
        f'{colour};background-color:{background};border-radius:6px;padding:10px 12px">'
        f'<div style="font-size:16px;font-weight:700;color:{colour}">Step Time: '
        f"{esc(verdict.label)} "
        f'<span style="font-size:11px;font-weight:600;text-transform:uppercase;'
        f'letter-spacing:0.05em;margin-left:6px">{esc(verdict.severity)}</span></div>'
        f'<div style="margin-top:6px"><b>Why</b> {with_code(verdict.why)}</div>'
        f'<div style="margin-top:4px"><b>Next</b> {esc(verdict.next)}</div></div>'
    )


def _tile_notes(summary: Summary) -> tuple[str, str, str]:
    """What each tile's figure is: the mean's share of the loop's time (the medians for a run
    saved before the means), and under the step time, the steps' shape or its median."""
    if summary.get("mean_step_ms") is None:
        wait, compute = summary.get("data_wait_share"), summary.get("compute_share")
        return (
            f"{fmt_pct(wait)} of step" if wait is not None else "median",
            f"{fmt_pct(compute)} of step" if compute is not None else "median",
            "median",
        )
    step = summary["mean_step_ms"]
    shares = [v / step if step and v is not None else None for v in (summary.get("mean_data_wait_ms"), summary.get("mean_compute_ms"))]
    pattern = (summary.get("step_pattern") or {}).get("text")
    median = f"mean; median {ms_fine(summary.get('step_ms'))}"
    return (
        f"mean, {fmt_pct(shares[0])} of the time",
        f"mean, {fmt_pct(shares[1])} of the time",
        f"mean; {pattern}" if pattern else median,
    )


def _tiles(summary: Summary) -> str:
    notes = _tile_notes(summary)
    tiles = [
        ("Data wait", headline_ms(summary, "data_wait_ms"), notes[0], WAIT_COLOUR),
        (compute_name(summary), headline_ms(summary, "compute_ms"), notes[1], COMPUTE_COLOUR),
        ("Step time", headline_ms(summary, "step_ms"), notes[2], FG),
    ]
    out = []
    for label, value, sub, colour in tiles:
        if label == "GPU compute":  # not busy time: the body's span on the GPU's timeline
            sub += " (GPU span of the body)"
        out.append(
            f'<div class="tml-number" style="flex-grow:1;flex-basis:120px;margin:4px;'
            f'padding:8px 10px;border:1px solid {BORDER};border-radius:6px">'
            f'<div style="font-size:11px;color:{MUTED}">{esc(label)}</div>'
            f'<div style="font-size:18px;font-weight:700;color:{colour}">{ms_fine(value)}</div>'
            f'<div style="font-size:11px;color:{MUTED}">{esc(sub)}</div></div>'
        )
    return f'<div style="display:flex;flex-wrap:wrap;margin:8px -4px 0 -4px">{"".join(out)}</div>'


PART_LABELS = (("forward", "Forward"), ("backward", "Backward"), ("optimizer", "Optimizer"), ("rest", "The rest"))


def step_parts(summary: Summary) -> list[tuple[str, float, float]] | None:
    """What a step is made of: (label, median share of the step, bar width) for data wait,
    compute (split into forward, backward, optimizer and the rest where the parts of the step
    were timed) and what none explains. Medians of shares need not add up to one, so the
    widths are scaled to fit; None when nothing was measured."""
    wait, compute = summary.get("data_wait_share"), summary.get("compute_share")
    if wait is None or compute is None:
        return None
    figures = part_figures(summary)
    split = [(label, figures[key][1]) for key, label in PART_LABELS]
    inside: list[tuple[str, float]] = [(compute_name(summary), compute)]
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


def _step_bar(summary: Summary) -> str:
    parts = step_parts(summary)
    if parts is None:
        return f'<div style="color:{MUTED}">n/a: no step was analysed.</div>'
    colours = [PART_COLOURS.get(label, COMPUTE_COLOUR) for label, _, _ in parts]
    bars, legend = [], []
    for (label, share, width), colour in zip(parts, colours, strict=True):
        if width > 0:
            bars.append(
                f'<div title="{esc(label)} {fmt_pct(share)}" style="width:{100 * width:.2f}%;'
                f'background-color:{colour}"></div>'
            )
        if label != "Other" or share >= 0.005:
            legend.append((f"{label} {fmt_pct(share)}", colour, colour))
    split = parts_sentence(summary)
    caption = (
        f'<div class="tml-parts" style="margin-top:4px;font-size:11px;color:{MUTED}">'
        f"{with_code(split)}</div>"
        if split
        else ""
    )
    return (
        f'<div class="tml-bar" style="display:flex;height:14px;border-radius:4px;'
        f'overflow:hidden;background-color:#e9ecef">{"".join(bars)}</div>'
        + legend_html(legend)
        + caption
    )


def _also(result: RunResult) -> str:
    """The lines after the verdict: the rest of the step (its own verdict line), advice by the
    part that dominates, each epoch's start-up, the trend over the run (or that there is none)."""
    lines = render.lines_after_verdict(result)
    out = "".join(
        f'<div class="tml-also tml-{esc(severity)}" style="margin-top:6px;padding:6px 10px;'
        f"border-radius:6px;color:{SEVERITY[severity][0]};background-color:{SEVERITY[severity][1]}\">"
        f"{with_code(text)}</div>"
        for severity, text in lines
    )
    found = result.summary.get("trend")
    if found and not found.get("direction"):
        out += (
            f'<div class="tml-trend" style="margin-top:6px;font-size:11px;color:{MUTED}">Over the run: '
            f"no trend (median step {ms_fine(found['first_ms'])} in the first third of the analysed "
            f"steps, {ms_fine(found['last_ms'])} in the last; noise ±{100 * found['noise']:.1f} %)</div>"
        )
    return out


def _item_row(item: Item) -> str:
    colour, background = BADGE.get(item.status, BADGE[CHECK])
    change = value_html(item.seen)
    if item.to_try:
        change += f" &rarr; {value_html(item.to_try, strong=True)}"
    where = ""
    if item.site is not None:
        where = (
            f'<span class="tml-where" style="margin-left:8px;padding:0 6px;border-radius:4px;'
            f'border:1px solid {BORDER};font-size:11px;color:{MUTED};white-space:nowrap">'
            f"{esc(item.site.label())}</span>"
        )
    return (
        f'<div class="tml-item tml-item-{esc(item.key)} tml-{esc(item.status)}" style="display:flex;'
        f'padding:6px 0;border-top:1px solid {BORDER}">'
        f'<div style="flex-shrink:0;width:62px">{badge(item.status, colour, background)}</div>'
        f'<div style="min-width:0;flex-grow:1">'
        f'<div><b>{esc(item.title)}</b></div>'
        f'<div style="margin-top:2px">{change}{where}</div>'
        f'<div style="margin-top:2px;color:{MUTED};font-size:12px">{with_code(item.reason)}</div>'
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


def _notes(result: RunResult, problem: str | None = None) -> str:
    out = ""
    if result.error:
        colour, background = SEVERITY["critical"]
        out += (
            f'<div class="tml-error" style="margin-top:12px;padding:6px 10px;border-radius:6px;'
            f'color:{colour};background-color:{background}">'
            f"<b>Stopped by:</b> {esc(result.error)} (the numbers cover the steps before it)</div>"
        )
    notes_seen = list(result.notes) + ([problem] if problem else [])
    if notes_seen:
        notes = "".join(f'<li style="margin:2px 0">{esc(n)}</li>' for n in notes_seen)
        out += f'<ul class="tml-notes" style="margin:10px 0 0 0;padding-left:18px">{notes}</ul>'
    return out


def _text_box(result: RunResult) -> str:
    return (
        f'<details class="tml-text" style="margin-top:12px"><summary style="cursor:pointer;'
        f'color:{MUTED};font-size:12px">Text report</summary>'
        f'<pre style="font-family:{MONO};font-size:11px;line-height:1.4;overflow-x:auto;'
        f"margin:6px 0 0 0;padding:8px;border:1px solid {BORDER};border-radius:6px;"
        f'background-color:{SUBTLE};color:{FG}">{esc(render.text(result))}</pre></details>'
    )


def _header(result: RunResult) -> str:
    bits = [f"{result.n_steps} steps"]
    if result.loop.line is not None:
        bits.append(f"loop on line {result.loop.line}")
    if result.loop.where and result.loop.where != "this cell":
        bits.append(result.loop.where)
    return (
        f'<div style="display:flex;flex-wrap:wrap;align-items:baseline;margin-bottom:8px">'
        f'<span style="font-weight:700;font-size:14px;margin-right:10px">traceml</span>'
        f'<span style="color:{MUTED}">{esc(result.name)} &middot; {esc(" · ".join(bits))}</span>'
        f'<span class="tml-step-definition" style="color:{MUTED};margin-left:10px">'
        f"({with_code(result.steps.definition)})</span></div>"
    )


def _phases(result: RunResult) -> str:
    """The passes kept out of the steps (validation, test, eval): their share of the cell and
    their own data wait, and a line of their own when they are what makes the cell slow."""
    if not result.data.phases:
        return ""
    rows = "".join(
        f'<li class="tml-phase" style="margin:2px 0">{with_code(phase_sentence(p))}</li>'
        for p in result.data.phases
    )
    out = section_title("Kept out of the steps") + (
        f'<ul class="tml-phases" style="margin:0;padding-left:18px">{rows}</ul>'
    )
    slow = phase_verdict(result.data.phases)
    if slow:
        colour, background = SEVERITY["warn"]
        out += (
            f'<div class="tml-phase-verdict" style="margin-top:6px;padding:6px 10px;border-radius:6px;'
            f'color:{colour};background-color:{background}">{with_code(slow)}</div>'
        )
    return out


def report_html(run: FinishedRun, checklist: Sequence[Item] | None = None) -> str:
    """The report of a finished run, of this kernel or read back from its file: its result
    rendered with what the kernel reads for it (the code around it; the checklist, `checklist`
    when given, else the one the file saved, else evaluated now)."""
    return render_html(run.result, kernel_reading(run, checklist))


def render_html(result: RunResult, reading: KernelReading | None = None) -> str:
    """The report of `result` as one self-contained HTML fragment: inline styles only, no
    script, no external asset, so it reads the same after a reload, on nbviewer, GitHub and
    Kaggle. `reading` is what the kernel read for it (kernel_reading); without it, the
    checklist the result holds and no code beyond the result's."""
    if reading is None:
        reading = KernelReading(CodeContext(), [Item.from_dict(item) for item in result.reading.checklist or []])
    items = reading.checklist
    left = code_pane(result, reading.code, items)
    right = (
        _banner(result)
        + _tiles(result.summary)
        + _ranks(result)
        + section_title("What a step is made of (median shares)")
        + _step_bar(result.summary)
        + _also(result)
        + compile_section(result)
        + _phases(result)
        + _resources(result)
        + loader_inside_html(result)
        + section_title("Evidence")
        + evidence_table(result, reading.code)
        + section_title("Checklist")
        + _checklist(items)
        + _notes(result, reading.problem)
        + _text_box(result)
    )
    pane = "flex-grow:1;flex-shrink:1;min-width:0;margin:8px"
    return (
        f'<div class="{ROOT_CLASS}" style="font-family:{SANS};font-size:13px;line-height:1.45;'
        f"color:{FG};background-color:{BG};border:1px solid {BORDER};border-radius:8px;"
        f'padding:12px 14px;max-width:1400px;box-sizing:border-box;text-align:left">'
        f"{_header(result)}"
        f'<div style="display:flex;flex-wrap:wrap;align-items:flex-start;margin:-8px">'
        f'<div class="tml-code-pane" style="{pane};flex-basis:380px">{left}</div>'
        f'<div class="tml-result-pane" style="{pane};flex-basis:440px">{right}</div>'
        f"</div></div>"
    )


def _resource_figures(result: RunResult) -> str:
    """One line of the run's resource figures: GPU memory peak, CPU cores busy, RSS, workers."""
    s = result.summary
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


def _worker_rows(result: RunResult) -> str:
    host = result.resources.host
    workers = (host.get("workers") or []) if host else []
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
        f'<div class="tml-finding tml-{esc(f["severity"])}" style="margin-top:6px;padding:6px 10px;'
        f'border-left:4px solid {colour};border-radius:6px;background-color:{background}">'
        f'<b style="color:{colour}">{esc(f["label"])}</b>{where}'
        f'<div style="margin-top:2px">{with_code(text[:1].upper() + text[1:])}</div>'
        + (f'<div style="margin-top:2px"><b>Next</b> {with_code(str(f["next"]))}</div>' if f.get("next") else "")
        + "</div>"
    )


def _resources(result: RunResult) -> str:
    """Memory and CPU beside the time: the findings (with the lines to change), small plots
    of GPU memory per step, CPU cores busy and host memory, and the DataLoader workers."""
    from .resource_plots import cpu_svg, gpu_memory_svg, host_memory_svg

    s = result.summary
    host = result.resources.host
    samples = (host.get("samples") or {}) if host else {}
    plots = [
        gpu_memory_svg(result.columns, s.get("gpu_mem_capacity_mib")),
        cpu_svg(samples, host.get("usable_cores") if host else None),
        host_memory_svg(samples),
    ]
    plots = [p for p in plots if p]
    findings = "".join(_finding_row(f) for f in s.get("resource_findings") or [])
    figures = _resource_figures(result)
    if not (plots or findings or figures):
        return ""
    out = section_title("Resources")
    if figures:
        out += f'<div class="tml-resource-figures" style="color:{MUTED};font-size:12px">{esc(figures)}</div>'
    out += findings
    if plots:
        out += f'<div style="display:flex;flex-wrap:wrap;column-gap:12px;margin-top:6px">{"".join(plots)}</div>'
    out += _worker_rows(result)
    return f'<div class="tml-resources">{out}</div>'


def _ranks(result: RunResult) -> str:
    """Several processes: one row per rank (steps, medians per step, status), the rank that
    holds the others back highlighted, then what the numbers alone do not say."""
    if not result.ranks:
        return ""
    late = (result.straggler or {}).get("rank")
    num = CELL + ";text-align:right;white-space:nowrap"
    left = CELL + ";text-align:left"
    heads = ("rank", "steps", "data wait", "compute", "forward", "backward", "optimizer", "step time", "status")
    head = "".join(
        f'<th style="{left if i in (0, len(heads) - 1) else num};color:{MUTED};font-weight:600">{h}</th>'
        for i, h in enumerate(heads)
    )
    rows = [f'<tr style="{ROW}">{head}</tr>']
    colour, background = SEVERITY["critical"]
    for r in result.ranks:
        is_late = r.get("rank") == late
        style = f"background-color:{background}" if is_late else ROW
        name = f"rank {r.get('rank')}" + (" &larr; holds the others back" if is_late else "")
        cells = "".join(
            f'<td style="{num}">{ms_fine(value)}</td>'
            for value in (
                r.get("data_wait_ms"), r.get("compute_ms"), r.get("forward_ms"),
                r.get("backward_ms"), r.get("optimizer_ms"), r.get("step_ms"),
            )
        )
        rows.append(
            f'<tr class="tml-rank{" tml-straggler" if is_late else ""}" style="{style}">'
            f'<td style="{left};{"color:" + colour + ";font-weight:600" if is_late else ""}">{name}</td>'
            f'<td style="{num}">{r.get("n_steps") or 0}</td>{cells}'
            f'<td style="{left}">{esc(r.get("status") or "finished")}</td></tr>'
        )
    table = f'<table class="tml-ranks" style="{TABLE}">{"".join(rows)}</table>'
    notes = result.summary.get("rank_notes") or []
    listed = "".join(f'<li style="margin:2px 0">{esc(n)}</li>' for n in notes)
    more = f'<ul class="tml-rank-notes" style="margin:6px 0 0 0;padding-left:18px">{listed}</ul>' if notes else ""
    return section_title("Ranks (median per step)") + table + more
