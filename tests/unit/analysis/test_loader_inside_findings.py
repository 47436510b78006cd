"""Inside the DataLoader in numbers and words (analysis/loader_inside.py), on records made by
hand: the figures per worker and per stage, the wait's split, each finding and its threshold,
the Next line, compare."""

from __future__ import annotations

from traceml_jupyter.analysis.loader_inside import (
    compare_lines,
    dominant_stage,
    findings,
    inside_lines,
    inside_next,
    slow_samples,
    slow_worker,
    summarise,
)
from traceml_jupyter.analysis.verdict import Verdict

MS = 1_000_000


def record(pid: int, worker: int, k: int, start_ms: float, getitem_ms: float, collate_ms: float, items: int = 4,
           nbytes: int = 1_000_000, slow: tuple[tuple[int, float], ...] = (), task: int | None = None,
           passes: int = 0) -> tuple[int, ...]:  # fmt: skip
    """A worker's BATCH record as worker_side.RECORD holds it (times in ms from 0): its k-th
    fetch, torch's task `task` (k unless told) of pass `passes`."""
    start = int(start_ms * MS)
    collate = start + int(getitem_ms * MS)
    end = collate + int(collate_ms * MS)
    pairs = [v for i, ms in slow for v in (i, int(ms * MS))]
    pairs += [-1, 0] * (4 - len(slow))
    return (0, pid, worker, passes, k, k if task is None else task, start, collate, end, int(getitem_ms * MS), items, nbytes, *pairs)


def two_workers(slow_ms: float = 10.0, collate_ms: float = 1.0) -> list[tuple[int, ...]]:
    rows = []
    for k in range(4):
        rows.append(record(100, 0, k, 20.0 * k, 8.0, collate_ms, slow=((k * 8, 2.0),)))
        rows.append(record(101, 1, k, 20.0 * k, slow_ms, collate_ms, slow=((k * 8 + 4, 2.5),)))
    return rows


def test_per_worker_and_per_stage() -> None:
    inside = summarise(two_workers(), [], 0)
    assert inside["batches"] == 8 and inside["received"] == 0
    w0, w1 = inside["workers"]
    assert (w0["worker"], w0["batches"], w0["items"]) == (0, 4, 16)
    assert w0["getitem_ms"] == 8.0 and w1["getitem_ms"] == 10.0 and w0["collate_ms"] == 1.0
    assert w0["item_ms"] == 2.0 and w0["busy_ms"] == 36.0
    assert inside["getitem_ms"] == 9.0 and inside["mb_per_batch"] == 1.0
    assert inside["handover_ms"] is None and inside["wait_ms"] is None  # nothing received: unmeasured


def test_the_wait_split_into_producing_and_handing_over() -> None:
    rows = [record(100, 0, 0, 0.0, 8.0, 2.0), record(100, 0, 1, 10.0, 8.0, 2.0)]  # ready at 10 and 20 ms
    # The loop asked at 5 ms (the batch still in the making: 5 ms producing) and got it at 12;
    # asked the second at 25 ms (ready since 20) and got it at 26 (all of it handing over).
    receptions = [(100, 0, 0, 5 * MS, 12 * MS), (100, 0, 1, 25 * MS, 26 * MS)]  # (pid, pass, task, asked, received)
    inside = summarise(rows, receptions, 0)
    assert inside["received"] == 2
    assert inside["wait_ms"] == 8.0 and inside["producing_ms"] == 5.0 and inside["handing_over_ms"] == 3.0
    assert inside["handover_ms"] == 1.5
    assert inside["waits"] == [[5.0, 12.0], [25.0, 26.0]]  # beneath the lanes
    bars = inside["lanes"]
    assert [(b["start_ms"], b["end_ms"], b["received_ms"]) for b in bars] == [(0.0, 10.0, 12.0), (10.0, 20.0, 26.0)]


def test_slow_worker_a_batch_and_in_all() -> None:
    assert slow_worker(summarise(two_workers(slow_ms=10.0), [], 0)) is None  # 1.2x: not slow
    found = slow_worker(summarise(two_workers(slow_ms=40.0), [], 0))
    assert found is not None and found["label"] == "SLOW WORKER" and found["text"].startswith("worker 1 took 41.0 ms a batch")
    # Uneven shards: the same time a batch, worker 0 makes 6 batches, worker 1 two.
    uneven = [record(100, 0, k, 10.0 * k, 4.0, 1.0) for k in range(6)] + [record(101, 1, k, 10.0 * k, 4.0, 1.0) for k in range(2)]
    found = slow_worker(summarise(uneven, [], 0))
    assert found is not None and "worker 0 took 30.0 ms in all" in found["text"]


def test_slow_samples_past_five_times_the_median_and_two_ms() -> None:
    rows = two_workers()
    rows.append(record(100, 0, 4, 100.0, 60.0, 1.0, slow=((40, 50.0), (41, 4.0))))
    found = slow_samples(summarise(rows, [], 0))
    assert found is not None and found["text"].startswith("indices 40 (50 ms) against")
    assert "41" not in found["text"]  # 4 ms: under 5x the median sample (2 ms)
    assert slow_samples(summarise(two_workers(), [], 0)) is None


def test_the_dominant_stage_and_its_figure() -> None:
    assert dominant_stage(summarise(two_workers(), [], 0))["label"] == "GETITEM"  # type: ignore[index]
    found = dominant_stage(summarise(two_workers(collate_ms=40.0), [], 0))
    assert found is not None and found["label"] == "COLLATE" and found["text"].startswith("40.0 ms a batch in collate_fn")
    rows = [record(100, 0, 0, 0.0, 1.0, 1.0, nbytes=25_000_000)]
    found = dominant_stage(summarise(rows, [(100, 0, 0, 2 * MS, 30 * MS)], 0))
    assert found is not None and found["label"] == "TRANSFER" and found["text"].startswith("25.0 MB a batch, 28.0 ms")
    assert dominant_stage(summarise([], [], 0)) is None


def test_lines_next_and_compare() -> None:
    slow = summarise(two_workers(collate_ms=40.0), [], 0)
    fast = summarise(two_workers(collate_ms=4.0), [], 0)
    assert [f["label"] for f in findings(slow)] == ["COLLATE"]
    assert inside_lines(slow)[0].startswith("inside the loader, COLLATE: 40.0 ms a batch")
    assert inside_lines(None) == [] and inside_lines(summarise([], [], 0)) == []
    bound = Verdict("INPUT-BOUND", "warn", "why", "Feed the loop faster.")
    assert inside_next(bound, slow).next.startswith("Feed the loop faster. COLLATE dominates inside the loader")
    other = Verdict("COMPUTE-BOUND", "info", "why", "Make the model faster.")
    assert inside_next(other, slow) is other and inside_next(bound, None) is bound
    assert "collate 40.0 -> 4.0 ms a batch" in compare_lines(slow, fast)
    assert compare_lines(slow, None) == []
