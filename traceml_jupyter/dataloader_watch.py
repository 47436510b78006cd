"""Watching torch DataLoaders during a traced cell: which loader feeds the loop, and the
fallback that times any DataLoader iterator when no loop could be rewritten."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter_ns
from typing import Any

from .patches import patched
from .recorder import Recorder


def _dataloader_class() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        from torch.utils.data import DataLoader
    except Exception:
        return None
    return DataLoader


def unwrap_loader(iterable: Any) -> Any:
    """The DataLoader behind `iterable` when it is one or wraps one visibly (tqdm's .iterable)."""
    DataLoader = _dataloader_class()
    if DataLoader is None:
        return None
    for _ in range(4):
        if isinstance(iterable, DataLoader):
            return iterable
        iterable = getattr(iterable, "iterable", None)
        if iterable is None:
            return None
    return None


def describe_loader(loader: Any) -> dict[str, Any]:
    """The settings the checklist reads, as plain values (no reference to the loader kept)."""
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    collate_name = getattr(collate, "__qualname__", type(collate).__name__)
    collate_module = getattr(collate, "__module__", "") or ""
    try:
        length: int | None = len(loader)
    except TypeError:
        length = None
    try:
        n_samples: int | None = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        n_samples = None
    ds_type = type(dataset)
    return {
        "type": type(loader).__name__,
        "num_workers": getattr(loader, "num_workers", None),
        "batch_size": getattr(loader, "batch_size", None),
        "pin_memory": getattr(loader, "pin_memory", None),
        "persistent_workers": getattr(loader, "persistent_workers", None),
        "prefetch_factor": getattr(loader, "prefetch_factor", None),
        "multiprocessing_context": _context_name(getattr(loader, "multiprocessing_context", None)),
        "collate_fn": collate_name,
        "custom_collate": not collate_module.startswith("torch."),
        "dataset_type": ds_type.__name__,
        "dataset_module": ds_type.__module__,
        "len": length,
        "n_samples": n_samples,
    }


def _context_name(ctx: Any) -> str | None:
    if ctx is None:
        return None
    get = getattr(ctx, "get_start_method", None)
    return str(get()) if get else str(ctx)


@contextmanager
def watch_loaders(on_iter: Callable[[Any], None]) -> Iterator[None]:
    """Call `on_iter(loader)` each time a DataLoader starts a pass; undone on exit."""
    DataLoader = _dataloader_class()
    if DataLoader is None:
        yield
        return
    original = DataLoader.__dict__["__iter__"]

    def __iter__(self: Any) -> Any:
        on_iter(self)
        return original(self)

    with patched(DataLoader, {"__iter__": __iter__}):
        yield


class LoaderSteps:
    """Fallback timing: a step is the interval between two next() on one DataLoader iterator.

    Steps are kept per loader; the loader that ran the most steps is taken as the step loop.
    """

    def __init__(self) -> None:
        self.by_loader: dict[int, Recorder] = {}
        self.loaders: dict[int, Callable[[], Any]] = {}
        self._pending: dict[int, tuple[int, int, int]] = {}  # iterator id -> (loader, t0, t1)
        self.origin_ns = perf_counter_ns()

    def recorder_for(self, loader_key: int) -> Recorder:
        rec = self.by_loader.get(loader_key)
        if rec is None:
            rec = self.by_loader[loader_key] = Recorder()
            rec.origin_ns = self.origin_ns
        return rec

    def fetch_started(self, iterator: Any, t0: int) -> None:
        pending = self._pending.pop(id(iterator), None)
        if pending is not None:
            key, p0, p1 = pending
            self.recorder_for(key).add(p0, p1, t0)

    def fetched(self, iterator: Any, loader_key: int, t0: int, t1: int) -> None:
        self._pending[id(iterator)] = (loader_key, t0, t1)

    def busiest(self) -> tuple[Recorder | None, Any]:
        if not self.by_loader:
            return None, None
        key = max(self.by_loader, key=lambda k: self.by_loader[k].n_steps)
        ref = self.loaders.get(key)
        return self.by_loader[key], ref() if ref else None


@contextmanager
def time_loader_iterators(steps: LoaderSteps) -> Iterator[None]:
    """Time every DataLoader iterator's __next__ for the duration; undone on exit."""
    DataLoader = _dataloader_class()
    if DataLoader is None:
        yield
        return
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    original_next = _BaseDataLoaderIter.__dict__["__next__"]
    original_iter = DataLoader.__dict__["__iter__"]
    owner: dict[int, int] = {}

    def __iter__(self: Any) -> Any:
        iterator = original_iter(self)
        owner[id(iterator)] = id(self)
        try:
            steps.loaders[id(self)] = weakref.ref(self)
        except TypeError:
            pass
        return iterator

    def __next__(self: Any) -> Any:
        t0 = perf_counter_ns()
        steps.fetch_started(self, t0)
        item = original_next(self)  # StopIteration ends this iterator's steps
        steps.fetched(self, owner.get(id(self), 0), t0, perf_counter_ns())
        return item

    with patched(DataLoader, {"__iter__": __iter__}), patched(_BaseDataLoaderIter, {"__next__": __next__}):
        yield
