"""The report as one standalone HTML file (`--save report.html`, `run.save("x.html")`): the
chart of the whole run as an inline SVG above the report the notebook shows (report.py's own
renderer, the checklist as it was evaluated), in a page with no script and nothing fetched from
the network, so it opens the same in any browser, attached to a mail or an issue. A renderer of
the run's result, as the report is; `run.save` reads the kernel for it once (`html_page`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from html import escape
from typing import TYPE_CHECKING

import numpy as np

from ..analysis.checklist import Item
from ..kernel.code_facts import KernelReading, kernel_reading
from .live_svg import LEGEND_HTML, Overview, svg_chart
from .report import render_html
from .report_style import BORDER, FG, MUTED, SANS, SUBTLE

if TYPE_CHECKING:
    from ..kernel.cells import FinishedRun
    from ..result import RunResult

CHART_WIDTH, CHART_HEIGHT = 900, 150
MAX_POINTS = 600  # a longer run is drawn as the means of Overview's bins


def chart_html(result: RunResult) -> str:
    """Data wait under compute for every step of the run (on its clock), as an inline SVG with
    its caption; empty when fewer than two steps were timed."""
    columns = result.columns
    suffix = "_gpu_ms" if result.summary.get("clock") == "gpu" else "_ms"
    step = np.asarray(columns.get("step", ()), dtype=np.int64)
    wait = np.asarray(columns.get("data_wait" + suffix, ()), dtype=np.float64)
    compute = np.asarray(columns.get("compute" + suffix, ()), dtype=np.float64)
    if not len(step) or len(wait) != len(step) or len(compute) != len(step):
        return ""
    ok = np.isfinite(wait) & np.isfinite(compute)
    step, wait, compute = step[ok], wait[ok], compute[ok]
    if len(step) < 2:
        return ""
    compute_name = "GPU compute" if suffix == "_gpu_ms" else "CPU compute"
    caption = f"Data wait and {compute_name} of each of the {result.n_steps:,} steps"
    if len(step) > MAX_POINTS:
        overview = Overview()
        overview.add(step, wait, compute)
        _, wait, compute = overview.means()
        caption = (
            f"Data wait and {compute_name} over the {result.n_steps:,} steps "
            f"(mean of each {overview.width:,} steps)"
        )
    return (
        f'<div class="tml-file-chart" style="margin-bottom:12px;padding:10px 14px;'
        f"background-color:#ffffff;border:1px solid {BORDER};border-radius:8px;"
        f'max-width:1400px;box-sizing:border-box;overflow-x:auto">'
        f'<div style="font-size:13px;margin-bottom:6px;color:{FG}"><b>traceml</b> '
        f"{escape(result.name)} &middot; {escape(caption)} &middot; {LEGEND_HTML}</div>"
        f"{svg_chart(wait, compute, CHART_WIDTH, CHART_HEIGHT)}</div>"
    )


def _footer(result: RunResult) -> str:
    machine: Mapping[str, object] = result.machine or {}
    bits = []
    if result.started_at == result.started_at:  # NaN: the file did not say
        bits.append("run started " + time.strftime("%Y-%m-%d %H:%M", time.localtime(result.started_at)))
    for key, label in (("python", "Python"), ("torch", "torch"), ("cpu", ""), ("gpu", "")):
        if machine.get(key):
            bits.append(f"{label} {machine[key]}".strip())
    if machine.get("cpus"):
        bits.append(f"{machine['cpus']} usable CPUs")
    made = f"traceml_jupyter {machine['traceml_jupyter']}" if machine.get("traceml_jupyter") else "traceml_jupyter"
    return (
        f'<div class="tml-file-footer" style="margin-top:10px;font-size:11px;color:{MUTED}">'
        f"Saved by {escape(made)}: {escape(' · '.join(bits))}</div>"
    )


def html_page(run: FinishedRun) -> str:
    """The page `run.save("x.html")` writes: the run's result, with what the kernel reads for
    it (the checklist as it was shown, when it was; else evaluated now)."""
    saved = run.result.reading.checklist
    items = [Item.from_dict(item) for item in saved] if saved is not None else None
    return report_page(run.result, kernel_reading(run, items))


def report_page(result: RunResult, reading: KernelReading | None = None) -> str:
    """The whole page: the chart, the report (report.render_html, with the kernel's `reading`),
    a footer with what the run ran on."""
    title = f"traceml: {result.name} - {result.verdict.label}"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title></head>"
        f'<body style="margin:0;padding:16px;font-family:{SANS};background-color:{SUBTLE};'
        f'color:{FG}">'
        f'<div class="traceml-file" style="max-width:1400px;margin:0 auto">'
        f"{chart_html(result)}{render_html(result, reading)}{_footer(result)}</div></body></html>\n"
    )


def write_report_file(run: FinishedRun, path: str) -> None:
    """Write the run's report page (html_page) to `path`."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(html_page(run))

