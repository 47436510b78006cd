"""Hints say only what is true for this code: no mixed precision on the CPU, no torch.compile for a
compiled model, no caching of random augmentations. The notes of a traced cell (an epoch loop, a
library run): tests/integration/shell/test_hints_of_a_cell.py."""

from __future__ import annotations

import ast
import textwrap
from typing import Any

from synthetic import step_columns

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


def test_a_host_bound_compiled_run_is_not_told_to_compile() -> None:
    """HOST-BOUND's advice names torch.compile only for a run that did not compile (a compiled
    model, or a torch.compile'd step function the cell calls)."""
    from traceml_jupyter.analysis.verdict import _host_verdict

    summary = summarize(step_columns([0.1] * 40, [10.0] * 40), 40)
    assert "torch.compile" in _host_verdict(summary, "warning", []).next
    summary["model_compiled"] = True
    assert "torch.compile" not in _host_verdict(summary, "warning", []).next
