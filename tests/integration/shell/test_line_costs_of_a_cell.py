"""The cost of each line of a traced cell's loop, through %%traceml: ms per step for each body line,
--lines off, a traceback at the line that failed, a loop in a function of this cell or of another."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import run

import traceml_jupyter
from traceml_jupyter.capture.inside.line_costs import (
    LINES,
    heat,
)


# -- the user's story through the magic ---------------------------------------------------------
def traced(ip: Any, cell: str) -> tuple[Any, Any]:
    return run(ip, cell), traceml_jupyter.last()


@pytest.fixture()
def no_names_left(ip: Any) -> Iterator[None]:
    yield
    assert LINES not in ip.user_ns


@pytest.mark.slow
def test_a_cpu_run_gets_ms_per_step_for_each_body_line(ip: Any, no_names_left: None) -> None:
    ip.run_cell("import time\nimport torch\nbatches = [torch.ones(8, 8) for _ in range(24)]")
    result, run = traced(
        ip,
        """\
        %%traceml --no-live --name lines
        for i, x in enumerate(batches):
            time.sleep(0.005)
            y = x @ x
            if i % 2:
                continue
            time.sleep(0.001)
        """,
    )
    assert result.error_in_exec is None
    costs = run.result.line_costs
    assert costs["clock"] == "wall clock" and costs["loop_line"] == 2
    rows = {r["line"]: r for r in costs["statements"]}
    assert sorted(rows) == [3, 4, 5, 7] and rows[5]["end_line"] == 6
    assert rows[3]["text"] == "time.sleep(0.005)"
    ranked = sorted(rows, key=lambda line: -rows[line]["ms_per_step"])
    assert ranked[0] == 3 and ranked[1] == 7  # the 5 ms sleep, then the 1 ms one
    assert rows[7]["runs"] == rows[3]["runs"] // 2  # `continue` skips it every other step
    assert rows[5]["runs"] == rows[3]["runs"]  # and still ends the `if` statement's time
    # Parts of the same steps, on the same clock: the lines add up to less than the step.
    assert sum(r["ms_per_step"] for r in rows.values()) < costs["step_ms"]
    assert heat(costs)[3] == 1.0
    assert run.to_dict()["line_costs"]["statements"][0]["line"] == 3


def test_lines_off_times_nothing(ip: Any, no_names_left: None) -> None:
    ip.run_cell("batches = list(range(12))")
    result, run = traced(ip, "%%traceml --no-live --lines off\nfor x in batches:\n    y = x\n")
    assert result.error_in_exec is None and run.result.line_costs is None


@pytest.mark.slow
def test_a_traceback_points_at_the_line_that_failed(ip: Any, no_names_left: None) -> None:
    ip.run_cell("batches = list(range(12))")
    result, run = traced(
        ip,
        """\
        %%traceml --no-live
        for x in batches:
            y = x + 1
            z = 10 / (x - 5)
        """,
    )
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    frames = traceback.extract_tb(result.error_in_exec.__traceback__)
    cell_frames = [f for f in frames if f.filename == run.result.loop.cell_filename]
    assert cell_frames[-1].lineno == 4 and "10 / (x - 5)" in (cell_frames[-1].line or "")
    assert run.result.line_costs is not None and run.n_steps == 6  # the partial run still has its costs


@pytest.mark.slow
def test_a_loop_in_a_function_of_the_cell_is_timed_and_restored(ip: Any, no_names_left: None) -> None:
    ip.run_cell("batches = list(range(12))")
    result, run = traced(
        ip,
        """\
        %%traceml --no-live
        def train(data):
            total = 0
            for x in data:  # traceml: loop
                total += x
            return total
        answer = train(batches)
        """,
    )
    assert result.error_in_exec is None and ip.user_ns["answer"] == 66
    assert [r["line"] for r in run.result.line_costs["statements"]] == [5]
    # After the cell the function runs plain: no clock needed any more.
    assert ip.run_cell("again = train(batches)").error_in_exec is None
    assert ip.user_ns["again"] == 66


@pytest.mark.slow
def test_a_loop_in_another_cell_gets_its_cost_per_line_in_its_own_numbering(ip: Any, no_names_left: None) -> None:
    ip.run_cell("def fit(data):\n    for x in data:  # traceml: loop\n        y = x\n    return y\n")
    plain = ip.user_ns["fit"].__code__
    ip.run_cell("batches = list(range(12))")
    result, run = traced(ip, "%%traceml --no-live\nfit(batches)\n")
    assert result.error_in_exec is None and run.n_steps == 12
    assert run.result.line_costs is not None and run.result.line_costs["loop_line"] == 2
    assert [r["line"] for r in run.result.line_costs["statements"]] == [3]
    assert "function fit" in (run.result.loop.where or "") and ip.user_ns["fit"].__code__ is plain
