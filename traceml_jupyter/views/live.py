"""The live view of a traced cell: a header line and a bqplot chart of data wait vs compute per step.

A thin view over the Run: `start(run)` registers `view.refresh` as an observer (the step hook
calls it on the main thread at most 4 times a second, and once more when the run finishes).
Each refresh reads a bounded tail of the recorder and sends one batched update per widget it
changes. Without a widget front-end it becomes an updating HTML display, or nothing. Its final
state, once the run has finished, reads the run's result (the header's verdict, rate, time and
resources: live_header.py); the window's bars stay the recording's last steps (the result keeps
every stride-th step of a long run only).

Widgets are built only for runs that last past the first update (about a second), and only
the KEEP_LIVE_CHARTS newest finished runs keep them: an older chart is replaced in place by a
static picture of its final state and its widgets are closed, so a long session does not pile
them up.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

import numpy as np

from ..failures import never_raise
from ..kernel.shell import ipython_shell
from . import environment
from .live_header import (
    clock_columns,
    header_html,
    header_text,
    live_numbers,
    live_ranks,
    resources_text,
    with_ranks_live,
)
from .live_lanes import LanesFigure, lanes_line
from .live_svg import (
    COMPUTE_COLOUR,
    PART_COLOURS,
    WAIT_COLOUR,
    WINDOW,
    WINDOW_ROWS,
    Overview,
    rank_lines,
    rank_svg,
    static_chart_html,
    svg_chart,
    two_rows,
    waiting_html,
    window_parts,
    window_rows,
)
from .loop_passes import loops_around, passes_of

if TYPE_CHECKING:
    from .live_header import LiveRecording
    from .live_lanes import LaneFeed


# Each refresh (at most 4 a second) redraws one widget, so the view sends at most one comm
# message per refresh and 4 a second: the bars twice a second, the header 1.5 times, the
# overview strip every 2 s. The final refresh redraws all three.
ROTATION = ("header", "bars", "header", "bars", "header", "bars", "overview", "bars")
# With the lanes inside the DataLoader (a loader with workers): they take two of the turns.
LANES_ROTATION = ("header", "bars", "lanes", "bars", "header", "bars", "overview", "lanes")
MESSAGES_PER_S = 4.0  # chart updates a second of run, the final three included
FINAL_MESSAGES = 3
OVERVIEW_READ_CAP = 1 << 17  # most new steps read in one refresh for the overview
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# Finished runs whose chart stays made of live widgets (22 each); an older chart is replaced
# in place by a static picture of its final state and its widgets are closed.
KEEP_LIVE_CHARTS = 3


def widgets_under(root: Any) -> list[Any]:
    """Every widget reachable from `root` through its synced traits: children, marks, axes,
    scales, figures, layouts, styles (each one holds a comm until closed)."""
    from ipywidgets import Widget

    found: dict[int, Any] = {}
    stack = [root]
    while stack:
        widget = stack.pop()
        if id(widget) in found:
            continue
        found[id(widget)] = widget
        for name in widget.keys:
            value = getattr(widget, name, None)
            if isinstance(value, dict):  # a mark's scales
                value = list(value.values())
            values = value if isinstance(value, (list, tuple)) else [value]
            stack.extend(v for v in values if isinstance(v, Widget))
    return list(found.values())


class WidgetDisplay:
    """Displays a widget with a plain-text fallback (never "VBox(children=...)"), the same way
    under ipywidgets 7 and 8 (both speak version 2 of the widget view format)."""

    def __init__(self, widget: Any, text: str) -> None:
        self.widget = widget
        self.text = text

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {
            "text/plain": self.text,
            WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": self.widget.model_id},
        }


def vertical_axis() -> dict[str, str]:
    """A y axis on the left: `orientation` in bqplot 0.12 (ipywidgets 7), `side` alone in 0.13.
    Set at creation, so bqplot sends no update for it afterwards."""
    from bqplot import Axis

    if "orientation" in Axis.class_traits():
        return {"orientation": "vertical", "side": "left"}
    return {"side": "left"}


class WidgetChart:
    """Header (ipywidgets.HTML), a bqplot figure of the window, and a thin overview strip.

    Scales fit their data in the browser, so a refresh changes only the mark data and the
    header text: one update message per changed widget, x and y batched with hold_sync.
    """

    def __init__(self, run_name: str) -> None:
        import ipywidgets as widgets
        from bqplot import Axis, Bars, Figure, LinearScale

        self.header = widgets.HTML(value=waiting_html(run_name))
        x, y = LinearScale(), LinearScale(min=0.0)
        empty_x, empty_y = np.zeros(0), np.zeros((2, 0))
        self.bars = Bars(
            x=empty_x,
            y=np.zeros((len(WINDOW_ROWS), 0)),
            scales={"x": x, "y": y},
            type="stacked",
            colors=[WAIT_COLOUR, *PART_COLOURS, COMPUTE_COLOUR],
            labels=list(WINDOW_ROWS),
            padding=0.1,
        )
        self.figure = Figure(
            marks=[self.bars],
            axes=[
                Axis(scale=x, label="step", tick_format="d"),
                Axis(scale=y, label="ms per step", tick_format=".3~g", **vertical_axis()),
            ],
            layout=widgets.Layout(width="100%", height="240px"),
            fig_margin={"top": 10, "bottom": 40, "left": 60, "right": 30},
            animation_duration=0,
        )
        ox, oy = LinearScale(), LinearScale(min=0.0)
        self.overview_bars = Bars(
            x=empty_x,
            y=empty_y,
            scales={"x": ox, "y": oy},
            type="stacked",
            colors=[WAIT_COLOUR, COMPUTE_COLOUR],
            padding=0.0,
        )
        self.overview = Figure(
            marks=[self.overview_bars],
            axes=[Axis(scale=ox, tick_format="d", num_ticks=6)],
            title="whole run (mean per bin)",
            title_style={"font-size": "11px"},
            layout=widgets.Layout(width="100%", height="80px"),
            fig_margin={"top": 18, "bottom": 22, "left": 60, "right": 30},
            animation_duration=0,
        )
        self.box = widgets.VBox([self.header, self.figure, self.overview])
        self.handle: Any = None  # the display of the box, updated when the chart is released
        self.rank_lines: Any = None  # several processes: one line per rank in place of the bars
        self.rank_series: Mapping[str, Any] | None = None
        self.lanes: LanesFigure | None = None  # inside the DataLoader, once its workers wrote

    def show(self, text: str) -> Any:
        """What to display for the chart: its widgets, with `text` for front-ends without them."""
        return WidgetDisplay(self.box, text)

    def picture(self, text: str) -> HtmlStatus:
        """The chart as it is now, without widgets."""
        if self.rank_series is not None:
            body = str(self.header.value) + rank_svg(self.rank_series)
            return HtmlStatus(text, '<div class="traceml-live-static">' + body + "</div>")
        return HtmlStatus(
            text,
            static_chart_html(
                str(self.header.value),
                two_rows(np.asarray(self.bars.y, dtype=np.float64)),
                np.asarray(self.overview_bars.y, dtype=np.float64),
            )
            + (self.lanes.picture() if self.lanes is not None else ""),
        )

    def release(self, text: str) -> None:
        """Replace the displayed chart by its static picture, then close every widget of it."""
        try:
            if self.handle is not None:
                self.handle.update(self.picture(text))
        finally:
            for widget in widgets_under(self.box):
                widget.close()

    def draw_header(self, value: str) -> None:
        """Set the header's HTML (no message when it did not change)."""
        if self.header.value != value:
            self.header.value = value

    def draw_window(
        self, step: np.ndarray, wait: np.ndarray, compute: np.ndarray, parts: dict[str, np.ndarray] | None = None
    ) -> None:
        """Draw the window's steps: data wait under compute (or its parts), one message."""
        with self.bars.hold_sync():
            self.bars.x = step.astype(np.float64)
            self.bars.y = window_rows(wait, compute, parts)

    def draw_overview(self, centre: np.ndarray, wait: np.ndarray, compute: np.ndarray) -> None:
        """Draw the whole run's strip: the mean data wait and compute of each bin."""
        with self.overview_bars.hold_sync():
            self.overview_bars.x = centre
            self.overview_bars.y = np.vstack([wait, compute])

    def draw_lanes(self, bars: np.ndarray, waits: np.ndarray) -> None:
        """Draw the workers' lanes under the charts (the figure added the first time): one
        update message."""
        if self.lanes is None:
            self.lanes = LanesFigure(vertical_axis(), bars, waits)
            self.box.children = [*self.box.children, *self.lanes.widgets()]
        else:
            self.lanes.draw(bars, waits)

    def draw_ranks(self, feed: Mapping[str, Any]) -> None:
        """Several processes: each rank's step time (its data wait paler) in place of the bars,
        the rank that holds the others back in red; one update message."""
        from bqplot import Lines

        self.rank_series = feed
        x, y, colours, opacities, labels = rank_lines(feed)
        if self.rank_lines is None:
            self.rank_lines = Lines(
                x=x, y=y, scales=self.bars.scales, colors=colours, opacities=opacities,
                labels=labels, display_legend=True, stroke_width=1.5,
            )
            self.figure.marks = [self.rank_lines]
            return
        with self.rank_lines.hold_sync():
            self.rank_lines.x, self.rank_lines.y = x, y
            self.rank_lines.colors, self.rank_lines.opacities = colours, opacities
            self.rank_lines.labels = labels


class HtmlStatus:
    """The updating HTML display used where widgets cannot be drawn."""

    def __init__(self, text: str, body: str) -> None:
        self.text, self.body = text, body

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text, "text/html": self.body}


class HtmlChart:
    """Header and a small SVG of the window in one display, updated through its display handle."""

    def __init__(self, run_name: str) -> None:
        self.status = HtmlStatus(
            f"traceml {run_name}: waiting for the first step", waiting_html(run_name)
        )
        self.handle: Any = None
        self._header = ""
        self._svg = ""

    def show(self, text: str) -> Any:
        """What to display for the chart: its HTML status (header and SVG)."""
        return self.status

    def draw_header(self, value: str) -> None:
        """Keep the header's HTML for the next publish."""
        self._header = value

    def draw_window(
        self, step: np.ndarray, wait: np.ndarray, compute: np.ndarray, parts: dict[str, np.ndarray] | None = None
    ) -> None:
        """Keep an SVG of the window's data wait and compute for the next publish."""
        self._svg = svg_chart(wait, compute)

    def draw_overview(self, centre: np.ndarray, wait: np.ndarray, compute: np.ndarray) -> None:
        """Nothing: the HTML chart has no overview strip."""
        pass

    def draw_ranks(self, feed: Mapping[str, Any]) -> None:
        """Keep an SVG of each rank's step time for the next publish."""
        self._svg = rank_svg(feed)

    def publish(self, text: str) -> None:
        """Update the displayed chart with the header and SVG kept."""
        self.status = HtmlStatus(text, self._header + self._svg)
        if self.handle is not None:
            self.handle.update(self.status)


class LiveView:
    """Refreshed by the run (observer); `close()` ends it, leaving the last picture displayed."""

    def __init__(
        self,
        run: LiveRecording,
        chart: WidgetChart | HtmlChart | None,
        shell: Any = None,
        widgets: bool = False,
    ) -> None:
        self.run = run
        self.chart = chart
        self.shell = shell
        # A widget front-end: the HTML chart becomes the bqplot chart at the first update
        # (about a second in). Shorter runs never build widgets: their final picture is HTML.
        self.widgets_wanted = widgets
        self.overview = Overview()
        self.refreshes = 0  # refreshes done (the final one included)
        self.refresh_ns = 0  # time spent refreshing, for the overhead benchmark
        self.final_done = False
        self.closed = False
        self._seen = 0
        self._overview_of: Any = run.recorder  # the recorder the overview has read
        self._loops: list[ast.For] | None = None
        self._loops_parsed = False
        self._passes: int | None = None
        self.lane_counts: dict[int, tuple[int, float]] = {}  # the lanes' batches so far, per worker

    def display(self) -> None:
        """Show the chart under the cell (nothing without a front-end)."""
        if self.chart is None:
            return
        from IPython.display import display as ipython_display

        display: Any = ipython_display  # untyped in IPython
        self.chart.handle = display(self.chart.show(self._text()), display_id=True)

    def _text(self) -> str:
        return f"traceml {self.run.name}: live chart (shown by notebook front-ends with widgets)"

    def _become_widgets(self) -> None:
        """Swap the HTML chart for the bqplot chart, in the same output (a display update)."""
        self.widgets_wanted = False
        html = self.chart
        if not isinstance(html, HtmlChart) or html.handle is None:
            return
        try:
            chart = WidgetChart(self.run.name)
        except ImportError:  # no bqplot: the HTML chart goes on
            return
        chart.handle = html.handle
        self.chart = chart  # from now on released (and its widgets closed) like any chart
        chart.handle.update(chart.show(self._text()))

    # -- numbers the header needs ----------------------------------------------------------
    def _total(self) -> tuple[int | None, tuple[int, int, int] | None]:
        """Expected steps of the whole run (per pass x passes), else the position in this pass."""
        run = self.run
        per_pass = run.expected_steps
        if not per_pass:
            return None, None
        if self._passes is None and run.loop_where == "this cell":
            if not self._loops_parsed:
                self._loops = loops_around(run.cell_source, run.loop_line)
                self._loops_parsed = True
            names = getattr(self.shell, "user_ns", None) or {}
            self._passes = passes_of(self._loops, names)
        if self._passes and per_pass * self._passes >= run.n_steps:
            return per_pass * self._passes, None
        started = max(1, run.loops_started)
        in_pass = run.n_steps - (started - 1) * per_pass
        if not 0 <= in_pass <= per_pass:
            return None, None
        return None, (in_pass, per_pass, started)

    def _gpu_text(self) -> str:
        """GPU, CPU and memory for the header, read from what capture samples (never sampled
        here): the run's resource watch while it runs, what the run kept once it ended."""
        return resources_text(self.run)

    # -- the observer ----------------------------------------------------------------------
    def refresh(self, run: LiveRecording | None = None) -> None:
        """The run's observer: draw the steps so far (within the update budget), or the final
        state once the run has finished (its header read off the result)."""
        if self.closed or self.final_done:
            return
        began = perf_counter_ns()
        run = self.run
        final = run.finished
        if not final:
            if self.chart is not None and not self._within_budget(began):
                return  # a refresh skipped costs nothing: the next tick tries again
            if self.widgets_wanted:
                self._become_widgets()
        if self.chart is not None:
            self._draw(final)
        self.refreshes += 1
        self.final_done = final
        self.refresh_ns += perf_counter_ns() - began

    def _within_budget(self, now_ns: int) -> bool:
        """One more update keeps the run at most MESSAGES_PER_S a second, with room kept for
        the final refresh (so the first update comes about a second into the run)."""
        origin = self.run.recorder.origin_ns or now_ns
        allowed = MESSAGES_PER_S * (now_ns - origin) / 1e9
        return self.refreshes + 1 + FINAL_MESSAGES + bool(self.lane_counts) <= allowed

    def _lanes(self, final: bool) -> LaneFeed | None:
        """The lanes inside the DataLoader to draw (None: no widget chart, or no worker of a
        watched loader wrote yet: nothing changes), read up to now on the turns that show them
        (the lanes, the header's counts) and until the first worker wrote."""
        feed: LaneFeed | None = self.run.loader_lanes
        if feed is None or not isinstance(self.chart, WidgetChart):
            return None
        if final or not self.lane_counts or LANES_ROTATION[self.refreshes % len(LANES_ROTATION)] in ("lanes", "header"):
            feed.read()
            self.lane_counts = feed.counts()
        return feed if self.lane_counts else None

    def _draw(self, final: bool) -> None:
        chart, run = self.chart, self.run
        assert chart is not None
        recorder = run.recorder
        if recorder is not self._overview_of:  # several ranks: the run now shows another rank
            self.overview, self._seen, self._overview_of = Overview(), 0, recorder
        ranks = live_ranks(run)
        new = recorder.n_steps - self._seen
        fresh = recorder.tail(max(WINDOW, min(new, OVERVIEW_READ_CAP)))  # one read a refresh
        if new > 0:
            unseen = fresh["step"] >= self._seen
            self.overview.add(
                fresh["step"][unseen],
                fresh["data_wait_ms"][unseen],
                fresh["compute_ms"][unseen],
            )
            self._seen = recorder.n_steps
        tail = {name: column[-WINDOW:] for name, column in fresh.items()}
        if not len(tail["step"]) and not final:
            return
        lanes = self._lanes(final)
        turn = (ROTATION if lanes is None else LANES_ROTATION)[self.refreshes % len(ROTATION)]
        total, pass_info = self._total()
        numbers = live_numbers(run, tail, total, pass_info)
        if ranks is not None:
            with_ranks_live(numbers, ranks)
        gpu = self._gpu_text()
        if final or turn == "header":
            chart.draw_header(header_html(numbers, gpu) + lanes_line(self.lane_counts if lanes else {}))
        if (final or turn == "bars") and ranks is not None:
            chart.draw_ranks(ranks)
        elif (final or turn == "bars") and len(tail["step"]) >= 2:
            # On a GPU, the steps whose events have resolved, on the GPU clock: what the host
            # waited while queued work hid it is no data wait (the report says the same).
            cols, on_gpu = clock_columns(tail, run.gpu_used)
            suffix = "_gpu_ms" if on_gpu else "_ms"
            parts = window_parts(run, cols, on_gpu)
            if parts is None:
                chart.draw_window(cols["step"] + 1, cols["data_wait" + suffix], cols["compute" + suffix])
            else:
                chart.draw_window(cols["step"] + 1, cols["data_wait" + suffix], cols["compute" + suffix], parts)
        if final or turn == "overview":
            centre, wait, compute = self.overview.means()
            if len(centre) >= 2:
                chart.draw_overview(centre, wait, compute)
        if lanes is not None and (final or turn == "lanes") and isinstance(chart, WidgetChart):
            chart.draw_lanes(*lanes.window())
        if isinstance(chart, HtmlChart):
            chart.publish(header_text(numbers, gpu))

    def close(self) -> None:
        """Final refresh (if the run's own did not happen). The chart stays displayed: its
        saved state is the run's evidence."""
        if self.closed:
            return
        try:
            if not self.final_done:
                self.refresh(self.run)
        finally:
            self.closed = True
        if isinstance(self.chart, WidgetChart):
            _live_charts.append(self)
            release_charts(KEEP_LIVE_CHARTS)

    def release(self) -> None:
        """Swap a finished widget chart for its static picture and close its widgets."""
        chart, self.chart = self.chart, None
        if isinstance(chart, WidgetChart):
            chart.release(f"traceml {self.run.name}: {self.run.n_steps} steps (static picture)")


_live_charts: list[LiveView] = []  # finished views whose chart is still widgets, oldest first


def release_charts(keep: int = 0) -> int:
    """Release the charts of all but the `keep` newest finished runs (each becomes a static
    picture of its final state). Returns how many were released."""
    released = 0
    while len(_live_charts) > keep:
        view = _live_charts.pop(0)
        with never_raise():  # a front-end gone away must not cost the cell
            view.release()
        released += 1
    return released


def live_widget_count() -> int:
    """Widgets alive in this kernel (ipywidgets 8: `widget._instances`; 7: `Widget.widgets`)."""
    from ipywidgets.widgets import widget

    instances = getattr(widget, "_instances", None)
    if instances is None:
        instances = widget.Widget.widgets
    return len(instances)


def start(run: LiveRecording, show: bool = True) -> LiveView | None:
    """Show the live view of `run` under the cell and register it with the run.

    A widget front-end gets the bqplot chart once the run lasts long enough for an update
    (about a second; before that, and for shorter runs, the HTML chart); a kernel without
    ipywidgets/bqplot an updating HTML display; a terminal, or `show=False` (--no-live),
    nothing on screen (the GPU is still sampled for the report). Never raises: a view that
    cannot start is a note on the run.
    """
    shell = ipython_shell()
    guard = never_raise(run.notes, "The live view could not start")
    with guard:
        mode = environment.live_mode(shell) if show else "none"
        if mode == "widget":
            environment.enable_custom_widget_manager_once()
        chart = HtmlChart(run.name) if mode != "none" else None
        view = LiveView(run, chart, shell, widgets=mode == "widget")
        view.display()
    if guard.error is not None:
        return None
    run.observe(view.refresh)
    return view
