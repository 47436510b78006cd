"""Runs that outlive the kernel, in real kernels (nbclient): a first kernel traces the same cell
twice and then with a 2x fix, saving the runs (a path, the history); a fresh kernel loads them
and compares: the same figures as the first kernel's comparison, NO CHANGE for the unchanged
cell, IMPROVEMENT with an interval that excludes 1 for the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_harness import DECODING_DATASET, KERNEL_NAME, ensure_python3_kernel, notebook

nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.kernel

SETUP = DECODING_DATASET + """
loader = DataLoader(SlowDataset(6.0), batch_size=4)
model = torch.nn.Linear(16, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.CrossEntropyLoss()"""
LOOP = """
for x, y in loader:
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()"""
COMPARED = """\
import json, traceml_jupyter
print(json.dumps({"same": traceml_jupyter.compare("slow", "slow again").to_dict(),
                  "fix": traceml_jupyter.compare(%r, "fixed").to_dict()}))"""


def execute(nb: nbformat.NotebookNode) -> None:
    nbclient.NotebookClient(nb, timeout=120, startup_timeout=60, kernel_name=KERNEL_NAME).execute()


def printed(cell: Any) -> dict[str, Any]:
    text = "".join(o.get("text", "") for o in cell.outputs if o["output_type"] == "stream")
    return dict(json.loads(text.strip().splitlines()[-1]))


def test_runs_saved_in_one_kernel_compare_the_same_in_a_fresh_one(tmp_path: Path) -> None:
    ensure_python3_kernel()
    where, slow = tmp_path / "history", tmp_path / "slow.json"
    first = notebook(
        "%load_ext traceml_jupyter",
        SETUP,
        f"%traceml history {where}",
        f"%%traceml --name slow --no-live --save {slow}" + LOOP,
        '%%traceml --name "slow again" --no-live' + LOOP,
        "loader = DataLoader(SlowDataset(3.0), batch_size=4)  # the fix: half the decoding",
        f"%%traceml --name fixed --no-live --save {tmp_path / 'fixed.html'}" + LOOP,
        COMPARED % str(slow),
    )
    execute(first)
    in_first = printed(first.cells[-1])

    fresh = notebook(
        "%load_ext traceml_jupyter",
        f"%traceml history {where}",
        f"import traceml_jupyter\ntraceml_jupyter.load({str(slow)!r})",
        COMPARED % str(slow),
        "%traceml compare slow fixed",
    )
    execute(fresh)
    in_fresh = printed(fresh.cells[3])

    assert in_fresh == in_first  # every figure, interval and sentence
    same, fix = in_fresh["same"], in_fresh["fix"]
    assert same["change"] == "NO CHANGE", same["conclusion"]
    # Faster for sure; MIXED when the tiny model's compute also moved beyond noise (it did once
    # in CI: +0.6 ms a step), which compare then says beside the speed-up.
    assert fix["change"] in ("IMPROVEMENT", "MIXED"), fix["conclusion"]
    assert fix["speedup_interval"][0] > 1.0 and 1.6 < fix["speedup"] < 2.4, fix["conclusion"]
    assert same["caveats"] == [] and fix["caveats"] == []
    # The loaded run shows its report as the cell's value, and the magic compares by name.
    report = fresh.cells[2].outputs[-1]["data"]
    assert "Step Time: INPUT-BOUND" in report["text/html"] and "num_workers" in report["text/html"]
    shown = fresh.cells[4].outputs[-1]["data"]["text/plain"]
    assert shown.splitlines()[1].startswith(("  IMPROVEMENT: ", "  MIXED: ")) and "x faster" in shown.splitlines()[1]
    page = (tmp_path / "fixed.html").read_text()
    assert "<script" not in page and "Step Time:" in page
