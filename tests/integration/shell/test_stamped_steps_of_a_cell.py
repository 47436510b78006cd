"""Traced cells give the same steps whether the hooks stamp them and replay later or report each
at once (training, accumulation, validation inside the loop, next() in the body), an optimizer
whose step calls super().step() is one step, and a DataLoader that gives no batch makes none."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest
from IPython.utils.capture import capture_output

import traceml_jupyter
from traceml_jupyter.capture import stamping
from traceml_jupyter.capture.steps.step_model import BACKWARD

# -- a traced run: stamped or reported, the same steps ----------------------------------------
CELLS = {
    "plain loop": "for x in data:\n    pass\n",
    "training": (
        "for x, y in loader:\n    opt.zero_grad()\n    loss = (model(x) - y).pow(2).mean()\n"
        "    loss.backward()\n    opt.step()\n"
    ),
    "accumulation": (
        "for i, (x, y) in enumerate(loader):\n    ((model(x) - y).pow(2).mean() / 4).backward()\n"
        "    if i % 4 == 3:\n        opt.step()\n        opt.zero_grad()\n"
    ),
    "next() in the body": (
        "it = iter(loader)\nfor i in range(len(loader)):\n    x, y = next(it)\n"
        "    (model(x) - y).pow(2).mean().backward()\n    opt.step()\n"
    ),
    "validation inside the loop": (
        "for i, (x, y) in enumerate(loader):\n    (model(x) - y).pow(2).mean().backward()\n    opt.step()\n"
        "    if i % 50 == 49:\n        with torch.no_grad():\n            for vx, vy in val:\n                model(vx)\n"
    ),
}


SETUP = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
data = list(range(3000))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(torch.randn(800, 4), torch.randn(800, 1)), batch_size=2)
val = DataLoader(TensorDataset(torch.randn(20, 4), torch.randn(20, 1)), batch_size=5)
"""


def shape_of(run: Any) -> dict[str, Any]:
    """What a run says, timings aside."""
    return {
        "n_steps": run.n_steps,
        "step_kind": run.result.steps.kind,
        "batches_per_step": run.result.steps.batches_per_step,
        "sources": [{k: v for k, v in s.items() if not k.endswith(("_ms", "share"))} for s in run.result.data.sources],
        "phases": [{k: v for k, v in p.items() if k in ("kind", "label", "passes", "batches")} for p in run.result.data.phases],
        "sampled": run.summary["parts_sampled_steps"] > 0,
    }


def stamped_and_reported(ip: Any, cell: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The cell traced as the hooks choose (stamped where they may), then with every event
    reported when it happens (the GPU path's way): what each run says."""
    with capture_output():
        ip.run_cell(SETUP)
    seen = {}
    for how in ("stamped", "reported"):
        if how == "reported":
            monkeypatch.setattr(stamping.Stamping, "budget", lambda self: 0)
        with capture_output():
            result = ip.run_cell(f"%%traceml --no-live\n{CELLS[cell]}")
        assert result.error_in_exec is None
        run = traceml_jupyter.last()
        assert run is not None
        seen[how] = shape_of(run)
        cols = run.steps
        assert np.all(cols["step_ms"] >= cols["data_wait_ms"]) and np.all(cols["data_wait_ms"] >= 0)
    return seen


@pytest.mark.slow  # a real traced cell run twice, 1-2 s each: the full suite runs it
@pytest.mark.parametrize("cell", list(CELLS))
def test_a_traced_cell_gives_the_same_steps_stamped_or_reported(ip: Any, cell: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = stamped_and_reported(ip, cell, monkeypatch)
    assert seen["stamped"] == seen["reported"]
    assert seen["stamped"]["n_steps"] == {"plain loop": 3000, "accumulation": 100}.get(cell, 400)


@pytest.mark.slow  # as above
@pytest.mark.parametrize("cell", [c for c in CELLS if c != "plain loop"])
def test_training_steps_stamped_whenever_they_may_be_are_the_steps_reported(
    ip: Any, cell: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training steps are stamped only when many of them remain before the next sampled step
    (`stamping.TRAINING_BUDGET`: fewer cost more replayed than reported); stamped from two on,
    as plain iterations are, their hooks' stamps still give the steps reported at once."""
    stamped = []
    real_defer = stamping.Stamping.defer

    def defer(self: Any, room: int, loop: bool) -> None:
        stamped.append(self.model.level)
        real_defer(self, room, loop)

    monkeypatch.setattr(stamping, "TRAINING_BUDGET", stamping.MIN_BUDGET)
    monkeypatch.setattr(stamping.Stamping, "defer", defer)
    seen = stamped_and_reported(ip, cell, monkeypatch)
    assert seen["stamped"] == seen["reported"]
    assert any(level >= BACKWARD for level in stamped)  # training steps were stamped


# -- three bugs of the step model ---------------------------------------------------------------
def test_an_optimizer_whose_step_calls_super_step_is_one_step(ip: Any) -> None:
    """torch wraps `step` of each optimizer class when one is made: a subclass calling
    `super().step()` runs the step hooks twice once the base class was made anywhere."""
    cell = """\
    import torch
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)  # the base class, made anywhere
    class Clipped(torch.optim.SGD):
        def step(self, closure=None):
            torch.nn.utils.clip_grad_norm_(self.param_groups[0]["params"], 1.0)
            return super().step(closure)
    model = torch.nn.Linear(4, 1)
    opt = Clipped(model.parameters(), lr=0.1)
    """
    with capture_output():
        ip.run_cell(textwrap.dedent(cell))
    with capture_output():
        result = ip.run_cell(
            "%%traceml --no-live\nfor i in range(100):\n    opt.zero_grad()\n"
            "    model(torch.ones(2, 4)).sum().backward()\n    opt.step()\n"
        )
    assert result.error_in_exec is None
    run = traceml_jupyter.last()
    assert run is not None and run.result.steps.kind == "optimizer" and run.n_steps == 100


@pytest.mark.parametrize(
    "cell",
    [
        "x = list(empty)\n",
        "it = iter(empty)\ntry:\n    next(it)\nexcept StopIteration:\n    pass\n",
        "try:\n    next(iter(bad))\nexcept ValueError:\n    pass\n",
    ],
)
def test_a_dataloader_that_gives_no_batch_makes_no_step(ip: Any, cell: str) -> None:
    setup = """\
    from torch.utils.data import DataLoader
    empty = DataLoader([], batch_size=2)
    class Bad:
        def __len__(self):
            return 4
        def __getitem__(self, i):
            raise ValueError("bad item")
    bad = DataLoader(Bad(), batch_size=2)
    """
    with capture_output():
        ip.run_cell(textwrap.dedent(setup))
    before = len(traceml_jupyter.runs())
    with capture_output() as out:
        result = ip.run_cell(f"%%traceml --no-live\n{cell}")
    assert result.error_in_exec is None
    assert len(traceml_jupyter.runs()) == before  # no run: "no training loop found"
    assert "no training loop found" in out.stdout
