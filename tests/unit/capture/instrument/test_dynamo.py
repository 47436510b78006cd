"""What the hooks ask before Dynamo may trace them (instrument/dynamo.py): torch's own check, a
compiled function told from a plain one without calling it, our frames kept out of Dynamo."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from traceml_jupyter.capture.instrument import dynamo

pytestmark = pytest.mark.slow  # torch._dynamo's import: seconds


def test_the_check_is_torchs_own_and_a_torch_without_one_never_compiles() -> None:
    assert dynamo.compile_check(torch) is torch.compiler.is_dynamo_compiling
    older = SimpleNamespace(compiler=SimpleNamespace(is_compiling=torch.compiler.is_compiling))
    assert dynamo.compile_check(older) is torch.compiler.is_compiling
    assert dynamo.compile_check(SimpleNamespace())() is False
    assert dynamo.compile_check(None)() is False


def test_a_compiled_function_is_told_from_a_plain_one_without_compiling_it() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    compiled = torch.compile(step, backend="eager")
    assert dynamo.compiled_function(compiled)
    assert not dynamo.compiled_function(step)
    assert not dynamo.compiled_function(torch.nn.Linear(2, 2))
    assert not dynamo.compiled_function(None)


def test_every_module_of_the_capture_is_kept_out_once_dynamo_is_loaded() -> None:
    """(That a frame of ours then runs as written inside a compiled function is shown by the
    frames torch counts: tests/integration/shell/test_compiled_cells.py.)"""
    import torch._dynamo.eval_frame  # noqa: F401  (what the user's first torch.compile loads)

    from traceml_jupyter.capture import session  # noqa: F401
    from traceml_jupyter.capture.inside import step_parts  # noqa: F401

    dynamo.keep_out()
    kept = set(dynamo._codes_of)
    assert {"traceml_jupyter.capture.session", "traceml_jupyter.capture.inside.step_parts"} <= kept
    assert all(name.startswith("traceml_jupyter") for name in kept)
    dynamo.keep_out()  # each module read once (its code marked again: torch._dynamo.reset() unmarks it)
    assert set(dynamo._codes_of) == kept


compiled_step = torch.compile(lambda x: x + 1, backend="eager")


def calls_the_compiled_step(x: torch.Tensor) -> torch.Tensor:
    return compiled_step(x)


def calls_nothing_compiled(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def test_a_function_that_calls_a_compiled_one_by_its_name_reaches_compiled_code() -> None:
    assert dynamo.reaches_compiled(compiled_step)
    assert dynamo.reaches_compiled(calls_the_compiled_step)
    assert not dynamo.reaches_compiled(calls_nothing_compiled)
    assert not dynamo.reaches_compiled(torch.nn.Linear(2, 2))


class Holder:
    def __init__(self, held: object) -> None:
        self.held = held


def test_compiled_code_held_by_an_object_is_found_without_reading_its_attributes() -> None:
    """A trainer's `self.step_fn`, a LightningModule's `self.net = torch.compile(...)` (in its
    `_modules`): found one level down; two levels down, or in a list, they are not (torch's
    compile start tells then: the next test)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    compiled = torch.compile(step, backend="eager")
    holder = Holder(compiled)
    had_a_dict = any(type(r) is dict for r in gc.get_referents(holder))  # (3.11+: inline values)
    assert dynamo.holds(holder, dynamo.compiled_function)
    # CPython keeps the holder's attributes as they were: reading `holder.__dict__` would have
    # made it a dict (on 3.11 and later), and every later attribute access slower.
    assert any(type(r) is dict for r in gc.get_referents(holder)) == had_a_dict
    assert not dynamo.holds(Holder(step), dynamo.compiled_function)
    assert not dynamo.holds(Holder(Holder(compiled)), dynamo.compiled_function)
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    parent = torch.nn.Module()
    parent.net = torch.compile(net, backend="eager")
    assert dynamo.holds(parent, dynamo.compiled_model)
    assert not dynamo.holds(torch.nn.Sequential(net), dynamo.compiled_model)
    assert not dynamo.holds([compiled], dynamo.compiled_function)  # (builtins are not looked into)
    assert not dynamo.holds(Holder, dynamo.compiled_function)  # (nor classes)


def test_torch_starting_to_compile_is_heard_before_it_traces_and_not_after_removal() -> None:
    """The compile start callback runs before Dynamo traces the frame: what the listener does
    there (the parts take their patch off a class) is what Dynamo sees."""
    import torch._dynamo

    seen: list[bool] = []
    marker = torch.nn.Linear(2, 2)
    starts = dynamo.CompileStarts(lambda: seen.append(hasattr(marker, "traced")))

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    torch._dynamo.reset()
    starts.register()
    starts.register()  # (once only)
    torch.compile(step, backend="eager")(torch.ones(2))
    assert seen == [False]
    starts.remove()
    torch.compile(lambda x: x - 1, backend="eager")(torch.ones(2))
    assert seen == [False]
