"""Hints say only what is true for this code: no mixed precision on the CPU, no torch.compile for a
compiled model, no caching of random augmentations, no batch-type note for an epoch loop, no
--lines note on a library run."""

from __future__ import annotations

import ast
import textwrap
from typing import Any

from helpers import run
from synthetic import step_columns

import traceml_jupyter
from traceml_jupyter.analysis.cell_code import sample_code_in
from traceml_jupyter.analysis.checklist import Facts, per_sample_item
from traceml_jupyter.analysis.summary import summarize
from traceml_jupyter.analysis.verdict import diagnose


def compute_bound(**extra: Any) -> str:
    summary = summarize(step_columns([0.1] * 40, [10.0] * 40), 40)
    summary.update(extra)
    verdict = diagnose(summary)
    assert verdict.label == "COMPUTE-BOUND"
    return verdict.next


def test_a_cpu_run_is_not_told_to_use_mixed_precision() -> None:
    advice = compute_bound()
    assert "mixed precision" not in advice and "torch.compile" in advice


def test_a_compiled_model_is_not_told_to_compile() -> None:
    assert "torch.compile" not in compute_bound(model_compiled=True)


def item_for(source: str) -> Any:
    tree = ast.parse(textwrap.dedent(source))
    code = sample_code_in(tree, "Images")
    return per_sample_item(Facts("INPUT-BOUND", {"num_workers": 2}, 4, sample_code=code))


def test_random_augmentations_are_not_to_be_cached() -> None:
    item = item_for(
        """
        class Images:
            def __getitem__(self, i):
                img = self.aug.RandomResizedCrop(self.images[i])
                return self.ColorJitter(img)
        """
    )
    assert item.to_try == "run it in workers, or on the GPU" and "cannot be cached" in item.reason


def test_only_the_deterministic_work_is_to_be_cached() -> None:
    item = item_for(
        """
        class Images:
            def __getitem__(self, i):
                img = decode_jpeg(self.files[i])
                return RandomHorizontalFlip(img)
        """
    )
    assert item.to_try == "cache or precompute"
    assert "decode_jpeg()" in item.reason and "RandomHorizontalFlip()) must stay per epoch" in item.reason


def traced(ip: Any, cell: str) -> Any:
    run(ip, cell, check=True)
    return traceml_jupyter.last()


def test_an_epoch_loop_chosen_as_the_loop_gets_no_batch_type_note(ip: Any) -> None:
    ip.run_cell("import torch\nbatches = [torch.ones(4, 2) for _ in range(3)]")
    run = traced(ip, "%%traceml --no-live --loop 2\nfor epoch in range(3):\n    for b in batches:\n        b.sum()\n")
    assert run.n_steps == 3 and run.batch_size is None
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
    assert run.n_steps == 4 and run.step_kind == "optimizer" and run.batch_size == 8
    assert not any("--lines" in note for note in run.notes)
    assert run.summary["samples_per_s"] is not None
