"""`%traceml tune` shown while it measures: a bar chart (widgets), one updated HTML display, or
lines of text; and the caller's progress callback told the same events."""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..analysis.tune_plan import OK, TIMEOUT, Row, Setting, rate_text
from ..failures import never_raise
from .render import BAR, MODEL, table_lines

if TYPE_CHECKING:
    from .result import TuneResult

Progress = Callable[[Mapping[str, Any]], None]


class ProgressView(Protocol):
    """What a view shown while a tune measures offers (as a run's live view, views/display.py:
    told as it goes, then the final state): the tune starts, a candidate starts, a candidate
    was measured, the tune ended with its result."""

    def start(self, label: str, budget: float, model: float | None) -> None:
        """The tune starts: `label`, its budget (s), the model's rate (batches/s)."""

    def candidate(self, setting: Setting, index: int, total: int) -> None:
        """Candidate `index` of about `total` starts."""

    def measured(self, row: Row, rows: Sequence[Row]) -> None:
        """`row` was measured; `rows`: every row so far."""

    def finish(self, result: TuneResult) -> None:
        """The tune ended with `result`: its final state."""


class TextView:
    """A terminal: one line per candidate as it ends."""

    def start(self, label: str, budget: float, model: float | None) -> None:
        """Say what is tuned, the budget and the model's rate."""
        rate = f"; the model takes {rate_text(model)} batches/s" if model else ""
        print(f"traceml tune: {label}, at most {budget:g} s{rate} (interrupt to stop)", flush=True)

    def candidate(self, setting: Setting, index: int, total: int) -> None:
        """Nothing: a terminal gets one line per candidate, once it is measured."""

    def measured(self, row: Row, rows: Sequence[Row]) -> None:
        """One line: the candidate's rate, or why it has none."""
        rate = f"{rate_text(row.batches_per_s)} batches/s" if row.batches_per_s else "no rate"
        extra = f" ({row.status}: {row.message})" if row.status not in (OK, TIMEOUT) else ""
        print(f"  {row.setting.label()}: {rate}{extra}", flush=True)

    def finish(self, result: TuneResult) -> None:
        """Nothing: the result prints itself."""


class HtmlView:
    """A kernel without widgets: one HTML display, updated through its handle."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.label = ""
        self.model: float | None = None

    def _show(self, text: str, html_body: str) -> None:
        from IPython.display import display

        from ..views.live import HtmlStatus

        status = HtmlStatus(text, html_body)
        if self.handle is None:
            self.handle = display(status, display_id=True)
        else:
            self.handle.update(status)

    def start(self, label: str, budget: float, model: float | None) -> None:
        """The display, saying what is tuned."""
        self.label, self.model = label, model
        self._show(f"traceml tune: {label}", f"<b>traceml tune</b> {html.escape(label)}: starting")

    def candidate(self, setting: Setting, index: int, total: int) -> None:
        """The display says which candidate is measured."""
        self._show(
            f"traceml tune: measuring {setting.label()}",
            f"<b>traceml tune</b> {html.escape(self.label)}: measuring "
            f"<code>{html.escape(setting.label())}</code> ({index} of about {total})",
        )

    def measured(self, row: Row, rows: Sequence[Row]) -> None:
        """The display shows the table so far."""
        text = "\n".join(table_lines([r.to_dict() for r in rows], self.model, None))
        self._show(text, f"<pre>{html.escape(text)}</pre>")

    def finish(self, result: TuneResult) -> None:
        """The display shows the final table, the best setting marked."""
        head = f"traceml tune: done in {result.elapsed_s:.1f} s" + (
            " (stopped)" if result.stopped else ""
        )
        text = "\n".join(table_lines(result.rows, self.model, result.best_settings))
        self._show(f"{head}\n{text}", f"<b>{html.escape(head)}</b><pre>{html.escape(text)}</pre>")


class WidgetView:
    """A notebook front-end: a header and a bqplot bar chart of batches/s per setting, with the
    model's rate as a line."""

    def __init__(self) -> None:
        import ipywidgets as widgets
        from bqplot import Axis, Bars, Figure, LinearScale, Lines, OrdinalScale

        from ..views.live import vertical_axis

        self.header = widgets.HTML(value="<b>traceml tune</b>: starting")
        x, y = OrdinalScale(), LinearScale(min=0.0)
        self.bars = Bars(x=[], y=[], scales={"x": x, "y": y}, colors=[BAR], padding=0.3)
        self.model_line = Lines(
            x=[0.0, 1.0],
            y=[0.0, 0.0],
            scales={"x": LinearScale(min=0.0, max=1.0), "y": y},
            colors=[MODEL],
            stroke_width=2,
            visible=False,
        )
        self.figure = Figure(
            marks=[self.bars, self.model_line],
            axes=[
                Axis(scale=x, label="num_workers"),
                Axis(scale=y, label="batches/s", tick_format=".3~g", **vertical_axis()),
            ],
            layout=widgets.Layout(width="100%", height="220px"),
            fig_margin={"top": 10, "bottom": 40, "left": 60, "right": 20},
            animation_duration=0,
        )
        self.box = widgets.VBox([self.header, self.figure])
        self.label = ""

    def start(self, label: str, budget: float, model: float | None) -> None:
        """Show the chart (the model's rate as a line when known)."""
        from IPython.display import display

        from ..views.environment import enable_custom_widget_manager_once
        from ..views.live import WidgetDisplay

        enable_custom_widget_manager_once()
        self.label = label
        if model:
            self.model_line.y = [model, model]
            self.model_line.visible = True
        line = f" &middot; model {html.escape(rate_text(model))} batches/s" if model else ""
        self.header.value = (
            f"<b>traceml tune</b> {html.escape(label)}: up to {budget:g} s{line}"
            f' <span style="color:{MODEL}">&#9472;</span>'
        )
        display(WidgetDisplay(self.box, f"traceml tune: {label} (live chart)"))

    def candidate(self, setting: Setting, index: int, total: int) -> None:
        """The header says which candidate is measured."""
        self.header.value = (
            f"<b>traceml tune</b> {html.escape(self.label)}: measuring "
            f"<code>{html.escape(setting.label())}</code> ({index} of about {total})"
        )

    def measured(self, row: Row, rows: Sequence[Row]) -> None:
        """One bar per candidate measured so far."""
        done = [r for r in rows if r.batches_per_s is not None]
        with self.bars.hold_sync():
            self.bars.x = [r.setting.short() for r in done]
            self.bars.y = [float(r.batches_per_s or 0.0) for r in done]

    def finish(self, result: TuneResult) -> None:
        """The header says the tune is done."""
        self.header.value = (
            f"<b>traceml tune</b> {html.escape(self.label)}: done in {result.elapsed_s:.1f} s"
            + (" (stopped)" if result.stopped else "")
        )


def progress_view(show: bool) -> ProgressView | None:
    """The view for this front-end (widgets, an HTML display, text); None when `show` is False."""
    if not show:
        return None
    from ..kernel.shell import ipython_shell
    from ..views.environment import live_mode

    mode = live_mode(ipython_shell())
    with never_raise():  # a view must never stop the tune
        if mode == "widget":
            return WidgetView()
        if mode == "html":
            return HtmlView()
    return TextView()


class ProgressViews:
    """The view and the caller's progress callback, told the same events. A broken view is
    dropped; the callback's exceptions (KeyboardInterrupt included) are the caller's."""

    def __init__(self, view: ProgressView | None, progress: Progress | None) -> None:
        self.view, self.progress = view, progress

    def _call(self, name: str, *args: Any) -> None:
        if self.view is not None:
            guard = never_raise()  # a broken view is dropped
            with guard:
                getattr(self.view, name)(*args)
            if guard.error is not None:
                self.view = None

    def start(self, label: str, budget: float, model: float | None) -> None:
        """The tune starts: `label`, its budget (s), the model's rate (batches/s)."""
        self._call("start", label, budget, model)

    def candidate(self, setting: Setting, index: int, total: int) -> None:
        """Candidate `index` of about `total` starts."""
        self._call("candidate", setting, index, total)
        if self.progress is not None:
            self.progress(
                {"event": "start", "setting": setting.kwargs(), "index": index, "total": total}
            )

    def measured(self, row: Row, rows: Sequence[Row]) -> None:
        """`row` was measured; `rows`: every row so far."""
        self._call("measured", row, rows)
        if self.progress is not None:
            self.progress({"event": "measured", "row": row.to_dict(), "index": len(rows)})

    def finish(self, result: TuneResult) -> None:
        """The tune ended with `result`."""
        self._call("finish", result)


