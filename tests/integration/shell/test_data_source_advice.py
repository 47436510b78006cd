"""A traced cell whose steps wait on a source that is no DataLoader (a generator, an iterator,
get_batch(), a list) gets advice that names it; a DataLoader keeps its loader advice."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from helpers import shell_fixture
from helpers import traced as traced_with

from traceml_jupyter.analysis.checklist import FIX, OK

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SETUP = """
import time, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def slow(n):
    for i in range(n):
        time.sleep(0.004)
        yield torch.zeros(8, 4)

def get_batch(split):
    time.sleep(0.004)
    return torch.zeros(8, 4)

class Stream:
    def __init__(self, n):
        self.n = n
    def __iter__(self):
        return self
    def __next__(self):
        if self.n == 0:
            raise StopIteration
        self.n -= 1
        time.sleep(0.004)
        return torch.zeros(8, 4)

class Slow(Dataset):
    def __len__(self):
        return 24
    def __getitem__(self, i):
        time.sleep(0.0005)
        return torch.zeros(4)

batches = [torch.zeros(8, 4) for _ in range(24)]
"""


TRAIN = """\
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
"""


DATALOADER_WORDS = ("DataLoader workers", "persistent workers", "pinned memory")


traced = partial(traced_with, store_history=True)


shell = shell_fixture(SETUP, store_history=True)


def items_of(run: Any) -> dict[str, dict[str, Any]]:
    return {item["key"]: item for item in run.result.reading.checklist or ()}


def sleep_line(code: str) -> int:
    """The line of SETUP (as its cell numbers it) where `code` sleeps."""
    lines = SETUP.lstrip("\n").splitlines()  # IPython drops a leading blank line
    start = next(i for i, text in enumerate(lines) if f"def {code.split('.')[-1].rstrip('()')}(" in text)
    return next(i for i in range(start, len(lines)) if "time.sleep" in lines[i]) + 1


@pytest.mark.parametrize(
    ("head", "label", "kind", "line", "code"),
    [
        ("for x in slow(24):\n", "`slow(24)` on line 2", "generator", 2, "slow()"),
        ("for i, x in enumerate(slow(24)):\n", "`slow(24)` on line 2", "generator", 2, "slow()"),
        ("for x in Stream(24):\n", "`Stream(24)` on line 2", "iterator", 2, "Stream.__next__"),
        ("for i in range(24):\n    x = get_batch('train')\n", "`get_batch('train')` on line 3", "function", 3, "get_batch()"),
        ("g = slow(24)\nfor i in range(24):\n    x = next(g)\n", "`next(g)` on line 4", "generator", 4, "slow()"),
    ],
    ids=["generator", "enumerate(generator)", "iterator", "get_batch", "next(generator)"],
)
@pytest.mark.slow
def test_a_slow_source_that_is_no_dataloader_gets_advice_that_names_it(
    shell: Any, head: str, label: str, kind: str, line: int, code: str
) -> None:
    run = traced(shell, head + TRAIN)
    assert run.verdict == "INPUT-BOUND" and run.n_steps == 24
    s = run.summary
    assert (s["data_source"], s["data_source_type"], s["data_source_line"]) == (label, kind, line)
    text = run.verdict_detail.next
    assert text.startswith(f"Feed the loop faster: {label} (a")
    assert "background thread" in text and "cache" in text
    assert not any(word in text for word in DATALOADER_WORDS)
    items = items_of(run)
    source = items["data_source"]
    assert source["status"] == FIX and source["line"] == line and label in source["seen"]
    assert "num_workers" not in items and "dataloader" not in items
    per_item = items["per_sample_cost"]  # read from its def in the setup cell
    assert per_item["title"] == f"Per-item work in {code}" and per_item["cell"].startswith("In [")
    assert per_item["line"] == sleep_line(code) and per_item["to_try"] == "cache or precompute"
    assert run.to_dict()["summary"]["data_source_type"] == kind


@pytest.mark.slow
def test_a_list_is_named_and_gets_no_loader_settings(shell: Any) -> None:
    run = traced(shell, "for x in batches:\n" + TRAIN)
    s = run.summary
    assert (s["data_source"], s["data_source_type"]) == ("`batches` on line 2", "list")
    items = items_of(run)
    assert items["data_source"]["status"] == OK and "built before the loop" in items["data_source"]["reason"]
    assert items["per_sample_cost"]["status"] == OK and "num_workers" not in items


@pytest.mark.slow
def test_a_dataloader_keeps_its_advice(shell: Any) -> None:
    run = traced(shell, "loader = DataLoader(Slow(), batch_size=4)\nfor x in loader:\n" + TRAIN)
    assert run.verdict == "INPUT-BOUND"
    assert run.summary["data_source_type"] == "dataloader" and run.summary["data_source_line"] is None
    # the DataLoader's settings, as true for this run: one pass (no persistent workers), the CPU
    # clock (no pinned memory)
    assert run.verdict_detail.next == "Feed the loop faster: more DataLoader workers, and less per-sample work (see the checklist)."
    items = items_of(run)
    assert items["num_workers"]["status"] == FIX and "data_source" not in items
    assert items["per_sample_cost"]["title"] == "Per-sample work in __getitem__"
