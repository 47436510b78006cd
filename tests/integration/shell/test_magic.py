"""The user's story through a real IPython shell: %%traceml on training cells."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any

import pytest
from helpers import run, shell_fixture
from IPython.utils.capture import capture_output

import traceml_jupyter

SETUP = '''
import time, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

class SleepyBatches(Dataset):
    """Each item is a whole batch and takes `delay` seconds to make."""
    def __init__(self, n, delay):
        self.n, self.delay = n, delay
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        if i == getattr(self, "fail_at", -1):
            raise ValueError(f"corrupt sample {i}")
        time.sleep(self.delay)
        return torch.randn(16, 32), torch.randn(16, 1)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
crit = nn.MSELoss()
'''




shell = shell_fixture(SETUP)


@pytest.mark.slow
def test_a_slow_dataset_is_input_bound_with_the_injected_wait(shell: Any) -> None:
    run(shell, "loader = DataLoader(SleepyBatches(30, 0.020), batch_size=None)")
    r = run(
        shell,
        """\
        %%traceml --name slow
        for x, y in loader:
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
        """,
    )
    assert r.error_in_exec is None
    got = traceml_jupyter.last()
    assert got is not None and got.name == "slow"
    assert got.verdict == "INPUT-BOUND" and got.severity == "critical"
    assert got.clock == "cpu" and got.n_steps == 30
    assert 20.0 <= got.summary["data_wait_ms"] <= 23.0  # the injected 20 ms, and what sleep() oversleeps on a busy machine
    assert got.summary["data_wait_share"] >= 0.2
    assert got.result.steps.batch_size == 16 and got.result.loop.line == 2
    text = r.shown
    assert "|  Step Time: INPUT-BOUND" in text and "CPU compute:" in text
    assert "Why:" in text and "Next:" in text


@pytest.mark.slow
def test_a_fast_in_memory_loader_with_a_heavy_model_is_compute_bound(shell: Any) -> None:
    r = run(
        shell,
        """\
        big = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1))
        big_opt = torch.optim.SGD(big.parameters(), lr=0.01)
        fast = DataLoader(TensorDataset(torch.randn(2048, 512), torch.randn(2048, 1)), batch_size=64)
        # A long suite leaves garbage behind: collect it now, not in the middle of a fetch, where
        # one pause would cost more than the fetches of the whole run (an input straggler).
        import gc; gc.collect()
        """,
    )
    assert r.error_in_exec is None
    r = run(
        shell,
        """\
        %%traceml
        for epoch in range(2):
            for x, y in fast:
                big_opt.zero_grad()
                crit(big(x), y).backward()
                big_opt.step()
        """,
    )
    assert r.error_in_exec is None
    got = traceml_jupyter.last()
    assert got is not None
    assert got.verdict == "COMPUTE-BOUND" and got.severity == "info"
    assert got.n_steps == 64 and got.result.loop.line == 3
    assert got.summary["compute_share"] >= 0.9


LOOP_FORMS = {
    "tuple targets and enumerate": """
        out = []
        for i, (x, y) in enumerate(loader):
            out.append((i, round(float(x.sum()), 3)))
            loss = crit(model(x), y); loss.backward()
        """,
    "a wrapper generator and zip": """
        def progress(it):
            for item in it:
                yield item
        out = []
        for (x, y), k in zip(progress(loader), "abc"):
            out.append(k)
            crit(model(x), y).backward()
        """,
    "break, continue and else": """
        out = []
        for i, (x, y) in enumerate(loader):
            crit(model(x), y).backward()
            if i == 1:
                continue
            out.append(i)
            if i == 3:
                break
        else:
            out.append("no break")
        """,
    "else without break": """
        out = []
        for x, y in loader:
            crit(model(x), y).backward()
            out.append(1)
        else:
            out.append("else ran")
        """,
    "return inside a function and nested loops": """
        def train(n):
            seen = []
            for epoch in range(2):
                for i, (x, y) in enumerate(loader):
                    crit(model(x), y).backward()
                    seen.append((epoch, i))
                    if epoch == 1 and i == n:
                        return seen
            return seen
        out = train(2)
        """,
    "an exception caught inside the body": """
        out = []
        for i, (x, y) in enumerate(loader):
            crit(model(x), y).backward()
            try:
                if i % 2:
                    raise KeyError(i)
                out.append(i)
            except KeyError as e:
                out.append(f"caught {e}")
        """,
}


@pytest.mark.slow
@pytest.mark.parametrize("form", sorted(LOOP_FORMS))
def test_every_loop_form_keeps_its_meaning(shell: Any, form: str) -> None:
    run(shell, "torch.manual_seed(1); loader = DataLoader(TensorDataset(torch.randn(40, 32), torch.randn(40, 1)), batch_size=8)")
    cell = textwrap.dedent(LOOP_FORMS[form])
    assert run(shell, cell).error_in_exec is None
    plain = shell.user_ns["out"]
    before = len(traceml_jupyter.runs())
    r = run(shell, "%%traceml --no-live\n" + cell)
    assert r.error_in_exec is None
    assert shell.user_ns["out"] == plain
    assert len(traceml_jupyter.runs()) == before + 1
    assert traceml_jupyter.last().n_steps > 0  # type: ignore[union-attr]
    # functions the traced cell defined run unpatched afterwards
    if "def train" in cell:
        assert shell.user_ns["train"](0) == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0)]


@pytest.mark.slow
def test_an_error_in_the_cell_is_reraised_after_the_partial_report(shell: Any) -> None:
    run(shell, "loader = DataLoader(TensorDataset(torch.randn(40, 32), torch.randn(40, 1)), batch_size=8)")
    r = run(
        shell,
        """\
        %%traceml --name boom
        for i, (x, y) in enumerate(loader):
            crit(model(x), y).backward()
            if i == 2:
                raise RuntimeError("boom at step 2")
        """,
    )
    assert isinstance(r.error_in_exec, RuntimeError)
    got = traceml_jupyter.last()
    assert got is not None and got.name == "boom" and got.n_steps == 3
    assert got.result.error == "RuntimeError: boom at step 2"
    assert "Step Time:" in r.shown and r.out.outputs  # the report was displayed
    # The traceback's last frame is the cell's own line 5 (the %%traceml line is line 1).
    frames = traceback.extract_tb(r.error_in_exec.__traceback__)
    assert frames[-1].filename == got.result.loop.cell_filename and frames[-1].lineno == 5
    assert 'raise RuntimeError("boom at step 2")' in r.out.stdout
    assert "line 5" in r.out.stdout


def test_the_traceback_names_the_cell_by_its_own_number(shell: Any) -> None:
    with capture_output() as out:
        r = shell.run_cell("%%traceml\nfor v in [1]:\n    1 / 0\n", store_history=True)
    assert isinstance(r.error_in_exec, ZeroDivisionError)
    assert f"Cell In[{r.execution_count}], line 3" in out.stdout


@pytest.mark.slow
def test_keyboard_interrupt_stops_the_cell_and_keeps_the_partial_run(shell: Any) -> None:
    run(shell, "loader = DataLoader(TensorDataset(torch.randn(40, 32), torch.randn(40, 1)), batch_size=8)")
    r = run(
        shell,
        """\
        %%traceml
        done = 0
        for x, y in loader:
            crit(model(x), y).backward()
            done += 1
            if done == 3:
                raise KeyboardInterrupt
        """,
    )
    assert isinstance(r.error_in_exec, KeyboardInterrupt)
    got = traceml_jupyter.last()
    assert got is not None and got.n_steps == 3 and got.result.error == "KeyboardInterrupt"
    assert shell.user_ns["done"] == 3


@pytest.mark.slow
def test_a_loader_that_raises_is_reraised_with_its_own_traceback(shell: Any) -> None:
    run(shell, "bad = SleepyBatches(10, 0.0); bad.fail_at = 4; bad_loader = DataLoader(bad, batch_size=None)")
    r = run(
        shell,
        """\
        %%traceml
        for x, y in bad_loader:
            crit(model(x), y).backward()
        """,
    )
    assert isinstance(r.error_in_exec, ValueError)
    assert "corrupt sample 4" in str(r.error_in_exec)
    got = traceml_jupyter.last()
    assert got is not None and got.n_steps == 4 and "corrupt sample 4" in (got.result.error or "")
    frames = traceback.extract_tb(r.error_in_exec.__traceback__)
    assert any(f.filename == got.result.loop.cell_filename and f.lineno == 2 for f in frames)


def test_an_empty_loader_is_no_data(shell: Any) -> None:
    r = run(
        shell,
        """\
        %%traceml
        for x, y in DataLoader(TensorDataset(torch.randn(0, 32), torch.randn(0, 1)), batch_size=8):
            crit(model(x), y).backward()
        """,
    )
    assert r.error_in_exec is None
    got = traceml_jupyter.last()
    assert got is not None and got.verdict == "NO DATA" and got.n_steps == 0
    lines = [line for line in r.out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and "no step ran" in lines[0] and "iterator is empty" in lines[0]
    assert "Step Time" not in r.shown


@pytest.mark.parametrize("line", ["--bogus", "--warmup many", "--loop", "--warmup -1", "extra words"])
def test_a_bad_option_is_a_usage_error_and_the_cell_does_not_run(shell: Any, line: str) -> None:
    shell.user_ns["ran"] = False
    before = len(traceml_jupyter.runs())
    r = run(shell, f"%%traceml {line}\nran = True\n")
    assert r.error_in_exec is not None and type(r.error_in_exec).__name__ == "UsageError"
    assert shell.user_ns["ran"] is False and len(traceml_jupyter.runs()) == before


def test_loop_option_chooses_the_loop_and_rejects_a_line_without_one(shell: Any) -> None:
    run(shell, "a_list = [1, 2, 3]; b_list = [4, 5]")
    r = run(shell, "%%traceml --loop 4\nfor a in a_list:\n    pass\nfor b in b_list:\n    pass\n")
    assert r.error_in_exec is None
    got = traceml_jupyter.last()
    assert got is not None and got.result.loop.line == 4 and got.n_steps == 2
    r = run(shell, "%%traceml --loop 9\nfor a in a_list:\n    pass\n")
    assert type(r.error_in_exec).__name__ == "UsageError"
    assert "no for loop on line 9" in str(r.error_in_exec)


def test_a_cell_without_a_loop_runs_untouched_with_one_line(shell: Any) -> None:
    before = len(traceml_jupyter.runs())
    r = run(shell, "%%traceml\nanswer = 6 * 7\n")
    assert r.error_in_exec is None and shell.user_ns["answer"] == 42
    assert len(traceml_jupyter.runs()) == before
    lines = [line for line in r.out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("traceml: no training loop found")
    assert "# traceml: loop" in lines[0] and "--loop" in lines[0]


@pytest.mark.slow
def test_leading_blank_lines_keep_line_numbers(shell: Any) -> None:
    r = run(shell, "%%traceml\n\n\nfor v in [1, 2]:\n    1 / (v - 2)\n")
    assert isinstance(r.error_in_exec, ZeroDivisionError)
    got = traceml_jupyter.last()
    assert got is not None and got.result.loop.line == 4
    assert traceback.extract_tb(r.error_in_exec.__traceback__)[-1].lineno == 5


def test_the_last_expression_is_shown_as_out(shell: Any) -> None:
    r = run(shell, "%%traceml\nfor v in [1, 2, 3]:\n    pass\nv * 10\n")
    assert r.result == 30


@pytest.mark.slow
def test_a_cell_run_twice_gives_two_runs(shell: Any) -> None:
    cell = "%%traceml\nfor v in [1, 2, 3]:\n    pass\n"
    before = len(traceml_jupyter.runs())
    run(shell, cell)
    run(shell, cell)
    names = [r.name for r in traceml_jupyter.runs()[before:]]
    assert len(names) == 2 and names[0] != names[1]
    assert all(r.n_steps == 3 for r in traceml_jupyter.runs()[before:])


def test_save_writes_json_that_round_trips(shell: Any, tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    run(shell, "loader = DataLoader(SleepyBatches(6, 0.001), batch_size=None)")
    r = run(shell, f"%%traceml --save {path} --warmup 1\nfor x, y in loader:\n    crit(model(x), y).backward()\n")
    assert r.error_in_exec is None
    data = json.loads(path.read_text())
    got = traceml_jupyter.last()
    assert got is not None
    assert data["schema_version"] == 2 and data["verdict"]["label"] == got.verdict
    assert data["summary"]["warmup_steps"] == 1 and data["summary"]["n_analysed"] == 5
    assert len(data["steps"]["data_wait_ms"]) == got.n_steps == 6
    assert data["steps"]["data_wait_gpu_ms"] == [None] * 6  # unmeasured is null, not 0
    assert data["loader"]["num_workers"] == 0
    assert data == json.loads(json.dumps(got.to_dict(), allow_nan=False))


@pytest.mark.slow
def test_a_loop_inside_a_function_from_another_cell(shell: Any) -> None:
    run(shell, "loader = DataLoader(TensorDataset(torch.randn(40, 32), torch.randn(40, 1)), batch_size=8)")
    r = run(
        shell,
        """\
        def train_one_epoch(model, loader):
            total = 0.0
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                total += float(loss.detach())
            return total
        """,
    )
    assert r.error_in_exec is None
    plain_code = shell.user_ns["train_one_epoch"].__code__
    r = run(shell, "%%traceml\nfor epoch in range(2):\n    train_one_epoch(model, loader)\n")
    assert r.error_in_exec is None
    got = traceml_jupyter.last()
    assert got is not None and got.n_steps == 10 and got.result.loop.line == 3
    assert "function train_one_epoch" in (got.result.loop.where or "")
    assert shell.user_ns["train_one_epoch"].__code__ is plain_code


def test_a_trainer_method_defined_in_a_cell(shell: Any) -> None:
    run(shell, "loader = DataLoader(TensorDataset(torch.randn(40, 32), torch.randn(40, 1)), batch_size=8)")
    run(
        shell,
        """\
        class Trainer:
            def __init__(self, model, loader):
                self.model, self.loader = model, loader
            def fit(self, epochs):
                for _ in range(epochs):
                    self.epoch()
            def epoch(self):
                for x, y in self.loader:
                    crit(self.model(x), y).backward()
        trainer = Trainer(model, loader)
        """,
    )
    r = run(shell, "%%traceml\ntrainer.fit(3)\n")
    assert r.error_in_exec is None
    got = traceml_jupyter.last()
    assert got is not None and got.n_steps == 15 and "Trainer.epoch" in (got.result.loop.where or "")


def test_a_loop_the_magic_cannot_see_is_timed_by_its_training_events(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "libtrainer.py").write_text(
        "def train(model, loader, crit):\n"
        "    it = iter(loader)\n"
        "    while True:\n"
        "        try:\n"
        "            x, y = next(it)\n"
        "        except StopIteration:\n"
        "            return\n"
        "        crit(model(x), y).backward()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run(shell, "import libtrainer; loader = DataLoader(SleepyBatches(12, 0.005), batch_size=None)")
    r = run(shell, "%%traceml\nlibtrainer.train(model, loader, crit)\n")
    assert r.error_in_exec is None
    got = traceml_jupyter.last()
    assert got is not None and got.n_steps == 12 and got.result.loop.line is None
    assert got.result.steps.kind == "backward" and got.verdict == "INPUT-BOUND"
    assert got.result.data.loader is not None and got.result.data.loader["num_workers"] == 0


def test_the_loader_behind_the_loop_is_described(shell: Any) -> None:
    run(shell, "loader = DataLoader(TensorDataset(torch.randn(40, 32), torch.randn(40, 1)), batch_size=8, num_workers=0)")
    run(shell, "%%traceml\nfor i, (x, y) in enumerate(loader):\n    crit(model(x), y).backward()\n")
    got = traceml_jupyter.last()
    assert got is not None and got.result.data.loader is not None
    assert got.result.data.loader["num_workers"] == 0 and got.result.data.loader["batch_size"] == 8
    assert got.result.steps.expected == 5 and got.result.steps.batch_size == 8


def test_non_tensor_batches_get_a_note_not_an_error(shell: Any) -> None:
    r = run(shell, "%%traceml\nfor word in ['a', 'b', 'c']:\n    pass\n")
    assert r.error_in_exec is None
    got = traceml_jupyter.last()
    assert got is not None and got.result.steps.batch_size is None
    assert any("not tensors" in note for note in got.notes)


def test_the_docstring_is_the_help(ip: Any) -> None:
    doc = ip.find_cell_magic("traceml").__doc__
    assert "Usage" in doc and "--warmup" in doc and "--loop LINE" in doc and "Example" in doc


def test_the_python_api_gives_the_same_run_object() -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(20, 4)), batch_size=5)
    with capture_output():
        with traceml_jupyter.trace("script", warmup=0) as r:
            for _epoch in range(2):
                for (x,) in r.loop(loader):
                    x.sum()
    assert traceml_jupyter.last() is r
    assert r.n_steps == 8 and r.verdict in {"COMPUTE-BOUND", "INPUT-BOUND", "MIXED", "INPUT STRAGGLER"}
    assert r.result.steps.expected == 4


@pytest.mark.slow
def test_load_ext_imports_no_heavy_module() -> None:
    code = (
        "import sys\n"
        "from IPython.testing.globalipapp import get_ipython\n"
        "ip = get_ipython(); ip.run_line_magic('load_ext', 'traceml_jupyter')\n"
        "print(sorted(m for m in ('torch', 'bqplot', 'pynvml', 'ipywidgets') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
