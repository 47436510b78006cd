"""The training process's side of the watch inside the DataLoader (capture/loader/watch.py),
without a cell: the pin-memory thread's batches timed against the time the test's own pinning
function takes (a stand-in: pinning needs an accelerator), torch's function back afterwards;
a worker's records read back whole, a record cut short left out."""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

import pytest
import torch
from torch.utils.data._utils import pin_memory as pinning

from traceml_jupyter.analysis.loader_inside import summarise
from traceml_jupyter.capture.loader import watch, worker_side


def test_the_pin_memory_threads_batches_are_timed_and_torchs_function_is_back(monkeypatch: pytest.MonkeyPatch) -> None:
    own: list[float] = []

    def stand_in(data: Any, device: Any = None) -> Any:  # pins a batch in 5 ms
        t0 = time.monotonic_ns()
        time.sleep(0.005)
        own.append((time.monotonic_ns() - t0) / 1e6)
        return data

    monkeypatch.setattr(pinning, "pin_memory", stand_in)
    inside = watch.LoaderInside(object())
    with inside.patches():
        assert pinning.pin_memory is not stand_in
        batch = torch.zeros(4)
        out: list[Any] = []
        thread = threading.Thread(target=lambda: out.extend(pinning.pin_memory(batch, None) for _ in range(3)))
        thread.start()
        thread.join()
    assert pinning.pin_memory is stand_in  # as it was
    assert all(x is batch for x in out)
    assert len(inside.pinned) == 3
    ours = [(t1 - t0) / 1e6 for t0, t1 in inside.pinned]
    assert all(o >= mine for o, mine in zip(ours, own, strict=True))  # ours encloses the stand-in's own timer
    record = (0, 1, 0, 0, 0, 0, 0, 1, 2, 1, 1, 4, -1, 0, -1, 0, -1, 0, -1, 0)
    figures = summarise([record], [], 0, inside.pinned)
    assert figures["pinned"] == 3 and figures["pin_ms"] == pytest.approx(sum(ours) / 3)
    inside.close([])


def test_a_workers_records_are_read_back_and_a_record_cut_short_left_out(tmp_path: Any) -> None:
    rows = [(0, 7, 1, 0, k, 2 * k + 1, 10 * k, 10 * k + 5, 10 * k + 9, 5, 4, 64, 3, 2, -1, 0, -1, 0, -1, 0) for k in range(3)]
    started = (1, 7, 1, 0, 3, 7, 30, 4, 1, 40, 41, 42, 43, *[-1] * 7)  # a fetch begun: samples 40-43
    data = b"".join(worker_side.RECORD.pack(*row) for row in rows) + worker_side.STARTED_RECORD.pack(*started)
    (tmp_path / "w1-7.bin").write_bytes(data + data[:50])  # a worker killed mid-write
    (tmp_path / "other.txt").write_text("not ours")
    assert worker_side.read_records(str(tmp_path)) == [*rows, started]


def test_in_a_worker_the_users_init_runs_once_after_ours_and_the_fetchers_come_back(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.data._utils.fetch import _MapDatasetFetcher

    torch_fetch = _MapDatasetFetcher.fetch
    calls: list[int] = []
    init = worker_side.WorkerInit(str(tmp_path), calls.append)
    init(3)  # (as a worker calls it, here in this process)
    try:
        assert calls == [3] and _MapDatasetFetcher.fetch is not torch_fetch
        fetcher = _MapDatasetFetcher(list(range(10)), True, lambda batch: sum(batch), False)
        assert fetcher.fetch([1, 2, 3]) == 6  # the same batch
        started, record = worker_side.read_records(str(tmp_path))
        assert started[:2] == (worker_side.STARTED, os.getpid()) and started[7:13] == (3, 1, 1, 2, 3, -1)
        assert record[:3] == (worker_side.BATCH, os.getpid(), 3) and record[10] == 3 and {record[12], record[14], record[16]} == {1, 2, 3}
        assert record[5] == started[5] == -1  # (not called by torch's worker loop: no task known)
    finally:
        assert worker_side._Timing.active is not None
        worker_side._Timing.active.stop()
    assert _MapDatasetFetcher.fetch is torch_fetch
    # A torch whose fetchers are not the ones known: nothing timed, the user's init still runs.
    monkeypatch.setattr(worker_side, "known_fetchers", lambda: [])
    init(4)
    assert calls == [3, 4] and _MapDatasetFetcher.fetch is torch_fetch and worker_side._Timing.active is None


class _Corrupt:
    """A dataset whose sample 2 raises, as a corrupt file does."""

    def __getitem__(self, i: int) -> int:
        if i == 2:
            raise ValueError("sample 2 is corrupt")
        return i


def test_a_fetch_that_raises_is_left_started_and_its_traceback_shows_no_frame_of_ours(tmp_path: Any) -> None:
    from torch.utils.data._utils.fetch import _MapDatasetFetcher

    worker_side.WorkerInit(str(tmp_path), None)(0)
    try:
        fetcher = _MapDatasetFetcher(_Corrupt(), True, lambda batch: batch, False)
        assert fetcher.fetch([0, 1]) == [0, 1]
        with pytest.raises(ValueError, match="sample 2 is corrupt") as raised:
            fetcher.fetch([1, 2, 3])
    finally:
        assert worker_side._Timing.active is not None
        worker_side._Timing.active.stop()
    frames = [entry.filename for entry in traceback.extract_tb(raised.value.__traceback__)]
    assert frames[-1] == __file__ and not any(name == worker_side.__file__ for name in frames)
    assert any(name.endswith("fetch.py") for name in frames)  # torch's own frames kept
    kinds = [(r[0], r[4]) for r in worker_side.read_records(str(tmp_path))]
    assert kinds == [(worker_side.STARTED, 0), (worker_side.BATCH, 0), (worker_side.STARTED, 1)]  # the second: begun, not done


def test_an_iterable_datasets_fetch_is_started_with_its_places_in_the_stream(tmp_path: Any) -> None:
    from torch.utils.data._utils.fetch import _IterableDatasetFetcher

    worker_side.WorkerInit(str(tmp_path), None)(1)
    try:
        fetcher = _IterableDatasetFetcher(iter(range(100, 110)), True, list, False)
        assert fetcher.fetch([None] * 4) == [100, 101, 102, 103] and fetcher.fetch([None] * 4) == [104, 105, 106, 107]
    finally:
        assert worker_side._Timing.active is not None
        worker_side._Timing.active.stop()
    started = [r for r in worker_side.read_records(str(tmp_path)) if r[0] == worker_side.STARTED]
    # items, 2 (places in the stream), the places: 0-3, then 4-7
    assert [r[7:13] for r in started] == [(4, 2, 0, 1, 2, 3), (4, 2, 4, 5, 6, 7)]
