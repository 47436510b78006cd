"""Several processes: ranks forked from a traced cell stream their steps to the kernel (a real
kernel through nbclient, and this process for the bad cases), torchrun ranks gather theirs at
the end of trace(); nothing is left running after the cell."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from helpers import REPO, TESTS
from ranks_cells import SETUP
from torch.utils.data import DataLoader, Dataset

from traceml_jupyter import ranks
from traceml_jupyter.analysis.rank_verdict import RANK_NUMBERS
from traceml_jupyter.run import Run

SCRIPTS = TESTS / "ranks_scripts"


# -- the wire and the bookkeeping ---------------------------------------------------------------
def test_frames_survive_being_cut_anywhere() -> None:
    rows = np.arange(len(ranks.ROWS) * 3, dtype=np.float64).reshape(len(ranks.ROWS), 3)
    data = (
        ranks.frame(ranks.HELLO, {"pid": 7, "index": 0})
        + ranks.frame(ranks.STEPS, {"rank": 1, "world": 2}, rows)
        + ranks.frame(ranks.END, {"error": "ValueError: boom"})
    )
    for cut in range(len(data) + 1):
        buf = bytearray(data[:cut])
        got = ranks.read_frames(buf)
        buf += data[cut:]
        got += ranks.read_frames(buf)
        assert [kind for kind, _, _ in got] == [ranks.HELLO, ranks.STEPS, ranks.END]
        assert not buf
        assert np.array_equal(got[1][2], rows)
        assert got[2][1] == {"error": "ValueError: boom"}


def test_backward_time_goes_to_the_step_it_started_in() -> None:
    timer = ranks.BackwardTimer()
    timer.starts.extend([5, 12, 15, 31, 45])  # step 0 = [0, 10), 1 = [10, 20), 2 = [20, 40)
    timer.durations.extend([1_000_000, 2_000_000, 3_000_000, 4_000_000, 9_000_000])
    got = timer.per_step(np.array([0, 10, 20, 40]))
    assert np.allclose(got, [1.0, 5.0, 4.0])  # two calls in step 1 (gradient accumulation)
    assert list(timer.starts) == [45]  # after the last step: kept for the next ones
    got = timer.per_step(np.array([40, 50, 60]))
    assert got[0] == 9.0 and np.isnan(got[1])  # a step without backward(): not measured


def test_backward_sample_stays_bounded_and_uniform() -> None:
    sample = ranks.StepSample(cap=1000)
    for start in range(0, 10_000, 500):
        steps = np.arange(start, start + 500)
        sample.add(steps, np.full(500, 2.0))
    assert len(sample.steps) <= 1000 and sample.stride == 16
    assert np.all(sample.steps % 16 == 0)
    assert sample.median(100) == 2.0


def test_a_summary_crosses_the_process_group_as_numbers() -> None:
    summary = {key: 3.5 for key in RANK_NUMBERS}
    summary.update(rank=1, pid=99, n_steps=40, n_analysed=36, warmup_steps=4, backward_ms=None, clock="gpu")
    back = ranks.decode(ranks.encode(summary))
    assert back["rank"] == 1 and back["n_steps"] == 40 and back["backward_ms"] is None
    assert back["data_wait_ms"] == 3.5 and back["clock"] == "gpu" and back["status"] == "finished"


# -- forked ranks, this process as the kernel -------------------------------------------------------
class Batches(Dataset[Any]):
    def __init__(self, n: int, sleep_s: float = 0.0) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.randn(8), i % 2


def independent_training(
    index: int, batches: tuple[int, ...], linger_s: float = 0.0, sleep_s: float = 0.001, workers: tuple[int, ...] = (0, 0)
) -> None:
    """Ranks without a process group (each trains its own model): `batches[index]` steps."""
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Batches(batches[index] * 4, sleep_s), batch_size=4, num_workers=workers[index])
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    time.sleep(linger_s)


def open_fds() -> dict[str, str]:
    """This process's open descriptors and what each is (socket:[...], pipe:[...], a path)."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed already
            pass
    return fds


def left_open(before: dict[str, str]) -> dict[str, str]:
    return {fd: what for fd, what in open_fds().items() if before.get(fd) != what}


@pytest.fixture()
def no_leaks() -> Iterator[None]:
    before = open_fds()
    yield
    assert not ranks.running, "a collector is still running"
    assert not [t for t in threading.enumerate() if t.name.startswith("traceml")]
    assert not mp.active_children()
    sockets = {fd: what for fd, what in left_open(before).items() if what.startswith("socket:")}
    assert not sockets, f"sockets left open: {sockets}"  # the ranks' channels are sockets
    # A DataLoader closes its worker pipes lazily: its queues' feeder threads close their ends
    # after the loop, the workers' sentinels go with the garbage iterator. Let those finish.
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread":
            thread.join(timeout=10)
    gc.collect()
    left = left_open(before)
    assert not left, f"descriptors left open: {left}"


@pytest.mark.slow
def test_ranks_with_different_step_counts_are_said(no_leaks: None) -> None:
    run = Run("uneven")
    with ranks.followed(run.recording):  # rank 0 reads with 2 DataLoader workers (forked by the rank: no ranks)
        mp.start_processes(independent_training, args=((12, 8), 0.0, 0.001, (2, 0)), nprocs=2, start_method="fork")
    run.finish()
    assert [(r["rank"], r["n_steps"], r["status"]) for r in run.result.ranks or []] == [(0, 12, "finished"), (1, 8, "finished")]
    assert all(r["backward_ms"] is not None for r in run.result.ranks or [])
    text = run.text()
    assert "different numbers of steps (rank 0 12, rank 1 8): uneven data" in text
    assert "The ranks' DataLoaders differ: num_workers 2 on rank 0, 0 on rank 1" in text
    assert run.n_steps == 12  # the run shows the lowest rank's steps
    assert "a step = one `optimizer.step()`" in text


@pytest.mark.slow
@pytest.mark.parametrize("interrupted", [False, True])
def test_a_rank_still_running_when_the_cell_ends_is_a_note(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch, interrupted: bool
) -> None:
    monkeypatch.setattr(ranks.collector, "DRAIN_S", 0.5)
    run = Run("lingering")
    ctx = mp.get_context("fork")
    # 40 steps of 20 ms: some go at the rank's ticks; then it lingers for 30 s
    proc = ctx.Process(target=independent_training, args=(0, (40,), 30.0, 0.005))
    try:
        with pytest.raises(KeyboardInterrupt) if interrupted else nullcontext():
            with ranks.followed(run.recording):
                proc.start()
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:  # the rank has sent steps (at its ticks)
                    feed = run.recording.rank_collector
                    if feed is not None and any(s.recorder.n_steps for s in feed.streams):
                        break
                    time.sleep(0.05)
                if interrupted:
                    raise KeyboardInterrupt
        run.finish()
    finally:
        proc.terminate()
        proc.join()
    notes = " ".join(run.notes)
    when = "when the cell was interrupted" if interrupted else "0.5 s after the cell ended"
    assert f"was still running {when}" in notes
    assert run.result.ranks is not None and run.result.ranks[0]["status"] == "running"


@pytest.mark.slow
def test_dataloader_workers_are_not_ranks(no_leaks: None) -> None:
    run = Run("workers")
    rec = run.recording
    loader = DataLoader(Batches(16), batch_size=4, num_workers=2, multiprocessing_context="fork")
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ranks.followed(run.recording):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    run.finish()
    assert rec.rank_collector is None and run.result.ranks is None
    assert run.n_steps == 4


def accelerate_training() -> None:
    """An accelerate training function (CPU): 80 samples sharded over the ranks, 8 a batch."""
    from accelerate import Accelerator

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Batches(80), batch_size=8)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for x, y in loader:
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()


@pytest.mark.slow
def test_accelerate_notebook_launcher_forks_ranks_too() -> None:
    accelerate = pytest.importorskip("accelerate")
    run = Run("accelerate")
    with ranks.followed(run.recording):
        accelerate.notebook_launcher(accelerate_training, num_processes=2, use_port=str(free_port()))
    run.finish()
    assert [(r["rank"], r["n_steps"], r["status"]) for r in run.result.ranks or []] == [(0, 5, "finished"), (1, 5, "finished")]
    assert not ranks.running and not mp.active_children()


@pytest.mark.slow
def test_nn_dataparallel_gets_a_note(ip: Any) -> None:
    ip.run_cell(
        "import torch\n"
        "dp_model = torch.nn.DataParallel(torch.nn.Linear(8, 2))\n"
        "dp_opt = torch.optim.SGD(dp_model.parameters(), lr=0.1)\n"
    )
    try:
        result = ip.run_cell(
            "%%traceml --no-live --name dp\n"
            "for _ in range(6):\n"
            "    dp_opt.zero_grad()\n"
            "    dp_model(torch.randn(4, 8)).sum().backward()\n"
            "    dp_opt.step()\n"
        )
        assert result.error_in_exec is None
        import traceml_jupyter

        run = traceml_jupyter.last()
        assert run is not None and run.n_steps == 6
        assert ranks.DATAPARALLEL_NOTE in run.notes
    finally:
        ip.run_cell("del dp_model, dp_opt")


# -- a notebook that starts ranks: a real kernel -------------------------------------------------------
STRAGGLER = """\
%%traceml --name straggler
mp.start_processes(train, args=(2, free_port(), (0.0, 0.005)), nprocs=2, start_method="fork")"""

BALANCED = """\
%%traceml --name balanced
mp.start_processes(train, args=(2, free_port(), (0.003, 0.003)), nprocs=2, start_method="fork")"""

FAILS = """\
%%traceml --name fails
mp.start_processes(train, args=(2, free_port(), (0.0, 0.0), 5), nprocs=2, start_method="fork")"""

FACTS = """\
keys = ("rank", "n_steps", "status", "error")
print(json.dumps({
    "runs": {r.name: {"verdict": r.verdict, "straggler": r.straggler,
                      "ranks": [{k: x[k] for k in keys} for x in r.result.ranks or []]}
             for r in traceml_jupyter.runs()},
    "threads": [t.name for t in threading.enumerate() if t.name.startswith("traceml")],
    "children": [p.pid for p in mp.active_children()],
    "collectors": len(traceml_jupyter.ranks.running),
}))"""


def cell_text(cell: Any) -> str:
    """Everything a cell showed, as text (stdout, plain text and HTML of its displays)."""
    out = []
    for o in cell.outputs:
        out.append(o.get("text", ""))
        for key in ("text/plain", "text/html"):
            out.append(str(o.get("data", {}).get(key, "")))
    return "\n".join(out)


@pytest.mark.slow
@pytest.mark.kernel
def test_a_notebook_cell_that_forks_ddp_ranks() -> None:
    nbclient = pytest.importorskip("nbclient")
    from jupyter_harness import KERNEL_NAME, ensure_python3_kernel, notebook, widget_models

    ensure_python3_kernel()
    nb = notebook(SETUP, STRAGGLER, BALANCED, FAILS, FACTS)
    nbclient.NotebookClient(nb, timeout=120, startup_timeout=60, kernel_name=KERNEL_NAME, allow_errors=True).execute()
    stdout = [o["text"] for o in nb.cells[4].outputs if o.get("name") == "stdout"]
    assert stdout, cell_text(nb.cells[4])
    facts = json.loads(stdout[-1].strip().splitlines()[-1])
    runs = facts["runs"]

    # Rank 1's shard is slow: rank 0 waits for it in backward.
    straggler = runs["straggler"]
    assert straggler["verdict"] == "RANK STRAGGLER", cell_text(nb.cells[1])
    assert straggler["straggler"]["rank"] == 1 and straggler["straggler"]["cause"] == "input"
    assert [(r["rank"], r["n_steps"], r["status"]) for r in straggler["ranks"]] == [(0, 30, "finished"), (1, 30, "finished")]
    shown = cell_text(nb.cells[1])
    assert "rank 0 waits for rank 1 in backward: it waits" in shown and "a step for data" in shown
    assert "tml-ranks" in shown  # the per-rank table of the HTML report

    # Both ranks read equally slowly: no straggler, the usual verdict on their medians.
    balanced = runs["balanced"]
    assert balanced["straggler"] is None and balanced["verdict"] == "INPUT-BOUND", cell_text(nb.cells[2])
    assert [r["n_steps"] for r in balanced["ranks"]] == [30, 30]

    # Rank 1 raises: the cell raises as it would without the magic, the report names rank 1.
    errors = [o for o in nb.cells[3].outputs if o.get("output_type") == "error"]
    assert errors and errors[0]["ename"] == "ProcessRaisedException"
    failed = {r["rank"]: r for r in runs["fails"]["ranks"]}
    assert failed[1]["status"] == "failed" and failed[1]["error"] == "ValueError: rank 1 cannot read its shard"
    assert "Rank 1 failed after 5 steps: ValueError: rank 1 cannot read its shard" in cell_text(nb.cells[3])

    # The live chart drew one line per rank; nothing of ours is left in the kernel.
    labels = [m["state"].get("labels") for m in widget_models(nb).values() if m["model_name"] == "LinesModel"]
    assert ["rank 0 step", "rank 0 data wait", "rank 1 step", "rank 1 data wait"] in labels
    assert facts["threads"] == [] and facts["children"] == [] and facts["collectors"] == 0


# -- torchrun ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_report_is_printed_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks under torchrun share one stdout pipe; with PYTHONUNBUFFERED=1 print() writes a text
    and its newline apart, and another rank's line could land between them, glued to the end
    of this text (what once hid rank 1's RANKS line). One write is never split."""
    from traceml_jupyter.views.display import print_whole

    writes: list[str] = []

    class Stream:
        def write(self, text: str) -> None:
            writes.append(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Stream())
    print_whole("report\nlast line")
    print("a line")  # what print() does here, for contrast
    assert writes == ["report\nlast line\n", "a line", "\n"]


@pytest.mark.slow
def test_torchrun_ranks_gather_and_rank_0_prints_the_table() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
         str(SCRIPTS / "ddp_trace.py")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("Step Time: RANK STRAGGLER") == 1  # rank 0 prints the report, rank 1 does not
    assert "Ranks (median per step; * holds the others back):" in out
    assert "rank 0 waits for rank 1 in backward: it waits" in out
    table = out[out.index("Ranks (median per step"):].splitlines()[:6]
    marked = [line.split()[1] for line in table if line.startswith("*")]
    assert marked == ["1"]  # rank 1 is the one marked
    seen = {}
    for line in out.splitlines():
        if line.startswith("RANKS "):
            _, rank, payload = line.split(" ", 2)
            seen[int(rank)] = json.loads(payload)
    assert set(seen) == {0, 1}  # run.result.ranks and run.straggler on every rank
    for facts in seen.values():
        assert facts["straggler"]["rank"] == 1 and facts["straggler"]["cause"] == "input"
        assert facts["steps"] == [24, 24]
        assert facts["during_steps"] == []  # no collective of ours on the per-step path
        assert facts["at_end"] == ["all_gather"]  # one, at the end of trace()
