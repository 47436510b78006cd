"""The report's "Inside the DataLoader" part (docs/loader-inside.md): the findings with their
fix, the loop's wait split, a table per worker, the slowest samples, and the lane picture — one
lane per worker, each batch a bar split into `__getitem__`, `collate_fn` and the wait until the
loop received it (inline SVG, inline styles only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..analysis.loader_inside import (
    Finding,
    LaneBar,
    LoaderInside,
    findings,
    stop_findings,
    wait_split,
)
from .report_style import (
    BORDER,
    CELL,
    MUTED,
    ROW,
    SEVERITY,
    TABLE,
    WAIT_COLOUR,
    esc,
    section_title,
    with_code,
)

if TYPE_CHECKING:
    from ..result import RunResult

GETITEM_COLOUR, COLLATE_COLOUR, HANDOVER_COLOUR = "#f08c00", "#ae3ec9", "#ced4da"
LANE_H, WIDTH, LEFT = 14, 560, 64


def loader_inside_html(result: RunResult) -> str:
    """The part, or "" when no worker was watched."""
    inside = result.data.inside
    if not inside or not (inside.get("batches") or inside.get("stopped")):
        return ""
    out = section_title("Inside the DataLoader")
    out += "".join(_finding(f, "critical", "tml-inside-stopped") for f in stop_findings(inside))
    out += "".join(_finding(f, "warn", "tml-inside-finding") for f in findings(inside))
    split = wait_split(inside)
    if split:
        out += f'<div class="tml-inside-wait" style="margin-top:6px">{esc(split[:1].upper() + split[1:])}.</div>'
    if inside.get("workers"):
        out += _worker_table(inside)
    out += lanes_svg(inside.get("lanes") or [], inside.get("waits") or [])
    return f'<div class="tml-inside">{out}</div>'


def _finding(f: Finding, severity: str, kind: str) -> str:
    colour, background = SEVERITY[severity]
    return (
        f'<div class="{kind}" style="margin-top:6px;padding:6px 10px;border-left:4px solid {colour};'
        f'border-radius:6px;background-color:{background}"><b style="color:{colour}">{esc(f["label"])}</b>'
        f'<div style="margin-top:2px">{with_code(f["text"])}</div>'
        f'<div style="margin-top:2px"><b>Next</b> {with_code(f["fix"])}</div></div>'
    )


def _worker_table(inside: LoaderInside) -> str:
    num = CELL + ";text-align:right;white-space:nowrap"
    heads = ("worker", "pid", "batches", "items", "__getitem__ a batch", "collate a batch", "a batch", "busy")
    head = "".join(f'<th style="{num};color:{MUTED};font-weight:600">{h}</th>' for h in heads)
    rows = [f'<tr style="{ROW}">{head}</tr>']
    for w in (inside.get("workers") or [])[:16]:
        cells = (w["worker"], w["pid"], w["batches"], w["items"], f"{w['getitem_ms']:.1f} ms", f"{w['collate_ms']:.1f} ms",
                 f"{w['batch_ms']:.1f} ms", f"{w['busy_ms']:.0f} ms")  # fmt: skip
        rows.append(f'<tr style="{ROW}">' + "".join(f'<td style="{num}">{c}</td>' for c in cells) + "</tr>")
    slow = inside.get("slow_samples") or []
    note = ""
    if slow:
        shown = ", ".join(f"{s['index']} ({s['ms']:.1f} ms, worker {s['worker']})" for s in slow[:6])
        note = f'<div class="tml-inside-slowest" style="color:{MUTED};font-size:12px">Slowest samples: {esc(shown)}</div>'
    return f'<table class="tml-inside-workers" style="{TABLE};margin-top:6px">{"".join(rows)}</table>{note}'


def lanes_svg(bars: list[LaneBar], waits: list[list[float]]) -> str:
    """One lane per worker, each batch a bar: __getitem__, collate, then until received; the
    loop's waits for its batches beneath."""
    if not bars:
        return ""
    workers = sorted({b["worker"] for b in bars})
    t0 = min(b["start_ms"] for b in bars)
    t1 = max(max(b["end_ms"], b["received_ms"] or b["end_ms"]) for b in bars)
    scale = (WIDTH - LEFT - 4) / max(t1 - t0, 1e-3)
    lane = {w: i for i, w in enumerate(workers)}
    loop_y = LANE_H * len(workers) + 2
    height = LANE_H * (len(workers) + 1) + 18

    def x(t: float) -> float:
        return LEFT + (t - t0) * scale

    parts = [f'<text x="0" y="{LANE_H * i + 11}" font-size="10" fill="{MUTED}">worker {w}</text>' for w, i in lane.items()]
    for b in bars:
        y = LANE_H * lane[b["worker"]] + 2
        spans = [(b["start_ms"], b["collate_ms"], GETITEM_COLOUR), (b["collate_ms"], b["end_ms"], COLLATE_COLOUR)]
        if b["received_ms"] is not None:
            spans.append((b["end_ms"], b["received_ms"], HANDOVER_COLOUR))
        for a, z, fill in spans:
            if z > a:
                parts.append(f'<rect x="{x(a):.1f}" y="{y}" width="{max((z - a) * scale, 0.5):.1f}" height="{LANE_H - 4}" fill="{fill}"/>')
    parts.append(f'<text x="0" y="{loop_y + 9}" font-size="10" fill="{MUTED}">loop waits</text>')
    for asked, got in waits:
        a, z = max(asked, t0), min(got, t1)  # (the first wait starts with the workers' start-up)
        if z > a:
            parts.append(f'<rect x="{x(a):.1f}" y="{loop_y}" width="{max((z - a) * scale, 0.5):.1f}" '
                         f'height="{LANE_H - 4}" fill="{WAIT_COLOUR}"/>')
    axis = LANE_H * (len(workers) + 1) + 14
    parts.append(f'<text x="{LEFT}" y="{axis}" font-size="10" fill="{MUTED}">{t0:.0f} ms</text>')
    parts.append(f'<text x="{WIDTH - 4}" y="{axis}" font-size="10" fill="{MUTED}" text-anchor="end">{t1:.0f} ms from the cell\'s start</text>')
    legend = (
        f'<div style="color:{MUTED};font-size:11px"><span style="color:{GETITEM_COLOUR}">■</span> __getitem__ '
        f'<span style="color:{COLLATE_COLOUR}">■</span> collate_fn <span style="color:{HANDOVER_COLOUR}">■</span> '
        f'ready, until the loop received it <span style="color:{WAIT_COLOUR}">■</span> the loop waiting for a batch</div>'
    )
    svg = (
        f'<svg class="tml-inside-lanes" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        f'xmlns="http://www.w3.org/2000/svg" style="border-bottom:1px solid {BORDER};margin-top:6px">{"".join(parts)}</svg>'
    )
    return svg + legend
