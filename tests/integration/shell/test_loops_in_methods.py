"""A training loop in a method of a class from an earlier cell, called on an object the traced cell
makes itself (`Trainer(...).fit()`, `t = Trainer(...)` then `t.fit()`, a factory, chained calls):
the loop is located in the method, its lines are timed, the class's cell is shown beside the
report, and after the cell the class runs its own code again, also when fit() raised."""

from __future__ import annotations

import time
import traceback
from typing import Any

import pytest
from helpers import run, shell_fixture

import traceml_jupyter

SETUP = """
import time, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(40, 8), torch.randn(40, 1)), batch_size=8)
"""

# The class's own cell, as the notebook shows it (line 1 is `class Base:`).
TRAINERS = """\
class Base:
    def setup(self):
        self.ready = True
        return self

class Trainer(Base):
    def __init__(self, model, loader, opt, fail_at=None, error=ValueError):
        self.model, self.loader, self.opt = model, loader, opt
        self.fail_at, self.error = fail_at, error
    def fit(self, epochs=2):
        losses = []
        for _ in range(epochs):
            for x, y in self.loader:
                self.opt.zero_grad()
                loss = ((self.model(x) - y) ** 2).mean()
                loss.backward()
                self.opt.step()
                time.sleep(0.01)
                losses.append(float(loss.detach()))
                if len(losses) == self.fail_at:
                    raise self.error(f"diverged at step {len(losses)}")
        return losses

class Finetuner(Trainer):
    pass

def make_trainer(model, loader, opt):
    trainer = Trainer(model, loader, opt)
    return trainer.setup()
"""


def line_of(text: str) -> int:
    """The line of TRAINERS that holds `text`, as its cell numbers it."""
    (line,) = [i for i, source in enumerate(TRAINERS.splitlines(), 1) if text in source]
    return line


LOOP_LINE = line_of("for x, y in self.loader:")
BODY_LINES = list(range(LOOP_LINE + 1, line_of("if len(losses) == self.fail_at")))
SLEEP_LINE = line_of("time.sleep(0.01)")
RAISE_LINE = line_of("raise self.error")
STEPS = 10  # 2 epochs of 5 batches

shell = shell_fixture(SETUP)


@pytest.fixture
def trainers(shell: Any) -> Any:
    """The classes defined in a cell of their own; `trainer` and `history` not yet names."""
    run(shell, TRAINERS, check=True)
    for name in ("trainer", "history"):
        shell.user_ns.pop(name, None)
    return shell


def plain_codes(ip: Any) -> dict[str, Any]:
    ns = ip.user_ns
    return {
        "fit": ns["Trainer"].__dict__["fit"].__code__,
        "setup": ns["Base"].__dict__["setup"].__code__,
        "make_trainer": ns["make_trainer"].__code__,
    }


SHAPES = {
    "made inline": "history = Trainer(model, loader, opt).fit()",
    "a new name": "trainer = Trainer(model, loader, opt)\nhistory = trainer.fit()",
    "a factory": "history = make_trainer(model, loader, opt).fit()",
    "chained": "history = Trainer(model, loader, opt).setup().fit()",
    "inherited": "history = Finetuner(model, loader, opt).fit()",
    "a list of them": "history = []\nfor t in [Trainer(model, loader, opt)]:\n    history += t.fit()",
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_loop_in_the_method_is_located_timed_and_shown(trainers: Any, shape: str) -> None:
    ip = trainers
    plain = plain_codes(ip)
    started = time.perf_counter()
    r = run(ip, "%%traceml --no-live\n" + SHAPES[shape], check=True)
    cell_ms = (time.perf_counter() - started) * 1e3
    got = traceml_jupyter.last()
    assert got is not None
    # The cell did what it does without the magic: every step's loss came back.
    assert len(ip.user_ns["history"]) == STEPS == got.n_steps
    # The located loop is the method's, as the class's cell numbers its lines.
    assert got.result.loop.line == LOOP_LINE and (got.result.loop.where or "").startswith("function Trainer.fit (")
    assert got.result.loop.loop_cell_source is not None and got.result.loop.loop_cell_source.strip() == TRAINERS.strip()
    # Each body line of the method got its cost per step; the line that sleeps 10 ms costs at
    # least that, and all of them together no more than the cell's own clock says a step took.
    costs = {s["line"]: s["ms_per_step"] for s in got.result.line_costs["statements"]}
    assert sorted(costs) == BODY_LINES + [BODY_LINES[-1] + 1]  # and the `if` after the append
    assert costs[SLEEP_LINE] >= 10.0 * 0.95
    assert sum(costs.values()) <= cell_ms / STEPS
    # The report shows the class's cell with the loop, beside the traced cell.
    html = "".join(o.data.get("text/html", "") for o in r.out.outputs)
    assert "The step loop: function Trainer.fit" in html and "for x, y in self.loader:" in html
    # After the cell the class runs its own code: the same code objects, no hooks in them.
    assert all(a is b for a, b in zip(plain_codes(ip).values(), plain.values(), strict=True))
    assert not [n for n in plain["fit"].co_names if n.startswith("__traceml")]
    run(ip, "again = Trainer(model, loader, opt).fit(1)", check=True)
    assert len(ip.user_ns["again"]) == STEPS // 2


@pytest.mark.slow
def test_an_instance_made_in_an_earlier_cell_is_located_as_before(trainers: Any) -> None:
    ip = trainers
    run(ip, "old = Trainer(model, loader, opt)", check=True)
    plain = plain_codes(ip)["fit"]
    run(ip, "%%traceml --no-live\nhistory = old.fit()", check=True)
    got = traceml_jupyter.last()
    assert got is not None and got.n_steps == len(ip.user_ns["history"]) == STEPS
    assert got.result.loop.line == LOOP_LINE and "function Trainer.fit (" in (got.result.loop.where or "")
    assert ip.user_ns["Trainer"].__dict__["fit"].__code__ is plain


@pytest.mark.slow
@pytest.mark.parametrize("error", ["ValueError", "KeyboardInterrupt"])
def test_an_error_inside_fit_keeps_its_traceback_and_the_class_its_code(trainers: Any, error: str) -> None:
    ip = trainers
    plain = plain_codes(ip)
    cell = f"trainer = Trainer(model, loader, opt, fail_at=3, error={error})\ntrainer.fit()\n"
    r = run(ip, "%%traceml --no-live\n" + cell)
    assert type(r.error_in_exec).__name__ == error and str(r.error_in_exec) == "diverged at step 3"
    got = traceml_jupyter.last()
    assert got is not None and got.n_steps == 3 and got.result.loop.line == LOOP_LINE
    assert got.result.error == f"{error}: diverged at step 3"
    # The traceback ends on the method's own line, in the class's cell, as a plain run's would.
    last = traceback.extract_tb(r.error_in_exec.__traceback__)[-1]
    assert (last.filename, last.lineno) == (plain["fit"].co_filename, RAISE_LINE)
    assert last.line == 'raise self.error(f"diverged at step {len(losses)}")'
    # The class has its own code back.
    assert all(a is b for a, b in zip(plain_codes(ip).values(), plain.values(), strict=True))
