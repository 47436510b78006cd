"""Inside the DataLoader's workers (docs/loader-inside.md): loaders built to each case — slow
samples, a slow worker, a slow collate_fn, a heavy batch — under %%traceml, with fork and spawn,
persistent workers or not. Each case's dataset and collate_fn time themselves in the workers
(tests/loader_cases.py writes their own timings to files): the figures ours are judged by. The
user's worker_init_fn still runs once per worker, the batches are the same bit for bit, and
nothing of ours is left after the cell."""

from __future__ import annotations

import json
import os
from functools import partial
from statistics import mean
from typing import Any

import pytest
import torch
from helpers import note_watch_directories, shell_fixture, traced_and_result
from helpers import run as run_cell
from loader_cases import own_timings

import traceml_jupyter
from traceml_jupyter.result.codec import from_dict, to_dict

SETUP = """
import os, tempfile, time, torch
from torch import nn
from loader_cases import Batched, Buckets, Samples, SlowCollate, Stream, CountInits, loader
model = nn.Linear(8, 2)
"""

TRAIN = """\
for x, y in data:
    model.zero_grad()
    model(x.reshape(len(x), -1)[:, :8]).sum().backward()
"""

run = partial(run_cell, check=True)
shell = shell_fixture(SETUP)


def traced_over(shell: Any, build: str, tmp: Any, name: str) -> tuple[Any, str]:
    """The run of TRAIN over the loader `build` makes (`log` is the test's own timings' folder)."""
    shell.user_ns["log"] = str(tmp)
    run(shell, f"data = {build}")
    before = our_directories()
    got, result = traced_and_result(shell, TRAIN, f"--no-live --name {name}")
    nothing_left(shell, before)
    return got, result.shown


MADE: list[str] = []  # the private directories the watch made in this test


@pytest.fixture(autouse=True)
def _directories_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each private directory the watch makes, noted (other processes of the machine make theirs
    in the same temporary folder: only ours are judged)."""
    MADE.clear()
    note_watch_directories(monkeypatch, MADE)


def our_directories() -> set[str]:
    """The private directories of the watch made in this test that are still there."""
    return {d for d in MADE if os.path.basename(d).startswith("traceml-loader-") and os.path.exists(d)}


def nothing_left(shell: Any, before: set[str]) -> None:
    """torch's classes as they were, the user's worker_init_fn back, no new directory of ours
    (`before`: those there before the cell, another process's)."""
    from torch.utils.data import DataLoader
    from torch.utils.data._utils import fetch
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    assert DataLoader.__iter__.__module__ == "torch.utils.data.dataloader"
    assert _BaseDataLoaderIter.__next__.__module__ == "torch.utils.data.dataloader"
    assert fetch._MapDatasetFetcher.fetch.__module__ == "torch.utils.data._utils.fetch"
    assert "traceml" not in type(shell.user_ns["data"].worker_init_fn).__module__
    assert our_directories() <= before


def test_slow_samples_are_named_with_their_indices_and_their_own_times(shell: Any, tmp_path: Any) -> None:
    # 48 samples of 1 ms, samples 7 and 30 take 60 ms more; 2 forked workers, batches of 8.
    got, shown = traced_over(
        shell, "loader(Samples(48, 1.0, slow=(7, 30), slow_ms=60, log_dir=log), batch_size=8, num_workers=2, "
        "worker_init_fn=CountInits(log), multiprocessing_context='fork')", tmp_path, "slow-samples")
    inside = got.result.data.inside
    assert inside is not None and inside["batches"] == 6 and inside["received"] == 6
    own = {key: (t1 - t0) / 1e6 for key, t0, t1 in own_timings(str(tmp_path), "getitem")}
    slowest = sorted(own, key=lambda k: -own[k])[:2]
    assert sorted(slowest) == [7, 30]  # (the test's own figures say which)
    ours = inside["slow_samples"][:2]
    assert sorted(s["index"] for s in ours) == [7, 30]
    for s in ours:  # ours encloses the dataset's own timer, and little more
        assert own[s["index"]] <= s["ms"] <= own[s["index"]] + 5
    assert "Also: inside the loader, SLOW SAMPLES: indices" in shown
    item = next(i for i in got.result.reading.checklist or () if i["key"] == "per_sample_cost")
    assert item["reason"].endswith(f"Measured in the workers: {inside['item_ms']:.2f} ms a sample (median).")
    # per worker: the batches and samples each made, as the test's own timings count them
    assert sum(w["batches"] for w in inside["workers"]) == 6 and sum(w["items"] for w in inside["workers"]) == 48
    # The report's part: the finding, a row per worker (its pid), a lane per worker with a bar per stage.
    from traceml_jupyter.views.report import report_html

    page = report_html(got)
    part = page[page.index('class="tml-inside"'):]
    assert "SLOW SAMPLES" in part and all(f">{w['pid']}<" in part for w in inside["workers"])
    lanes = part[part.index('<svg class="tml-inside-lanes"'):part.index("</svg>")]
    assert lanes.count(">worker ") == 2 and lanes.count("<rect") >= 2 * 6 and ">loop waits<" in lanes
    # The user's worker_init_fn ran once in each worker; nothing of ours is left.
    inits = own_timings_lines(str(tmp_path), "init")
    assert sorted(inits) == ["0", "1"]


def own_timings_lines(log_dir: str, kind: str) -> list[str]:
    lines: list[str] = []
    for name in os.listdir(log_dir):
        if name.startswith(kind + "-"):
            with open(os.path.join(log_dir, name)) as f:
                lines += [line.strip() for line in f if line.strip()]
    return lines


def test_a_slow_collate_dominates_over_two_passes_of_persistent_workers(shell: Any, tmp_path: Any) -> None:
    # collate_fn sleeps 30 ms a batch; the samples cost nothing; persistent workers, two passes.
    shell.user_ns["log"] = str(tmp_path)
    run(shell, "data = loader(Samples(32, 0.0), batch_size=8, num_workers=2, persistent_workers=True, "
        "collate_fn=SlowCollate(30, log), multiprocessing_context='fork')")
    got, result = traced_and_result(shell, "for epoch in range(2):\n" + "".join("    " + line + "\n" for line in TRAIN.splitlines()),
                                    "--no-live --name slow-collate")
    inside = got.result.data.inside
    assert inside is not None and inside["batches"] == 8  # both passes (4 batches each)
    own = [(t1 - t0) / 1e6 for _, t0, t1 in own_timings(str(tmp_path), "collate")]
    assert len(own) == 8
    assert mean(own) <= inside["collate_ms"] <= mean(own) + 5
    assert "inside the loader, COLLATE:" in result.shown
    # The checklist's collate_fn item reads the measured figure.
    item = next(i for i in got.result.reading.checklist or () if i["key"] == "collate_fn")
    assert item["seen"] == f"SlowCollate: {inside['collate_ms']:.1f} ms a batch" and item["to_try"] == "vectorise it (stack, pad once)"
    assert item["status"] in ("fix", "check") and "Measured in the workers" in item["reason"]
    # After the cell the persistent workers go on without us: a plain pass gives its 4 batches.
    run(shell, "n = sum(1 for _ in data)")
    assert shell.user_ns["n"] == 4
    # A later traced cell over the same workers (started before it): not watched, and said so.
    again, _ = traced_and_result(shell, TRAIN, "--no-live --name again")
    assert again.result.data.inside is None
    assert any("persistent workers started before this cell were not watched" in n for n in again.result.notes)
    # The collate made fast (2 ms): compare says so, stage by stage.
    faster, _ = traced_over(shell, "loader(Samples(32, 0.0), batch_size=8, num_workers=2, collate_fn=SlowCollate(2), "
                            "multiprocessing_context='fork')", tmp_path, "fast-collate")
    after = faster.result.data.inside
    assert after is not None and after["collate_ms"] is not None and after["collate_ms"] < inside["collate_ms"]
    notes = traceml_jupyter.compare("slow-collate", "fast-collate").notes
    assert f"inside the loader: collate {inside['collate_ms']:.1f} -> {after['collate_ms']:.1f} ms a batch" in notes


def test_one_slow_worker_is_named(shell: Any, tmp_path: Any) -> None:
    # worker 1 sleeps 15 ms more a sample (a slow disk): its batches take 5x the others'.
    got, shown = traced_over(
        shell, "loader(Samples(32, 1.0, slow_worker=1, worker_ms=15, log_dir=log), batch_size=4, num_workers=2, "
        "multiprocessing_context='fork')", tmp_path, "slow-worker")
    inside = got.result.data.inside
    assert inside is not None
    own: dict[int, list[float]] = {}
    for name in os.listdir(tmp_path):  # the test's own timings, by worker process
        pid = int(name.split("-")[1].split(".")[0])
        with open(os.path.join(tmp_path, name)) as f:
            own[pid] = [(int(b) - int(a)) / 1e6 for _, a, b in (line.split() for line in f)]
    slow_pid = max(own, key=lambda pid: mean(own[pid]))
    slow = next(w for w in inside["workers"] if w["pid"] == slow_pid)
    assert slow["worker"] == 1 and slow["items"] == len(own[slow_pid])
    assert f"SLOW WORKER: worker {slow['worker']} took" in shown


def test_uneven_shards_of_an_iterable_dataset_name_the_busy_worker(shell: Any, tmp_path: Any) -> None:
    # An IterableDataset whose worker 0 streams 16 items and worker 1 only 4 (5 ms an item).
    got, shown = traced_over(
        shell, "loader(Stream((16, 4), 5.0, log_dir=log), batch_size=2, num_workers=2, multiprocessing_context='fork')",
        tmp_path, "uneven")
    inside = got.result.data.inside
    assert inside is not None and inside["batches"] == 10
    own = {}  # items each worker process streamed, by its own count
    for name in os.listdir(tmp_path):
        with open(os.path.join(tmp_path, name)) as f:
            own[int(name.split("-")[1].split(".")[0])] = sum(1 for _ in f)
    busy_pid = max(own, key=lambda pid: own[pid])
    busy = next(w for w in inside["workers"] if w["pid"] == busy_pid)
    assert busy["items"] == own[busy_pid] == 16
    assert f"SLOW WORKER: worker {busy['worker']} took" in shown and "in all" in shown


def test_a_heavy_batch_is_weighed_and_the_wait_split(shell: Any, tmp_path: Any) -> None:
    # 8 x 3 x 128 x 128 float32 and 8 int64 labels a batch: 1,572,928 bytes.
    got, shown = traced_over(
        shell, "loader(Samples(32, 0.0, shape=(3, 128, 128)), batch_size=8, num_workers=2, multiprocessing_context='fork')",
        tmp_path, "heavy")
    inside = got.result.data.inside
    assert inside is not None and inside["mb_per_batch"] == pytest.approx((8 * 3 * 128 * 128 * 4 + 8 * 8) / 1e6)
    assert inside["handover_ms"] is not None and inside["handover_ms"] >= 0
    wait, producing, handing = inside["wait_ms"], inside["producing_ms"], inside["handing_over_ms"]
    assert wait is not None and producing is not None and handing is not None
    assert producing >= 0 and handing >= 0 and producing + handing == pytest.approx(wait)
    assert wait <= got.result.loop.wall_ms
    assert "the loop waited" in shown and "handing them over" in shown
    # In the JSON (`loader_inside`), and read back the same.
    document = json.loads(json.dumps(to_dict(got.result)))
    assert document["loader_inside"]["mb_per_batch"] == inside["mb_per_batch"]
    assert from_dict(document) == got.result and from_dict(document).data.inside == inside


def batches_of(shell: Any, build: str, traced: bool) -> list[torch.Tensor]:
    run(shell, f"data = {build}")
    cell = "got = [x for x, y in data]\n"
    if traced:
        traced_and_result(shell, cell, "--no-live")
    else:
        run(shell, cell)
    return list(shell.user_ns["got"])


@pytest.mark.parametrize("context", ["fork", *(pytest.param(c, marks=pytest.mark.slow) for c in ("spawn", "forkserver"))])
def test_the_batches_are_the_same_bit_for_bit(shell: Any, context: str, tmp_path: Any) -> None:
    # Random samples (torch.rand in the workers, seeded per worker from the loader's generator):
    # the same batches with and without the watch inside the workers; the user's worker_init_fn
    # runs once a worker in each (its own count), whatever starts the workers.
    shell.user_ns["log"] = str(tmp_path)
    build = (f"loader(Samples(24, 0.0, shape=(4,)), batch_size=4, shuffle=True, num_workers=2, "
             f"worker_init_fn=CountInits(log), multiprocessing_context='{context}')")
    plain = batches_of(shell, build, traced=False)
    assert sorted(own_timings_lines(str(tmp_path), "init")) == ["0", "1"]
    before = our_directories()
    watched = batches_of(shell, build, traced=True)
    nothing_left(shell, before)
    assert traceml_inside(shell) is not None  # (the watch did run)
    assert sorted(own_timings_lines(str(tmp_path), "init")) == ["0", "0", "1", "1"]
    assert len(plain) == len(watched) == 6
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))


def test_a_batch_sampler_of_its_own_gives_the_same_batches_and_its_slow_samples_are_named(shell: Any, tmp_path: Any) -> None:
    # A batch_sampler that groups samples (batches of 3, 5 and 8 in turn, odd indices first), as
    # a length-bucketing sampler does: the same batches as without the magic, each batch's
    # samples as the sampler chose them, and the slow ones named by the indices it gave.
    shell.user_ns["log"] = str(tmp_path)
    build = ("loader(Samples(32, 1.0, slow=(5, 12), slow_ms=40, log_dir=log), batch_sampler=Buckets(32, (3, 5, 8)), "
             "num_workers=2, multiprocessing_context='fork')")
    plain = batches_of(shell, build, traced=False)
    watched = batches_of(shell, build, traced=True)
    assert [len(b) for b in watched] == [3, 5, 8, 3, 5, 8]
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    inside = traceml_inside(shell)
    assert inside is not None and inside["batches"] == 6 and sum(w["items"] for w in inside["workers"]) == 32
    assert sorted(s["index"] for s in inside["slow_samples"][:2]) == [5, 12]


def traceml_inside(shell: Any) -> Any:
    import traceml_jupyter

    last = traceml_jupyter.last()
    return last.result.data.inside if last is not None else None


def test_a_cell_that_raises_mid_pass_leaves_nothing_of_ours(shell: Any, tmp_path: Any) -> None:
    # The user's error after the second batch: it is the cell's error, as without the magic,
    # and the loader, torch's classes and the temporary folder are as they were.
    run(shell, "data = loader(Samples(32, 0.0), batch_size=4, num_workers=2, multiprocessing_context='fork')")
    before = our_directories()
    result = run_cell(shell, "%%traceml --no-live\nfor i, (x, y) in enumerate(data):\n    if i == 2:\n        raise ValueError('bad batch')\n")
    assert isinstance(result.error_in_exec, ValueError) and str(result.error_in_exec) == "bad batch"
    nothing_left(shell, before)
    run(shell, "n = sum(1 for _ in data)")  # the loader as it was
    assert shell.user_ns["n"] == 8


def test_batches_handed_out_of_order_are_measured_in_the_workers_and_not_matched(shell: Any, tmp_path: Any) -> None:
    # in_order=False: the stages in the workers as ever; which batch the loop got from whom is
    # not known, so no hand-over and no wait split (unmeasured, not 0).
    got, shown = traced_over(shell, "loader(Samples(16, 1.0), batch_size=4, num_workers=2, in_order=False, "
                             "multiprocessing_context='fork')", tmp_path, "out-of-order")
    inside = got.result.data.inside
    assert inside is not None and inside["batches"] == 4 and inside["received"] == 0
    assert inside["handover_ms"] is None and inside["wait_ms"] is None and inside["getitem_ms"] is not None
    assert "handing them over" not in shown


def test_a_dataset_read_a_batch_at_a_time_is_timed_as_one_call(shell: Any, tmp_path: Any) -> None:
    # __getitems__ (one call a batch): its time is the batch's, no sample is timed alone.
    got, _ = traced_over(shell, "loader(Batched(16, 2.0, log_dir=log), batch_size=4, num_workers=2, "
                         "multiprocessing_context='fork')", tmp_path, "batched")
    inside = got.result.data.inside
    assert inside is not None and inside["batches"] == 4 and inside["slow_samples"] == [] and inside["item_ms"] is None
    own = own_timings(str(tmp_path), "getitem")  # the samples' own timings, 4 a batch
    assert len(own) == 16 and inside["getitem_ms"] is not None
    assert inside["getitem_ms"] >= 4 * min((t1 - t0) / 1e6 for _, t0, t1 in own)


def test_after_an_early_break_persistent_workers_batches_are_matched_to_the_ones_the_loop_got(shell: Any, tmp_path: Any) -> None:
    # Persistent workers: the first pass takes one batch and breaks (the batches prefetched for
    # it are made and never received), the second takes all 6. Each batch received is matched
    # to the one its worker made for that pass: the ones left behind are those made before the
    # second pass asked for its first batch (the loop's own wait, on the same clock).
    run(shell, "data = loader(Samples(48, 1.0), batch_size=8, num_workers=2, persistent_workers=True, multiprocessing_context='fork')")
    cell = "for x, y in data:\n    break\ntime.sleep(0.05)\nfor x, y in data:\n    model(x).sum().backward()\n"
    got, _ = traced_and_result(shell, cell, "--no-live --name early-break")
    inside = got.result.data.inside
    assert inside is not None and inside["received"] == 1 + 6 == len(inside["waits"])
    second_asked = inside["waits"][1][0]
    left = [bar for bar in inside["lanes"] if bar["received_ms"] is None]
    assert len(left) == inside["batches"] - 7 and left  # (prefetched for the first pass)
    assert all(bar["end_ms"] <= second_asked for bar in left)
    assert all(bar["received_ms"] >= bar["end_ms"] for bar in inside["lanes"] if bar["received_ms"] is not None)
