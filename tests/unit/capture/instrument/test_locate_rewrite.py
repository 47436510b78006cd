"""Locating the step loop and rewriting it: source in, behaviour out (pure functions)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from traceml_jupyter.analysis.cell_code import dataloader_lines
from traceml_jupyter.capture.instrument.hooks import FETCH
from traceml_jupyter.capture.instrument.locate import (
    find_innermost_loop,
    find_training_loop,
    loop_at_line,
)
from traceml_jupyter.capture.instrument.rewrite import HOOK, instrument_loop


def pick(src: str) -> int | None:
    tree = ast.parse(src)
    choice = find_training_loop(tree, src.splitlines()) or find_innermost_loop(tree)
    return choice.lineno if choice else None


def test_the_loop_that_calls_backward_wins_over_the_epoch_loop() -> None:
    src = """
for epoch in range(3):
    for x, y in loader:
        loss = f(x, y)
        loss.backward()
        opt.step()
    sched.step()
"""
    assert pick(src) == 3


def test_step_only_loops_pick_the_innermost() -> None:
    src = """
for epoch in range(3):
    for batch in loader:
        opt.step()
    sched.step()
"""
    assert pick(src) == 3


def test_a_marked_loop_wins() -> None:
    src = """
for x in loader:  # traceml: loop
    pass
for x in other:
    loss.backward()
"""
    assert pick(src) == 2


def test_without_training_calls_the_innermost_non_range_loop() -> None:
    assert pick("for i in range(3):\n    for b in batches:\n        total += b\n") == 2
    assert pick("for i in range(3):\n    total += i\n") is None
    assert pick("x = 1\n") is None


def test_loops_inside_functions_are_found_and_named() -> None:
    src = "def train(loader):\n    for x in loader:\n        x.backward()\n"
    choice = find_training_loop(ast.parse(src), src.splitlines())
    assert choice is not None and choice.function == "train" and choice.lineno == 2


def test_loop_at_line_takes_a_line_inside_the_loop() -> None:
    tree = ast.parse("for a in A:\n    for b in B:\n        pass\n")
    got = loop_at_line(tree, 3)
    assert got is not None and got.lineno == 2
    assert loop_at_line(tree, 9) is None


def test_dataloader_lines() -> None:
    tree = ast.parse("import torch\nloader = torch.utils.data.DataLoader(ds)\ntrainer.fit(m)\ntrain()\n")
    assert dataloader_lines(tree) == [2]


class Spy:
    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.fetched: list[tuple[int, Any]] = []

    def __call__(self, iterable: Iterable[Any], token: int) -> Iterator[Any]:
        assert token == TOKEN
        self.seen.append(iterable)
        yield from iterable

    def fetch(self, token: int, line: int, func: Any, /, *args: Any, **kwargs: Any) -> Any:
        assert token == TOKEN
        self.fetched.append((line, func))
        return func(*args, **kwargs)


TOKEN = 7


def run_both(src: str, names: list[str]) -> tuple[dict[str, Any], dict[str, Any], Spy]:
    tree = ast.parse(src)
    choice = find_training_loop(tree, src.splitlines()) or find_innermost_loop(tree)
    assert choice is not None
    plain: dict[str, Any] = {}
    exec(compile(tree, "<plain>", "exec"), plain)
    spy = Spy()
    traced: dict[str, Any] = {HOOK: spy, FETCH: spy.fetch}
    new, _ = instrument_loop(tree, choice, TOKEN)
    exec(compile(new, "<traced>", "exec"), traced)
    return {n: plain[n] for n in names}, {n: traced[n] for n in names}, spy


def test_rewrite_keeps_break_continue_else_and_targets() -> None:
    src = """
out = []
for i, (a, b) in enumerate(zip("abcdef", range(6))):  # traceml: loop
    if b == 1:
        continue
    if b == 4:
        break
    out.append((i, a))
else:
    out.append("else")
"""
    plain, traced, spy = run_both(src, ["out"])
    assert plain == traced and len(spy.seen) == 1


@pytest.mark.slow
def test_rewrite_keeps_return_inside_functions_and_the_else_branch() -> None:
    src = """
def first_big(xs):
    for x in xs:  # traceml: loop
        if x > 2:
            return x
    else:
        return None
a = first_big([1, 5, 3])
b = first_big([0, 1])
"""
    plain, traced, spy = run_both(src, ["a", "b"])
    assert plain == traced == {"a": 5, "b": None} and len(spy.seen) == 2


def test_rewrite_keeps_line_numbers() -> None:
    src = "total = 0\nfor x in [1, 2]:  # traceml: loop\n    total += x\n    1/0\n"
    tree = ast.parse(src)
    choice = find_innermost_loop(tree)
    assert choice is not None
    new, _ = instrument_loop(tree, choice, TOKEN)
    assert [n.lineno for n in ast.walk(new) if isinstance(n, ast.stmt)] == [
        n.lineno for n in ast.walk(tree) if isinstance(n, ast.stmt)
    ]


def test_schedulers_and_scalers_do_not_make_a_training_loop() -> None:
    src = """
for epoch in range(1, 3):
    train(model, loader)
    test(model, test_loader)
    scheduler.step()
"""
    tree = ast.parse(src)
    assert find_training_loop(tree, src.splitlines()) is None
    assert pick("for b in batches:\n    scaler.step(opt)\n    lr_sched.step()\n") == 1  # innermost
    assert find_training_loop(ast.parse("for b in bs:\n    opt.step()\n")) is not None


def test_fetch_calls_in_the_body_go_through_the_fetch_hook_with_their_line() -> None:
    src = """
it = iter([(1, 2), (3, 4), (5, 6)])
seen = []
def get_batch(split):
    return split
for step in range(3):  # traceml: loop
    x, y = next(it)
    s = get_batch("train")
    seen.append((x, y, s, next(it, None) if False else 0))
"""
    plain, traced, spy = run_both(src, ["seen"])
    assert plain == traced
    assert [line for line, _ in spy.fetched] == [7, 8] * 3


def test_the_rewrite_leaves_nested_definitions_alone() -> None:
    src = "for b in bs:  # traceml: loop\n    f = lambda: next(it)\n    def g():\n        return get_batch()\n"
    tree = ast.parse(src)
    choice = find_innermost_loop(tree)
    assert choice is not None
    _, sites = instrument_loop(tree, choice, TOKEN)
    assert sites == {}
