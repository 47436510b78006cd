"""tests/unit runs no cell (tests/unit/conftest.py): a cell run here fails with a message that
says where the test goes, and the cell's code never runs; the shell itself stays usable for
what is no cell (a line magic, the namespace)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import run, traced

import traceml_jupyter


def test_a_cell_run_in_a_unit_test_fails_and_says_where_the_test_goes(ip: Any) -> None:
    name = "ran_in_a_unit_test"
    ip.user_ns.pop(name, None)
    for attempt in (
        lambda: ip.run_cell(f"{name} = 1"),
        lambda: run(ip, f"{name} = 1"),
        lambda: ip.run_cell_magic("traceml", "--no-live", f"{name} = 1\nfor x in [1, 2]:\n    pass\n"),
    ):
        with pytest.raises(AssertionError, match="move this test to tests/integration/shell/"):
            attempt()
    assert name not in ip.user_ns  # the cell's code did not run


def test_a_traced_cell_in_a_unit_test_makes_no_run(ip: Any) -> None:
    before = traceml_jupyter.last()
    with pytest.raises(AssertionError, match="tests/unit runs no cell"):
        traced(ip, "for x in [1, 2, 3]:\n    pass\n")
    assert traceml_jupyter.last() is before


def test_the_shell_still_answers_what_is_no_cell(ip: Any) -> None:
    from IPython.core.error import UsageError

    ip.user_ns["answer"] = 42
    try:
        assert ip.ev("answer + 1") == 43  # an expression, evaluated without a cell
        with pytest.raises(UsageError, match="unknown command 'diff'"):  # a line magic runs
            ip.run_line_magic("traceml", "diff")
    finally:
        del ip.user_ns["answer"]
