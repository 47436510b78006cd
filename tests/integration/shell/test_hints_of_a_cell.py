"""Notes a traced cell gets only when they are true of its code: no batch-type note for an epoch
loop chosen as the loop, no --lines note on a library run."""

from __future__ import annotations

from typing import Any

from helpers import run

import traceml_jupyter


def traced(ip: Any, cell: str) -> Any:
    run(ip, cell, check=True)
    return traceml_jupyter.last()


def test_an_epoch_loop_chosen_as_the_loop_gets_no_batch_type_note(ip: Any) -> None:
    ip.run_cell("import torch\nbatches = [torch.ones(4, 2) for _ in range(3)]")
    run = traced(ip, "%%traceml --no-live --loop 2\nfor epoch in range(3):\n    for b in batches:\n        b.sum()\n")
    assert run.n_steps == 3 and run.result.steps.batch_size is None
    assert not any("not tensors" in note for note in run.notes)


def test_a_library_run_gets_no_lines_note(ip: Any) -> None:
    ip.run_cell(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "lib_loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)\n"
        "lib_model = torch.nn.Linear(4, 1)\nlib_opt = torch.optim.SGD(lib_model.parameters(), lr=0.1)\n"
        "def lib_fit():\n    it = iter(lib_loader)\n    while True:\n        try:\n            x, y = next(it)\n"
        "        except StopIteration:\n            return\n"
        "        lib_opt.zero_grad(); torch.nn.functional.mse_loss(lib_model(x), y).backward(); lib_opt.step()\n"
    )
    run = traced(ip, "%%traceml --no-live\nlib_fit()\n")
    assert run.n_steps == 4 and run.result.steps.kind == "optimizer" and run.result.steps.batch_size == 8
    assert not any("--lines" in note for note in run.notes)
    assert run.summary["samples_per_s"] is not None
