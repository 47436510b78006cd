"""The training process's side of the inside-the-loader watch (docs/loader-inside.md): for the
traced cell, `iter(loader)` on a loader with workers starts them with worker_side.WorkerInit
chained before the user's `worker_init_fn` (put back as soon as the workers started), and each
`next()` on that iterator notes when the loop asked and when it received which worker's batch.
At the cell's end the workers' records are read from the run's private directory, which is
then removed (a persistent worker stops timing at its next batch).

The patches stand on the capture's own (`DataLoader.__iter__`, `_BaseDataLoaderIter.__next__`)
and pass straight through for anything else. Reads of the user's loader go through read_or."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from threading import get_ident
from typing import Any

from ...failures import read_or
from ..instrument import hooks
from ..instrument.patches import patched
from .worker_side import WorkerInit, known_fetchers, read_records

MAX_RECEPTIONS = 200_000  # the loop's batches noted (then no more)
# What a run's watch gives its recording: (records, receptions, began_ns, pinned)
Watched = tuple[list[tuple[int, ...]], list[tuple[int, int, int]], int, list[tuple[int, int]]]


class LoaderInside:
    """One run's watch inside its DataLoaders' workers."""

    def __init__(self, capture: object) -> None:
        self.capture = capture  # (hooks.active while the cell runs)
        self.thread, self.pid = get_ident(), os.getpid()
        self.directory: str | None = None
        self.began_ns = time.monotonic_ns()
        self.iterators: dict[int, list[int]] = {}  # id(iterator) -> its workers' pids by worker id
        self.receptions: list[tuple[int, int, int]] = []  # (worker pid, asked, received)
        self.unmeasured = 0  # passes whose workers started before the cell (persistent)
        self.pinned: list[tuple[int, int]] = []  # the pin-memory thread's batches: (start, end)

    @contextmanager
    def patches(self) -> Iterator[None]:
        """The patches on the capture's (entered after them, undone before them)."""
        data = sys.modules.get("torch.utils.data")
        loader_class = getattr(data, "DataLoader", None)
        base_iter = getattr(sys.modules.get("torch.utils.data.dataloader"), "_BaseDataLoaderIter", None)
        if loader_class is None or base_iter is None:
            yield
            return
        if not known_fetchers():  # (another torch: its workers' fetchers are not the ones timed)
            yield
            return
        self.directory = tempfile.mkdtemp(prefix="traceml-loader-")
        inner_iter, inner_next = loader_class.__dict__["__iter__"], base_iter.__dict__["__next__"]
        watch = self

        def __iter__(loader: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            if hooks.active is not watch.capture or get_ident() != watch.thread:
                return inner_iter(loader)
            return watch.started(loader, inner_iter)

        def __next__(it: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            pids = watch.iterators.get(id(it))
            if pids is None:
                return inner_next(it)
            return watch.received(it, pids, inner_next)

        with ExitStack() as stack:
            stack.enter_context(patched(loader_class, {"__iter__": __iter__}))
            stack.enter_context(patched(base_iter, {"__next__": __next__}))
            pinning = sys.modules.get("torch.utils.data._utils.pin_memory")
            if callable(getattr(pinning, "pin_memory", None)):
                stack.enter_context(patched(pinning, {"pin_memory": self.timed_pin(pinning.pin_memory)}))  # type: ignore[union-attr]
            yield

    def timed_pin(self, original: Any) -> Any:
        """torch's `pin_memory(data, device)` as the pin-memory thread calls it, timed (its module's
        name, looked up at each call: the thread takes torch's own back after the cell)."""
        pinned = self.pinned

        def pin_memory(data: Any, device: Any = None) -> Any:
            t0 = time.monotonic_ns()
            out = original(data, device)
            if len(pinned) < MAX_RECEPTIONS:
                pinned.append((t0, time.monotonic_ns()))
            return out

        return pin_memory

    def started(self, loader: Any, inner: Any) -> Any:
        """`iter(loader)`: the workers started with our init before the user's; the iterator noted."""
        workers = read_or(0, _num_workers, loader)
        fresh = read_or(None, _iterator_of, loader) is None  # (a persistent loader's workers: started before)
        user = read_or(None, _init_of, loader)
        armed = bool(workers and fresh and self.directory) and read_or(False, _set_init, loader, WorkerInit(str(self.directory), user))
        try:
            it = inner(loader)
        finally:
            if armed:
                read_or(False, _set_init, loader, user)
        if armed:  # (batches handed out of order, `in_order=False`: not matched to their worker)
            self.iterators[id(it)] = read_or([], _pids, it) if getattr(it, "_in_order", True) is not False else []
        elif workers and not fresh and id(it) not in self.iterators:
            self.unmeasured += 1
        return it

    def received(self, it: Any, pids: list[int], inner: Any) -> Any:
        """`next()` on a watched iterator: which worker's batch, asked and received when."""
        before = getattr(it, "_rcvd_idx", None)
        info = getattr(it, "_task_info", None)
        task = info.get(before) if isinstance(info, dict) else None
        asked = time.monotonic_ns()
        item = inner(it)
        got = time.monotonic_ns()
        if (
            isinstance(task, tuple) and task and isinstance(task[0], int) and 0 <= task[0] < len(pids)
            and getattr(it, "_rcvd_idx", None) == (before + 1 if isinstance(before, int) else None)
            and len(self.receptions) < MAX_RECEPTIONS
        ):  # fmt: skip
            self.receptions.append((pids[task[0]], asked, got))
        return item

    def close(self, notes: list[str]) -> Watched | None:
        """The cell ended: the workers' records, the loop's receptions, the start (monotonic
        ns) and the pin-memory thread's batches, or None when no worker was watched; the
        directory removed. What could not be watched: a note."""
        directory, self.directory = self.directory, None
        self.iterators.clear()
        if os.getpid() != self.pid:  # a forked process closing what it inherited: the directory is its parent's
            return None
        if self.unmeasured:
            notes.append("inside the loader: persistent workers started before this cell were not watched (a new loader, or iter() in this cell, watches them)")
        if directory is None:
            return None
        records = read_records(directory)
        shutil.rmtree(directory, ignore_errors=True)
        return (records, self.receptions, self.began_ns, self.pinned) if records else None


def _num_workers(loader: Any) -> int:
    n = loader.num_workers
    return n if type(n) is int else 0


def _iterator_of(loader: Any) -> Any:
    return vars(loader).get("_iterator")


def _init_of(loader: Any) -> Any:
    return loader.worker_init_fn


def _set_init(loader: Any, init: Any) -> bool:
    loader.worker_init_fn = init
    return True


def _pids(it: Any) -> list[int]:
    return [int(w.pid) for w in it._workers]
