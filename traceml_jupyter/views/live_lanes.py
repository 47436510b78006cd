"""The live chart's lanes inside the DataLoader (docs/loader-inside.md#live-lanes): while a
traced cell's loader with workers runs, one lane per worker under the steps' chart, each batch
a bar split into `__getitem__`, `collate_fn` and ready-until-received, the loop's waits for a
batch beneath — the report's picture, growing as the run goes. The lanes are read by the
capture (capture/loader/lanes.py, through `LaneFeed`); this module only draws them: one bqplot
Lines mark (a row per stage, NaN between bars), so a redraw is one update message, and its
size is bounded by what the feed keeps (its newest batches a lane)."""

from __future__ import annotations

import html
from typing import Any, Protocol

import numpy as np

from ..analysis.loader_inside import LaneBar
from .live_svg import WAIT_COLOUR
from .report_loader import COLLATE_COLOUR, GETITEM_COLOUR, HANDOVER_COLOUR, lanes_svg

STAGES = ("__getitem__", "collate_fn", "ready, until the loop received it", "the loop waiting for a batch")
COLOURS = [GETITEM_COLOUR, COLLATE_COLOUR, HANDOVER_COLOUR, WAIT_COLOUR]
LANE_PX = 24  # a lane's height
BAR_PX = 14.0  # a bar's thickness (the lines' stroke)
LOOP_LANE = -1.0  # the loop's waits: the lane beneath the workers'


class LaneFeed(Protocol):
    """The lanes as the capture reads them (capture/loader/lanes.LiveLanes)."""

    def read(self) -> int:
        """Read what is new since the last read; the records read."""
    def counts(self) -> dict[int, tuple[int, float]]:
        """Per worker id: its batches so far and their mean ms."""
    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """The bars to draw (worker, start, collate, end, received; ms) and the loop's waits."""


def lane_lines(bars: np.ndarray, waits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x and y of the lanes' Lines mark: a row per stage (STAGES), each bar two points and a
    NaN (a gap), the rows NaN-padded to one length. Worker k's lane at y = k, the loop's waits
    at LOOP_LANE."""
    lane = bars[:, 0]
    rows = []
    for a, z in ((bars[:, 1], bars[:, 2]), (bars[:, 2], bars[:, 3]), (bars[:, 3], bars[:, 4])):
        shown = z > a  # (NaN, not received yet: not shown)
        rows.append((_segments(a[shown], z[shown]), _segments(lane[shown], lane[shown])))
    at = np.full(len(waits), LOOP_LANE)
    rows.append((_segments(waits[:, 0], waits[:, 1]), _segments(at, at)))
    width = max(1, *(len(x) for x, _ in rows))
    x, y = np.full((len(STAGES), width), np.nan), np.full((len(STAGES), width), np.nan)
    for i, (xr, yr) in enumerate(rows):
        x[i, : len(xr)], y[i, : len(yr)] = xr, yr
    return x, y


def _segments(a: np.ndarray, z: np.ndarray) -> np.ndarray:
    """a0, z0, NaN, a1, z1, NaN, ...: one segment per pair, a gap between them."""
    out = np.full(3 * len(a), np.nan)
    out[0::3], out[1::3] = a, z
    return out


def bars_per_lane(y: np.ndarray) -> dict[int, int]:
    """The bars the `__getitem__` row of `lane_lines` draws in each lane, by worker id: what a
    test reads back off the chart's update messages."""
    row = y[0][np.isfinite(y[0])]
    places, points = np.unique(row, return_counts=True)
    return {int(p): int(n) // 2 for p, n in zip(places, points, strict=True)}


def lanes_line(counts: dict[int, tuple[int, float]]) -> str:
    """The header's line under the steps' figures: each worker's batches so far and ms a batch."""
    if not counts:
        return ""
    parts = [f"worker {w}: {n:,} batches, {ms:.1f} ms a batch" for w, (n, ms) in counts.items()]
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {html.escape(s)}' for c, s in zip(COLOURS, STAGES, strict=True))
    return (
        '<div class="traceml-live-lanes" style="font-size:12px;color:#555">Inside the DataLoader (lanes below): '
        f"{html.escape('; '.join(parts))}<br>{legend}</div>"
    )


class LanesFigure:
    """The lanes' bqplot figure: one Lines mark, x fitted in the browser, a lane per worker."""

    def __init__(self, y_side: dict[str, str], bars: np.ndarray, waits: np.ndarray) -> None:
        """`y_side`: the y axis's side as this bqplot spells it (live.vertical_axis); the
        figure made with its first lanes (bqplot's Lines fails in the browser when made empty)."""
        import ipywidgets as widgets
        from bqplot import Axis, Figure, LinearScale, Lines

        self.x, self.y = LinearScale(), LinearScale(min=LOOP_LANE - 0.6, max=0.6)
        self.last: tuple[np.ndarray, np.ndarray] = bars, waits  # the bars and waits drawn last
        x, y = lane_lines(bars, waits)
        self.lines = Lines(
            x=x, y=y, scales={"x": self.x, "y": self.y}, colors=list(COLOURS), labels=list(STAGES), stroke_width=BAR_PX,
        )  # fmt: skip
        self.y_axis = Axis(scale=self.y, label="worker", tick_values=np.zeros(0), tick_format="d", **y_side)
        self.figure = Figure(
            marks=[self.lines],
            axes=[Axis(scale=self.x, label="ms from the cell's start", tick_format=".4~g"), self.y_axis],
            layout=widgets.Layout(width="100%", height=f"{self._height(1)}px"),
            fig_margin={"top": 6, "bottom": 36, "left": 60, "right": 30},
            animation_duration=0,
        )
        self.workers: list[int] = []
        self._fit(bars)

    @staticmethod
    def _height(lanes: int) -> int:
        return 48 + LANE_PX * (lanes + 1)

    def draw(self, bars: np.ndarray, waits: np.ndarray) -> None:
        """The lanes now: one update message (x and y together); the lanes' scale, ticks and
        height only when a worker's lane appeared."""
        self.last = bars, waits
        x, y = lane_lines(bars, waits)
        self._fit(bars)
        with self.lines.hold_sync():
            self.lines.x, self.lines.y = x, y

    def _fit(self, bars: np.ndarray) -> None:
        """The lanes' scale, ticks and height, when a worker's lane appeared."""
        workers = sorted(set(self.workers) | {int(w) for w in np.unique(bars[:, 0])})
        if workers and workers != self.workers:
            self.workers = workers
            self.y.max = workers[-1] + 0.6
            self.y_axis.tick_values = np.array(workers, dtype=np.float64)
            self.figure.layout.height = f"{self._height(workers[-1] + 1)}px"

    def picture(self) -> str:
        """The lanes drawn last as the report draws them (inline SVG): the static picture of a
        released chart keeps them."""
        bars, waits = self.last
        lanes = [
            LaneBar(worker=int(w), start_ms=a, collate_ms=c, end_ms=e, received_ms=None if np.isnan(r) else r)
            for w, a, c, e, r in bars.tolist()
        ]
        return '<div class="traceml-live-lanes-static">' + lanes_svg(lanes, waits.tolist()) + "</div>"

    def widgets(self) -> list[Any]:
        """Its widgets, for the chart's box."""
        return [self.figure]
