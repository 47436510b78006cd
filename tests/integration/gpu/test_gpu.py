"""scripts/gpu_check.py, the one GPU validation: on a CUDA machine each scenario group runs as a
test (skipped without CUDA); on any machine the script lists its scenarios and skips cleanly
without a CUDA device, and its fork check (no CUDA initialised before a fork) passes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import pytest
from helpers import REPO

torch = pytest.importorskip("torch")
# Asking is_available() initialises CUDA: only on a machine built with CUDA, where these tests
# are meant to use it anyway.
HAS_CUDA = bool(torch.backends.cuda.is_built() and torch.cuda.is_available())
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

SCRIPT = REPO / "scripts" / "gpu_check.py"


def load_script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=SCRIPT.parents[1]
    )


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("group", [s.key for s in load_script().SCENARIOS] + [s.key for s in load_script().second_pass().SECOND_PASS])
def test_gpu_scenario(ip: Any, group: str) -> None:
    gpu_check = load_script()
    checks = gpu_check.run_all(ip, only=lambda key: key == group)
    print(gpu_check.table(checks))
    assert checks and all(c.ok for c in checks), gpu_check.table(checks)


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="this machine has a GPU: the script runs for real")
def test_without_cuda_the_script_lists_its_scenarios_and_skips() -> None:
    done = script("--all")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "skipped: no CUDA device"
    listed = [line for line in lines if line.startswith("  ") and ":" in line and "not covered" not in line]
    assert len(listed) >= 15, done.stdout
    for key in ("A ", "B ", "C ", "D ", "E ", "F ", "H ", "I ", "J ", "K ", "L ", "M ", "hf ", "demo ", "overhead "):
        assert any(line.strip().startswith(key) for line in listed), key


def test_every_scenario_group_is_there_and_says_what_it_shows() -> None:
    gpu_check = load_script()
    keys = {s.key for s in gpu_check.SCENARIOS}
    assert set("ABCDEFHIJKLM") <= keys and {"hf", "demo", "overhead", "compile"} <= keys
    assert all(s.run.__doc__ for s in gpu_check.SCENARIOS)  # each says what it shows


@pytest.mark.slow
def test_the_fork_check_passes_after_a_traced_cell() -> None:
    """In a fresh interpreter: a traced CPU cell leaves CUDA uninitialised and a fork
    child is not in a "bad fork" (on a GPU machine the child also runs a CUDA kernel)."""
    done = script("--fork-check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fork check: ok" in done.stdout


def test_the_second_pass_lists_its_groups_and_skips_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    """The second pass (≤ 60 s) beside --all: its groups are listed, none is a first-pass scenario."""
    gpu_check = load_script()
    second = gpu_check.second_pass()
    keys = [s.key for s in second.SECOND_PASS]
    assert {"calibration", "S1", "G1", "D3", "env", "N", "S2", "G2e", "C4", "G3"} <= set(keys)
    assert not set(keys) & {s.key for s in gpu_check.SCENARIOS}  # --only picks one group
    assert all(s.run.__doc__ for s in second.SECOND_PASS)
    if HAS_CUDA:
        return
    for args, first in ((["--second"], False), (["--all", "--second"], True)):
        assert gpu_check.main(args) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[0] == "skipped: no CUDA device"
        assert f"second pass: {len(keys)} groups" in out
        assert (f"{len(gpu_check.SCENARIOS)} scenario groups" in out) == first
