"""The worker that stopped the loop, and the batches of a pass left early, on records made by
hand (analysis/loader_inside.py): a worker that died is named with its pid, how it ended, the
samples it was loading and the batches it had made, with the fix that fits; a worker whose
error torch re-raised, or that was late past the timeout, likewise; a batch received is matched
to the one its worker made by torch's task in that pass, not by order."""

from __future__ import annotations

from traceml_jupyter.analysis.loader_inside import inside_lines, stop_findings, summarise

MS = 1_000_000


def record(pid: int, worker: int, k: int, start_ms: float, getitem_ms: float, collate_ms: float, task: int,
           passes: int = 0) -> tuple[int, ...]:  # fmt: skip
    """A worker's BATCH record (worker_side.RECORD; ms from 0): its k-th fetch, torch's task `task`."""
    start, collate = int(start_ms * MS), int((start_ms + getitem_ms) * MS)
    end = collate + int(collate_ms * MS)
    return (0, pid, worker, passes, k, task, start, collate, end, int(getitem_ms * MS), 8, 64, *[-1, 0] * 4)


def started(pid: int, worker: int, k: int, task: int, samples: list[int], n: int | None = None, passes: int = 0,
            consecutive: bool = True, stream: bool = False) -> tuple[int, ...]:  # fmt: skip
    """A worker's STARTED record (worker_side.STARTED_RECORD): its k-th fetch begun (`stream`:
    an IterableDataset's, its places in the worker's stream)."""
    shown = samples[:11] + [-1] * (11 - len(samples[:11]))
    return (1, pid, worker, passes, k, task, 0, len(samples) if n is None else n, 2 if stream else int(consecutive), *shown)


def made(pid: int, worker: int, batches: int) -> list[tuple[int, ...]]:
    """`batches` fetches begun and done (tasks worker, worker + 2, ...: two workers)."""
    out = []
    for k in range(batches):
        task = worker + 2 * k
        out += [started(pid, worker, k, task, list(range(8 * task, 8 * task + 8))), record(pid, worker, k, 10.0 * k, 8.0, 1.0, task=task)]
    return out


def test_a_worker_killed_by_the_oom_killer_is_named_with_the_samples_it_was_loading() -> None:
    # Worker 1 (pid 101) made batches 1 and 3, began batch 5 (samples 40-47) and was SIGKILLed.
    records = made(100, 0, 3) + made(101, 1, 2) + [started(101, 1, 2, 5, list(range(40, 48)))]
    error = (0, 100, 0, 4, "RuntimeError: DataLoader worker (pid(s) 101) exited unexpectedly")
    inside = summarise(records, [], 0, [], [error], [(1, 101, -9)])
    (stop,) = inside["stopped"]
    assert (stop["worker"], stop["pid"], stop["how"], stop["code"], stop["batches"]) == (1, 101, "died", -9, 2)
    assert stop["samples"] == list(range(40, 48)) and stop["in_batch"] == 8 and stop["error"] == error[4]
    (found,) = stop_findings(inside)
    assert found["label"] == "WORKER DIED"
    assert found["text"] == "DataLoader worker 1 (pid 101) died (killed by signal 9, SIGKILL: out of memory?) while loading samples 40-47, after 2 batches"
    assert "fewer workers" in found["fix"] and "prefetch_factor" in found["fix"]
    assert inside_lines(inside)[0].startswith("inside the loader, WORKER DIED: DataLoader worker 1 (pid 101) died")


def test_how_a_worker_ended_chooses_the_fix() -> None:
    records = made(100, 0, 1) + [started(100, 0, 1, 2, [7, 3, 19, 4, 11, 2, 30, 8], consecutive=False)]
    crashed = stop_findings(summarise(records, [], 0, [], [], [(0, 100, -11)]))[0]
    assert crashed["text"] == ("DataLoader worker 0 (pid 100) crashed (signal 11, SIGSEGV) while loading samples "
                               "7, 3, 19, 4, 11, 2, ... (8 in the batch), after 1 batch")  # fmt: skip
    assert "native code" in crashed["fix"]
    exited = stop_findings(summarise(records, [], 0, [], [], [(0, 100, 3)]))[0]
    assert "exited with code 3" in exited["text"] and "num_workers=0" in exited["fix"]
    assert "shared memory" in stop_findings(summarise(records, [], 0, [], [], [(0, 100, -7)]))[0]["fix"]
    # An IterableDataset's worker: its items' places in its stream, not indices.
    stream = made(100, 0, 1) + [started(100, 0, 1, 2, list(range(8, 16)), stream=True)]
    assert "while loading items 8-15 of its stream" in stop_findings(summarise(stream, [], 0, [], [], [(0, 100, -9)]))[0]["text"]
    # Died between two fetches (its last record a batch done): no samples named.
    idle = stop_findings(summarise(made(100, 0, 2), [], 0, [], [], [(0, 100, -9)]))[0]
    assert idle["text"].endswith("SIGKILL: out of memory?), after 2 batches")


def test_a_worker_whose_error_torch_reraised_and_a_late_one_are_named() -> None:
    # The loop awaited task 2 (worker 0, samples 16-23) when torch re-raised the worker's error;
    # worker 1 was busy with task 3 at the time (not the one named).
    records = made(100, 0, 1) + made(101, 1, 1) + [started(100, 0, 1, 2, list(range(16, 24))), started(101, 1, 1, 3, list(range(24, 32)))]
    raised = (0, 100, 0, 2, "ValueError: Caught ValueError in DataLoader worker process 0.")
    (stop,) = summarise(records, [], 0, [], [raised], [])["stopped"]
    assert (stop["worker"], stop["how"], stop["samples"][0], stop["batches"]) == (0, "raised", 16, 1)
    (found,) = stop_findings(summarise(records, [], 0, [], [raised], []))
    assert found["text"] == "DataLoader worker 0 (pid 100) raised ValueError while loading samples 16-23, after 1 batch"
    late = (0, 100, 0, 2, "RuntimeError: DataLoader timed out after 2 seconds")
    (found,) = stop_findings(summarise(records, [], 0, [], [late], []))
    assert found["label"] == "WORKER LATE" and "samples 16-23 when the loader's timeout passed" in found["text"]
    # Another error of next() (a sampler's, the user's interrupt): no worker is named.
    other = (0, 100, 0, 2, "IndexError: list index out of range")
    assert summarise(records, [], 0, [], [other], [])["stopped"] == []


def test_a_worker_that_died_before_its_first_batch_is_still_named() -> None:
    inside = summarise([started(100, 0, 0, 0, list(range(8)))], [], 0, [], [], [(0, 100, -9)])
    assert inside["batches"] == 0 and inside["workers"] == []
    assert inside_lines(inside) == [
        "inside the loader, WORKER DIED: DataLoader worker 0 (pid 100) died (killed by signal 9, SIGKILL: out of memory?) "
        "while loading samples 0-7, after 0 batches - " + stop_findings(inside)[0]["fix"]
    ]


def test_after_an_early_break_the_next_passes_batches_are_matched_by_their_task() -> None:
    # Persistent worker 0: pass 0 made tasks 0 and 2, the loop took task 0 and left (break);
    # task 2 was made and never received. Pass 1 made tasks 0 and 2, both received.
    records = [record(100, 0, 0, 0.0, 8.0, 1.0, task=0), record(100, 0, 1, 10.0, 8.0, 1.0, task=2),
               record(100, 0, 2, 100.0, 8.0, 1.0, task=0, passes=1), record(100, 0, 3, 110.0, 8.0, 1.0, task=2, passes=1)]  # fmt: skip
    receptions = [(100, 0, 0, 5 * MS, 10 * MS), (100, 1, 0, 105 * MS, 110 * MS), (100, 1, 2, 115 * MS, 120 * MS)]
    inside = summarise(records, receptions, 0)
    assert inside["received"] == 3
    received = [(bar["start_ms"], bar["received_ms"]) for bar in inside["lanes"]]
    assert received == [(0.0, 10.0), (10.0, None), (100.0, 110.0), (110.0, 120.0)]  # the left-behind batch: not received
    assert inside["handing_over_ms"] == 3.0  # (ready 9 ms after its start, received 1 ms later: each)
