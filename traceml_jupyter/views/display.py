"""Where a run is shown: the live view while it runs, the report when it ends."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol

from ..failures import never_raise
from ..kernel.shell import ipython_shell

if TYPE_CHECKING:
    from ..kernel.cells import FinishedRun
    from ..kernel.code_facts import KernelReading
    from .live_header import LiveRecording


class LiveView(Protocol):
    """What a view shown while a run records offers (live.LiveView; tune's progress views have
    the same shape for a tune: tuning/progress.ProgressView). `refresh` is the run's observer
    (run.Observer): it draws what the run holds so far, and its final state once the run has
    finished. `close` draws that final state if the run's last tick did not, and leaves it
    displayed."""

    def refresh(self, run: LiveRecording | None = None) -> None:
        """Draw what the run holds now (its final state once it has finished)."""

    def close(self) -> None:
        """The final state drawn (if not yet), left displayed; no refresh after."""


class ReportDisplay:
    """The final report as a display object: static HTML for notebooks, the box for terminals
    (renderers of the run's result: report.report_html, result.text)."""

    def __init__(self, run: FinishedRun, reading: KernelReading | None = None) -> None:
        self.run = run
        self.reading = reading  # the code around the run and its checklist, read once (read_kernel_at_end)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        from ..result import text
        from .report import render_html, report_html

        reading = self.reading
        html = render_html(self.run.result, reading) if reading is not None else report_html(self.run)
        return {"text/plain": text(self.run.result), "text/html": html}


def register_views() -> None:
    """Tell the run how the views show and write it: `run.save("x.html")` writes the report
    page (report_file.write_report_file), and a run read back from its file, as a cell's value,
    is its report (ReportDisplay). Called by the public API before it hands out a run."""
    from ..kernel_state import FILE_WRITERS, REPORT_BUNDLES
    from .report_file import write_report_file

    FILE_WRITERS[".html"] = FILE_WRITERS[".htm"] = write_report_file
    REPORT_BUNDLES[:] = [lambda run, include, exclude: ReportDisplay(run)._repr_mimebundle_(include, exclude)]


def show_report(run: FinishedRun, view: LiveView | None = None) -> None:
    """Stop the live view (its chart stays, with the final data), evaluate the checklist once
    (it stays on the run: `run.checklist`) and show the report below the chart."""
    from ..kernel.code_facts import read_kernel_at_end

    if view is not None:
        with never_raise():
            view.close()
    reading = read_kernel_at_end(run)
    if ipython_shell() is None:
        from ..result import text

        print_whole(text(run.result))
        return
    from IPython.display import display

    display(ReportDisplay(run, reading))


def print_whole(text: str) -> None:
    """Print `text` and its newline in one write. Under `torchrun` every rank writes to the
    same pipe, and print() writes the text and its newline separately when the stream is
    unbuffered (PYTHONUNBUFFERED=1): another rank's line could land between the two, glued to
    the end of this text. One write up to the pipe's atomic size (4 KiB) is never split."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def start_live_view(run: LiveRecording, show: bool = True) -> LiveView | None:
    """The live chart for a notebook front-end, or (show=False, or no front-end) only the
    GPU sampling behind it; None if it cannot start."""
    from .live import start

    return start(run, show)  # never raises: a view that cannot start is a note


def release_charts() -> int:
    """Turn every finished run's live chart into a static picture of its final state and close
    its widgets. Returns how many charts were released."""
    live = sys.modules.get(f"{__package__}.live")  # no chart was ever drawn without it
    return int(live.release_charts(0)) if live is not None else 0


