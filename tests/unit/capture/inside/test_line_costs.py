"""Cost per line: the rewrite keeps every loop form's meaning and the cell's line numbers,
sampling and warm-up are accounted for, and on a stand-in GPU the events give each line its GPU
time. A traced cell's cost per line: tests/integration/shell/test_line_costs_of_a_cell.py."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
from fake_gpu import FakeGpu, HostClock

from traceml_jupyter.capture.inside import line_costs as lc
from traceml_jupyter.capture.inside.line_costs import (
    LINES,
    CudaLineClock,
    LineClock,
    Statement,
    heat,
    line_costs,
    samples_before,
    schedule,
    step_of_sample,
    time_lines,
)
from traceml_jupyter.capture.instrument.locate import find_training_loop

# -- the rewrite keeps the cell's meaning ------------------------------------------------------

LOOP_FORMS = {
    "targets": """
        xs, ys = [1, 2, 3], [10, 20, 30]
        out = []
        for i, (a, b) in enumerate(zip(xs, ys)):  # traceml: loop
            out.append(i * a + b)
        """,
    "break-continue-else": """
        out = []
        for x in range(10):  # traceml: loop
            if x == 3:
                continue
            if x == 7:
                break
            out.append(x)
        else:
            out.append("no break")
        done = []
        for x in range(3):  # not the traced loop: its else runs
            done.append(x)
        else:
            done.append("else")
        """,
    "else-without-break": """
        out = []
        for x in range(4):  # traceml: loop
            out.append(x)
        else:
            out.append("else")
        """,
    "return": """
        def f(xs):
            total = 0
            for x in xs:  # traceml: loop
                total += x
                if total > 10:
                    return total
            return -1
        out = [f(range(20)), f(range(3))]
        """,
    "exception": """
        seen = []
        try:
            for x in range(10):  # traceml: loop
                seen.append(x)
                if x == 4:
                    raise ValueError(f"bad {x}")
        except ValueError as e:
            out = str(e)
        """,
    "generator": """
        def g(xs):
            for x in xs:  # traceml: loop
                y = x * 2
                yield y
                z = y + 1
        out = list(g(range(5)))
        it = g(range(5))
        first = next(it)
        it.close()
        """,
    "nested": """
        out = []
        for row in [[1, 2], [3]]:  # traceml: loop
            for v in row:
                out.append(v)
            k = 0
            while k < 2:
                k += 1
            with open(__file__) if False else __import__("contextlib").nullcontext():
                out.append(k)
        """,
    "global": """
        count = 0
        def h(xs):
            for x in xs:  # traceml: loop
                global count
                count += x
        h(range(5))
        out = count
        """,
    "nonlocal": """
        def outer():
            n = 0
            def inner(xs):
                for x in xs:  # traceml: loop
                    nonlocal n
                    n += x
            inner(range(4))
            return n
        out = outer()
        """,
    "closures": """
        fs = []
        for x in range(3):  # traceml: loop
            def f(x=x):
                return x * x
            fs.append(f)
            class C:
                v = x
            fs.append(lambda c=C: c.v)
        out = [f() for f in fs]
        """,
}


class ClockByToken:
    """What `__traceml_lines__` is in builtins (hooks.py), bound to one clock; `.on` asks
    `sample` (the capture sets it before each step)."""

    def __init__(self, clock: LineClock, sample: Callable[[], bool] | None = None) -> None:
        self.clock = clock
        self.sample = sample or clock.sample

    @property
    def on(self) -> bool:
        return bool(self.sample())

    def start(self, token: int) -> None:
        self.clock.start()

    def lap(self, token: int, index: int) -> None:
        self.clock.lap(index)


def run_source(source: str, rewrite: bool, sample: Callable[[], bool]) -> dict[str, Any]:
    tree = ast.parse(source)
    lines = source.splitlines()
    statements: list[Statement] = []
    if rewrite:
        choice = find_training_loop(tree, lines)
        assert choice is not None
        tree, statements = time_lines(tree, choice, lines)
    ns: dict[str, Any] = {"__file__": __file__}
    if rewrite:
        ns[LINES] = ClockByToken(LineClock(statements), sample)
    exec(compile(tree, "<loop>", "exec"), ns)
    return {k: v for k, v in ns.items() if k in ("out", "done", "seen", "count", "first")}


@pytest.mark.slow
@pytest.mark.parametrize("form", sorted(LOOP_FORMS))
@pytest.mark.parametrize("sampled", ["always", "never", "alternate"])
def test_the_rewrite_keeps_the_loops_meaning(form: str, sampled: str) -> None:
    source = textwrap.dedent(LOOP_FORMS[form])
    flips = iter([True, False] * 100)
    sample = {"always": lambda: True, "never": lambda: False, "alternate": lambda: next(flips)}[sampled]
    plain = run_source(source, False, lambda: True)
    assert plain
    assert run_source(source, True, sample) == plain


@pytest.mark.slow
def test_each_top_level_statement_is_timed_with_its_lines() -> None:
    source = "for x in range(3):  # traceml: loop\n    y = x\n    if y:\n        z = 1\n    w = [\n        y,\n    ]\n"
    tree = ast.parse(source)
    choice = find_training_loop(tree, source.splitlines())
    assert choice is not None
    new, statements = time_lines(tree, choice, source.splitlines())
    assert [(s.line, s.end_line, s.text) for s in statements] == [
        (2, 2, "y = x"),
        (3, 4, "if y:"),
        (5, 7, "w = ["),
    ]
    clock = LineClock(statements)
    exec(compile(new, "<loop>", "exec"), {LINES: ClockByToken(clock)})
    assert clock.timed == 3 and clock.runs == [3, 3, 3]
    # Every node of the rewritten loop sits on one of the loop's own lines.
    loop = new.body[0]
    assert {n.lineno for n in ast.walk(loop) if hasattr(n, "lineno")} <= set(range(1, 8))


@pytest.mark.slow
def test_break_continue_and_exceptions_still_end_the_statements_time() -> None:
    source = textwrap.dedent(
        """\
        try:
            for x in range(10):  # traceml: loop
                if x % 2:
                    continue
                if x == 6:
                    break
                if x == 4:
                    raise KeyError(x)
        except KeyError:
            pass
        """
    )
    tree = ast.parse(source)
    choice = find_training_loop(tree, source.splitlines())
    assert choice is not None
    new, statements = time_lines(tree, choice, source.splitlines())
    clock = LineClock(statements)
    exec(compile(new, "<loop>", "exec"), {LINES: ClockByToken(clock)})
    # x = 0, 1, 2, 3, 4: five steps; `continue` on 1 and 3, the KeyError on 4.
    assert clock.timed == 5 and clock.runs == [5, 3, 3]


# -- the schedule and the warm-up ---------------------------------------------------------------


def test_the_first_steps_are_all_timed_then_one_in_sixteen() -> None:
    picks = [k for k, timed in zip(range(200), schedule(), strict=False) if timed]
    assert picks[:64] == list(range(64)) and picks[64:] == list(range(64, 200, 16))
    assert [step_of_sample(k) for k in range(len(picks))] == picks
    assert [samples_before(s) for s in (0, 5, 64, 65, 80, 81)] == [0, 5, 64, 65, 65, 66]


@pytest.fixture()
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> HostClock:
    clock = HostClock(fake=True)
    monkeypatch.setattr(lc, "perf_counter_ns", clock)
    return clock


def statements(n: int) -> list[Statement]:
    return [Statement(i, 10 + i, 10 + i, f"s{i}") for i in range(n)]


def test_warmup_steps_are_taken_out_of_the_cost_per_line(fake_clock: HostClock) -> None:
    clock = LineClock(statements(2))
    for k in range(30):
        clock.start()
        fake_clock.sleep((100.0 if k == 0 else 1.0) * 1e6)  # the first step compiles, say
        clock.lap(0)
        fake_clock.sleep(2e6)
        clock.lap(1)
    warm = line_costs(clock, 1, step_ms=3.0)
    assert warm["ms_per_step"] == {10: 1.0, 11: 2.0}
    assert warm["timed_steps"] == 29 and warm["statements"][0]["share"] == pytest.approx(1 / 3)
    cold = line_costs(clock, 0)
    assert cold["ms_per_step"][10] == pytest.approx((100.0 + 29.0) / 30)


def test_gpu_time_per_line_comes_from_events_on_sampled_steps(fake_clock: HostClock) -> None:
    gpu = FakeGpu(fake_clock, queue_ms=1e9)
    clock = CudaLineClock(statements(2), gpu.event, lambda: True)
    n = 200
    for _ in range(n):
        if not clock.sample():
            continue
        clock.start()
        gpu.launch(2.0)  # statement 0 queues 2 ms of GPU work in 0.1 ms
        fake_clock.sleep(0.1e6)
        clock.lap(0)
        fake_clock.sleep(0.5e6)  # statement 1: Python only
        clock.lap(1)
    clock.finish()
    costs = line_costs(clock, 5)
    assert costs["clock"] == "wall clock + CUDA events"
    # After the warm-up (5): one step in 4 of the first 64, then one in 16.
    assert costs["gpu_sampled_steps"] == len(range(8, 64, 4)) + len(range(64, n, 16))
    assert costs["gpu_ms_per_step"] == {10: pytest.approx(2.0), 11: pytest.approx(0.0)}
    assert costs["ms_per_step"] == {10: pytest.approx(0.1), 11: pytest.approx(0.5)}


def test_a_failure_reading_the_gpu_marks_stops_at_the_line_clocks_edge(
    fake_clock: HostClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a sampled step's events fails (inside `_poll`, called from the next step's
    `start`): the GPU time per line turns itself off there, the loop's statements still run and
    keep their wall time, and finish() raises it for the caller's note."""
    gpu = FakeGpu(fake_clock, queue_ms=1e9)
    clock = CudaLineClock(statements(2), gpu.event, lambda: True, warmup_until=-1, full=8, every=1)

    def broken(self: Any) -> None:
        raise RuntimeError("event pool gone")

    monkeypatch.setattr(CudaLineClock, "_poll", broken)
    ran = 0
    for _ in range(8):
        if not clock.sample():
            continue
        clock.start()  # from the second sampled step on, the marks of the one before are read
        fake_clock.sleep(1e6)
        ran += 1
        clock.lap(0)
        clock.lap(1)
    assert ran == 8 and clock.gpu_off == "RuntimeError: event pool gone"
    assert clock.finish() == "GPU time per line turned off: RuntimeError: event pool gone"
    assert line_costs(clock, 0)["ms_per_step"][10] == pytest.approx(1.0)


def test_heat_scales_bars_to_the_costliest_line() -> None:
    costs = {
        "statements": [{"line": 3, "ms_per_step": 2.0}, {"line": 4, "ms_per_step": 0.5}],
        "loop_line": 2,
        "fetch_ms_per_step": 4.0,
    }
    assert heat(costs) == {2: 1.0, 3: 0.5, 4: 0.125}
    assert heat({"statements": [{"line": 3, "ms_per_step": 0.0}]}) == {3: 0.0}
