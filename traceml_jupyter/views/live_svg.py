"""The live chart as static pictures (SVG and HTML, no widget): the rolling window of data wait
and compute, the overview strip, the ranks' lines; what a finished or widget-less chart shows."""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import numpy as np

WINDOW = 300  # steps in the rolling chart
OVERVIEW_BINS = 128  # bins of the overview strip over the whole run
WAIT_COLOUR = "#f28e2b"  # warm: the loop waits for data
COMPUTE_COLOUR = "#4e79a7"  # cool: the loop body runs
# The parts of sampled steps, stacked under the rest of compute (all of it on other steps).
PART_COLOURS = ("#76b7b2", "#59a14f", "#b07aa1")  # forward, backward, optimizer
WINDOW_ROWS = ("data wait", "forward", "backward", "optimizer", "compute")
RANK_COLOURS = ("#4e79a7", "#59a14f", "#9c755f", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#bab0ac")
STRAGGLER_COLOUR = "#c0392b"
WAIT_OPACITY = 0.45


def rank_lines(feed: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, list[str], list[float], list[str]]:
    """x, y (one row per line, NaN-padded), colours, opacities and labels: for each rank its
    step time, then its data wait (paler, same colour); the straggler in red."""
    series = list(feed["series"])
    width = max((len(s["step"]) for s in series), default=0)
    xs, ys, colours, opacities, labels = [], [], [], [], []
    for i, s in enumerate(series):
        colour = STRAGGLER_COLOUR if s["rank"] == feed.get("slowest") else RANK_COLOURS[i % len(RANK_COLOURS)]
        for column, opacity, what in (("step_ms", 1.0, "step"), ("data_wait_ms", WAIT_OPACITY, "data wait")):
            x = np.full(width, np.nan)
            y = np.full(width, np.nan)
            n = len(s["step"])
            x[:n] = np.asarray(s["step"], dtype=np.float64)
            y[:n] = np.asarray(s[column], dtype=np.float64)
            xs.append(x)
            ys.append(y)
            colours.append(colour)
            opacities.append(opacity)
            labels.append(f"rank {s['rank']} {what}")
    if not xs:
        return np.zeros((0, 0)), np.zeros((0, 0)), [], [], []
    return np.vstack(xs), np.vstack(ys), colours, opacities, labels


def rank_svg(feed: Mapping[str, Any], width: int = 640, height: int = 170) -> str:
    """The per-rank chart as a small inline SVG (front-ends without widgets, and the static
    picture of a finished chart): step time per rank, data wait paler, the straggler in red."""
    x, y, colours, opacities, labels = rank_lines(feed)
    if not x.size or not np.isfinite(y).any():
        return ""
    left, bottom, top = 44.0, 18.0, 8.0
    x0, x1 = float(np.nanmin(x)), float(np.nanmax(x))
    peak = float(np.nanmax(y)) or 1.0
    span = (x1 - x0) or 1.0

    def px(a: np.ndarray) -> np.ndarray:
        return left + (a - x0) / span * (width - left - 8.0)

    def py(a: np.ndarray) -> np.ndarray:
        return height - bottom - a / peak * (height - bottom - top)

    parts = []
    for row in range(len(labels)):
        ok = np.isfinite(x[row]) & np.isfinite(y[row])
        if ok.sum() < 2:
            continue
        points = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px(x[row][ok]), py(y[row][ok]), strict=True))
        parts.append(
            f'<polyline fill="none" stroke="{colours[row]}" stroke-opacity="{opacities[row]}" '
            f'stroke-width="1.5" points="{points}"><title>{html.escape(labels[row])}</title></polyline>'
        )
    legend = "".join(
        f'<text x="{left + 6 + 150 * (i // 2)}" y="{top + 10 + 12 * (i % 2)}" font-size="10" '
        f'fill="{colours[i]}" fill-opacity="{max(opacities[i], 0.7)}">{html.escape(labels[i])}</text>'
        for i in range(len(labels))
    )
    axes = (
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - 8}" y2="{height - bottom}" stroke="#999"/>'
        f'<text x="2" y="{top + 8}" font-size="10" fill="#555">{peak:.3g} ms</text>'
        f'<text x="2" y="{height - bottom}" font-size="10" fill="#555">0</text>'
        f'<text x="{left}" y="{height - 4}" font-size="10" fill="#555">step {x0:.0f}</text>'
        f'<text x="{width - 60}" y="{height - 4}" font-size="10" fill="#555">step {x1:.0f}</text>'
    )
    return (
        f'<svg class="traceml-rank-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'xmlns="http://www.w3.org/2000/svg" style="display:block">' + axes + "".join(parts) + legend + "</svg>"
    )


LEGEND_HTML = (
    f'<span style="color:{WAIT_COLOUR}">&#9632;</span> data wait '
    f'<span style="color:{PART_COLOURS[0]}">&#9632;</span> forward '
    f'<span style="color:{PART_COLOURS[1]}">&#9632;</span> backward '
    f'<span style="color:{PART_COLOURS[2]}">&#9632;</span> optimizer '
    f'<span style="color:{COMPUTE_COLOUR}">&#9632;</span> compute (the rest)'
)


def window_rows(wait: np.ndarray, compute: np.ndarray, parts: dict[str, np.ndarray] | None) -> np.ndarray:
    """The window's stacked rows (WINDOW_ROWS): data wait, forward, backward and optimizer of
    sampled steps (0 elsewhere), and the rest of compute (all of it on steps not sampled)."""
    n = len(wait)
    split = [np.zeros(n)] * 3
    if parts is not None:
        split = [np.nan_to_num(np.asarray(parts[k], dtype=np.float64)[-n:]) for k in ("forward", "backward", "optimizer")]
    rest = np.maximum(np.asarray(compute, dtype=np.float64) - split[0] - split[1] - split[2], 0.0)
    return np.vstack([wait, *split, rest])


def window_parts(run: object, cols: Mapping[str, np.ndarray], on_gpu: bool) -> dict[str, np.ndarray] | None:
    """The parts of the window's steps on its clock (None: the run has no parts)."""
    parts = getattr(run, "step_parts", None)
    if parts is None or not len(cols["step"]):
        return None
    got = parts.columns(dict(cols))
    suffix = "_gpu_ms" if on_gpu else "_ms"
    return {k: got[k + suffix] for k in ("forward", "backward", "optimizer") if k + suffix in got}


def waiting_html(name: str) -> str:
    """The header shown before the first step: "traceml NAME: waiting for the first step"."""
    return (
        '<div class="traceml-live-header" style="font-size:13px">'
        f"<b>traceml</b> {html.escape(name)}: waiting for the first step&hellip;</div>"
    )


class Overview:
    """The whole run in at most OVERVIEW_BINS bins of equal width (a power of two of steps):
    mean data wait and compute per bin, accumulated from the steps each refresh adds."""

    def __init__(self, bins: int = OVERVIEW_BINS) -> None:
        self.bins = bins
        self.width = 1
        self.count = np.zeros(bins)
        self.wait = np.zeros(bins)
        self.compute = np.zeros(bins)

    def add(self, step: np.ndarray, wait: np.ndarray, compute: np.ndarray) -> None:
        """Add steps in order. Where the recorder kept one step in k (very long runs), a row
        stands for the steps up to the next row, and counts that many times."""
        if not len(step):
            return
        while int(step[-1]) // self.width >= self.bins:
            self.width *= 2
            for values in (self.count, self.wait, self.compute):
                merged = values.reshape(-1, 2).sum(axis=1)
                values[:] = 0.0
                values[: len(merged)] = merged
        weight = np.diff(step, append=step[-1] + 1).astype(np.float64)
        ok = np.isfinite(wait) & np.isfinite(compute)
        index = (step[ok] // self.width).astype(np.int64)
        weight = weight[ok]
        size = self.bins
        self.count += np.bincount(index, weights=weight, minlength=size)[:size]
        self.wait += np.bincount(index, weights=wait[ok] * weight, minlength=size)[:size]
        self.compute += np.bincount(index, weights=compute[ok] * weight, minlength=size)[:size]

    def means(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bin centres (1-based steps), mean data wait and mean compute in ms, filled bins only."""
        used = self.count > 0
        centre = (np.flatnonzero(used) + 0.5) * self.width + 0.5
        n = self.count[used]
        return centre, self.wait[used] / n, self.compute[used] / n


def svg_chart(wait: np.ndarray, compute: np.ndarray, width: int = 640, height: int = 110) -> str:
    """Stacked areas (data wait under compute) as a small inline SVG, for front-ends without widgets."""
    n = len(wait)
    if n < 2:
        return ""
    top = wait + compute
    peak = float(np.nanmax(top)) or 1.0
    x = np.linspace(0.0, width, n)

    def points(upper: np.ndarray, lower: np.ndarray) -> str:
        ys = height - np.concatenate([upper, lower[::-1]]) / peak * (height - 4)
        xs = np.concatenate([x, x[::-1]])
        return " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(xs, ys, strict=True))

    zero = np.zeros(n)
    return (
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'xmlns="http://www.w3.org/2000/svg" style="display:block">'
        f'<polygon fill="{COMPUTE_COLOUR}" points="{points(top, wait)}"/>'
        f'<polygon fill="{WAIT_COLOUR}" points="{points(wait, zero)}"/>'
        f'<text x="4" y="12" font-size="11" fill="#333">max {peak:.3g} ms / step</text></svg>'
    )


def static_chart_html(header: str, window: np.ndarray, overview: np.ndarray) -> str:
    """A finished chart as inline HTML: its last header, then the window and the whole run
    (rows: data wait, compute) as small SVGs. Reads the same on GitHub and nbviewer."""
    parts = [header]
    if window.ndim == 2 and window.shape[1] >= 2:
        parts.append(svg_chart(window[0], window[1]))
    if overview.ndim == 2 and overview.shape[1] >= 2:
        parts.append(
            '<div style="font-size:11px;color:#555;margin-top:4px">whole run (mean per bin)</div>'
            + svg_chart(overview[0], overview[1], height=40)
        )
    parts.append(
        '<div style="font-size:11px;color:#777">Static picture of the finished live chart '
        "(its widgets were released: newer runs have the live ones).</div>"
    )
    return '<div class="traceml-live-static">' + "".join(parts) + "</div>"


def two_rows(rows: np.ndarray) -> np.ndarray:
    """The window's stacked rows as data wait and compute (the static picture's two colours)."""
    if rows.ndim == 2 and rows.shape[0] > 2:
        return np.vstack([rows[0], rows[1:].sum(axis=0)])
    return rows
