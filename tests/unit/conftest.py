"""tests/unit runs no cell: a unit test checks a module on values (tests/result_factory.py,
tests/synthetic.py), and a test that runs a cell through the shell is a user's story, which goes
to tests/integration/shell/. This autouse guard makes running a cell here fail, saying so."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NoReturn

import pytest
from IPython.core.interactiveshell import InteractiveShell

MOVE_IT = "tests/unit runs no cell: move this test to tests/integration/shell/ (see docs/testing.md)"


def _no_cell(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError(MOVE_IT)


@pytest.fixture(autouse=True)
def no_cell_in_unit_tests(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("run_cell", "run_cell_async", "run_cell_magic"):
        monkeypatch.setattr(InteractiveShell, name, _no_cell)
    yield
