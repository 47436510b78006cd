"""Where a run is shown: the live view while it runs, the report when it ends."""

from __future__ import annotations

from typing import Any

from .run import Run


def ipython_shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


class ReportDisplay:
    """The final report as a display object: static HTML for notebooks, the box for terminals."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        bundle = {"text/plain": self.run.text()}
        try:
            from .report import render_html
        except ImportError:
            return bundle
        bundle["text/html"] = render_html(self.run)
        return bundle


def show_report(run: Run, view: Any = None) -> None:
    """Show the final report: replaces the live view where it can, else below it."""
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
