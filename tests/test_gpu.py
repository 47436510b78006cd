"""On a CUDA machine: the checks of scripts/gpu_check.py (verdicts and GPU timings against
injected delays, copies, syncs and host-bound steps), one test per group. Skipped without CUDA."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def load_script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("group", ["demo", "delays", "known", "h2d", "tiny", "item"])
def test_gpu_scenario(ip: Any, group: str) -> None:
    gpu_check = load_script()
    checks = gpu_check.run_all(ip, only=lambda name: name == group)
    print(gpu_check.table(checks))
    assert checks and all(c.ok for c in checks), gpu_check.table(checks)


def test_the_script_says_it_skips_without_cuda(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    gpu_check = load_script()
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: False)
    assert gpu_check.main() == 0
    assert capsys.readouterr().out.strip() == "no CUDA: skipped"
