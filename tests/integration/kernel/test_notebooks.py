"""The notebooks in notebooks/ run top to bottom in a real kernel and show what their text
claims; in git they carry no outputs and are what scripts/make_notebooks.py writes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import nbformat
import pytest
from helpers import REPO

ROOT = REPO
# One intra-op thread for torch in the kernel: on a shared 2-core machine, two OpenMP threads
# slow a step up to 10x whenever another process takes a core (measured: 250 ms steps among
# 25 ms ones), which no verdict margin survives; one thread is slowed 2x at most.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


run_demo = load_script("run_demo")


def executed(name: str) -> Any:
    """The notebook run in a kernel whose torch uses one thread (see ONE_THREAD)."""
    nb, _, error = run_demo.execute(ROOT / "notebooks" / name, env={**os.environ, **ONE_THREAD})
    assert error is None, "\n".join(run_demo.errors(nb)) or repr(error)
    return nb


def markdown(nb: Any) -> str:
    return "\n".join(cell.source for cell in nb.cells if cell.cell_type == "markdown")


def test_there_are_notebooks() -> None:
    assert {p.name for p in NOTEBOOKS} >= {
        "dataloader_bottleneck.ipynb",
        "loops_in_functions.ipynb",
    }


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_in_git_carry_no_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source
    assert "widgets" not in nb.metadata


@pytest.mark.slow
def test_notebooks_are_what_the_generator_writes() -> None:
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_notebooks.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr


def test_the_demo_links_open_it_on_colab_kaggle_and_binder() -> None:
    demo = ROOT / "notebooks" / "dataloader_bottleneck.ipynb"
    text = markdown(nbformat.read(demo, 4))  # type: ignore[no-untyped-call]
    assert "https://colab.research.google.com/github/" in text
    assert "https://kaggle.com/kernels/welcome?src=https://github.com/" in text
    assert "urlpath=lab/tree/notebooks/dataloader_bottleneck.ipynb" in text


@pytest.mark.kernel
def test_the_dataloader_story_holds(tmp_path: Path) -> None:
    nb = executed("dataloader_bottleneck.ipynb")
    verdicts = {r.name: r.label for r in run_demo.reports(nb)}
    assert verdicts == {
        "fast": "COMPUTE-BOUND",
        "slow": "INPUT-BOUND",
        "fixed": verdicts.get("fixed"),  # judged by the comparison below
        "collate": "INPUT-BOUND",
        "spiky": "INPUT STRAGGLER",
    }

    promised = re.search(r"at least (\d+(?:\.\d+)?)x faster", markdown(nb))
    assert promised is not None, "the notebook states the speed-up it expects"
    [text] = run_demo.comparisons(nb)
    lines = text.splitlines()
    assert lines[0] == "traceml compare: slow -> fixed"
    # judged against the noise: the fix is faster with an interval that excludes 1 (MIXED when
    # the workers slowed the model's compute on a machine with few cores: the notebook says so)
    found = re.match(r"  (?:IMPROVEMENT|MIXED): [\d.]+x faster \(95 % interval ([\d.]+)x to [\d.]+x\)", lines[1])
    assert found is not None and float(found[1]) > 1.0, lines[1]
    assert "INPUT-BOUND -> " in lines[1] or "still INPUT-BOUND" in lines[1]
    rates = re.search(r"Throughput \(samples/s\)\s+([\d.]+)\s+([\d.]+)", text)
    assert rates is not None, text
    speedup = float(rates[2]) / float(rates[1])
    assert speedup >= float(promised[1]), text

    page = run_demo.write_html(nb, tmp_path / "demo.html").read_text(encoding="utf-8")
    assert "traceml compare" in page and "INPUT-BOUND" in page


@pytest.mark.kernel
def test_loops_are_found_in_functions_classes_and_libraries() -> None:
    nb = executed("loops_in_functions.ipynb")
    verdicts = {r.name: r.label for r in run_demo.reports(nb)}
    assert verdicts == {
        "function": "INPUT-BOUND",
        "trainer": "INPUT-BOUND",
        "library": "INPUT-BOUND",
    }
    where = run_demo.plain_outputs(nb)[-1].splitlines()
    assert where[0].startswith("function") and "function train (" in where[0]
    assert where[1].startswith("trainer") and "function Trainer.fit (" in where[1]
    assert where[2].startswith("library") and "a step = one `optimizer.step()` of SGD" in where[2]


def test_binder_builds_a_cpu_only_environment_with_the_package() -> None:
    lines = [
        line.split("#")[0].strip()
        for line in (ROOT / "binder" / "requirements.txt").read_text().splitlines()
    ]
    lines = [line for line in lines if line]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    torch_pins = [line for line in lines if line.startswith("torch")]
    assert torch_pins and all(line.endswith("+cpu") for line in torch_pins)
    assert "." in lines or "-e ." in lines
    readme = (ROOT / "binder" / "README.md").read_text()
    target = re.search(r"urlpath=lab/tree/(\S+\.ipynb)", readme)
    assert target is not None and (ROOT / target[1]).exists()
