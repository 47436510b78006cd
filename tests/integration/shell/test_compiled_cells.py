"""A cell that trains through `torch.compile` behaves under `%%traceml` as without it: the same
compilations, recompilations, graphs and graph breaks, as torch's own counters count them, and
bit for bit the same losses and weights. Each story runs its cell plainly, then traced, each
after `torch._dynamo.reset()` and the same seed, and compares what torch counted; the steps are
still counted (one per iteration). Both shapes: `@torch.compile` on a training-step function
(the model and optimizer by global name, or passed in; called from the cell or from a function
of the notebook) and `model = torch.compile(model)`."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import run, traced

import traceml_jupyter
from traceml_jupyter.capture.session import COMPILED_MODEL_NOTE, COMPILED_NOTE, COMPILING_NOTE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # each compiles: 2-10 s

STEPS = 80  # past the first 64 steps, where the parts start sampling (and used to patch and unpatch)

SETUP = """
import torch
torch.manual_seed(0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 1)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1)
data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS)]
losses = []
"""

STEP_FUNCTION = """
@torch.compile(backend="BACKEND")
def train_step(x, y):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss
"""
STEP_FUNCTION_LOOP = """
for x, y in data:
    loss = train_step(x, y)
    losses.append(loss.detach().clone())
"""

STEP_OF_ARGUMENTS = """
@torch.compile(backend="BACKEND")
def step_of(m, o, x, y):
    o.zero_grad()
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    o.step()
    return loss
"""
STEP_OF_ARGUMENTS_LOOP = """
for x, y in data:
    loss = step_of(model, opt, x, y)
    losses.append(loss.detach().clone())
"""

THROUGH_A_FUNCTION = STEP_FUNCTION.replace("train_step", "inner_step") + """
def train(x, y):
    return inner_step(x, y)
"""
THROUGH_A_FUNCTION_LOOP = """
for x, y in data:
    loss = train(x, y)
    losses.append(loss.detach().clone())
"""

COMPILED_MODEL = """
compiled = torch.compile(model, backend="BACKEND")
"""
COMPILED_MODEL_LOOP = """
for x, y in data:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(compiled(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.detach().clone())
"""


@dataclass(frozen=True)
class Compiled:
    """What torch counted while a cell ran, and what the cell computed."""

    compiles: int  # frames compiled (torch's compilation metrics: one per compile)
    recompiles: int  # of them, those a failed guard caused (a recompile reason)
    graphs: int
    graph_breaks: int
    frames: int  # frames Dynamo looked at
    losses: torch.Tensor
    weights: torch.Tensor

    @staticmethod
    def now(losses: torch.Tensor, weights: torch.Tensor) -> Compiled:
        """What torch counted so far (its compilation metrics and counters), with what was computed."""
        from torch._dynamo.utils import counters, get_compilation_metrics

        metrics = get_compilation_metrics()
        return Compiled(
            compiles=len(metrics),
            recompiles=sum(m.recompile_reason is not None for m in metrics),
            graphs=counters["stats"]["unique_graphs"],
            graph_breaks=sum(counters["graph_break"].values()),
            frames=counters["frames"]["total"],
            losses=losses,
            weights=weights,
        )

    def counts(self) -> dict[str, int]:
        return {
            "compiles": self.compiles,
            "recompiles": self.recompiles,
            "graphs": self.graphs,
            "graph breaks": self.graph_breaks,
            "frames": self.frames,
        }


def fresh_dynamo() -> None:
    from torch._dynamo.utils import clear_compilation_metrics, counters

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()


def counted(ip: Any) -> Compiled:
    ns = ip.user_ns
    return Compiled.now(torch.stack(ns["losses"]), torch.cat([p.detach().flatten() for p in ns["model"].parameters()]))


def compiled_run(ip: Any, setup: str, loop: str, *, magic: bool, times: int = 1) -> tuple[Compiled, list[Any]]:
    """`setup` then `loop` run `times` times, plainly or under the magic, from a fresh Dynamo:
    what torch counted, and the traced runs."""
    fresh_dynamo()
    run(ip, SETUP.replace("STEPS", str(STEPS)) + textwrap.dedent(setup), check=True)
    runs = []
    for _ in range(times):
        if magic:
            runs.append(traced(ip, loop))
        else:
            run(ip, loop, check=True)
    return counted(ip), runs


def assert_as_plain(plain: Compiled, traced_: Compiled) -> None:
    assert traced_.counts() == plain.counts()
    assert torch.equal(traced_.losses, plain.losses), (traced_.losses - plain.losses).abs().max()
    assert torch.equal(traced_.weights, plain.weights)


SHAPES = {
    "a compiled training-step function": (STEP_FUNCTION, STEP_FUNCTION_LOOP),
    "a compiled step taking the model and optimizer": (STEP_OF_ARGUMENTS, STEP_OF_ARGUMENTS_LOOP),
    "a compiled step called by a function of the notebook": (THROUGH_A_FUNCTION, THROUGH_A_FUNCTION_LOOP),
    "a compiled model": (COMPILED_MODEL, COMPILED_MODEL_LOOP),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_compiled_cell_compiles_and_computes_as_without_the_magic(ip: Any, shape: str) -> None:
    setup, loop = SHAPES[shape]
    setup = setup.replace("BACKEND", "eager")  # the backend does not change what Dynamo traces
    plain, _ = compiled_run(ip, setup, loop, magic=False)
    assert plain.compiles >= 1  # the story compiles at all
    with_magic, runs = compiled_run(ip, setup, loop, magic=True)
    assert_as_plain(plain, with_magic)
    result = runs[0].result
    assert result.steps.n_steps == STEPS  # one step per iteration, as the loop ran
    # A compiled step: its backward() calls are the steps, and the report says why.
    said = any(n == COMPILED_NOTE for n in result.notes)
    assert said == (shape != "a compiled model")
    assert result.steps.kind == ("optimizer" if shape == "a compiled model" else "backward")
    # Every shape compiles: no advice tells it to try torch.compile.
    assert result.summary["model_compiled"] is True
    assert "torch.compile" not in result.verdict.next


@pytest.mark.parametrize("shape", list(SHAPES)[:2])
def test_a_compiled_cell_run_twice_under_the_magic_compiles_as_often_as_plainly(ip: Any, shape: str) -> None:
    setup, loop = SHAPES[shape]
    setup = setup.replace("BACKEND", "eager")
    plain, _ = compiled_run(ip, setup, loop, magic=False, times=2)
    with_magic, runs = compiled_run(ip, setup, loop, magic=True, times=2)
    assert with_magic.counts() == plain.counts()
    assert torch.equal(with_magic.losses, plain.losses)
    assert [r.result.steps.n_steps for r in runs] == [STEPS, STEPS]


def test_a_step_function_compiled_in_the_traced_cell_itself(ip: Any) -> None:
    """The function is compiled by the traced cell, before its loop: the capture sees it when
    the loop starts, before Dynamo traces anything."""
    setup = STEP_FUNCTION.replace("BACKEND", "eager").replace("train_step", "step_here")
    loop = STEP_FUNCTION_LOOP.replace("train_step", "step_here")
    fresh_dynamo()
    run(ip, SETUP.replace("STEPS", str(STEPS)), check=True)
    run(ip, setup + loop, check=True)
    plain = counted(ip)
    fresh_dynamo()
    run(ip, SETUP.replace("STEPS", str(STEPS)), check=True)
    got = traced(ip, setup + loop)
    assert_as_plain(plain, counted(ip))
    assert got.result.steps.n_steps == STEPS


def test_inductor_end_to_end(ip: Any) -> None:
    """Inductor's generated C++ (built with the machine's compiler): the same compilations and
    bit for bit the same losses and weights, with and without the magic."""
    pytest.importorskip("torch._inductor")
    setup, loop = SHAPES["a compiled training-step function"]
    setup = setup.replace("BACKEND", "inductor")
    # Inductor's first use in a process compiles frames of its own (151 frames, 8 compiles, where
    # later runs count 13 and 7): a plain run first, so both measured runs start alike.
    compiled_run(ip, setup, loop, magic=False)
    plain, _ = compiled_run(ip, setup, loop, magic=False)
    with_magic, runs = compiled_run(ip, setup, loop, magic=True)
    assert_as_plain(plain, with_magic)
    assert runs[0].result.steps.n_steps == STEPS


def test_nothing_of_ours_is_left_where_dynamo_looks(ip: Any) -> None:
    """After a traced compiled cell: no hook of ours in torch's optimizer hook dicts, no patch
    on the model's class (what Dynamo guards on in the next cell's compiled code)."""
    module = sys.modules["torch.optim.optimizer"]  # (torch.optim deletes its name `optimizer`)
    setup, loop = SHAPES["a compiled training-step function"]
    compiled_run(ip, setup.replace("BACKEND", "eager"), loop, magic=True)
    assert dict(module._global_optimizer_pre_hooks) == {}
    assert dict(module._global_optimizer_post_hooks) == {}
    assert "__call__" not in type(ip.user_ns["model"]).__dict__
    assert traceml_jupyter.last() is not None


def test_a_compiled_model_beside_another_module_of_its_layers_class_compiles_as_plainly(ip: Any) -> None:
    """The notebook holds another module of the class the compiled model's layers have (a
    Linear from an earlier cell): patching that class for the parts of sampled steps would
    change what Dynamo guards on (the class's `__call__`) and compile the model again. The cell
    stands aside from the parts, with a note, and compiles exactly as plainly."""
    setup = COMPILED_MODEL.replace("BACKEND", "eager") + "probe = torch.nn.Linear(8, 16)\n"
    loop = COMPILED_MODEL_LOOP.replace("compiled(x)", "compiled(x) + 0 * probe(x).sum()")
    plain, _ = compiled_run(ip, setup, loop, magic=False)
    with_magic, runs = compiled_run(ip, setup, loop, magic=True)
    assert_as_plain(plain, with_magic)
    result = runs[0].result
    assert result.steps.kind == "optimizer" and result.steps.n_steps == STEPS
    assert COMPILED_MODEL_NOTE in result.notes


PAUSE = """
import time
@torch.compiler.disable
def pause(h=None):  # a graph break, and 2 ms a step so that the run lasts long enough to sample
    time.sleep(0.002)
    return h
data = data * 5
"""
EAGER_SHAPES = {
    # the sample starts and stops at an optimizer step, outside compiled code
    "a compiled model": (PAUSE + """
class Broken(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
    def forward(self, x):
        return pause(self.inner(x))
compiled = torch.compile(Broken(model), backend="aot_eager")
""", COMPILED_MODEL_LOOP),
    # ... at a backward(), inside the compiled function (after its graph break)
    "a compiled training-step function": (
        PAUSE + STEP_FUNCTION.replace("BACKEND", "aot_eager").replace("    loss.backward()", "    pause()\n    loss.backward()"),
        STEP_FUNCTION_LOOP,
    ),
}


@pytest.mark.parametrize("shape", list(EAGER_SHAPES))
def test_the_eager_shares_profiled_steps_compile_and_compute_as_without_the_magic(ip: Any, shape: str) -> None:
    """The eager share's sample (capture/compiled/eager_share.py) runs torch's profiler over a
    few steps of compiled code that breaks its graph (AOTAutograd marks its graphs): the same
    compilations, graphs, breaks and frames as plainly, bit for bit the same losses."""
    setup, loop = EAGER_SHAPES[shape]
    plain, _ = compiled_run(ip, setup, loop, magic=False)
    assert plain.graph_breaks >= 1
    with_magic, runs = compiled_run(ip, setup, loop, magic=True)
    assert_as_plain(plain, with_magic)
    eager = runs[0].result.compiled["eager"]
    assert eager is not None and eager["profiled"], eager  # the profiler ran

# Compiled code the cell does not name: a step function an object holds (`self.step_fn`, as a
# library's trainer holds it), and a model that a runner compiles in the traced cell itself (as a
# trainer compiles its model in `fit()`: only torch's compile start says so), beside a Linear of
# the notebook's that the step calls (the parts would patch `Linear`, which Dynamo guards on).
HELD_STEP = STEP_FUNCTION.replace("train_step", "compiled_step") + """
class Stepper:
    def __init__(self, step_fn):
        self.step_fn = step_fn
    def step(self, x, y):
        return self.step_fn(x, y)
stepper = Stepper(compiled_step)
"""
HELD_STEP_LOOP = """
for x, y in data:
    loss = stepper.step(x, y)
    losses.append(loss.detach().clone())
"""
COMPILED_INSIDE = """
class Part:
    def __init__(self, net):
        self.net = net
class Runner:
    def __init__(self, net):
        self.part = Part(net)
    def step(self, x, y):
        if not hasattr(self, "fast"):
            self.fast = torch.compile(self.part.net, backend="BACKEND")
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.fast(x), y) + 0 * probe(x).sum()
        loss.backward()
        opt.step()
        return loss
runner = Runner(model)
probe = torch.nn.Linear(8, 16)  # a Linear of the notebook's, called eagerly in the step
"""
COMPILED_INSIDE_LOOP = """
for x, y in data:
    loss = runner.step(x, y)
    losses.append(loss.detach().clone())
"""
# Two objects down, a whole step (its `opt.step()` inside): only torch's compile start tells.
STEP_TWO_OBJECTS_DOWN = HELD_STEP + """
class Outer:
    def __init__(self, stepper):
        self.inner = stepper
    def step(self, x, y):
        return self.inner.step(x, y)
outer = Outer(stepper)
del stepper
"""
STEP_TWO_OBJECTS_DOWN_LOOP = HELD_STEP_LOOP.replace("stepper.step", "outer.step")
DEEPER = {
    "a compiled step held by an object": (HELD_STEP, HELD_STEP_LOOP, COMPILED_NOTE),
    "a model compiled inside a runner's method": (COMPILED_INSIDE, COMPILED_INSIDE_LOOP, COMPILING_NOTE),
    "a compiled step two objects down": (STEP_TWO_OBJECTS_DOWN, STEP_TWO_OBJECTS_DOWN_LOOP, COMPILING_NOTE),
}


@pytest.mark.parametrize("shape", list(DEEPER))
def test_compiled_code_the_cell_does_not_name_compiles_as_plainly(ip: Any, shape: str) -> None:
    """The cell names neither the compiled function nor the compiled model: one is an
    attribute of an object it names, the other is compiled inside a method, where only torch's
    compile start tells. Run twice under the magic (the second run finds the code compiled):
    the same compilations, recompilations, graph breaks and frames as two plain runs, the same
    losses and weights, one step per iteration, and a note that says why the parts are missing."""
    setup, loop, note = DEEPER[shape]
    setup = setup.replace("BACKEND", "eager")
    plain, _ = compiled_run(ip, setup, loop, magic=False, times=2)
    assert plain.compiles >= 1
    with_magic, runs = compiled_run(ip, setup, loop, magic=True, times=2)
    if shape == "a compiled step two objects down":
        # Our global optimizer hooks stay (they count the steps) and Dynamo traces them in
        # Optimizer.step: it looks at one no-op frame fewer (docs/step-parts.md#torchcompile).
        assert with_magic.frames == plain.frames - 1
        plain = dataclasses.replace(plain, frames=with_magic.frames)
    assert_as_plain(plain, with_magic)
    for got in runs:
        assert got.result.steps.n_steps == STEPS
        assert got.result.summary["parts_sampled_steps"] == 0
    assert note in runs[0].result.notes
    assert "__call__" not in type(ip.user_ns["model"]).__dict__


def test_an_error_of_ours_when_torch_starts_compiling_turns_the_parts_off_and_nothing_else(
    ip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile start callback runs inside torch's compile: an error of ours there turns
    the parts off with a note (their patch leaves all the same), and the cell compiles and
    computes as plainly."""
    from traceml_jupyter.capture.inside.step_parts import StepParts

    setup = COMPILED_INSIDE.replace("BACKEND", "eager")
    plain, _ = compiled_run(ip, setup, COMPILED_INSIDE_LOOP, magic=False)

    def broken(self: StepParts, *, forget: bool = False) -> None:
        raise RuntimeError("standing aside broke")

    monkeypatch.setattr(StepParts, "stand_aside", broken)
    with_magic, runs = compiled_run(ip, setup, COMPILED_INSIDE_LOOP.replace("loss =", "loss  ="), magic=True)
    assert_as_plain(plain, with_magic)
    result = runs[0].result
    assert result.steps.n_steps == STEPS
    assert any("RuntimeError: standing aside broke" in n for n in result.notes)
    assert "__call__" not in type(ip.user_ns["probe"]).__dict__


def test_a_method_named_like_a_function_that_calls_compiled_code_is_not_that_function(ip: Any) -> None:
    """The notebook's `train()` calls a compiled step; the traced cell calls another object's
    `train()` method, eagerly (as `Trainer(...).train()` does): no compiled call is assumed, the
    optimizer's steps are the steps and their parts are timed."""
    setup = THROUGH_A_FUNCTION.replace("BACKEND", "eager") + """
class Eager:
    def train(self, x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss
eager = Eager()
"""
    loop = THROUGH_A_FUNCTION_LOOP.replace("train(x, y)", "eager.train(x, y)")
    _, runs = compiled_run(ip, setup, loop, magic=True)
    result = runs[0].result
    assert result.steps.kind == "optimizer" and result.steps.n_steps == STEPS
    assert COMPILED_NOTE not in result.notes and result.summary["parts_sampled_steps"] > 0
