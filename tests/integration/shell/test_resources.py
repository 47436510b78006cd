"""Memory and CPU beside the time, with real processes on this machine's CPUs: DataLoader workers
that burn CPU saturate it (and no "add workers" advice), workers that sleep leave it idle (more
workers advised), a dataset's big Python list grows its forked workers' private memory (named
with the attribute), a loss kept with its graph grows the process (named with the line)."""

from __future__ import annotations

import json
import os
import time
from functools import partial
from typing import Any

import numpy as np
import pytest
from helpers import run as run_cell
from helpers import shell_fixture

import traceml_jupyter
from traceml_jupyter.analysis.kept_graph import kept_graphs
from traceml_jupyter.analysis.resources import ResourceFacts, resource_summary
from traceml_jupyter.capture.resources.host import cgroup_quota

SETUP = '''
import time, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Burning(Dataset):
    """Each sample burns `ms` of CPU in the worker (a decode, an augmentation)."""
    def __init__(self, n, ms):
        self.n, self.ms = n, ms
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        end = time.thread_time() + self.ms / 1000
        while time.thread_time() < end:
            pass
        return torch.zeros(8), 0

class Sleeping(Dataset):
    """Each sample waits `ms` (a disk, the network) and costs no CPU."""
    def __init__(self, n, ms):
        self.n, self.ms = n, ms
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        time.sleep(self.ms / 1000)
        return torch.zeros(8), 0

class Records(Dataset):
    """A dataset as a Python list of records (dicts parsed from a CSV, say), read in chunks."""
    def __init__(self, n, chunk):
        self.records = [(float(i), i) for i in range(n)]
        self.chunk = chunk
    def __len__(self):
        return len(self.records) // self.chunk
    def __getitem__(self, i):
        rows = self.records[i * self.chunk:(i + 1) * self.chunk]
        time.sleep(0.004)
        return torch.full((8,), sum(r[0] for r in rows)), 0

model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
crit = nn.CrossEntropyLoss()
'''

TRAIN = """\
%%traceml --no-live --name {name}
for x, y in loader:
    opt.zero_grad()
    loss = crit(model(x), y)
    loss.backward()
    opt.step()
"""


run = partial(run_cell, check=True)


shell = shell_fixture(SETUP)


def checklist_item(got: Any, key: str) -> dict[str, Any]:
    return next(i for i in got.result.reading.checklist or () if i["key"] == key)


@pytest.mark.slow
def test_workers_that_burn_every_core_saturate_the_cpu_and_get_no_more_workers(shell: Any) -> None:
    # 2 workers burning 4 ms a sample on this 2-core machine (each batch of 4 is 16 ms of CPU);
    # the model is tiny, so the loop waits for them: INPUT-BOUND, and the CPU has no core left.
    run(shell, "loader = DataLoader(Burning(4 * 120, 4.0), batch_size=4, num_workers=2)")
    shown = run(shell, TRAIN.format(name="burning")).shown
    got = traceml_jupyter.last()
    assert got is not None and got.verdict == "INPUT-BOUND"
    s = got.summary
    assert s["cpu_saturated"] is True, str({k: s[k] for k in s if k.startswith("cpu")})
    assert s["cpu_usable_cores"] == 2 and s["workers_seen"] == 2
    assert s["cpu_workers_running"] >= 0.5  # the workers compute (running or waiting for a CPU)
    labels = [f["label"] for f in s["resource_findings"]]
    assert "CPU SATURATED" in labels
    assert "Also: CPU SATURATED: the training process and its DataLoader workers keep" in shown
    # No "add workers" anywhere: not in the verdict, not in the checklist.
    assert "more DataLoader workers won't help" in got.verdict_detail.next
    item = checklist_item(got, "num_workers")
    assert item["to_try"] is None and item["status"] != "fix"
    assert "More workers won't help" in item["reason"]
    # The report's Resources part: the figures, the finding, CPU and memory plots, the workers.
    from traceml_jupyter.views.report import report_html

    page = report_html(got)
    part = page[page.index('class="tml-resources"'):]
    assert "CPU SATURATED" in part and "usable cores busy (saturated)" in part
    assert part.count('<svg class="tml-resource-plot"') == 2  # CPU per second, host memory
    assert "CPU cores busy" in part and 'class="tml-workers"' in part
    assert "<style" not in page and "<script" not in page


def trained_with_threads(shell: Any, threads: int, loader: str, name: str) -> str:
    """What the traced TRAIN cell named `name` shows over `loader` with torch's intra-op threads
    set to `threads` (put back after)."""
    run(shell, f"threads_before = torch.get_num_threads()\ntorch.set_num_threads({threads})")
    try:
        run(shell, f"loader = {loader}")
        return str(run(shell, TRAIN.format(name=name)).shown)
    finally:
        run(shell, "torch.set_num_threads(threads_before)")


@pytest.mark.slow
def test_more_torch_threads_than_cores_beside_workers_are_named_with_the_fix(shell: Any) -> None:
    # torch's intra-op threads set to one more than the CPUs this process may use, beside 2
    # workers that burn CPU: the threads take turns with the workers, whatever else runs. The
    # figures are the test's own: the threads it set, the CPUs it may use.
    cpus = len(os.sched_getaffinity(0))
    shown = trained_with_threads(shell, cpus + 1, "DataLoader(Burning(4 * 60, 2.0), batch_size=4, num_workers=2)", "oversubscribed")
    got = traceml_jupyter.last()
    assert got is not None
    o = got.summary["cpu_oversubscription"]
    assert o is not None and o["threads"] == cpus + 1 and got.summary["cpu_torch_threads"] == cpus + 1
    assert o["usable_cores"] <= cpus and 0 <= o["busy_workers"] <= 2
    assert o["wanted_cores"] == (cpus + 1) * (1 + o["busy_workers"])
    assert o["suggested_threads"] == max(1, int(o["usable_cores"]) - o["busy_workers"])
    assert "Also: CPU OVERSUBSCRIBED: torch's" in shown and f"torch.set_num_threads({o['suggested_threads']})" in shown
    item = checklist_item(got, "torch_threads")
    assert item["status"] == "fix" and item["to_try"] == f"torch.set_num_threads({o['suggested_threads']})"
    assert json.loads(json.dumps(got.to_dict()))["summary"]["cpu_oversubscription"]["threads"] == cpus + 1

    # One thread and no workers: the cores suffice, nothing is said.
    shown = trained_with_threads(shell, 1, "DataLoader(Burning(4 * 30, 1.0), batch_size=4, num_workers=0)", "fits")
    got = traceml_jupyter.last()
    assert got is not None and got.summary["cpu_torch_threads"] == 1
    assert got.summary["cpu_oversubscription"] is None and "OVERSUBSCRIBED" not in shown
    assert not [i for i in got.result.reading.checklist or () if i["key"] == "torch_threads"]


@pytest.mark.slow
def test_workers_that_sleep_leave_the_cpu_idle_and_more_workers_are_advised(shell: Any) -> None:
    # 2 workers waiting 8 ms a sample (I/O): the CPU is idle, so more workers overlap more waiting.
    run(shell, "loader = DataLoader(Sleeping(4 * 120, 8.0), batch_size=4, num_workers=2)")
    run(shell, TRAIN.format(name="sleeping"))
    got = traceml_jupyter.last()
    assert got is not None and got.verdict == "INPUT-BOUND"
    s = got.summary
    assert s["cpu_saturated"] is False, {k: s[k] for k in s if k.startswith("cpu")}
    assert "CPU SATURATED" not in [f["label"] for f in s["resource_findings"]]
    assert s["cpu_workers_running"] < 0.5  # the workers sleep
    assert "more DataLoader workers" in got.verdict_detail.next
    item = checklist_item(got, "num_workers")
    assert item["status"] == "fix" and int(item["to_try"]) > 2, item
    assert "wait" in item["reason"]


@pytest.mark.slow
def test_a_python_list_read_by_forked_workers_grows_their_private_memory(shell: Any) -> None:
    # 1.6 million (float, int) tuples, read in chunks by 2 forked workers: reading them writes
    # their reference counts, so each worker copies the pages it reads (copy-on-read); RSS
    # barely moves, the workers' private memory (USS) grows. Persistent workers are still
    # alive when the cell ends: their last read covers the whole epoch.
    run(
        shell,
        "records = Records(1_600_000, 2_000)\n"
        "loader = DataLoader(records, batch_size=1, num_workers=2, shuffle=True, persistent_workers=True)",
    )
    run(shell, TRAIN.format(name="records"))
    got = traceml_jupyter.last()
    assert got is not None
    s = got.summary
    workers = (got.result.resources.host or {})["workers"]
    assert len(workers) == 2 and all(w["uss_reads"] >= 2 for w in workers), workers
    assert s["worker_uss_growth_mib"] >= 64, workers
    found = next(f for f in s["resource_findings"] if f["label"] == "WORKER MEMORY GROWTH")
    assert "`loader.dataset.records` holds a list of 1,600,000 tuple objects" in found["text"]
    assert "numpy arrays" in found["next"]
    assert "copy-on-read" in found["text"]
    shell.user_ns.pop("loader", None)  # its persistent workers end with it


@pytest.mark.slow
def test_a_short_run_whose_workers_copy_a_list_is_reported_every_time(shell: Any) -> None:
    # The same copy-on-read in a run of about 2.5 s (5-7 s on a loaded machine) whose workers end
    # with their one pass (not persistent: no read after the loop): 1.2 million (float, int, str)
    # tuples, each worker reading half of them. Their page faults say they grow; their USS is read
    # again while they grow, so the growth is seen in every run, not only when a spaced read
    # happened to fall late enough. The bound is the test's own: what the list's objects weigh.
    run(
        shell,
        "import sys\n"
        "class Rows(Records):\n"
        "    def __init__(self, n, chunk):\n"
        "        self.records, self.chunk = [(float(i), i, str(i)) for i in range(n)], chunk\n"
        "short = Rows(1_200_000, 960)\n"
        "held_mib = sum(sum(map(sys.getsizeof, (r, *r))) for r in short.records) / 2**20\n"
        "loader = DataLoader(short, batch_size=1, num_workers=2, shuffle=True)",
    )
    held = float(shell.user_ns["held_mib"])
    for i in range(3):
        run(shell, "cell_t0 = time.perf_counter()\n")
        run(shell, TRAIN.format(name=f"short{i}"))
        wall = time.perf_counter() - float(shell.user_ns["cell_t0"])
        got = traceml_jupyter.last()
        assert got is not None
        workers = (got.result.resources.host or {})["workers"]
        growth = got.summary["worker_uss_growth_mib"]
        assert growth is not None and 64 <= growth <= held, (wall, held, workers)
        labels = [f["label"] for f in got.summary["resource_findings"]]
        assert "WORKER MEMORY GROWTH" in labels, (wall, workers)
    shell.user_ns.pop("loader", None)
    shell.user_ns.pop("short", None)


@pytest.mark.slow
def test_a_loss_kept_with_its_graph_grows_the_process_and_names_the_line(shell: Any) -> None:
    # An evaluation written without torch.no_grad(): `total = total + loss` keeps each step's
    # graph, and with it the activations saved for a backward that never comes (2 MiB a step, 96 steps).
    run(
        shell,
        "wide = nn.Sequential(nn.Linear(64, 8192), nn.ReLU(), nn.Linear(8192, 2))\n"
        "batches = [(torch.randn(64, 64), torch.zeros(64, dtype=torch.long)) for _ in range(8)] * 12",
    )
    shown = run(
        shell,
        """\
        %%traceml --no-live --name kept
        total = 0
        for x, y in batches:
            loss = crit(wide(x), y)
            total = total + loss
            time.sleep(0.015)
        """,
    ).shown
    got = traceml_jupyter.last()
    assert got is not None
    s = got.summary
    assert s["host_rss_growth_mib"] >= 100, s["host_rss_growth_mib"]
    found = next(f for f in s["resource_findings"] if f["label"].startswith("HOST MEMORY"))
    assert found["line"] == 5
    assert "line 5 keeps every step's graph (`total = total + loss`): use `loss.item()`" in found["text"]
    assert "Also: HOST MEMORY" in shown
    doc = json.loads(json.dumps(got.to_dict(), allow_nan=False))
    assert doc["resources"]["host"]["samples"]["process_rss_mib"]
    assert doc["summary"]["kept_graphs"][0]["line"] == 5
    # Read back (another kernel): the same findings, the Resources part with its plots.
    from traceml_jupyter.result import from_dict
    from traceml_jupyter.run import Run as RunHandle
    from traceml_jupyter.views.report import report_html

    back = RunHandle(result=from_dict(doc))
    host = back.result.resources.host
    assert "Also: HOST MEMORY" in back.text()
    assert host is not None and len(host["samples"]["time_s"]) == len(doc["resources"]["host"]["samples"]["time_s"])
    assert report_html(back).count('<svg class="tml-resource-plot"') == 2
    del got
    shell.user_ns.pop("total", None)  # free the kept graphs


# -- the pure parts -------------------------------------------------------------------------------

LOOP = """\
%%traceml
total_loss, losses, history, seen = 0, [], [], []
for x, y in loader:
    x, y = x.to(device), y.to(device)
    out = model(x)
    loss = criterion(out, y)
    loss.backward()
    total_loss += loss
    total = total + loss
    losses.append(loss)
    history.append(out)
    seen.append(x)
    running += loss.item()
    losses.append(loss.detach())
    acc = (out.argmax(1) == y).float().mean()
    history.append(float(loss))
    with torch.no_grad():
        val = model(x)
        history.append(val)
"""


def test_the_statements_that_keep_a_steps_graph_are_read_off_the_loop() -> None:
    kept = kept_graphs(LOOP, 3)
    assert [(k.line, k.text, k.value, k.holder, k.accumulates) for k in kept] == [
        (8, "total_loss += loss", "loss", "total_loss", True),
        (9, "total = total + loss", "loss", "total", True),
        (10, "losses.append(loss)", "loss", "losses", False),
        (11, "history.append(out)", "out", "history", False),
    ]
    assert kept[0].sentence() == (
        "line 8 keeps every step's graph (`total_loss += loss`): use `loss.item()` (or `loss.detach()`)"
    )
    assert "use `out.detach()`" in kept[3].sentence()


def test_kept_graphs_follow_what_the_names_hold() -> None:
    hf = "for batch in loader:\n    outputs = model(**batch)\n    loss = outputs.loss\n    log.append(loss)\n"
    assert [k.line for k in kept_graphs(hf, 1)] == [4]
    # a name that was .item()-ed, a module called by another name (known from the namespace)
    clean = "for x in data:\n    loss = f(x).item()\n    total += loss\n"
    assert kept_graphs(clean, 1) == []
    custom = "for x in data:\n    z = mlp(x)\n    keep.append(z)\n"
    assert kept_graphs(custom, 1) == [] and [k.line for k in kept_graphs(custom, 1, ["mlp"])] == [3]
    assert kept_graphs("for x in data:\n    pass\n", 7) == [] and kept_graphs(None, 1) == []
    assert kept_graphs("for x in (:\n", 1) == []


def columns(alloc: list[float], peak: float | None = None, step_ms: float = 10.0) -> dict[str, np.ndarray]:
    n = len(alloc)
    a = np.asarray(alloc, dtype=float)
    return {
        "step": np.arange(n),
        "time_s": np.arange(n) * step_ms / 1e3,
        "step_ms": np.full(n, step_ms),
        "gpu_mem_allocated_mib": a,
        "gpu_mem_peak_mib": a + (peak if peak is not None else 100.0),
        "gpu_mem_reserved_mib": a + 200.0,
    }


def labels(s: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["label"], f["severity"]) for f in s["resource_findings"]]


def test_high_pressure_from_92_percent_critical_from_97() -> None:
    def at(share: float) -> list[tuple[str, str]]:
        cols = columns([1000.0] * 30, peak=share * 10_000 - 1000)
        return labels(resource_summary(ResourceFacts(cols, 0, {"capacity_mib": 10_000})))

    assert at(0.919) == [] and at(0.92) == [("HIGH PRESSURE", "warn")]
    assert at(0.969) == [("HIGH PRESSURE", "warn")] and at(0.97) == [("HIGH PRESSURE", "critical")]


def test_memory_rising_then_creep_by_what_the_free_memory_allows() -> None:
    gpu = {"capacity_mib": 10_000}
    flat = resource_summary(ResourceFacts(columns([1000.0] * 30), 0, gpu))
    assert labels(flat) == [] and flat["gpu_mem_growth_mib"] == 0
    noise = resource_summary(ResourceFacts(columns([1000.0, 1000.5] * 15), 0, gpu))
    assert labels(noise) == []  # half a MiB: variable shapes, not a leak
    # +2 MiB a step over 30 steps (40 MiB between the thirds): RISING; the free 8.9 GiB last long.
    rising = resource_summary(ResourceFacts(columns([1000.0 + 2 * i for i in range(30)]), 0, gpu))
    assert labels(rising) == [("MEMORY RISING", "info")]
    assert rising["gpu_mem_growth_per_step_mib"] == pytest.approx(2.0)
    # +100 MiB a step: 10 runs this long would fill what the peak leaves free: CREEP.
    creep = resource_summary(ResourceFacts(columns([1000.0 + 100 * i for i in range(30)]), 0, gpu))
    assert labels(creep)[0] == ("MEMORY CREEP", "warn")
    kept = [{"line": 7, "sentence": "line 7 keeps every step's graph (`total_loss += loss`): use `loss.item()`"}]
    named = resource_summary(ResourceFacts(columns([1000.0 + 100 * i for i in range(30)]), 0, gpu, kept=kept))
    found = named["resource_findings"][0]
    assert found["line"] == 7 and "Likely cause: line 7 keeps every step's graph" in found["text"]


def test_creep_is_judged_on_the_whole_run_whatever_the_warm_up_and_the_steps_read() -> None:
    """+30 MiB a step over a 30-step run: 10 runs as long grow 9,000 MiB, more than the 8,030 MiB
    the peak leaves free: CREEP, whether 0 or 12 steps are warm-up and whether every step's memory
    was read or every third (the growth between the thirds' medians is 360 to 630 MiB)."""
    gpu = {"capacity_mib": 10_000}
    alloc = [1000.0 + 30 * i for i in range(30)]
    sparse = [a if i % 3 == 0 else float("nan") for i, a in enumerate(alloc)]
    for warmup in (0, 12):
        for read in (alloc, sparse):
            s = resource_summary(ResourceFacts(columns(read), warmup, gpu))
            assert s["gpu_mem_growth_per_step_mib"] == pytest.approx(30.0)
            assert labels(s) == [("MEMORY CREEP", "warn")], (warmup, read is sparse)
    # A third of the rate stays RISING: 10 runs as long grow 3,000 MiB of the 8,690 free.
    slow = resource_summary(ResourceFacts(columns([1000.0 + 10 * i for i in range(30)]), 15, gpu))
    assert labels(slow) == [("MEMORY RISING", "info")]


def test_a_kept_graph_without_measured_growth_is_still_said_once() -> None:
    kept = [{"line": 7, "sentence": "line 7 keeps every step's graph (`x`): use `y`"}]
    s = resource_summary(ResourceFacts(columns([1000.0] * 30), 0, {"capacity_mib": 10_000}, kept=kept))
    assert labels(s) == [("KEPT GRAPH", "info")] and s["resource_findings"][0]["line"] == 7


def host(cores: tuple[float, float], machine: float, running: float, workers: int = 2, n: int = 12) -> dict[str, Any]:
    t = np.arange(1, n + 1) * 0.25
    return {
        "usable_cores": 2.0,
        "samples": {
            "time_s": t,
            "process_cores": np.full(n, cores[0]),
            "workers_cores": np.full(n, cores[1]),
            "machine_cores": np.full(n, machine),
            "process_rss_mib": np.full(n, 500.0),
            "workers_rss_mib": np.full(n, 300.0),
            "workers_uss_mib": np.full(n, 20.0),
            "workers": np.full(n, float(workers)),
            "workers_running": np.full(n, running * workers),
        },
        "workers": [],
    }


def cpu(h: dict[str, Any]) -> dict[str, Any]:
    return resource_summary(ResourceFacts(columns([1.0] * 400, step_ms=10.0), 0, None, h))


def test_cpu_saturated_when_the_process_and_its_workers_use_every_core() -> None:
    assert cpu(host((0.2, 1.6), 1.85, 0.9))["cpu_saturated"] is True
    # 0.25 core idle, each computing worker uses 0.75: another worker finds no CPU to run on.
    assert cpu(host((0.2, 1.5), 1.75, 0.9))["cpu_saturated"] is True
    # 1 core idle, each worker uses 0.3: room for 3 more.
    assert cpu(host((0.2, 0.6), 1.0, 0.9))["cpu_saturated"] is False
    # 1.7 of 2 busy, but the workers mostly sleep: they wait, more of them overlap more waiting.
    assert cpu(host((0.2, 1.5), 1.75, 0.2))["cpu_saturated"] is False
    # A machine busy with others: our computing workers get their share, no idle core is left.
    loaded = cpu(host((0.3, 0.6), 2.0, 0.9))
    assert loaded["cpu_saturated"] is True and ("CPU SATURATED", "warn") in labels(loaded)
    assert "0.9 of the 2 usable cores" in loaded["resource_findings"][0]["text"]
    # ... but workers that sleep (I/O) leave the CPU to others: more of them overlap more waiting.
    assert cpu(host((0.3, 0.05), 2.0, 0.1))["cpu_saturated"] is False
    assert cpu(host((0.05, 0.0), 2.0, 0.0, workers=0))["cpu_saturated"] is False


def test_cgroup_quotas_v1_and_v2_cap_the_usable_cores() -> None:
    files = {
        "/sys/fs/cgroup/cpu.max": "150000 100000\n",
        "/sys/fs/cgroup/kube/pod/cpu.max": "max 100000\n",
    }
    assert cgroup_quota("0::/kube/pod\n", files.get) == 1.5  # the root's quota (a container's)
    v1 = {"/sys/fs/cgroup/cpu,cpuacct/docker/c/cpu.cfs_quota_us": "200000", "/sys/fs/cgroup/cpu,cpuacct/docker/c/cpu.cfs_period_us": "100000"}
    assert cgroup_quota("4:cpu,cpuacct:/docker/c\n3:memory:/docker/c\n", v1.get) == 2.0
    assert cgroup_quota("4:cpu,cpuacct:/\n", {"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"}.get) is None
    assert cgroup_quota("", files.get) is None


def test_one_usable_cpus_for_every_caller() -> None:
    import sys

    from traceml_jupyter import demo
    from traceml_jupyter.capture.resources import host as host_module
    from traceml_jupyter.kernel import code_facts

    one = host_module.usable_cpus
    for name in ("traceml_jupyter.recording", "traceml_jupyter.tuning.sweep"):
        assert sys.modules[name].usable_cpus is one
    assert demo.usable_cpus is one and code_facts.usable_cpus is one


def test_a_datasets_python_objects_are_named() -> None:
    from torch.utils.data import Subset

    from traceml_jupyter.capture.data.dataloaders import python_objects

    class Records:
        def __init__(self) -> None:
            self.rows = [{"x": i} for i in range(20_000)]
            self.small = list(range(10))
            self.index = {i: str(i) for i in range(12_000)}

    found = python_objects(Subset(Records(), [0, 1]))  # type: ignore[arg-type]
    assert found == [
        {"attribute": "dataset.rows", "kind": "list", "length": 20_000, "items": "dict"},
        {"attribute": "dataset.index", "kind": "dict", "length": 12_000, "items": "str"},
    ]
    assert python_objects(object()) == []


def test_the_live_header_reads_what_capture_sampled() -> None:
    import types

    from traceml_jupyter import kernel_state
    from traceml_jupyter.capture.resources.watch import ResourceWatch
    from traceml_jupyter.run import Run
    from traceml_jupyter.views.live_header import resources_text

    handle = Run("header")
    run = handle.recording
    try:
        watch = ResourceWatch(run, types.SimpleNamespace(memory=None, on_workers=None))
        run.resource_watch = watch
        watch.host.samples.add_row((0.5, 0.3, 1.5, 2.0, 1536.0, 800.0, 40.0, 2.0, 2.0))
        watch.memory.capacity_mib, watch.memory.last = 81920.0, {"allocated_mib": 10444.8}
        text = resources_text(run)
        assert "GPU mem 10.2 / 80 GiB" in text and f"CPU 1.8 / {watch.host.usable_cores:g} cores" in text
        assert "RSS 1.5 GiB" in text
    finally:
        run.resource_watch = None
        kernel_state.RUNS.remove(handle)


def test_compare_puts_memory_and_cpu_side_by_side() -> None:
    from traceml_jupyter.analysis.compare import resource_rows

    a = {"cpu_cores": 1.9, "cpu_usable_cores": 2.0, "cpu_saturated": True, "host_rss_mib": 1024.0, "gpu_mem_peak_mib": None}
    b = {"cpu_cores": 1.0, "cpu_usable_cores": 2.0, "cpu_saturated": False, "host_rss_mib": 512.0}
    rows = resource_rows(a, b)
    assert rows == [
        ("CPU cores busy (process + workers)", "1.9 of 2 (saturated)", "1.0 of 2", "-0.9 cores (-47 %)"),
        ("Host memory (RSS, max)", "1.00 GiB", "512 MiB", "-512 MiB (-50 %)"),
    ]


# -- bad cases: a note, never an error of ours ---------------------------------------------------


@pytest.mark.slow
def test_a_worker_that_exits_between_samples_is_marked_not_raised() -> None:
    import subprocess
    import sys

    from traceml_jupyter.capture.resources.host import HostSampler

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    sampler = HostSampler()
    try:
        assert sampler.start()
        sampler.add_workers([child.pid], 1)
        sampler.sample_once()
        assert not sampler.workers[child.pid].exited
        child.wait()
        sampler.sample_once()  # gone (and reaped): no error, its CPU moved to the children's
        assert sampler.workers[child.pid].exited and not sampler.notes
    finally:
        sampler.stop()
    assert not sampler.running and sampler.workers[child.pid].proc is None


def test_a_worker_that_cannot_be_read_is_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from traceml_jupyter.capture.resources.host import HostSampler

    class Denied:
        def __init__(self, pid: int) -> None:
            raise psutil.AccessDenied(pid)

    sampler = HostSampler()
    sampler._psutil, sampler._me = psutil, psutil.Process()
    monkeypatch.setattr(psutil, "Process", Denied)
    sampler.add_workers([1], 1)
    sampler.sample_once()
    assert sampler.workers[1].exited and "access denied" in sampler.notes[0]


def test_without_psutil_a_note_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from traceml_jupyter.capture.resources.host import HostSampler

    monkeypatch.setitem(sys.modules, "psutil", None)
    sampler = HostSampler()
    assert sampler.start() is False and "psutil is not installed" in sampler.notes[0]
    sampler.stop()
    assert sampler.result()["samples"]["time_s"].size == 0


def test_host_samples_are_bounded_for_any_run_length() -> None:
    from traceml_jupyter.capture.resources.host import CAPACITY, HOST_COLUMNS
    from traceml_jupyter.capture.resources.samples import SampleBuffer

    buffer = SampleBuffer(HOST_COLUMNS, CAPACITY)
    for i in range(10 * CAPACITY):  # 20 000 samples: hours at 4 a second
        buffer.add_row([float(i)] * len(HOST_COLUMNS))
    assert len(buffer) <= CAPACITY and buffer.decimations >= 3
    t = buffer.columns()["time_s"]
    assert t[0] == 0.0 and np.all(np.diff(t) > 0)


def test_host_memory_creep_is_judged_on_the_whole_run() -> None:
    """The process grows 200 MiB a second over a 1-second loop: 10 loops as long need about 2,000
    MiB. With 1,500 available: CREEP (the growth between the thirds' medians, ~130 MiB, would not
    say so); with 2,500: RISING."""
    cols = columns([1.0] * 100, step_ms=10.0)

    def found(available: float) -> list[tuple[str, str]]:
        h = host((0.5, 0.0), 0.5, 0.0, workers=0, n=20)
        h["samples"]["time_s"] = t = np.arange(20) * 0.05 + 0.025
        h["samples"]["process_rss_mib"] = 500.0 + 200.0 * t
        h["available_mib"] = available
        return [x for x in labels(resource_summary(ResourceFacts(cols, 0, None, h))) if x[0].startswith("HOST MEMORY")]

    assert found(1500.0) == [("HOST MEMORY CREEP", "warn")]
    assert found(2500.0) == [("HOST MEMORY RISING", "info")]
