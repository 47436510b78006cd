"""The report's small resource plots as inline SVG (no script, no style element: they survive
JupyterLab's sanitizer, nbviewer and GitHub): GPU memory per step, CPU cores busy per second,
the process's and the workers' memory over time."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

WIDTH, HEIGHT = 420, 120
LEFT, RIGHT, TOP, BOTTOM = 60.0, 8.0, 16.0, 18.0
MUTED = "#57606a"
PEAK_COLOUR, ALLOC_COLOUR, RESERVED_COLOUR = "#c92a2a", "#1c7ed6", "#868e96"
PROCESS_COLOUR, WORKERS_COLOUR, MACHINE_COLOUR = "#1c7ed6", "#e8590c", "#868e96"
RSS_COLOUR, USS_COLOUR = "#6741d9", "#e8590c"
LIMIT_COLOUR = "#c92a2a"
MAX_POINTS = 400  # a plot draws at most this many points per line (evenly picked)


@dataclass(frozen=True)
class Line:
    """One line of a resource plot: its label, values (one per x), colour, an area under it, or
    dashed (what frames the run's own line: memory reserved, all processes)."""

    label: str
    values: np.ndarray
    colour: str
    fill: bool = False  # an area down to zero under the line
    dash: bool = False


def _thin(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(x) <= MAX_POINTS:
        return x, y
    pick = np.linspace(0, len(x) - 1, MAX_POINTS).astype(np.int64)
    return x[pick], y[pick]


def line_svg(
    title: str,
    x: np.ndarray,
    lines: Sequence[Line],
    unit: str,
    x_label: str,
    limits: Sequence[tuple[str, float]] = (),
    css_class: str = "tml-resource-plot",
) -> str:
    """Lines (and areas) over a shared x, with horizontal limit lines (capacity, usable cores)
    and a legend; "" when there is nothing to draw."""
    x = np.asarray(x, dtype=np.float64)
    series = [(ln, np.asarray(ln.values, dtype=np.float64)) for ln in lines]
    drawn = [(ln, v) for ln, v in series if int(np.isfinite(v).sum()) >= 2]
    if len(x) < 2 or not drawn:
        return ""
    finite_x = x[np.isfinite(x)]
    x0, x1 = float(finite_x.min()), float(finite_x.max())
    top = max([float(np.nanmax(v)) for _, v in drawn] + [value for _, value in limits])
    top = top * 1.05 if top > 0 else 1.0
    span = (x1 - x0) or 1.0

    def px(a: np.ndarray) -> np.ndarray:
        return LEFT + (a - x0) / span * (WIDTH - LEFT - RIGHT)

    def py(a: np.ndarray) -> np.ndarray:
        return HEIGHT - BOTTOM - a / top * (HEIGHT - BOTTOM - TOP)

    parts = []
    for ln, values in drawn:
        ok = np.isfinite(values) & np.isfinite(x)
        xs, ys = _thin(x[ok], values[ok])
        points = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px(xs), py(ys), strict=True))
        if ln.fill:
            base = f"{px(xs[-1:])[0]:.1f},{HEIGHT - BOTTOM:.1f} {px(xs[:1])[0]:.1f},{HEIGHT - BOTTOM:.1f}"
            parts.append(f'<polygon fill="{ln.colour}" fill-opacity="0.25" stroke="none" points="{points} {base}"/>')
        dash = ' stroke-dasharray="4 3"' if ln.dash else ""
        parts.append(
            f'<polyline fill="none" stroke="{ln.colour}" stroke-width="1.5"{dash} points="{points}">'
            f"<title>{html.escape(ln.label)}</title></polyline>"
        )
    for label, value in limits:
        y = float(py(np.array([value]))[0])
        parts.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="{LIMIT_COLOUR}" '
            f'stroke-dasharray="2 2"><title>{html.escape(label)}</title></line>'
            f'<text x="{WIDTH - RIGHT - 4}" y="{y - 2:.1f}" font-size="9" text-anchor="end" '
            f'fill="{LIMIT_COLOUR}">{html.escape(label)}</text>'
        )
    legend = "".join(
        f'<tspan fill="{ln.colour}" dx="{8 if i else 0}">&#9632; {html.escape(ln.label)}</tspan>'
        for i, (ln, _) in enumerate(drawn)
    )
    axes = (
        f'<text x="{LEFT}" y="11" font-size="10" font-weight="600" fill="#1f2328">{html.escape(title)}</text>'
        f'<text x="{WIDTH - RIGHT}" y="11" font-size="9" text-anchor="end">{legend}</text>'
        f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" stroke="#ced4da"/>'
        f'<text x="{LEFT - 4}" y="{TOP + 6}" font-size="9" text-anchor="end" fill="{MUTED}">{_tick(top, unit)}</text>'
        f'<text x="{LEFT - 4}" y="{HEIGHT - BOTTOM}" font-size="9" text-anchor="end" fill="{MUTED}">0</text>'
        f'<text x="{LEFT}" y="{HEIGHT - 5}" font-size="9" fill="{MUTED}">{html.escape(x_label)} {x0:,.0f}</text>'
        f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 5}" font-size="9" text-anchor="end" fill="{MUTED}">{x1:,.0f}</text>'
    )
    return (
        f'<svg class="{css_class}" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        'xmlns="http://www.w3.org/2000/svg" style="display:block;max-width:100%;margin:4px 0">'
        + axes
        + "".join(parts)
        + "</svg>"
    )


def _tick(value: float, unit: str) -> str:
    if unit == "MiB" and value >= 1024:
        return f"{value / 1024:.3g} GiB"
    return f"{value:.3g} {unit}"


def gpu_memory_svg(cols: Mapping[str, Any], capacity_mib: float | None) -> str:
    """GPU memory per step: the step's peak, allocated and reserved at its end; the device's
    capacity as a limit when the peak comes within half of it."""
    if "gpu_mem_peak_mib" not in cols:
        return ""
    peak = np.asarray(cols["gpu_mem_peak_mib"], dtype=np.float64)
    limits: list[tuple[str, float]] = []
    if capacity_mib and np.isfinite(peak).any() and float(np.nanmax(peak)) >= 0.5 * capacity_mib:
        limits.append((f"capacity {_tick(capacity_mib, 'MiB')}", float(capacity_mib)))
    return line_svg(
        "GPU memory per step",
        np.asarray(cols["step"], dtype=np.float64) + 1,
        [
            Line("reserved", np.asarray(cols["gpu_mem_reserved_mib"], dtype=np.float64), RESERVED_COLOUR, dash=True),
            Line("peak", peak, PEAK_COLOUR),
            Line("allocated at end", np.asarray(cols["gpu_mem_allocated_mib"], dtype=np.float64), ALLOC_COLOUR),
        ],
        "MiB",
        "step",
        limits,
    )


def cpu_svg(samples: Mapping[str, Any], usable: float | None) -> str:
    """Cores busy per sample (4 a second): the process and its workers (areas), every process
    on the usable CPUs (dashed), and the usable cores as the limit."""
    if "time_s" not in samples or len(samples["time_s"]) < 3:
        return ""
    proc = np.asarray(samples["process_cores"], dtype=np.float64)
    both = proc + np.asarray(samples["workers_cores"], dtype=np.float64)
    lines = [Line("process + workers", both, WORKERS_COLOUR, fill=True), Line("process", proc, PROCESS_COLOUR, fill=True)]
    machine = np.asarray(samples["machine_cores"], dtype=np.float64)
    if np.isfinite(machine).sum() >= 2:
        lines.append(Line("all processes", machine, MACHINE_COLOUR, dash=True))
    limits = [(f"{usable:g} usable cores", float(usable))] if usable else []
    return line_svg("CPU cores busy", np.asarray(samples["time_s"]), lines, "cores", "s", limits)


def host_memory_svg(samples: Mapping[str, Any]) -> str:
    """The process's RSS and the workers' private memory (USS, summed) over time."""
    if "time_s" not in samples or len(samples["time_s"]) < 3:
        return ""
    lines = [Line("process RSS", np.asarray(samples["process_rss_mib"], dtype=np.float64), RSS_COLOUR)]
    uss = np.asarray(samples["workers_uss_mib"], dtype=np.float64)
    if np.isfinite(uss).sum() >= 2:
        lines.append(Line("workers' private memory", uss, USS_COLOUR))
    return line_svg("Host memory", np.asarray(samples["time_s"]), lines, "MiB", "s")
