"""The live lanes of the watch inside the DataLoader (docs/loader-inside.md#live-lanes): while
the cell runs, the workers' records (worker_side.RECORD) read incrementally — only what is new
since the last read, each worker file from its offset, a record cut short left for the next
read, a worker file that appears late picked up — with the loop's receptions the watch notes.

Read by the live view's tick (at most 4 times a second, never from the step's path), kept as
data: per worker lane its batches so far and its newest batches (start, collate start, end,
received; bounded), and the loop's newest waits for a batch. The view only draws them. Nothing
is held open between reads (each file is opened, read from its offset and closed), so the
watch removes its directory at the cell's end as before; `close()`, just before that, takes
the last records when the live view has read any."""

from __future__ import annotations

import os
from collections import deque
from time import perf_counter_ns
from typing import Protocol

import numpy as np

from .worker_side import BATCH, MAX_RECORDS, PREFIX, RECORD

LANE_KEEP = 64  # the newest batches a lane keeps for the chart
BARS_KEPT = 512  # and at most this many over all the lanes (many workers: fewer each)
WAITS_KEPT = 512  # the loop's newest waits for a batch
STALE = 16  # a worker file that did not grow for this many reads is looked at every STALE-th
MS = 1e6  # ns in a ms
FILE_CAP = MAX_RECORDS * RECORD.size  # the most a worker's file holds
# worker_side.RECORD as numpy reads it (little-endian, packed): the fields the lanes read named
# (a STARTED record, of the same size, reads with its kind and is left out)
RECORDS = np.dtype(
    [("kind", "<i4"), ("pid", "<i4"), ("worker", "<i4"), ("pass", "<i4"), ("ordinal", "<i8"), ("task", "<i8"),
     ("start", "<i8"), ("collate", "<i8"), ("end", "<i8"), ("rest", "<i8", (RECORD.size - 56) // 8)]
)  # fmt: skip


class Watched(Protocol):
    """What the lanes read of the watch (watch.LoaderInside): its private directory while the
    cell runs (None before and after), the loop's receptions (worker pid, pass, task, asked,
    received; appended in order) and when the watch began (monotonic ns)."""

    directory: str | None
    receptions: list[tuple[int, int, int, int, int]]
    began_ns: int


class LiveLanes:
    """The workers' lanes so far, read incrementally (`read()`), bounded whatever the run's length."""

    def __init__(self, watch: Watched) -> None:
        self.watch: Watched | None = watch
        self.began_ns = watch.began_ns
        self.offsets: dict[str, int] = {}  # a worker file's name -> bytes read (whole records)
        self.idle: dict[str, int] = {}  # a worker file's name -> reads since it last grew
        self.batches: dict[int, int] = {}  # worker id -> its batches read so far
        self.busy_ns: dict[int, int] = {}  # worker id -> its batches' time (start to end)
        self.bars: dict[int, deque[list[int]]] = {}  # worker id -> newest [start, collate, end, received or -1]
        # (pid, pass, task) -> the bar of a batch not received yet (the newest BARS_KEPT)
        self.unreceived: dict[tuple[int, int, int], list[int]] = {}
        self.receptions_read = 0
        self.waits = np.zeros((0, 2), dtype=np.int64)  # the newest (asked, received), at most WAITS_KEPT
        self.records = 0  # batches read in all
        self.reads = 0
        self.read_ns = 0  # the reads' time (the benchmark's figure)

    def read(self) -> int:
        """What the workers wrote and the loop received since the last read; the batches read."""
        watch = self.watch
        directory = watch.directory if watch is not None else None
        if watch is None or directory is None:
            return 0
        began = perf_counter_ns()
        try:
            names = os.listdir(directory)
        except OSError:  # (the directory gone: the cell ended)
            names = []
        n = sum(self._read_file(directory, name) for name in names if name.startswith(PREFIX))
        self._read_receptions(watch.receptions)
        self.records += n
        self.reads += 1
        self.read_ns += perf_counter_ns() - began
        return n

    def close(self) -> None:
        """The cell ends (before the watch removes its directory): the last records, when the
        live view read any; then nothing more is read."""
        if self.reads:
            self.read()
        self.watch = None

    def _read_file(self, directory: str, name: str) -> int:
        """A worker file's whole records since its offset (one `stat` when it has none; a file
        that has not grown for STALE reads — its worker gone — looked at every STALE-th read)."""
        offset, idle = self.offsets.get(name, 0), self.idle.get(name, 0)
        if idle >= STALE and self.reads % STALE:
            return 0
        path = os.path.join(directory, name)
        try:
            size = min(os.stat(path).st_size, FILE_CAP)
            n = (size - offset) // RECORD.size  # (a record being written: the next read's)
            if n <= 0:
                self.idle[name] = idle + 1
                return 0
            fd = os.open(path, os.O_RDONLY)
            try:
                data = os.pread(fd, n * RECORD.size, offset)
            finally:
                os.close(fd)
        except OSError:
            return 0
        n = len(data) // RECORD.size
        self.offsets[name], self.idle[name] = offset + n * RECORD.size, 0
        return self._add(np.frombuffer(data, dtype=RECORDS, count=n)) if n else 0

    def _add(self, rows: np.ndarray) -> int:
        """A worker file's new records (one worker process a file): its lane's count and busy
        time in bulk; its newest batches kept as bars, awaiting the loop's reception (by the
        batch's pass and torch's task in it, as the report matches)."""
        rows = rows[rows["kind"] == BATCH]
        if not len(rows):
            return 0
        worker, pid = int(rows["worker"][0]), int(rows["pid"][0])
        lane = self.bars.get(worker)
        if lane is None:
            lane = self.bars[worker] = deque(maxlen=LANE_KEEP)
            self.batches[worker] = self.busy_ns[worker] = 0
        self.batches[worker] += len(rows)
        self.busy_ns[worker] += int(rows["end"].sum() - rows["start"].sum())
        pending = self.unreceived
        newest = rows[-LANE_KEEP:]
        columns = (newest[c].tolist() for c in ("pass", "task", "start", "collate", "end"))
        for passes, task, start, collate, end in zip(*columns, strict=True):
            bar = [start, collate, end, -1]
            lane.append(bar)
            if task >= 0:
                pending[(pid, passes, task)] = bar
        while len(pending) > BARS_KEPT:  # (the oldest first: a batch never received, left behind)
            del pending[next(iter(pending))]
        return len(rows)

    def _read_receptions(self, receptions: list[tuple[int, int, int, int, int]]) -> None:
        """The loop's new receptions: its waits, and each matched to its batch (by its worker,
        pass and torch's task, as the report matches)."""
        new = receptions[self.receptions_read :]
        if not new:
            return
        self.receptions_read += len(new)
        got = np.array([r[3:5] for r in new[-WAITS_KEPT:]], dtype=np.int64)
        self.waits = np.concatenate([self.waits, got])[-WAITS_KEPT:]
        for pid, passes, task, _, received in new:
            bar = self.unreceived.pop((pid, passes, task), None)
            if bar is not None:
                bar[3] = received

    # -- what the live view draws -----------------------------------------------------------
    def counts(self) -> dict[int, tuple[int, float]]:
        """Per worker id: its batches so far and their mean ms (start to end)."""
        return {w: (n, self.busy_ns[w] / n / MS) for w, n in sorted(self.batches.items()) if n}

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """The bars to draw, an array (k, 5) of worker id, start, collate start, end and
        received (NaN: not yet; times in ms from the cell's start), and the loop's waits (m, 2):
        the newest of each lane (at most LANE_KEEP, BARS_KEPT over all), over the time that
        every full lane covers."""
        if not self.bars:
            return np.zeros((0, 5)), np.zeros((0, 2))
        keep = max(8, min(LANE_KEEP, BARS_KEPT // len(self.bars)))
        rows, since = [], -(1 << 62)
        for worker in sorted(self.bars):
            lane = self.bars[worker]
            kept = list(lane)[-keep:] if len(lane) > keep else list(lane)
            if self.batches[worker] >= keep:  # (a full lane: the window starts no earlier)
                since = max(since, kept[0][0])
            rows += [[worker, *bar] for bar in kept]
        ns = np.array(rows, dtype=np.int64)
        ns = ns[ns[:, 3] >= since]
        bars = ns.astype(np.float64)
        bars[:, 1:] = (ns[:, 1:] - self.began_ns) / MS
        bars[ns[:, 4] < 0, 4] = np.nan
        waits = self.waits[self.waits[:, 1] >= since]
        return bars, (waits - self.began_ns) / MS
