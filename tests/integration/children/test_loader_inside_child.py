"""The command line on a script whose DataLoader has workers: the child's watch inside its
loader's workers comes back in its END frame, in the printed box's Also lines and in --save's
JSON (docs/loader-inside.md), with nothing of ours left in the temporary folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import TESTS

TRAIN = TESTS / "child_scripts" / "train.py"


def our_directories() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("traceml-loader-")}


@pytest.mark.slow
def test_the_command_line_reports_inside_the_scripts_loader(tmp_path: Path) -> None:
    # 2 workers, each sample 4 ms of sleep, batches of 4: GETITEM dominates, 4 samples a batch.
    saved = tmp_path / "run.json"
    before = our_directories()
    done = subprocess.run(
        [sys.executable, "-m", "traceml_jupyter", "run", "--name", "cli-inside", "--save", str(saved), "--",
         sys.executable, str(TRAIN), "--sleep-ms", "4", "--steps", "24", "--workers", "2"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Also: inside the loader, GETITEM:" in done.stdout
    inside = json.loads(saved.read_text())["loader_inside"]
    assert inside["batches"] >= 24 and {w["worker"] for w in inside["workers"]} == {0, 1}
    assert all(w["items"] == 4 * w["batches"] for w in inside["workers"])  # batches of 4
    assert inside["item_ms"] >= 4.0  # each sample sleeps 4 ms in the script
    assert our_directories() <= before
