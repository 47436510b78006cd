"""Runs that outlive the kernel, in a real IPython shell: a run saved as JSON reads back as a
frozen result that shows the same report and compares as it did; files of the first schema
version load; a standalone HTML report; the history directory; names, paths and globs given to
`%traceml compare`; bad input answered in one line."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import TESTS
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from jupyter_harness import DECODING_DATASET

import traceml_jupyter
from traceml_jupyter import history, kernel_state
from traceml_jupyter.run import Run
from traceml_jupyter.saved import LoadError
from traceml_jupyter.views.report import report_html
from traceml_jupyter.views.report_file import html_page

DATA = TESTS / "data"
V1 = DATA / "run_v1.json"  # saved by main's code before runs could be loaded (make_run_v1.py)

SETUP = DECODING_DATASET
MODEL = '''\
loader = DataLoader(SlowDataset(1.0, n=48), batch_size=4)
model = torch.nn.Linear(16, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.CrossEntropyLoss()
'''
TRAIN = '''\
def train():
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
'''


def cell(ip: Any, source: str) -> Any:
    with capture_output() as out:
        result = ip.run_cell(textwrap.dedent(source), store_history=True)
    result.out = out
    return result


@pytest.fixture()
def own_runs() -> Iterator[None]:
    """This test's runs only (names from other tests must not match); no history afterwards."""
    before = list(kernel_state.RUNS)
    kernel_state.RUNS.clear()
    history._CHOSEN.clear()
    yield
    kernel_state.RUNS[:] = before
    history._CHOSEN.clear()


@pytest.fixture()
def saved(ip: Any, own_runs: None, tmp_path: Path) -> tuple[Run, Path]:
    """A real run of a cell that calls a training function from another cell, saved as JSON."""
    for source in (SETUP, MODEL, TRAIN):
        assert cell(ip, source).error_in_exec is None
    path = tmp_path / "slow.json"
    result = cell(ip, f"%%traceml --name slow --no-live --save {path}\ntrain()\n")
    assert result.error_in_exec is None, result.out.stderr
    run = traceml_jupyter.last()
    assert run is not None and run.name == "slow" and run.n_steps == 12
    return run, path


# -- a saved run reads back as the run it was -------------------------------------------------------


def test_a_loaded_run_shows_the_same_report_text_and_comparison(saved: tuple[Run, Path]) -> None:
    run, path = saved
    loaded = traceml_jupyter.load(str(path))
    assert isinstance(loaded, Run) and loaded.read_back and loaded.path == str(path)
    assert loaded.unsaved == frozenset()
    assert (loaded.name, loaded.verdict, loaded.n_steps) == (run.name, run.verdict, run.n_steps)
    assert loaded.text() == run.text()
    # The report page, chart, checklist and the lines of the other cells it quotes included,
    # is the same page from the file as from the kernel.
    quoted = run.result.reading.quoted_cells or {}
    assert any("DataLoader(" in t for t in quoted.values()) and any("def train" in t for t in quoted.values())
    page = html_page(run)
    assert html_page(loaded) == page
    assert "tml-elsewhere" in page and "def train():" in page and "<svg" in page
    for name in ("step_ms", "data_wait_ms"):
        assert loaded.steps[name].tolist() == run.steps[name].tolist()
    # It is this kernel's run "slow" (same name, same start): not listed twice. It compares as
    # the kernel's run does.
    assert traceml_jupyter.runs() == [run]
    assert traceml_jupyter.compare(loaded, run).to_dict() == traceml_jupyter.compare(run, run).to_dict()
    assert loaded.to_dict() == json.loads(path.read_text())
    assert loaded.result == run.result  # the same value, read back


def test_a_loaded_run_is_frozen(saved: tuple[Run, Path]) -> None:
    loaded = traceml_jupyter.load(str(saved[1]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.result.reading = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        loaded.result.summary["n_steps"] = 0  # type: ignore[index]
    with pytest.raises(ValueError, match="read-only"):
        loaded.steps["step_ms"][0] = 0.0
    assert loaded.finish() is loaded


def test_loading_the_same_file_twice_keeps_one_run(saved: tuple[Run, Path]) -> None:
    kernel_state.RUNS.clear()
    traceml_jupyter.load(str(saved[1]))
    traceml_jupyter.load(str(saved[1]))
    assert [r.name for r in traceml_jupyter.runs()] == ["slow"]


def test_a_loaded_run_shown_as_a_cells_value_is_its_report(saved: tuple[Run, Path]) -> None:
    from IPython.core.formatters import DisplayFormatter

    data, _ = DisplayFormatter().format(traceml_jupyter.load(str(saved[1])))
    assert "Step Time: INPUT-BOUND" in data["text/html"] and "Checklist" in data["text/html"]
    assert data["text/plain"].startswith("traceml: slow - 12 steps")


# -- every schema version loads ---------------------------------------------------------------------


def test_a_file_of_the_first_schema_version_loads_and_renders() -> None:
    run = traceml_jupyter.load(str(V1))
    try:
        assert run.schema_version == 1 and run.name == "slow" and run.verdict == "INPUT-BOUND"
        assert {"loop.cell_source", "machine", "reading.quoted_cells"} <= run.unsaved
        assert run.result.loop.cell_source is None and run.machine is None  # not in the file: None
        assert run.text().startswith("traceml: slow - 24 steps")
        assert "Step Time: INPUT-BOUND" in run.text()
        page = report_html(run)
        assert "INPUT-BOUND" in page and "num_workers" in page  # the checklist as saved
        assert "written by an older traceml_jupyter" in page  # no cell: said, not guessed
        assert "<script" not in html_page(run)
        c = traceml_jupyter.compare(run, str(V1))
        assert c.change == "NO CHANGE"
        assert c.caveats == [
            "Hardware and versions not checked: slow, slow was saved without them "
            "(by an older traceml_jupyter)."
        ]
    finally:
        kernel_state.RUNS.remove(run)


def test_a_later_version_with_more_keys_and_unknown_ones_loads(tmp_path: Path) -> None:
    document = json.loads(V1.read_text())
    document["schema_version"] = 2
    document["resources"] = {"time_s": [0.1, 0.2], "cpu_pct": [120.0, None]}  # a key we don't know
    document["steps"]["forward_ms"] = [1.0] * 24  # a part another branch measures
    document["steps"]["optimizer_ms"] = [None] * 24
    document["steps"]["memory_kind"] = ["cuda"] * 24  # a column of another kind: left out
    document["steps"]["backward_ms"] = None  # a column left null: left out
    document["cell"] = {"source": "%%traceml --name slow\nfor x, y in loader:\n    pass", "loop_cell_source": None}
    document["machine"] = {"python": "3.11.7", "torch": "2.13.0", "cpus": 2}
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(document))
    run = traceml_jupyter.load(str(path))
    try:
        assert run.schema_version == 2 and run.machine == document["machine"]
        assert "loop.cell_source" not in run.unsaved and run.result.loop.cell_source.startswith("%%traceml")
        assert run.steps["forward_ms"].tolist() == [1.0] * 24
        assert "memory_kind" not in run.steps and "backward_ms" not in run.steps
        assert run.to_dict()["steps"]["memory_kind"] == ["cuda"] * 24  # kept as read
        assert "for x, y in loader:" in report_html(run)
        c = traceml_jupyter.compare(run, str(V1))
        assert "forward_ms" not in {ch.column for ch in c.per_step}  # only one of them has it
    finally:
        kernel_state.RUNS.remove(run)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ('{"schema_version": 1, "name": "x", "summ', "not valid JSON (Unterminated string"),
        ('{"name": "resnet", "epochs": 3}', "not a traceml run (a JSON file without schema_version)"),
        ("[1, 2, 3]", "not a traceml run (a JSON file without schema_version)"),
        ('{"schema_version": 9, "name": "x"}', "written by a newer traceml_jupyter (schema_version 9"),
        ('{"schema_version": "1"}', "not a traceml run (schema_version '1')"),
        ('{"schema_version": 1, "name": "x", "summary": {}, "verdict": {"label": "X"}}',
         "not a complete traceml run (steps is missing)"),
        ('{"schema_version": 1, "name": "x", "summary": {}, "verdict": {"label": "X"}, '
         '"steps": {"step_ms": ["a"]}}', "steps.step_ms is not a list of numbers"),
        ('{"schema_version": 1, "name": "x", "summary": {}, "verdict": {"label": "X"}, '
         '"steps": {"step_ms": [1.0], "data_wait_ms": [], "compute_ms": [1.0]}}',
         "per-step columns have different lengths"),
        ('{"schema_version": 1, "name": "x", "summary": {}, "verdict": {"label": "X"}, '
         '"steps": {"step_ms": [1.0], "data_wait_ms": [1.0]}}', "steps.compute_ms is missing"),
        ("<!DOCTYPE html>\n<html><body>report</body></html>", "an HTML report, not a saved run"),
    ],
)
def test_a_file_that_is_not_a_saved_run_is_refused_in_one_line(tmp_path: Path, content: str, why: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(LoadError) as info:
        traceml_jupyter.load(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: ") and why in message and "\n" not in message


def test_missing_paths_and_directories_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match=r"nope\.json: no such file$"):
        traceml_jupyter.load(str(tmp_path / "nope.json"))
    with pytest.raises(LoadError, match="a directory, not a saved run"):
        traceml_jupyter.load(str(tmp_path))
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(LoadError, match="not a text file"):
        traceml_jupyter.load(str(tmp_path / "bin.json"))


# -- the report as a file ----------------------------------------------------------------------------


@pytest.mark.slow
def test_save_html_writes_one_standalone_page(ip: Any, saved: tuple[Run, Path], tmp_path: Path) -> None:
    run, _ = saved
    page_path = tmp_path / "report.html"
    result = cell(ip, f"%%traceml --name slow2 --no-live --save {page_path}\ntrain()\n")
    assert result.error_in_exec is None
    assert f"traceml: saved slow2 to {page_path}" in result.out.stdout
    page = page_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page.lower() and "javascript:" not in page.lower()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing from the network
    assert "Step Time: INPUT-BOUND" in page and "Checklist" in page and "num_workers" in page
    assert "<svg" in page  # the chart
    # run.save("x.html") writes the same page; JSON for anything else.
    again = tmp_path / "again.HTML"
    assert run.save(str(again)) == str(again)
    assert again.read_text() == html_page(run)
    assert json.loads(Path(run.save(str(tmp_path / "x.json"))).read_text())["name"] == "slow"


# -- the history and names across kernels -----------------------------------------------------------


@pytest.mark.slow
def test_the_history_finds_runs_of_an_earlier_kernel_by_name(ip: Any, saved: tuple[Run, Path], tmp_path: Path) -> None:
    where = tmp_path / "history"
    with capture_output() as out:
        ip.run_line_magic("traceml", f"history {where}")
    assert out.stdout.strip() == f"traceml: every run is saved to {where} (0 runs there)"
    assert cell(ip, "%%traceml --name before --no-live\ntrain()\n").error_in_exec is None
    assert cell(ip, "loader = DataLoader(SlowDataset(0.5, n=48), batch_size=4)").error_in_exec is None
    assert cell(ip, "%%traceml --name after --no-live\ntrain()\n").error_in_exec is None
    files = sorted(p.name for p in where.iterdir())
    assert len(files) == 2 and files[0].endswith("-before.json") and files[1].endswith("-after.json")
    in_kernel = traceml_jupyter.compare("before", "after").to_dict()
    kernel_state.RUNS.clear()  # a new kernel: its runs are gone, the history is not
    c = ip.run_line_magic("traceml", "compare before after")
    assert c.to_dict() == in_kernel
    # paths and globs too
    by_glob = traceml_jupyter.compare(str(where / "*-before.json"), "after")
    assert by_glob.to_dict() == in_kernel
    with capture_output() as out:
        ip.run_line_magic("traceml", "history off")
    assert "no history" in out.stdout


@pytest.mark.slow
def test_a_name_for_two_different_runs_is_refused(ip: Any, saved: tuple[Run, Path], tmp_path: Path) -> None:
    where = tmp_path / "history"
    history.choose(str(where))
    cell(ip, "%%traceml --name twice --no-live\ntrain()\n")
    history.choose("off")
    cell(ip, "%%traceml --name twice --no-live\ntrain()\n")  # this kernel's, not in the history
    history.choose(str(where))
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("traceml", "compare twice slow")
    message = str(info.value)
    assert message.startswith("%traceml compare: 'twice' stands for two runs: in this kernel")
    assert "in the history" in message and "\n" not in message


@pytest.mark.slow
def test_bad_names_paths_and_globs_say_which_and_why(ip: Any, saved: tuple[Run, Path], tmp_path: Path) -> None:
    cases = {
        "compare nosuch slow": "no run named 'nosuch' in this kernel (known: 'slow') and no "
        "history directory is set",
        f"compare {tmp_path}/missing.json slow": f"{tmp_path}/missing.json: no such file",
        f"compare '{tmp_path}/*.nothing' slow": f"{tmp_path}/*.nothing: no file matches",
    }
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.json").write_text("{}")
    cases[f"compare {tmp_path}/?.json slow"] = f"{tmp_path}/?.json: matches 2 files"
    cases[f"compare {tmp_path}/a.json slow"] = f"{tmp_path}/a.json: not a traceml run"
    for line, why in cases.items():
        with pytest.raises(UsageError) as info:
            ip.run_line_magic("traceml", line)
        assert str(info.value).startswith(f"%traceml compare: {why}"), str(info.value)
    kernel_state.RUNS.clear()
    with pytest.raises(UsageError, match=r"compare 'slow' with what\? This kernel has no run: name two"):
        ip.run_line_magic("traceml", f"compare {tmp_path}/slow.json")
    with pytest.raises(UsageError, match="unknown command 'load'.*history"):
        ip.run_line_magic("traceml", "load x")
    with pytest.raises(UsageError, match="history: .*a file, not a directory"):
        ip.run_line_magic("traceml", f"history {tmp_path / 'a.json'}")


@pytest.mark.slow
def test_a_history_that_cannot_be_written_costs_nothing_but_a_line(ip: Any, saved: tuple[Run, Path], tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    history.choose(str(blocked))
    shutil.rmtree(blocked)
    blocked.write_text("a file where the directory was")
    result = cell(ip, "%%traceml --name lost --no-live\ntrain()\nresult = 7\n")
    assert result.error_in_exec is None and ip.user_ns["result"] == 7
    assert "traceml: could not save lost to the history" in result.out.stderr
    assert traceml_jupyter.last().name == "lost"


@pytest.mark.slow
def test_traceml_history_in_the_environment_saves_every_run(
    ip: Any, saved: tuple[Run, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEML_HISTORY", str(tmp_path / "from-env"))
    assert cell(ip, "%%traceml --name env --no-live\ntrain()\n").error_in_exec is None
    [path] = (tmp_path / "from-env").iterdir()
    assert path.name.endswith("-env.json") and traceml_jupyter.load(str(path)).name == "env"
    with capture_output() as out:
        ip.run_line_magic("traceml", "history")
    assert out.stdout.strip() == f"traceml: every run is saved to {tmp_path / 'from-env'} (1 run there)"


def test_the_saved_checklist_does_not_depend_on_the_report_being_displayed(
    ip: Any, own_runs: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checklist is kept on the run before anything is shown: a run whose report could not
    be displayed saves the checklist a displayed one saves (the one its run reads now)."""
    from traceml_jupyter.kernel.code_facts import checklist_for

    for source in (SETUP, MODEL, TRAIN):
        assert cell(ip, source).error_in_exec is None
    saved = {}
    for shown in (True, False):
        if not shown:
            monkeypatch.setattr("IPython.display.display", lambda *a, **k: None)
        path = tmp_path / f"shown_{shown}.json"
        result = cell(ip, f"%%traceml --no-live --save {path}\ntrain()\n")
        assert result.error_in_exec is None, result.out.stderr
        run = traceml_jupyter.last()
        assert run is not None
        assert bool(result.out.outputs) is shown  # the report was displayed, or not
        saved[shown] = json.loads(path.read_text())
        assert saved[shown]["checklist"] == checklist_for(run) == list(run.result.reading.checklist or [])
    assert saved[True]["checklist"] and [i["key"] for i in saved[True]["checklist"]] == [
        i["key"] for i in saved[False]["checklist"]
    ]
