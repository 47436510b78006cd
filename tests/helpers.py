"""What several test files share, besides the fixtures in conftest.py: the paths tests reach, a
cell run in the shell with its output captured, a traced cell's run, and the `shell` and `gpu`
fixtures (made here from each file's own SETUP cell and machine). Importable from any folder
under tests/: pyproject's pytest `pythonpath` puts tests/ on sys.path."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from IPython.utils.capture import capture_output

import traceml_jupyter
from traceml_jupyter.run import Run

if TYPE_CHECKING:
    from fake_gpu import FakeGpu

TESTS = Path(__file__).resolve().parent  # tests/: child_scripts/, ranks_scripts/, data/
REPO = TESTS.parent  # the checkout: traceml_jupyter/, scripts/, docs/, notebooks/


def run(ip: Any, cell: str, *, store_history: bool = False, check: bool = False) -> Any:
    """Run `cell` (dedented) in the shell with its output captured: the ExecutionResult, with
    `.out` the captured output and `.shown` what the cell printed and displayed as text.
    `check`: fail the test when the cell raised."""
    with capture_output() as out:
        result = ip.run_cell(textwrap.dedent(cell), store_history=store_history)
    result.out = out
    result.shown = out.stdout + "\n".join(o.data.get("text/plain", "") for o in out.outputs)
    if check:
        assert result.error_in_exec is None, out.stdout + out.stderr + repr(result.error_in_exec)
    return result


def traced_and_result(
    ip: Any, cell: str, options: str = "--no-live", *, store_history: bool = False
) -> tuple[Run, Any]:
    """Run `cell` under `%%traceml OPTIONS` (its first line is line 2), failing the test when it
    raised: the run it made and the cell's result (as `run`'s)."""
    result = run(ip, f"%%traceml {options}\n" + textwrap.dedent(cell), store_history=store_history, check=True)
    got = traceml_jupyter.last()
    assert got is not None
    return got, result


def traced(ip: Any, cell: str, options: str = "--no-live", *, store_history: bool = False) -> Run:
    """The run `cell` made under `%%traceml OPTIONS` (`traced_and_result`)."""
    return traced_and_result(ip, cell, options, store_history=store_history)[0]


def stop_loader_workers(namespace: dict[str, Any]) -> list[str]:
    """Shut down the worker processes a DataLoader of `namespace` keeps between passes
    (`persistent_workers=True` keeps them in its `_iterator` until the loader is collected),
    so that a test's loader left in the session's shell does not leave processes behind for
    the next test file's leak checks (tests/integration/ranks, tests/integration/children).
    The loader stays usable: its next pass starts workers anew. The names of those stopped."""
    from torch.utils.data import DataLoader

    stopped = []
    for name, value in list(namespace.items()):
        if not isinstance(value, DataLoader):
            continue
        iterator = value.__dict__.get("_iterator")
        if iterator is not None and getattr(iterator, "_workers", None):
            iterator._shutdown_workers()
            value._iterator = None
            stopped.append(name)
    return stopped


def shell_fixture(setup: str, *, store_history: bool = False, scope: Any = "function") -> Any:
    """A `shell` fixture (`shell = shell_fixture(SETUP)` in a test file): the session's shell
    with `setup` run first, failing the test when it raised; afterwards the workers of the
    DataLoaders left in its namespace are stopped (`stop_loader_workers`)."""

    @pytest.fixture(scope=scope)
    def shell(ip: Any) -> Iterator[Any]:
        run(ip, setup, store_history=store_history, check=True)
        try:
            yield ip
        finally:
            stop_loader_workers(ip.user_ns)

    return shell


def gpu_fixture(setup: str | None = None, **machine: Any) -> Callable[..., Iterator[FakeGpu]]:
    """A `gpu` fixture (`gpu = gpu_fixture()` in a test file): a stand-in GPU, FakeGpu(**machine),
    installed as torch.cuda for the test. With `setup`, also in the shell for traced cells
    (stand_in_cells.stand_in_shell: `gpu`, `cuda`, `FakeTensor` and its SLOW_DATASET, then
    `setup`, run)."""
    from fake_gpu import FakeGpu, FakeTensor, install_fake_cuda
    from stand_in_cells import stand_in_shell

    if setup is None:

        @pytest.fixture()
        def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpu]:
            stand_in = FakeGpu(**machine)
            install_fake_cuda(monkeypatch, stand_in)
            yield stand_in
            FakeTensor.gpu = None

        return gpu

    @pytest.fixture()
    def gpu_in_shell(ip: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpu]:
        yield stand_in_shell(ip, monkeypatch, setup, **machine)
        FakeTensor.gpu = None

    return gpu_in_shell


def note_watch_directories(monkeypatch: Any, made: list[str]) -> None:
    """Each private directory the DataLoader watch makes (tempfile.mkdtemp), appended to `made`
    as it makes it: other processes of the machine make theirs in the same temporary folder,
    so only these are judged."""
    from traceml_jupyter.capture.loader import watch

    mkdtemp = watch.tempfile.mkdtemp

    def noted(*args: Any, **kwargs: Any) -> str:
        path = mkdtemp(*args, **kwargs)
        made.append(path)
        return path

    monkeypatch.setattr(watch.tempfile, "mkdtemp", noted)
