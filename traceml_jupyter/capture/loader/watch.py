"""The training process's side of the inside-the-loader watch (docs/loader-inside.md): for the
traced cell, `iter(loader)` on a loader with workers starts them with worker_side.WorkerInit
chained before the user's `worker_init_fn` (put back as soon as the workers started), and each
`next()` on that iterator notes when the loop asked and when it received which worker's batch
(torch's task in that pass), or, when it raised, which batch it awaited and the workers' exit
codes (a worker that died, raised or was late is named: analysis/loader_inside.py).
At the cell's end the workers' records are read from the run's private directory, which is
then removed (a persistent worker stops timing at its next batch).

The patches stand on the capture's own (`DataLoader.__iter__`, `_BaseDataLoaderIter.__next__`)
and pass straight through for anything else. Reads of the user's loader go through read_or."""

from __future__ import annotations

import os
import shutil
import signal
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
MAX_STOPS = 16  # the loop's failed next() noted
# The loop received a batch: (the worker's pid, pass, task, asked, received; monotonic ns).
Reception = tuple[int, int, int, int, int]
# The loop's next() raised: (the worker id and pid whose batch it awaited, -1 when unknown;
# pass; task; the error, "Type: its first line").
Stop = tuple[int, int, int, int, str]
# A worker that ended with an exit code other than 0: (worker id, pid, exit code; -N: signal N).
Exit = tuple[int, int, int]
# What a run's watch gives its recording: (records, receptions, began_ns, pinned, stops, exits)
Watched = tuple[list[tuple[int, ...]], list[Reception], int, list[tuple[int, int]], list[Stop], list[Exit]]


class _Iterator:
    """A watched iterator: its workers (torch's process objects, for their exit codes; their
    pids by worker id) and its passes so far (`iter()` again on persistent workers: one more)."""

    __slots__ = ("pids", "processes", "passes")

    def __init__(self, processes: list[Any]) -> None:
        self.processes = processes
        self.pids = [p if type(p) is int else -1 for p in (read_or(None, _pid_of, w) for w in processes)]
        self.passes = 0


class LoaderInside:
    """One run's watch inside its DataLoaders' workers."""

    def __init__(self, capture: object) -> None:
        self.capture = capture  # (hooks.active while the cell runs)
        self.thread, self.pid = get_ident(), os.getpid()
        self.directory: str | None = None
        self.began_ns = time.monotonic_ns()
        self.iterators: dict[int, _Iterator] = {}  # by id(iterator)
        self.receptions: list[Reception] = []
        self.stops: list[Stop] = []
        self.exits: list[Exit] = []  # the workers found ended when next() raised
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
            watched = watch.iterators.get(id(it))
            if watched is None:
                return inner_next(it)
            return watch.received(it, watched, inner_next)

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
        watched = self.iterators.get(id(it))
        if armed:
            self.iterators[id(it)] = _Iterator(read_or([], _workers_of, it))
        elif watched is not None:  # persistent workers, started in this cell: their next pass
            watched.passes += 1
        elif workers and not fresh:
            self.unmeasured += 1
        return it

    def received(self, it: Any, watched: _Iterator, inner: Any) -> Any:
        """`next()` on a watched iterator: which worker's batch (torch's task: its index in the
        pass, and the worker it was sent to), asked and received when; or, when next() raised
        (a worker's error, a timeout, a worker that died), which batch the loop awaited."""
        __tracebackhide__ = True  # noqa: F841
        before = getattr(it, "_rcvd_idx", None)
        before = before if type(before) is int else -1
        info = getattr(it, "_task_info", None)
        task = info.get(before) if isinstance(info, dict) and getattr(it, "_in_order", True) is not False else None
        worker = task[0] if isinstance(task, tuple) and task and type(task[0]) is int and 0 <= task[0] < len(watched.pids) else -1
        asked = time.monotonic_ns()
        done = False
        try:
            item = inner(it)
            done = True
        finally:
            if not done:
                self.failed(watched, worker, before, sys.exc_info()[1])
        got = time.monotonic_ns()
        if worker >= 0 and getattr(it, "_rcvd_idx", None) == before + 1 and len(self.receptions) < MAX_RECEPTIONS:
            self.receptions.append((watched.pids[worker], watched.passes, before, asked, got))
        return item

    def failed(self, watched: _Iterator, worker: int, task: int, error: BaseException | None) -> None:
        """next() raised `error` while the loop awaited `task` from `worker` (the end of a
        pass, an interrupt: not noted). Runs while the error goes up: nothing here raises."""
        if not isinstance(error, Exception) or isinstance(error, StopIteration) or len(self.stops) >= MAX_STOPS:
            return
        text = read_or("", str, error).strip().split("\n", 1)[0][:300]
        pid = watched.pids[worker] if worker >= 0 else -1
        self.stops.append((worker, pid, watched.passes, task, f"{type(error).__name__}: {text}"))
        self.exits.extend(e for e in _exits(watched) if e not in self.exits)  # (read now: torch may end the others next)

    def close(self, notes: list[str]) -> Watched | None:
        """The cell ended: the workers' records, the loop's receptions, the start (monotonic
        ns), the pin-memory thread's batches, the loop's failed next() and the workers that
        ended with a code other than 0, or None when no worker was watched; the directory
        removed (a plain read of files: nothing waits on a dead worker). What could not be
        watched: a note."""
        directory, self.directory = self.directory, None
        iterators = list(self.iterators.values())
        self.iterators.clear()
        if os.getpid() != self.pid:  # a forked process closing what it inherited: the directory is its parent's
            return None
        if self.unmeasured:
            notes.append("inside the loader: persistent workers started before this cell were not watched (a new loader, or iter() in this cell, watches them)")
        if directory is None:
            return None
        records = read_records(directory)
        shutil.rmtree(directory, ignore_errors=True)
        # Found ended at the cell's end: a worker that died while the loop was elsewhere (torch's
        # SIGCHLD handler raised in the user's code). Not SIGTERM: torch's own end of a worker
        # that did not stop in time.
        exits = self.exits + [e for w in iterators for e in _exits(w) if e[2] != -signal.SIGTERM and e not in self.exits]
        return (records, self.receptions, self.began_ns, self.pinned, self.stops, exits) if records or exits else None


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


def _workers_of(it: Any) -> list[Any]:
    return list(it._workers)


def _pid_of(process: Any) -> Any:
    return process.pid


def _exit_code(process: Any) -> Any:
    return process.exitcode  # (multiprocessing's: None while it runs; a poll, never a wait)


def _exits(watched: _Iterator) -> list[Exit]:
    """The workers that ended with an exit code other than 0 (-N: killed by signal N)."""
    codes = [read_or(None, _exit_code, w) for w in watched.processes]
    return [(k, watched.pids[k], code) for k, code in enumerate(codes) if type(code) is int and code != 0]
