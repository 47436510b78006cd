"""In a real kernel (nbclient): the training code the step model is for, a loop on a thread that
outlives its cell, and a cell that awaits (run on the kernel's own event loop)."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest
from helpers import TESTS
from jupyter_harness import KERNEL_NAME, ensure_python3_kernel, notebook

nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.kernel

SETUP = """\
%load_ext traceml_jupyter
import asyncio, json, threading, time, torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
import traceml_jupyter

class Digits(Dataset):
    def __len__(self):
        return 96
    def __getitem__(self, i):
        time.sleep(0.0005)
        return torch.randn(1, 28, 28), i % 10

def train(model, device, train_loader, optimizer):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.nll_loss(F.log_softmax(model(data), dim=1), target)
        loss.backward()
        optimizer.step()

def test(model, device, test_loader):
    model.eval()
    with torch.no_grad():
        for data, target in test_loader:
            model(data)

model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
train_loader = DataLoader(Digits(), batch_size=16)
test_loader = DataLoader(Digits(), batch_size=32)"""

MNIST = """\
%%traceml --name mnist
for epoch in range(1, 3):
    train(model, "cpu", train_loader, optimizer)
    test(model, "cpu", test_loader)
    scheduler.step()"""

THREAD = """\
%%traceml --no-live --name thread
done = []
def worker(n):
    for step in range(n):  # traceml: loop
        time.sleep(0.002)
        done.append(step)
t = threading.Thread(target=worker, args=(40,))
t.start()"""

AWAIT = """\
%%traceml --no-live --name awaits
async def batches(n):
    for i in range(n):
        await asyncio.sleep(0.002)
        yield i
total = 0
async for b in batches(8):
    total += b
total"""

FACTS = """\
t.join(10)
runs = {r.name: r for r in traceml_jupyter.runs()}
print(json.dumps({name: {"steps": r.n_steps, "kind": r.result.steps.kind, "phases": [p["kind"] for p in r.result.data.phases]}
                  for name, r in runs.items()} | {"done": len(done), "total": total}))"""


TRAIN_SCRIPT = TESTS / "child_scripts" / "train.py"
# `!python` runs through ipykernel's own system() (its output piped to the cell): the script is
# a child process, traced by the start-up hook the cell gives it.
SCRIPT = f"""\
import os
env_before = dict(os.environ)
%%traceml --name script
!{sys.executable} {TRAIN_SCRIPT} --sleep-ms 3 --steps 20"""
SCRIPT_FACTS = """\
r = traceml_jupyter.last()
print(json.dumps({"verdict": r.verdict, "steps": r.n_steps, "line": r.result.data.loader_site["line"],
                  "env": dict(os.environ) == env_before, "pids": [p["pid"] for p in r.result.processes],
                  "threads": [t.name for t in threading.enumerate() if t.name.startswith("traceml")]}))"""
BROKEN = "x = 1 +"  # a compile error, plain and traced: the same error in the kernel's reply
LAST_ERROR = """\
import sys
e = sys.last_value
print(json.dumps([type(e).__name__, type(e) is SyntaxError, e.msg, e.lineno, e.offset, e.text]))"""


def test_training_code_threads_and_awaiting_cells_in_a_real_kernel() -> None:
    ensure_python3_kernel()
    snapshot, script = SCRIPT.split("%%traceml", 1)
    nb = notebook(
        SETUP, MNIST, THREAD, AWAIT, FACTS, snapshot.strip(), "%%traceml" + script, SCRIPT_FACTS,
        BROKEN, "%%traceml\n" + BROKEN, LAST_ERROR,
    )
    for cell in nb.cells[8:10]:
        cell.metadata["tags"] = ["raises-exception"]
    nbclient.NotebookClient(nb, timeout=120, startup_timeout=60, kernel_name=KERNEL_NAME).execute()
    [plain], [traced] = ([o for o in c.outputs if o.get("output_type") == "error"] for c in nb.cells[8:10])
    assert traced["ename"] == plain["ename"] == "SyntaxError"
    plain_msg, plain_line = re.fullmatch(r"(.*) \(.*, line (\d+)\)", plain["evalue"]).groups()  # type: ignore[union-attr]
    msg, line = re.fullmatch(r"(.*) \(.*, line (\d+)\)", traced["evalue"]).groups()  # type: ignore[union-attr]
    assert msg == plain_msg == "invalid syntax" and int(line) == int(plain_line) + 1
    last = json.loads(next(o["text"] for o in nb.cells[10].outputs if o.get("name") == "stdout"))
    assert last == ["SyntaxError", True, "invalid syntax", int(line), 8, "x = 1 +\n"]
    facts: dict[str, Any] = json.loads(
        next(o["text"] for o in nb.cells[4].outputs if o.get("name") == "stdout").strip().splitlines()[-1]
    )
    assert facts["mnist"] == {"steps": 12, "kind": "optimizer", "phases": ["test"]}
    assert facts["done"] == 40  # the thread ran on after its cell, through the instrumented loop
    assert facts["awaits"]["steps"] == 8 and facts["total"] == 28
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs) + json.dumps(
        [o.get("data", {}) for o in nb.cells[1].outputs]
    )
    assert "optimizer.step()" in text and "test:" in text
    outputs = [o for cell in nb.cells[:8] for o in cell.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    script = json.loads(next(o["text"] for o in nb.cells[7].outputs if o.get("name") == "stdout").strip())
    assert script["verdict"] == "INPUT-BOUND" and script["steps"] == 20 and len(script["pids"]) == 1
    assert script["env"] and script["threads"] == []
    with open(TRAIN_SCRIPT) as fh:
        assert "loader = DataLoader(" in fh.read().splitlines()[script["line"] - 1]
    shown = json.dumps([o.get("data", {}) for o in nb.cells[6].outputs])
    assert "train.py, line" in shown  # the checklist reads the script's DataLoader
