"""The workers' side of the inside-the-loader watch: `WorkerInit` is what a traced cell sets as
the loader's `worker_init_fn` while `iter(loader)` starts its workers. It is a plain picklable
object (a module's class holding the user's init and a directory name), so it survives fork,
spawn and forkserver. In each worker it times the fetcher's work — each sample's `__getitem__`,
`collate_fn` — then runs the user's `worker_init_fn` as before (once per worker).

The figures go to a file of the worker's own in the run's private directory (mkdtemp, 0700), as
fixed-size binary records (struct): data, never code. Each fetch writes two: STARTED before it
(the batch's task and sample indices), BATCH after it; a fetch left STARTED is the batch a
worker was making when it died or raised (its file survives it). Nothing here draws a random number (the
workers' random states are untouched). When the directory is gone (the cell ended), the worker
puts the fetchers back at its next batch: a persistent worker that outlives the cell keeps
nothing of ours but that check's stat, once.

Clocks: `time.monotonic_ns()` (CLOCK_MONOTONIC on Linux and macOS, one clock for every process
of the machine), so a worker's "ready" and the training process's "received" compare.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...failures import read_or

SLOWEST = 4  # the slowest samples a record keeps (index, ns)
SHOWN = 11  # the sample indices a STARTED record keeps
BATCH, STARTED = 0, 1  # the record's kind (its first field)
# Both kinds begin with: kind, pid, worker id, pass (the fetchers the worker made: one a pass
# over the loader), ordinal, task (torch's index of the batch in its pass, -1 unknown). Then
# BATCH: start, collate start, end, getitem ns, items, bytes, SLOWEST (index, ns);
# STARTED: start, items, consecutive (1: the indices run on from the first; 2: an
# IterableDataset's places in this worker's stream, from the first), SHOWN indices.
RECORD = struct.Struct("<iiiiqq" + "qqqqqq" + "qq" * SLOWEST)
STARTED_RECORD = struct.Struct("<iiiiqq" + "qqq" + "q" * SHOWN)
MAX_RECORDS = 100_000  # per worker file, of both kinds (14.4 MB): bounded
PREFIX = "w"
INDEX_LIMIT = 1 << 62  # an index a record holds (another key of a dataset: -1, "not an index")


class WorkerInit:
    """The loader's `worker_init_fn` during a traced cell: the watch's start in the worker,
    then the user's own init (`user`, None when there was none)."""

    def __init__(self, directory: str, user: Callable[[int], Any] | None) -> None:
        self.directory, self.user = directory, user

    def __call__(self, worker_id: int) -> None:
        """In a worker, once: time its fetchers, then run the user's init."""
        if os.path.isdir(self.directory):
            _Timing.start(self.directory, worker_id)
        if self.user is not None:
            self.user(worker_id)


class _Timing:
    """One worker's timing: the fetchers' `fetch` replaced in this process only; one file."""

    active: _Timing | None = None

    def __init__(self, directory: str, worker_id: int, fetchers: list[tuple[Any, Any]]) -> None:
        self.directory, self.worker_id, self.pid = directory, worker_id, os.getpid()
        self.fetchers = fetchers  # (class, its own fetch) to put back
        self.ordinal, self.written = -1, 0  # the fetch under way (its STARTED and BATCH records)
        self.passes, self.fetcher = -1, 0  # a new fetcher (id) in the worker: a new pass over the loader
        path = os.path.join(directory, f"{PREFIX}{worker_id}-{self.pid}.bin")
        self.file: Any = open(path, "ab", buffering=0)  # noqa: SIM115  (closed in stop)

    @classmethod
    def start(cls, directory: str, worker_id: int) -> None:
        """Time this worker's fetchers (nothing when torch's are not the ones this knows)."""
        if cls.active is not None:  # (a worker re-initialised: never twice)
            return
        fetchers = known_fetchers()
        if not fetchers:
            return
        try:
            cls.active = _Timing(directory, worker_id, fetchers)
        except OSError:
            return  # (no file: nothing measured in this worker)
        for kind, original in fetchers:
            kind.fetch = _timed_fetch(original, kind.__name__ == "_IterableDatasetFetcher")

    def stop(self) -> None:
        """The cell ended: the fetchers as they were, the file closed."""
        for kind, original in self.fetchers:
            kind.fetch = original
        _Timing.active = None
        self.file.close()

    def started(self, fetcher: Any, task: int, start: int, index: Any, stream: int | None) -> None:
        """A fetch begins: its pass, task and sample indices (the STARTED record; an
        IterableDataset's: the places in this worker's stream from `stream` on)."""
        if id(fetcher) != self.fetcher:
            self.fetcher, self.passes = id(fetcher), self.passes + 1
        self.ordinal += 1
        many = isinstance(index, (list, tuple))
        n = len(index) if many else 1
        if stream is not None:
            indices, run = list(range(stream, stream + min(n, SHOWN))), 2
        else:
            indices = [i for i in index[:SHOWN] if type(i) is int and 0 <= i < INDEX_LIMIT] if many else [index] if type(index) is int else []
            run = int(len(indices) == min(n, SHOWN) > 0 and list(index) == list(range(indices[0], indices[0] + n)))
        self._write(STARTED_RECORD, STARTED, task, start, n, run, *indices, *[-1] * (SHOWN - len(indices)))

    def write(self, task: int, start: int, collate: int, end: int, getitem: int, items: int, nbytes: int, slow: list[tuple[int, int]]) -> None:
        """One batch's record, the fetch done (the BATCH record)."""
        slow = sorted(slow, key=lambda pair: -pair[1])[:SLOWEST]
        flat = [v for pair in slow for v in pair] + [-1, 0] * (SLOWEST - len(slow))
        self._write(RECORD, BATCH, task, start, collate, end, getitem, items, nbytes, *flat)

    def _write(self, layout: struct.Struct, kind: int, task: int, *fields: int) -> None:
        """A record (nothing once the file holds MAX_RECORDS, or once it cannot be written)."""
        if self.written >= MAX_RECORDS:
            return
        try:
            self.file.write(layout.pack(kind, self.pid, self.worker_id, self.passes, self.ordinal, task, *fields))
        except (OSError, struct.error):
            self.written = MAX_RECORDS  # (a full disk, a figure past 64 bits: nothing more written)
        self.written += 1


def known_fetchers() -> list[tuple[Any, Any]]:
    """torch's two fetcher classes with their own `fetch` ([] when this torch has other ones:
    then nothing is timed, and the user's init still runs)."""
    try:
        from torch.utils.data._utils import fetch as fetch_module
    except ImportError:
        return []
    kinds = [getattr(fetch_module, name, None) for name in ("_MapDatasetFetcher", "_IterableDatasetFetcher")]
    found = [(k, vars(k).get("fetch")) for k in kinds if isinstance(k, type)]
    return found if len(found) == 2 and all(callable(f) for _, f in found) else []


class _TimedItems:
    """The dataset as the fetcher sees it during one fetch: each `dataset[i]` timed."""

    def __init__(self, dataset: Any, times: list[tuple[int, int]]) -> None:
        self._dataset, self._times = dataset, times

    def __getitem__(self, index: Any) -> Any:
        t0 = time.monotonic_ns()
        item = self._dataset[index]
        self._times.append((index if type(index) is int and 0 <= index < INDEX_LIMIT else -1, time.monotonic_ns() - t0))
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dataset, name)  # (`__getitems__` and the rest: the user's own)


class _TimedIter:
    """An IterableDataset's iterator during one fetch: each item timed (its index: the count)."""

    def __init__(self, inner: Iterator[Any], times: list[tuple[int, int]], first: int) -> None:
        self._inner, self._times, self._n = inner, times, first

    def __iter__(self) -> _TimedIter:
        return self

    def __next__(self) -> Any:
        t0 = time.monotonic_ns()
        item = next(self._inner)
        self._times.append((self._n, time.monotonic_ns() - t0))
        self._n += 1
        return item


class _TimedCollate:
    """`collate_fn` during one fetch: its start taken."""

    def __init__(self, collate: Any) -> None:
        self.collate, self.started = collate, 0

    def __call__(self, data: Any) -> Any:
        self.started = time.monotonic_ns()
        return self.collate(data)


def _timed_fetch(original: Callable[[Any, Any], Any], iterable: bool) -> Callable[[Any, Any], Any]:
    items_seen = [0]  # an IterableDataset's items so far in this worker

    def fetch(self: Any, possibly_batched_index: Any) -> Any:
        timing = _Timing.active
        if timing is None or not os.path.isdir(timing.directory):
            if timing is not None:
                timing.stop()
            return original(self, possibly_batched_index)
        task = _task()
        timing.started(self, task, time.monotonic_ns(), possibly_batched_index, items_seen[0] if iterable else None)
        times: list[tuple[int, int]] = []
        collate = _TimedCollate(self.collate_fn)
        self.collate_fn = collate
        if iterable:
            inner = self.dataset_iter
            self.dataset_iter = _TimedIter(inner, times, items_seen[0])
        else:
            inner = self.dataset
            self.dataset = _TimedItems(inner, times)
        start = time.monotonic_ns()
        done = False
        try:
            batch = original(self, possibly_batched_index)
            done = True
        finally:
            if not done:  # the error goes on as without us: torch's text of it shows no frame of ours
                _hide_ours(sys.exc_info()[1])
            end = time.monotonic_ns()
            self.collate_fn = collate.collate
            if iterable:
                self.dataset_iter = inner
                items_seen[0] += len(times)
            else:
                self.dataset = inner
        started = collate.started or end
        getitem = sum(ns for _, ns in times) if times else started - start
        timing.write(task, start, started, end, getitem, len(times), read_or(-1, nbytes, batch), times)
        return batch

    return fetch


def _hide_ours(error: BaseException | None) -> None:
    """Our frames (this module's: the fetch, the timed dataset, iterator and collate_fn) out of
    `error`'s traceback, which torch formats into the error the training process raises: the
    user reads the same worker traceback as without traceml (their frames and torch's)."""
    if error is None:
        return
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    error.__traceback__ = head = tb
    while tb is not None and tb.tb_next is not None:
        if tb.tb_next.tb_frame.f_code.co_filename == __file__:
            tb.tb_next = tb.tb_next.tb_next
        else:
            tb = tb.tb_next
    del head


def _task() -> int:
    """torch's index of the batch being fetched (its worker loop's `idx`, sent with the sample
    indices; the loop receives the batch by it), -1 when the caller is not that loop."""
    caller = sys._getframe(2)
    if caller.f_code.co_name != "_worker_loop":
        return -1
    idx = caller.f_locals.get("idx")
    return idx if type(idx) is int else -1


def nbytes(batch: Any, depth: int = 0) -> int:
    """The bytes of a batch's tensors and arrays (through lists, tuples and dicts, 3 levels)."""
    size = getattr(batch, "nbytes", None)
    if isinstance(size, int):
        return size
    if depth >= 3:
        return 0
    if isinstance(batch, dict):
        return sum(nbytes(v, depth + 1) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(nbytes(v, depth + 1) for v in batch[:64])
    return 0


def read_records(directory: str) -> list[tuple[int, ...]]:
    """Every worker's records in `directory`, in the order each worker wrote them, of both
    kinds (a record cut short by a worker's end: left out). A plain read of files: a dead
    worker's file reads as any other."""
    out: list[tuple[int, ...]] = []
    for name in sorted(os.listdir(directory)):
        if not name.startswith(PREFIX):
            continue
        try:
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read(MAX_RECORDS * RECORD.size)
        except OSError:
            continue
        for at in range(0, len(data) - len(data) % RECORD.size, RECORD.size):
            layout = STARTED_RECORD if data[at] == STARTED else RECORD
            out.append(layout.unpack_from(data, at))
    return out
