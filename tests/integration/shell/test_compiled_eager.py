"""A compiled model whose forward breaks its graph around a section that runs eagerly, traced
in a real shell: the share of a step the report says runs eagerly between the compiled graphs
is the one the cell's own stopwatch measures on the same steps (the eager section timed inside
it, the step timed around it); a model without a break runs ~0 % eagerly; the eager backend,
which marks no graph, gets no figure and says why."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import shell_fixture, traced

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # Dynamo compiles: 1-3 s each

SETUP = """\
import time
import torch
import torch._dynamo
torch.manual_seed(0)

def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass

@torch.compiler.disable
def eager_section(h):  # Dynamo breaks the graph here and runs this as plain Python
    t = time.perf_counter()
    busy(0.002)
    eager_times.append(time.perf_counter() - t)
    return h

class Net(torch.nn.Module):
    def __init__(self, breaks):
        super().__init__()
        self.breaks = breaks
        self.a = torch.nn.Linear(64, 256)
        self.b = torch.nn.Linear(256, 10)
    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.breaks:
            h = eager_section(h)
        return self.b(h)

x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
"""
CELL = """\
torch._dynamo.reset()
model = torch.compile(Net(BREAKS), backend=BACKEND)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
eager_times, step_times = [], []
compiled_at = None
while compiled_at is None or time.perf_counter() - compiled_at < 2.5:  # 2.5 s of steps after compiling: room for the sample to start at a tick and see whole steps on a loaded machine
    t = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    step_times.append(time.perf_counter() - t)
    if len(step_times) == 2:
        compiled_at = time.perf_counter()
"""

shell = shell_fixture(SETUP)


def compiled_run(ip: Any, backend: str, breaks: bool) -> Any:
    return traced(ip, CELL.replace("BACKEND", repr(backend)).replace("BREAKS", repr(breaks))).result


def test_the_eager_share_is_the_eager_sections_share_by_the_cells_own_stopwatch(shell: Any) -> None:
    got = compiled_run(shell, "aot_eager", breaks=True)
    eager = got.compiled["eager"]
    assert eager is not None and eager["share"] is not None, f"{eager['note']} {eager['profiled']}"
    first, last = eager["steps"]
    ns = shell.user_ns
    hand = sum(ns["eager_times"][first : last + 1]) / sum(ns["step_times"][first : last + 1])
    assert abs(eager["share"] - hand) <= 0.3 * hand, (eager, hand)
    # the sampled steps are whole steps of the run, kept out of its steady state
    assert eager["profiled"][0] <= first <= last <= eager["profiled"][1]
    assert not set(range(eager["profiled"][0], eager["profiled"][1] + 1)) & set(got.summary["compiling_steps"])
    assert got.summary["eager_share"] == eager["share"]
    if eager["share"] >= 0.10:
        from traceml_jupyter.result import lines_after_verdict

        assert any(line.startswith("eager between graphs: ") for _, line in lines_after_verdict(got))


def test_a_model_without_a_graph_break_runs_next_to_nothing_eagerly(shell: Any) -> None:
    got = compiled_run(shell, "aot_eager", breaks=False)
    eager = got.compiled["eager"]
    assert got.compiled["graph_breaks"] == 0
    assert eager is not None and eager["share"] is not None and eager["share"] < 0.03, dict(eager)
    assert eager["graphs_s"] > 0


def test_the_eager_backend_marks_no_graph_and_gets_no_figure(shell: Any) -> None:
    got = compiled_run(shell, "eager", breaks=True)
    eager = got.compiled["eager"]
    assert eager is not None and eager["share"] is None and "no call of a compiled graph was marked" in (eager["note"] or "")
    assert got.summary["eager_share"] is None
