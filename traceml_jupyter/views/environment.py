"""Which front-end shows the run: one small function per environment quirk (Colab, kernels, terminals)."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Literal

from ..kernel.shell import ipython_shell

LiveMode = Literal["widget", "html", "none"]
LIVE_MODES: tuple[LiveMode, ...] = ("widget", "html", "none")

# TRACEML_LIVE=widget|html|none overrides the detection (a front-end it gets wrong, or a test).
LIVE_ENV = "TRACEML_LIVE"

_colab_widgets_enabled = False


def in_colab() -> bool:
    """True inside a Google Colab kernel (it imports google.colab at start-up)."""
    return "google.colab" in sys.modules


def enable_custom_widget_manager_once() -> bool:
    """Colab renders third-party widgets (bqplot) only with its custom widget manager on.

    Turned on once per kernel, before the first widget is displayed: from then on Colab's
    display hook adds the metadata its front-end needs to every widget output. True when on.
    """
    global _colab_widgets_enabled
    if _colab_widgets_enabled:
        return True
    if not in_colab():
        return False
    try:
        from google.colab import output

        output.enable_custom_widget_manager()
    except Exception:
        return False
    _colab_widgets_enabled = True
    return True


def in_kernel(shell: Any) -> bool:
    """True when the shell talks to a front-end through a Jupyter kernel (Lab, Notebook, VS Code,
    Colab, Kaggle, nbclient); False in terminal IPython and in IPython's test shell."""
    if shell is None:
        return False
    zmqshell = sys.modules.get("ipykernel.zmqshell")
    if zmqshell is None or not isinstance(shell, zmqshell.ZMQInteractiveShell):
        return False
    return getattr(shell, "kernel", None) is not None


def widgets_installed() -> bool:
    """ipywidgets and bqplot can be imported (checked without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("ipywidgets", "bqplot"))


def ipywidgets_major() -> int | None:
    """7 (Colab) or 8: the live view uses only APIs the two share; tests branch on this."""
    try:
        import ipywidgets
    except ImportError:
        return None
    try:
        return int(str(ipywidgets.__version__).split(".")[0])
    except ValueError:
        return None


def has_widget_frontend(shell: Any = None) -> bool:
    """A kernel whose front-end can draw ipywidgets and bqplot."""
    shell = ipython_shell() if shell is None else shell
    return in_kernel(shell) and widgets_installed()


def live_mode(shell: Any = None) -> LiveMode:
    """How to show a run while it runs: a bqplot chart, an updating HTML display, or nothing
    (terminal IPython, plain Python, IPython's test shell)."""
    forced = os.environ.get(LIVE_ENV, "").strip().lower()
    if forced in LIVE_MODES:
        return forced
    shell = ipython_shell() if shell is None else shell
    if not in_kernel(shell):
        return "none"
    return "widget" if widgets_installed() else "html"
