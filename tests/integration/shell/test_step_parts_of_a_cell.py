"""The step's parts a traced cell finds through %%traceml: a loss module is no forward, a model
without modules is said so, an error in forward reaches the cell unchanged, and this step's model
and optimizer are found in a namespace full of earlier ones."""

from __future__ import annotations

import textwrap
from functools import partial
from typing import Any

import pytest
import torch
from helpers import traced as traced_with
from IPython.utils.capture import capture_output
from sleepy_model import Sleepy
from torch import nn

from traceml_jupyter.run import Run

traced = partial(traced_with, options="--no-live --lines off")


@pytest.mark.slow
def test_a_loss_module_is_no_forward_and_a_model_without_modules_is_said_so(ip: Any) -> None:
    ip.user_ns.update(Sleepy=Sleepy)
    with capture_output():
        ip.run_cell(
            "import torch\nmodel = Sleepy(1.0)\ncrit = torch.nn.MSELoss()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "w = torch.zeros(4, requires_grad=True)\nopt_w = torch.optim.SGD([w], lr=0.1)\n"
        )
    run = traced(ip, """\
        for i in range(10):
            opt.zero_grad()
            crit(model(torch.ones(2, 4)), torch.zeros(2, 1)).backward()
            opt.step()
        """)
    assert run.summary["forward_modules"] == ["model (Sleepy)"]
    assert run.summary["optimizers"][0]["label"] == "opt (SGD)"
    bare = traced(ip, """\
        for i in range(10):
            opt_w.zero_grad()
            (w * 2).sum().backward()
            opt_w.step()
        """)
    s = bare.summary
    assert s["forward_state"] == "not found" and s["forward_ms"] is None and s["rest_ms"] is None
    assert s["backward_ms"] is not None and s["optimizer_ms"] is not None
    assert "Forward not found" in bare.text()


@pytest.mark.slow
def test_an_error_inside_the_models_forward_reaches_the_cell_unchanged(ip: Any) -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 5:
                raise ValueError("bad batch 5")
            return self.fc(x)

    ip.user_ns.update(broken=Broken(), torch=torch)
    with capture_output() as out:
        result = ip.run_cell(
            "%%traceml --no-live\nfor i in range(10):\n    broken(torch.ones(1, 4)).sum().backward()\n"
        )
    assert isinstance(result.error_in_exec, ValueError) and str(result.error_in_exec) == "bad batch 5"
    shown = out.stdout + out.stderr
    assert "----> 3     broken(torch.ones(1, 4))" in shown  # the cell's own line
    assert "model_calls.py" not in shown and "step_parts.py" not in shown  # our frames hidden
    assert "__call__" not in Broken.__dict__


def test_a_namespace_full_of_earlier_models_does_not_hide_this_steps_model(ip: Any) -> None:
    """A long session: forty models from earlier cells; this cell's trainer makes its own module
    (as a Lightning run does) and calls its child: it is found from the frames all the same."""
    old = {f"old_model_{i}": nn.Linear(3, 3) for i in range(40)}
    ip.user_ns.update(old)
    try:
        run = holder_run(ip)
        ip.user_ns.update(late_a=Sleepy(), late_b=Sleepy())  # defined after the forty, named in the cell
        ip.user_ns["late_opt"] = torch.optim.SGD([*ip.user_ns["late_a"].parameters(), *ip.user_ns["late_b"].parameters()], lr=0.1)
        named = traced(ip, """\
            for i in range(8):
                late_opt.zero_grad()
                (late_a(torch.ones(1, 4)) + late_b(torch.ones(1, 4))).sum().backward()
                late_opt.step()
            """)
    finally:
        for name in [*old, "late_a", "late_b", "late_opt"]:
            ip.user_ns.pop(name, None)
    assert named.summary["forward_modules"] == ["late_a (Sleepy)", "late_b (Sleepy)"]
    assert run.summary["forward_state"] == "found"
    assert run.summary["forward_modules"] == ["Holder.net (Sleepy)"]
    assert "__call__" not in nn.Linear.__dict__ and "__call__" not in Sleepy.__dict__


def holder_run(ip: Any) -> Run:
    ip.user_ns.update(Sleepy=Sleepy, torch=torch, nn=nn)
    with capture_output():
        ip.run_cell(textwrap.dedent('''
            class Holder(nn.Module):
                """Never called itself: its step calls self.net (like a LightningModule)."""
                def __init__(self):
                    super().__init__()
                    self.net = Sleepy(1.0)
                def step(self, x):
                    return self.net(x)
            def fit():
                holder = Holder()
                opt = torch.optim.SGD(holder.parameters(), lr=0.1)
                for i in range(12):
                    opt.zero_grad()
                    holder.step(torch.ones(2, 4)).sum().backward()
                    opt.step()
            '''))
    return traced(ip, "fit()\n")


def test_a_model_and_optimizer_made_in_the_traced_cell_are_found_beside_forty_earlier_ones(ip: Any) -> None:
    old = {f"old_model_{i}": nn.Linear(3, 3) for i in range(40)}
    old["old_opts"] = [torch.optim.SGD(m.parameters(), lr=0.1) for m in old.values()]
    ip.user_ns.update(old, Sleepy=Sleepy, torch=torch)
    try:
        run = traced(ip, """\
            old_model_3 = Sleepy()
            opt = torch.optim.Adam(old_model_3.parameters(), lr=0.1)
            for i in range(8):
                opt.zero_grad()
                old_model_3(torch.ones(1, 4)).sum().backward()
                opt.step()
            """)
    finally:
        for name in [*old, "opt"]:
            ip.user_ns.pop(name, None)
    assert run.summary["forward_modules"] == ["old_model_3 (Sleepy)"]
    assert [o["name"] for o in run.summary["optimizers"]] == ["Adam"]
