"""Where a run is shown: the live view while it runs, the report when it ends; and the display
libraries imported ahead of the first traced cell."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from . import environment
from .environment import ipython_shell

if TYPE_CHECKING:
    from .run import Run

# In a kernel whose front-end draws widgets, what the first traced cell would import (our own
# modules, numpy, ipywidgets, bqplot and the pandas bqplot imports: about 0.9 s here) is
# imported on the kernel's event loop this long after `%load_ext`, between cells.
IMPORT_DELAY_S = 0.5


class ReportDisplay:
    """The final report as a display object: static HTML for notebooks, the box for terminals."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        from .report import render_html

        return {"text/plain": self.run.text(), "text/html": render_html(self.run)}


def show_report(run: Run, view: Any = None) -> None:
    """Stop the live view (its chart stays, with the final data) and show the report below it."""
    if view is not None:
        try:
            view.close()
        except Exception:
            pass
    if ipython_shell() is None:
        print(run.text())
        return
    from IPython.display import display

    display(ReportDisplay(run))


def start_live_view(run: Run, show: bool = True) -> Any:
    """The live chart for a notebook front-end, or (show=False, or no front-end) only the
    GPU sampling behind it; None if it cannot start."""
    try:
        from .live import start

        return start(run, show)
    except Exception as exc:  # a view must never stop the user's cell
        run.notes.append(f"The live view could not start: {type(exc).__name__}: {exc}")
        return None


def release_charts() -> int:
    """Turn every finished run's live chart into a static picture of its final state and close
    its widgets. Returns how many charts were released."""
    live = sys.modules.get(f"{__package__}.live")  # no chart was ever drawn without it
    return int(live.release_charts(0)) if live is not None else 0


def import_views_when_idle(shell: Any) -> bool:
    """In a kernel that draws widgets, import what the first traced cell needs on the kernel's
    own event loop, IMPORT_DELAY_S from now: on the main thread, while no cell runs (or while
    an async cell awaits). No thread is started, so none can outlive a cell, hold the import
    lock when the user's code forks, or run concurrently with it. True when scheduled."""
    if environment.live_mode(shell) != "widget":
        return False
    loop = getattr(getattr(shell, "kernel", None), "io_loop", None)
    call_later = getattr(loop, "call_later", None)
    if call_later is None:
        return False
    call_later(IMPORT_DELAY_S, import_views)
    return True


def import_views() -> None:
    """Import the traced cell's modules and the live chart's libraries; never raises."""
    try:
        import bqplot  # noqa: F401
        import ipywidgets  # noqa: F401

        from . import live, report, traced_cell  # noqa: F401
    except Exception:  # the traced cell imports them again, and says what failed
        pass
