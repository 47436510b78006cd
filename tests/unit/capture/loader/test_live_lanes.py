"""The live lanes inside the DataLoader (capture/loader/lanes.py), without a cell: the workers'
records read incrementally, tick after tick, judged against the records the test writes itself
— appended across reads, a record cut short read once complete, a worker's file that appears
late, the loop's receptions matched to their batches — and what a lane keeps stays bounded
however many batches; the lanes drawn (views/live_lanes.py) give a bar per batch kept."""

from __future__ import annotations

import os
import types
from typing import Any

import numpy as np
import pytest

from traceml_jupyter.capture.loader import lanes as live_lanes
from traceml_jupyter.capture.loader.worker_side import BATCH, RECORD, STARTED, STARTED_RECORD
from traceml_jupyter.views.live_lanes import bars_per_lane, lane_lines

MS = 1_000_000


def record(pid: int, worker: int, ordinal: int, start_ms: float, collate_ms: float, end_ms: float, task: int | None = None) -> bytes:
    """One batch's records as a worker writes them: STARTED, then BATCH (times in ms from the
    watch's start, 0; torch's task in pass 0: the ordinal unless told)."""
    start, collate, end = int(start_ms * MS), int(collate_ms * MS), int(end_ms * MS)
    task = ordinal if task is None else task
    began = STARTED_RECORD.pack(STARTED, pid, worker, 0, ordinal, task, start, 4, 1, *range(4), *[-1] * 7)
    return began + RECORD.pack(BATCH, pid, worker, 0, ordinal, task, start, collate, end, collate - start, 4, 64, *([-1, 0] * 4))


def append(directory: Any, worker: int, pid: int, data: bytes) -> None:
    with open(os.path.join(directory, f"w{worker}-{pid}.bin"), "ab") as f:
        f.write(data)


def by_worker(bars: np.ndarray) -> dict[int, np.ndarray]:
    """The window's bars per worker id: (start, collate start, end, received) rows."""
    return {int(w): bars[bars[:, 0] == w, 1:] for w in np.unique(bars[:, 0])}


def watched(directory: Any) -> Any:
    """The watch as the lanes read it: its directory, the loop's receptions, its start."""
    return types.SimpleNamespace(directory=str(directory), receptions=[], began_ns=0)


def test_records_appended_between_reads_are_read_once_each(tmp_path: Any) -> None:
    lanes = live_lanes.LiveLanes(watched(tmp_path))
    append(tmp_path, 0, 100, b"".join(record(100, 0, k, 10 * k, 10 * k + 6, 10 * k + 9) for k in range(3)))
    assert lanes.read() == 3
    assert lanes.read() == 0  # nothing new
    append(tmp_path, 0, 100, b"".join(record(100, 0, k, 10 * k, 10 * k + 6, 10 * k + 9) for k in range(3, 5)))
    assert lanes.read() == 2
    assert lanes.counts() == {0: (5, pytest.approx(9.0))}
    bars, waits = lanes.window()
    bars = by_worker(bars)
    # start, collate start, end (ms from the watch's start); not received yet: NaN
    expected = np.array([[10 * k, 10 * k + 6, 10 * k + 9] for k in range(5)], dtype=np.float64)
    np.testing.assert_allclose(bars[0][:, :3], expected)
    assert np.isnan(bars[0][:, 3]).all() and len(waits) == 0


def test_a_record_cut_short_is_read_once_it_is_complete(tmp_path: Any) -> None:
    lanes = live_lanes.LiveLanes(watched(tmp_path))
    second = record(100, 0, 1, 20, 25, 30)
    append(tmp_path, 0, 100, record(100, 0, 0, 0, 5, 10) + second[:50])  # a worker mid-write
    assert lanes.read() == 1
    assert lanes.counts()[0][0] == 1
    append(tmp_path, 0, 100, second[50:])
    assert lanes.read() == 1
    bars, _ = lanes.window()
    bars = by_worker(bars)
    np.testing.assert_allclose(bars[0][:, :3], [[0, 5, 10], [20, 25, 30]])


def test_a_workers_file_that_appears_late_gets_its_own_lane(tmp_path: Any) -> None:
    lanes = live_lanes.LiveLanes(watched(tmp_path))
    append(tmp_path, 0, 100, record(100, 0, 0, 0, 5, 10))
    assert lanes.read() == 1 and set(lanes.counts()) == {0}
    append(tmp_path, 1, 101, record(101, 1, 0, 3, 9, 12) + record(101, 1, 1, 12, 18, 21))
    assert lanes.read() == 2
    assert {w: n for w, (n, _) in lanes.counts().items()} == {0: 1, 1: 2}


def test_the_loops_receptions_are_matched_to_the_batch_each_worker_made(tmp_path: Any) -> None:
    watch = watched(tmp_path)
    lanes = live_lanes.LiveLanes(watch)
    # torch's tasks 0 and 2 went to worker 0, task 1 to worker 1 (receptions: pid, pass, task, asked, received)
    append(tmp_path, 0, 100, record(100, 0, 0, 0, 5, 10, task=0) + record(100, 0, 1, 10, 15, 20, task=2))
    append(tmp_path, 1, 101, record(101, 1, 0, 0, 6, 12, task=1))
    watch.receptions += [(100, 0, 0, 8 * MS, 11 * MS), (101, 0, 1, 11 * MS, 13 * MS)]
    lanes.read()
    bars, waits = lanes.window()
    bars = by_worker(bars)
    assert bars[0][0, 3] == 11 and np.isnan(bars[0][1, 3]) and bars[1][0, 3] == 13
    watch.receptions.append((100, 0, 2, 13 * MS, 21 * MS))  # the next read: worker 0's second batch
    lanes.read()
    bars, waits = lanes.window()
    bars = by_worker(bars)
    assert bars[0][1, 3] == 21
    np.testing.assert_allclose(waits, [[8, 11], [11, 13], [13, 21]])


def test_what_a_lane_keeps_is_bounded_however_many_batches(tmp_path: Any) -> None:
    watch = watched(tmp_path)
    lanes = live_lanes.LiveLanes(watch)
    n = 5_000
    for worker in (0, 1):
        append(tmp_path, worker, 100 + worker, b"".join(record(100 + worker, worker, k, k, k + 0.5, k + 0.9) for k in range(n)))
        watch.receptions += [(100 + worker, 0, k, k * MS, int((k + 1) * MS)) for k in range(n)]
    assert lanes.read() == 2 * n
    assert {w: c for w, (c, _) in lanes.counts().items()} == {0: n, 1: n}
    bars, waits = lanes.window()
    bars = by_worker(bars)
    assert all(len(b) == live_lanes.LANE_KEEP for b in bars.values())
    assert all(b[-1, 0] == n - 1 for b in bars.values())  # the newest
    assert len(waits) <= live_lanes.WAITS_KEPT
    x, y = lane_lines(*lanes.window())
    # a row per stage, three points a bar: bounded by what the lanes keep
    assert x.shape == y.shape and x.shape[0] == 4 and x.shape[1] <= 3 * max(live_lanes.LANE_KEEP, live_lanes.WAITS_KEPT)
    assert bars_per_lane(y) == {0: live_lanes.LANE_KEEP, 1: live_lanes.LANE_KEEP}


def test_close_takes_the_last_records_only_for_a_view_that_read_and_then_reads_nothing(tmp_path: Any) -> None:
    watch = watched(tmp_path)
    unread = live_lanes.LiveLanes(watch)
    lanes = live_lanes.LiveLanes(watch)
    lanes.read()
    append(tmp_path, 0, 100, record(100, 0, 0, 0, 5, 10))
    lanes.close()
    unread.close()
    assert lanes.counts() == {0: (1, pytest.approx(10.0))}
    assert unread.counts() == {} and unread.reads == 0  # no live view: the files never read
    append(tmp_path, 0, 100, record(100, 0, 1, 10, 15, 20))
    assert lanes.read() == 0  # closed: the watch's directory is no longer the lanes' to read
    watch.directory = None  # the watch removed it
    assert live_lanes.LiveLanes(watch).read() == 0


def test_the_window_covers_the_time_every_full_lane_covers(tmp_path: Any) -> None:
    watch = watched(tmp_path)
    lanes = live_lanes.LiveLanes(watch)
    keep = live_lanes.LANE_KEEP
    # worker 0 makes a batch every ms, worker 1 every 10 ms: both lanes full
    append(tmp_path, 0, 100, b"".join(record(100, 0, k, k, k + 0.5, k + 1) for k in range(10 * keep)))
    append(tmp_path, 1, 101, b"".join(record(101, 1, k, 10 * k, 10 * k + 5, 10 * k + 10) for k in range(keep)))
    lanes.read()
    bars, _ = lanes.window()
    bars = by_worker(bars)
    since = 10 * keep - keep  # worker 0's oldest kept batch starts here
    assert bars[0][0, 0] == since and len(bars[0]) == keep
    assert (bars[1][:, 2] >= since).all() and len(bars[1]) == keep // 10 + 1


def test_a_file_that_stopped_growing_is_looked_at_less_often_and_still_read(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = live_lanes.LiveLanes(watched(tmp_path))
    append(tmp_path, 0, 100, record(100, 0, 0, 0, 5, 10))
    lanes.read()
    for _ in range(live_lanes.STALE):  # its worker idle (or gone): nothing new
        lanes.read()
    looked: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(live_lanes.os, "stat", lambda path: looked.append(path) or real_stat(path))
    for _ in range(live_lanes.STALE):
        lanes.read()
    assert len(looked) == 1  # once in STALE reads
    append(tmp_path, 0, 100, record(100, 0, 1, 10, 15, 20))
    reads = 0
    while lanes.counts()[0][0] == 1:  # read again within STALE reads
        lanes.read()
        reads += 1
        assert reads <= live_lanes.STALE
    assert lanes.counts()[0][0] == 2 and lanes.idle["w0-100.bin"] == 0


def test_the_watchs_directory_goes_even_when_the_lanes_last_read_fails(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from traceml_jupyter.capture import session
    from traceml_jupyter.capture.loader.watch import LoaderInside

    inside = LoaderInside(object())
    directory = str(tmp_path / "ours")
    os.mkdir(directory)
    inside.directory = directory
    lanes = live_lanes.LiveLanes(inside)
    lanes.read()  # a live view read them

    def broken() -> int:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(lanes, "read", broken)
    watched_as: list[Any] = []
    run = types.SimpleNamespace(loader_lanes=lanes, notes=[], inside_watched=watched_as.append)
    with pytest.raises(RuntimeError):  # (to the capture's edge, which notes it)
        session._inside_read(run, inside)  # type: ignore[arg-type]
    assert not os.path.exists(directory) and watched_as == [None]
