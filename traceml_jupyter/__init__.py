"""traceml_jupyter: is my DataLoader starving my GPU? `%%traceml` on a training cell answers.

    %load_ext traceml_jupyter

Heavy imports (torch, bqplot, pynvml, numpy) wait until a traced cell runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "load_ipython_extension",
    "unload_ipython_extension",
    "last",
    "runs",
    "clear",
    "trace",
    "compare",
    "load",
    "tune",
]

# `%traceml tune` as a function; tuning/ is light (torch loads when it runs).
from .tuning import tune

if TYPE_CHECKING:
    from .run import Run


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext traceml_jupyter`: the `%%traceml` cell magic and `%traceml` line magic, and the
    cells that await or do not compile routed as plain cells."""
    from .async_cells import route_async_cells
    from .magic import TraceMLMagics, import_views_when_idle
    from .syntax_cells import route_syntax_errors

    ipython.register_magics(TraceMLMagics)
    import_views_when_idle(ipython)
    cleanup = getattr(ipython, "input_transformers_cleanup", None)
    if isinstance(cleanup, list) and route_async_cells not in cleanup:
        cleanup.append(route_async_cells)  # cells that await run on IPython's event loop
    if isinstance(cleanup, list) and route_syntax_errors not in cleanup:
        cleanup.append(route_syntax_errors)  # cells that do not compile fail as plain cells


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext traceml_jupyter`: the magics and the cell routing removed again."""
    ipython.magics_manager.magics["cell"].pop("traceml", None)
    ipython.magics_manager.magics["line"].pop("traceml", None)
    from .async_cells import route_async_cells
    from .syntax_cells import route_syntax_errors

    cleanup = getattr(ipython, "input_transformers_cleanup", None)
    for transformer in (route_async_cells, route_syntax_errors):
        if isinstance(cleanup, list) and transformer in cleanup:
            cleanup.remove(transformer)


def last() -> Run | None:
    """The most recent run of this kernel, or None."""
    from .run import last as _last
    from .views.display import register_views

    register_views()  # run.save("x.html"); a loaded run shown as its report
    return _last()


def runs() -> list[Run]:
    """Every run of this kernel (and those `load` read), oldest first."""
    from .run import runs as _runs
    from .views.display import register_views

    register_views()  # run.save("x.html"); a loaded run shown as its report
    return _runs()


def load(path: str) -> Run:
    """A run saved with `--save PATH.json`, `run.save(...)` or into the history, read back (any
    version this package wrote) as a frozen result: `text()`, its report (shown as a cell's
    value), `steps`, `compare`, `save("x.html")`. It joins this kernel's runs, so `compare`
    finds it by name. A file that is not a saved run: ValueError, one line saying why."""
    __tracebackhide__ = True  # noqa: F841
    from .saved import load as _load
    from .views.display import register_views

    register_views()  # run.save("x.html"); a loaded run shown as its report
    return _load(path)


def clear() -> int:
    """Forget every run of this kernel; their live charts become static pictures of their
    final state (their widgets are closed). Returns how many runs were forgotten."""
    from .kernel_state import clear as _clear
    from .views.display import release_charts

    release_charts()
    return _clear()


def compare(a: Run | str | None = None, b: Run | str | None = None) -> Any:
    """Compare two runs: Run objects, names given with --name (this kernel's runs, or the
    history's: TRACEML_HISTORY), JSON paths or globs. The speed-up with its 95 % interval and
    IMPROVEMENT / REGRESSION / NO CHANGE (within noise) / MIXED; data wait, compute and every
    part both runs measured; the verdict change; first, what differs between the runs. No
    argument: the last two runs; one: that run against the latest. Bad input: ValueError,
    one line saying which and why."""
    __tracebackhide__ = True  # noqa: F841
    from .history import compare as _compare

    return _compare(a, b)


def trace(name: str | None = None, warmup: int | None = None, show: bool = True) -> Any:
    """Time a loop outside the magic::

        with traceml_jupyter.trace("baseline") as run:
            for x, y in run.loop(loader):
                ...
    """
    from .tracing import trace as _trace

    return _trace(name, warmup, show)
