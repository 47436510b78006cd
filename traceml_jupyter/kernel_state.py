"""What this kernel keeps between cells, in one place: its runs (oldest first), the last
`%traceml tune` and what it measured, the copy of a run's training loader kept for tune when
the loader itself is gone, and how the views write and show a run (registered explicitly by
`views.display.register_views`, called by the public API). It imports nothing of the package:
the run, the tune and the views read and write it."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

# The runs of this kernel, and those `load` read, oldest first (run.Run objects: run.runs()).
RUNS: list[Any] = []

# Formats other than JSON that `Run.save` writes, by file suffix ((run, path) -> None), and how a
# run read back from its file shows as a cell's value ((run, include, exclude) -> mime bundle).
FILE_WRITERS: dict[str, Callable[[Any, str], None]] = {}
REPORT_BUNDLES: list[Callable[[Any, Any, Any], dict[str, str]]] = []

# The last `%traceml tune` (tuning/) and the loader it measured: the checklist quotes it.
_LAST_TUNE: dict[str, Any] = {}

# The last run's training loader when the loader itself is gone (built inside a function of a
# script run with `%run`): a copy without its iterator (no worker processes), kept for
# `%traceml tune` until the next run or clear().
_KEPT_LOADER: dict[str, Any] = {}


def remember_tune(loader: Any, result: dict[str, Any]) -> None:
    """Keep the last tune's result (to_dict()) with weak references to what it measured."""
    refs: list[Any] = []
    for obj in (loader, getattr(loader, "dataset", None)):
        try:
            refs.append(weakref.ref(obj))
        except TypeError:
            refs.append(None)
    _LAST_TUNE.clear()
    _LAST_TUNE.update(loader=refs[0], dataset=refs[1], batch_size=getattr(loader, "batch_size", None), result=result)


def tuned_for(loader: Any) -> dict[str, Any] | None:
    """The last tune's result when it measured this loader, or one over the same dataset with
    the same batch size; else None."""
    if loader is None or not _LAST_TUNE:
        return None
    same = _LAST_TUNE["loader"] is not None and _LAST_TUNE["loader"]() is loader
    if not same and _LAST_TUNE["dataset"] is not None:
        same = _LAST_TUNE["dataset"]() is getattr(loader, "dataset", object())
        same = same and _LAST_TUNE["batch_size"] == getattr(loader, "batch_size", None)
    return dict(_LAST_TUNE["result"]) if same else None


def keep_loader_copy(copy: Any) -> Callable[[], Any]:
    """Keep `copy` as the last run's training loader until the next run or clear(); the
    reference to it that the run holds instead of its gone loader (None once it is dropped)."""
    _KEPT_LOADER.clear()
    token = object()
    _KEPT_LOADER.update(token=token, loader=copy)

    def kept() -> Any:
        return _KEPT_LOADER.get("loader") if _KEPT_LOADER.get("token") is token else None

    return kept


def forget_loader_copy() -> None:
    """A new run: the copy kept for the last one goes."""
    _KEPT_LOADER.clear()


def kept_loader_copy() -> Any:
    """The loader copy kept now, or None."""
    return _KEPT_LOADER.get("loader")


def clear() -> int:
    """Forget every run of this kernel and the loader copy kept for tune. Returns how many runs."""
    n = len(RUNS)
    RUNS.clear()
    _KEPT_LOADER.clear()
    return n
