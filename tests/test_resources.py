"""Memory and CPU beside the time, with real processes on this machine's CPUs: DataLoader workers
that burn CPU saturate it (and no "add workers" advice), workers that sleep leave it idle (more
workers advised), a dataset's big Python list grows its forked workers' private memory (named
with the attribute), a loss kept with its graph grows the process (named with the line)."""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest
from IPython.utils.capture import capture_output

import traceml_jupyter

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


def run(ip: Any, cell: str) -> Any:
    with capture_output() as out:
        result = ip.run_cell(textwrap.dedent(cell))
    assert result.error_in_exec is None, result.error_in_exec
    result.shown = out.stdout + "\n".join(o.data.get("text/plain", "") for o in out.outputs)
    return result


@pytest.fixture()
def shell(ip: Any) -> Any:
    run(ip, SETUP)
    return ip


def checklist_item(got: Any, key: str) -> dict[str, Any]:
    return next(i for i in got.checklist if i["key"] == key)


def test_workers_that_burn_every_core_saturate_the_cpu_and_get_no_more_workers(shell: Any) -> None:
    # 2 workers burning 4 ms a sample on this 2-core machine (each batch of 4 is 16 ms of CPU);
    # the model is tiny, so the loop waits for them: INPUT-BOUND, and the CPU has no core left.
    run(shell, "loader = DataLoader(Burning(4 * 120, 4.0), batch_size=4, num_workers=2)")
    shown = run(shell, TRAIN.format(name="burning")).shown
    got = traceml_jupyter.last()
    assert got is not None and got.verdict == "INPUT-BOUND"
    s = got.summary
    assert s["cpu_saturated"] is True, {k: s[k] for k in s if k.startswith("cpu")}
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


def test_a_python_list_read_by_forked_workers_grows_their_private_memory(shell: Any) -> None:
    # 1.6 million (float, int) tuples, read in chunks by 2 forked workers: reading them writes
    # their reference counts, so each worker copies the pages it reads (copy-on-read); RSS
    # barely moves, the workers' private memory (USS) grows.
    run(shell, "records = Records(1_600_000, 2_000)\nloader = DataLoader(records, batch_size=1, num_workers=2, shuffle=True)")
    run(shell, TRAIN.format(name="records"))
    got = traceml_jupyter.last()
    assert got is not None
    s = got.summary
    workers = (got.host or {})["workers"]
    assert len(workers) == 2 and all(w["uss_reads"] >= 2 for w in workers), workers
    assert s["worker_uss_growth_mib"] >= 64, workers
    found = next(f for f in s["resource_findings"] if f["label"] == "WORKER MEMORY GROWTH")
    assert "`loader.dataset.records` holds a list of 1,600,000 tuple objects" in found["text"]
    assert "numpy arrays" in found["next"]
    assert "copy-on-read" in found["text"]


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
    del got
    shell.user_ns.pop("total", None)  # free the kept graphs
