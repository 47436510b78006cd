"""A cell that trains a torch.compile'd model, traced in a real shell: the compile time the
report names is the one the cell's own stopwatch sees (its first step against a steady one),
its recompilations are the graphs torch counted after the first step, its graph break is at
the line `torch._dynamo.explain` names, with the reason torch gives."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
from helpers import run, shell_fixture, traced

from traceml_jupyter.analysis.compile import read_compile

pytestmark = pytest.mark.slow  # Dynamo compiles for a second or more

SETUP = """\
import time
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(16 * 30 + 6, 32)), batch_size=16)  # the last batch: 6
"""
# The model is defined in the traced cell: its lines are the cell's (the `if` is line 9).
CELL = """\
torch._dynamo.reset()
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 4)
    def forward(self, x):
        y = self.layer(x)
        if y.sum().item() > 1e9:
            y = y * 2
        return y.sum()
model = torch.compile(Net(), backend=BACKEND)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
hand, graphs = [], []
for (x,) in loader:
    t = time.perf_counter()
    model(x).backward()
    opt.step()
    opt.zero_grad()
    hand.append(time.perf_counter() - t)
    graphs.append(counters["stats"]["unique_graphs"])
"""
IF_LINE = 9  # `if y.sum().item() > 1e9:` (the %%traceml line is 1)

shell = shell_fixture(SETUP)


def compiled_run(ip: Any, backend: str) -> Any:
    return traced(ip, CELL.replace("BACKEND", repr(backend)))


def test_the_compile_time_is_the_first_steps_extra_time_by_the_cells_own_stopwatch(shell: Any) -> None:
    got = compiled_run(shell, "eager").result
    hand = shell.user_ns["hand"]
    steady = statistics.median(hand[2:-1])
    reading = read_compile(got.compiled, got.steps.columns, got.loop.wall_ms)
    first = hand[0] - steady  # what compiling added to the first step, by the cell's stopwatch
    assert abs(reading.per_step[0] - first) <= 0.3 * first, (reading.per_step, hand[:3])
    assert 0 in got.summary["compiling_steps"]
    assert got.summary["step_ms"] < 1e3 * hand[0] / 2  # the steady median holds no compile


def test_the_recompilations_are_the_graphs_torch_counted_after_the_first_step(shell: Any) -> None:
    got = compiled_run(shell, "eager").result
    graphs = shell.user_ns["graphs"]
    reading = read_compile(got.compiled, got.steps.columns, got.loop.wall_ms)
    # each graph torch compiled after the first step is a recompilation, in the step it counted it
    assert len(reading.recompiles) == graphs[-1] - graphs[0]
    new_graphs = [k for k in range(1, len(graphs)) for _ in range(graphs[k] - graphs[k - 1])]
    assert sorted(r.step for r in reading.recompiles) == new_graphs
    # the last batch (6 samples) compiled the forward and its resume again: drop_last=True
    last = [r for r in reading.recompiles if r.step == len(graphs) - 1]
    assert len(last) == 2 and all("6 instead of 16" in r.cause and "drop_last=True" in r.fix for r in last)
    # the second step: the resume function guarded on the value `.item()` read
    assert any(r.step == 1 and ".item()" in r.cause for r in reading.recompiles)
    assert any(
        line.startswith(f"recompiled forward() and forward() after line {IF_LINE} at step {len(graphs)}, ")
        for _, line in got_lines(got)
    )
    assert any("drop_last=True" in line for _, line in got_lines(got))


def test_the_graph_break_is_at_the_line_explain_names(shell: Any) -> None:
    got = compiled_run(shell, "eager").result
    run(shell, "torch._dynamo.reset(); explained = torch._dynamo.explain(Net())(torch.randn(4, 32))", check=True)
    explained = shell.user_ns["explained"]
    reading = read_compile(got.compiled, got.steps.columns, got.loop.wall_ms)
    assert [b.line for b in reading.breaks] == [r.user_stack[-1].lineno for r in explained.break_reasons] == [IF_LINE]
    (brk,) = reading.breaks
    assert brk.filename == got.loop.cell_filename and ".item()" in brk.fix
    assert explained.break_reasons[0].reason.startswith(brk.reason.split(":")[0])
    assert got.compiled["graph_breaks"] == 2  # torch's counter: the first compile and the recompile
    assert any(line.startswith(f"graph break in forward() at line {IF_LINE}: ") for _, line in got_lines(got))


def got_lines(result: Any) -> list[tuple[str, str]]:
    from traceml_jupyter.result import lines_after_verdict

    return lines_after_verdict(result)


def test_a_cell_that_compiles_nothing_has_no_compile_facts(shell: Any) -> None:
    got = traced(shell, "for (x,) in loader:\n    x.sum()\n").result
    assert got.compiled is None and got.summary["compiling_steps"] == []


def test_a_failure_reading_torchs_record_is_a_note_and_the_cell_runs_as_without_the_magic(
    shell: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._dynamo.utils

    def broken() -> list[object]:
        raise RuntimeError("metrics moved")

    monkeypatch.setattr(torch._dynamo.utils, "get_compilation_metrics", broken)
    got = traced(shell, "total = 0\nfor (x,) in loader:\n    total += int(x.shape[0])\n")
    assert shell.user_ns["total"] == 16 * 30 + 6
    assert got.result.compiled is None
    assert any(n.startswith("traceml failed reading torch.compile's record: RuntimeError: metrics moved") for n in got.result.notes)


def test_inductor_compile_time_is_the_first_steps_extra_time(shell: Any) -> None:
    """Inductor builds C++ with the machine's compiler: seconds, against the cell's stopwatch
    (its cache of earlier builds off, so that it builds)."""
    import torch._inductor.config

    with torch._inductor.config.patch(fx_graph_cache=False):
        got = traced(shell, CELL.replace("BACKEND", "'inductor'").replace("if y.sum().item() > 1e9:", "if False:")).result
    hand = shell.user_ns["hand"]
    steady = statistics.median(hand[2:-1])
    reading = read_compile(got.compiled, got.steps.columns, got.loop.wall_ms)
    first = hand[0] - steady
    assert first > 0.5  # Inductor compiled for real
    assert abs(reading.per_step[0] - first) <= 0.3 * first, (reading.per_step, hand[:3])
    assert not reading.breaks and got.compiled["graph_breaks"] == 0


def test_the_recompile_limit_hit_is_said_loudly(shell: Any) -> None:
    """A Python int that changes every step, compiled without dynamic shapes, past a limit of 2:
    torch gives up on the function (it runs eagerly) and the report says so."""
    import torch._dynamo

    cell = """\
    torch._dynamo.reset()
    def scale(x, n):
        return x * n
    scaled = torch.compile(scale, backend="eager", dynamic=False)
    for k, (x,) in enumerate(loader):
        scaled(x, k)
    """
    with torch._dynamo.config.patch(recompile_limit=2):
        got = traced(shell, cell).result
    reading = read_compile(got.compiled, got.steps.columns, got.loop.wall_ms)
    assert reading.limit_hit == "scale"
    assert [r.step for r in reading.recompiles] == [1]  # the one recompile allowed: k == 1
    assert "Python value" in reading.recompiles[0].cause
    assert ("critical", "RECOMPILE LIMIT HIT: torch.compile gave up on scale(): it runs eagerly (uncompiled) from "
            "then on — fix the recompilations below") in got_lines(got)


def test_a_compiled_training_step_function_names_its_own_breaks_at_the_users_lines(shell: Any) -> None:
    cell = """\
    torch._dynamo.reset()
    net = torch.nn.Linear(32, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    @torch.compile(backend="eager")
    def train_step(x):
        loss = net(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    for (x,) in loader:
        train_step(x)
    """
    got = traced(shell, cell).result
    reading = read_compile(got.compiled, got.steps.columns, got.loop.wall_ms)
    lines = {b.line: b for b in reading.breaks if b.function == "train_step"}
    assert 8 in lines and "compile the model" in lines[8].fix  # loss.backward()
    assert not [b for b in reading.breaks if "traceml_jupyter" in b.filename]  # never traceml's own lines (torch's may be)
    assert [(r.function, r.step) for r in reading.recompiles] == [("train_step", len(got.steps.columns["step"]) - 1)]
