"""A DataLoader worker that stops the loop, under %%traceml (docs/loader-inside.md#a-worker-that-stops-the-loop):
one that ends itself (os._exit), one killed by SIGKILL (as the out-of-memory killer does), one
whose __getitem__ raises, one late past the loader's timeout. Each dataset writes its own pid and
worker id before it fails (tests/loader_cases.py, Dying): the figures ours are judged by. The
cell's error is torch's, the same as without traceml; the report names the worker, its pid, how
it ended and the samples it was loading; nothing hangs, and nothing of ours is left (the
private directory, the patches, the threads: conftest's guard)."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import pytest
from helpers import note_watch_directories, run, shell_fixture
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

import traceml_jupyter
from traceml_jupyter.result.codec import to_dict
from traceml_jupyter.views.report import report_html

pytestmark = pytest.mark.slow  # (DataLoader workers)

SETUP = """
from loader_cases import Dying, Samples, loader
"""
CELL = "for x in data:\n    pass\n"
BOUND_S = 120  # a cell that takes this long hangs (each takes a second or two)

shell = shell_fixture(SETUP)


def failed(shell: Any, build: str, magic: str) -> tuple[BaseException, str, float]:
    """The error of CELL over the loader `build` makes (with `magic` on top), what the cell
    showed (the text box) and its wall time."""
    run(shell, f"data = {build}", check=True)
    t0 = time.monotonic()
    result = run(shell, magic + CELL)
    took = time.monotonic() - t0
    error = result.error_in_exec
    assert error is not None
    # The loader's iterator is held by the error's frames (IPython keeps it as sys.last_value)
    # until a garbage collection, in a later test, shuts its workers down (slowly there): its
    # workers are stopped now, as helpers.stop_loader_workers does for persistent ones.
    dataset = shell.user_ns["data"].dataset
    for it in gc.get_objects():
        if type(it) is _MultiProcessingDataLoaderIter and it._dataset is dataset:
            it._shutdown_workers()
    return error, result.shown, took


def who_failed(log: Any) -> tuple[int, int, int]:
    """(pid, worker id, index) the dying dataset wrote before it failed; its file then removed."""
    (name,) = [n for n in os.listdir(log) if n.startswith("dying-")]
    with open(log / name) as f:
        pid, worker, index = (int(v) for v in f.read().split())
    os.remove(log / name)
    return pid, worker, index


def ours(made: list[str]) -> list[str]:
    """The watch's own among the directories made (the capture makes others)."""
    return [d for d in made if os.path.basename(d).startswith("traceml-loader-")]


@pytest.fixture
def our_directories(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The private directories the watch makes (tempfile.mkdtemp), as it makes them."""
    made: list[str] = []
    note_watch_directories(monkeypatch, made)
    return made


@pytest.mark.parametrize(("how", "code"), [("exit", 3), ("kill", -9), ("raise", None)])
def test_a_worker_that_stops_the_loop_is_named_and_the_error_is_torchs(
    shell: Any, tmp_path: Any, our_directories: list[str], how: str, code: int | None
) -> None:
    # 48 samples, batches of 8, 2 forked workers: sample 21 (batch 2, samples 16-23) fails.
    shell.user_ns["log"] = str(tmp_path)
    build = f"loader(Dying(48, 21, '{how}', log, delay_s=1.0), batch_size=8, num_workers=2, multiprocessing_context='fork')"
    plain, _, _ = failed(shell, build, "")
    plain_pid = who_failed(tmp_path)[0]
    threads = set(threading.enumerate())
    traced, shown, took = failed(shell, build, "%%traceml --no-live\n")
    pid, worker, index = who_failed(tmp_path)
    assert took < BOUND_S  # (no hang)
    # The cell's error is torch's, as without traceml (the dead worker's pid is this run's).
    assert type(traced) is type(plain)
    assert str(traced) == str(plain).replace(str(plain_pid), str(pid))
    # The report names the worker the dataset says failed, and what it was loading.
    got = traceml_jupyter.last()
    assert got is not None and got.result.error is not None
    inside = got.result.data.inside
    assert inside is not None
    (stop,) = inside["stopped"]
    batch = index // 8  # (torch sends batch k to worker k % 2: the worker had made its batches before)
    assert (stop["worker"], stop["pid"], stop["code"]) == (worker, pid, code) and batch % 2 == worker
    assert stop["how"] == ("raised" if how == "raise" else "died")
    assert stop["samples"] == list(range(8 * batch, 8 * batch + 8)) and stop["consecutive"]
    assert stop["batches"] == sum(1 for k in range(batch) if k % 2 == worker)
    line = next(line for line in shown.splitlines() if f"DataLoader worker {worker} (pid {pid})" in line)
    assert f"while loading samples {8 * batch}-{8 * batch + 7}" in line
    assert ("SIGKILL: out of memory?" in line) == (how == "kill") and ("exited with code 3" in line) == (how == "exit")
    page = report_html(got)
    assert 'class="tml-inside-stopped"' in page and f"(pid {pid})" in page
    assert to_dict(got.result)["loader_inside"]["stopped"][0]["pid"] == pid
    # Nothing of ours left: the private directory, a thread.
    assert ours(our_directories) and not any(os.path.exists(d) for d in ours(our_directories))
    assert not [t for t in set(threading.enumerate()) - threads if t.is_alive() and t.name.startswith("traceml")]


def test_a_worker_late_past_the_loaders_timeout_is_named(shell: Any, tmp_path: Any, our_directories: list[str]) -> None:
    # timeout=1: sample 21 takes 2.5 s (then raises, after torch gave up on it).
    shell.user_ns["log"] = str(tmp_path)
    build = ("loader(Dying(48, 21, 'hang', log, hang_s=2.5, delay_s=0.0), batch_size=8, num_workers=2, timeout=1, "
             "multiprocessing_context='fork')")  # fmt: skip
    traced, shown, took = failed(shell, build, "%%traceml --no-live\n")
    pid, worker, _ = who_failed(tmp_path)
    assert took < BOUND_S
    assert type(traced) is RuntimeError and str(traced) == "DataLoader timed out after 1 seconds"  # torch's
    got = traceml_jupyter.last()
    assert got is not None and got.result.data.inside is not None
    (stop,) = got.result.data.inside["stopped"]
    assert (stop["worker"], stop["pid"], stop["how"], stop["samples"][0]) == (worker, pid, "late", 16)
    assert f"WORKER LATE: DataLoader worker {worker} (pid {pid}) was still loading samples 16-23" in shown
    assert ours(our_directories) and not any(os.path.exists(d) for d in ours(our_directories))


@pytest.mark.parametrize("at", [3, 21])
def test_a_worker_killed_while_the_loop_is_elsewhere_is_named_too(shell: Any, tmp_path: Any, our_directories: list[str], at: int) -> None:
    # No delay: the worker is killed while the loop may be anywhere (its own code, torch's, ours);
    # torch's SIGCHLD handler raises there, and the error reaches the cell as torch's. Killed in
    # the first batch (sample 3), before the first step: named under the cell's one line.
    shell.user_ns["log"] = str(tmp_path)
    build = f"loader(Dying(48, {at}, 'kill', log, delay_s=0.0), batch_size=8, num_workers=2, multiprocessing_context='fork')"
    traced, shown, took = failed(shell, build, "%%traceml --no-live\n")
    pid, worker, _ = who_failed(tmp_path)
    if at == 3:
        assert "traceml: no step ran" in shown and f"traceml: inside the loader, WORKER DIED: DataLoader worker {worker}" in shown
    assert took < BOUND_S
    assert type(traced) is RuntimeError and str(traced).startswith("DataLoader worker (pid") and str(pid) in str(traced)
    got = traceml_jupyter.last()
    assert got is not None and got.result.data.inside is not None
    (stop,) = got.result.data.inside["stopped"]
    assert (stop["worker"], stop["pid"], stop["how"], stop["code"]) == (worker, pid, "died", -9)
    assert f"WORKER DIED: DataLoader worker {worker} (pid {pid}) died (killed by signal 9" in shown
    assert not any(os.path.exists(d) for d in ours(our_directories))
