"""The report a notebook user sees when a traced cell ends, read from the displayed HTML: the
cells run through %%traceml in the session's shell (a loader on line 3, loaders and loops of earlier
cells, the checklist from the history, line costs, a stand-in GPU's copies and syncs)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_gpu import FakeGpu
from helpers import gpu_fixture, shell_fixture
from IPython.utils.capture import capture_output
from report_page import Element, Page, assert_cost_bars, heat_of

import traceml_jupyter
from traceml_jupyter.analysis.checklist import default_start_method, evaluate, suggested_workers
from traceml_jupyter.analysis.number_text import ms_fine
from traceml_jupyter.capture.resources.host import usable_cpus
from traceml_jupyter.kernel.code_facts import checklist_for, facts_for
from traceml_jupyter.run import Run
from traceml_jupyter.views.report import ROOT_CLASS, report_html

# pin_memory=True on this CPU-only machine is the point of one test; torch warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")


SETUP = '''
import time, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class SlowSamples(Dataset):
    """Every sample takes 3 ms to make, as if decoded from a file."""
    def __init__(self, n=64):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        time.sleep(0.003)
        return torch.randn(8), torch.randn(1)

model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.MSELoss()
'''


# The example: num_workers=0 seen on line 3 (the %%traceml line is line 1).
SLOW_CELL = """%%traceml --no-live --name slow
import torch
loader = DataLoader(SlowSamples(), batch_size=4, num_workers=0, pin_memory=True)
for x, y in loader:
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
"""


shell = shell_fixture(SETUP, store_history=True, scope="module")


def run_cell(ip: Any, cell: str) -> tuple[Run, Page, Any]:
    """Run a cell as the notebook does and return the run and the report it displayed."""
    before = traceml_jupyter.last()
    with capture_output() as captured:
        result = ip.run_cell(cell, store_history=True)
    run = traceml_jupyter.last()
    assert run is not None and run is not before
    html = [o.data["text/html"] for o in captured.outputs if "text/html" in o.data]
    assert len(html) == 1, captured.stdout + captured.stderr
    return run, Page(html[0]), result


def next_cell_number(ip: Any) -> int:
    """The `In [n]` number the next stored cell gets."""
    return len(ip.history_manager.input_hist_raw)


def test_report_of_a_loader_with_num_workers_0_on_line_3(shell: Any) -> None:
    run, page, result = run_cell(shell, SLOW_CELL)
    assert result.error_in_exec is None
    assert run.verdict == "INPUT-BOUND"

    banner = page.one("tml-verdict")
    assert "Step Time: INPUT-BOUND" in banner.text
    assert run.verdict_detail.why in banner.text and run.verdict_detail.next in banner.text
    numbers = [e.text for e in page.by_class("tml-number")]
    s = run.summary
    # The tiles lead with the means over every step: they add up, and steps x step = the loop.
    assert numbers[0].startswith(f"Data wait {ms_fine(s['mean_data_wait_ms'])} mean, ")
    assert numbers[1].startswith(f"CPU compute {ms_fine(s['mean_compute_ms'])} mean, ")
    assert numbers[2].startswith(f"Step time {ms_fine(s['mean_step_ms'])} mean")
    assert s["mean_data_wait_ms"] + s["mean_compute_ms"] == pytest.approx(s["mean_step_ms"])
    assert s["n_steps"] * s["mean_step_ms"] == pytest.approx(s["loop_ms"])
    evidence = page.one("tml-evidence").text
    p90 = ms_fine(s["stats"]["data_wait_ms"]["p90"])
    assert f"Data wait {ms_fine(s['data_wait_ms'])} {p90}" in evidence

    assert "tml-dataloader" in page.line(3).classes
    assert "tml-loop" in page.line(4).classes
    assert "tml-change" in page.line(3).classes
    assert "loader = DataLoader(SlowSamples(), batch_size=4" in page.line(3).text
    assert [e for e in page.by_class("tml-loop")] == [page.line(4)]

    item = page.one("tml-item-num_workers")
    assert "tml-fix" in item.classes
    assert "tml-folded" not in item.ancestors
    assert f"0 → {suggested_workers(usable_cpus())}" in item.text
    assert page.by_class("tml-where")  # the line chips
    assert "line 3" in [e.text for e in page.by_class("tml-where") if e in _inside(page, item)]

    as_json = {i["key"]: i for i in checklist_for(run)}
    assert as_json["num_workers"]["status"] == "fix"
    assert (as_json["num_workers"]["seen"], as_json["num_workers"]["line"]) == ("0", 3)
    per_sample = as_json["per_sample_cost"]
    assert (per_sample["status"], per_sample["seen"]) == ("check", "time.sleep()")
    assert per_sample["cell"] is not None and per_sample["cell"].startswith("In [")
    json.dumps(as_json)


def _inside(page: Page, parent: Element) -> list[Element]:
    start = page.elements.index(parent)
    return [e for e in page.elements[start + 1 :] if e.ancestors >= parent.classes]


@pytest.mark.slow
def test_pin_memory_on_a_cpu_only_run_is_ok_and_folded(shell: Any) -> None:
    run, page, _ = run_cell(shell, SLOW_CELL)
    assert run.clock == "cpu"
    item = page.one("tml-item-pin_memory")
    assert "tml-ok" in item.classes
    assert "tml-folded" in item.ancestors
    assert "Not applicable" in item.text
    assert "tml-ok" in page.one("tml-item-non_blocking").classes


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Got pickle error:UserWarning")
def test_a_notebook_dataset_with_spawned_workers_gets_the_start_method_fix(shell: Any) -> None:
    cell = """%%traceml --no-live
class CellData(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.zeros(2)
loader = DataLoader(CellData(), batch_size=2, num_workers=2, multiprocessing_context="spawn")
for x in loader:
    opt.step()
"""
    with capture_output() as captured:
        result = shell.run_cell(cell, store_history=True)
    run = traceml_jupyter.last()
    assert run is not None and result.error_in_exec is not None  # workers cannot load __main__.CellData
    # No step ran: one line, with the exception and the fix, and no report.
    lines = [line for line in captured.stdout.splitlines() if line.startswith("traceml:")]
    assert len(lines) == 1 and "no step ran" in lines[0] and "PicklingError" in lines[0]
    assert "move CellData into a .py module" in lines[0]
    assert not [o for o in captured.outputs if "text/html" in o.data]
    page = Page(report_html(run))  # the report is still there for those who ask (run.save, HTML)
    assert "Stopped by:" in page.one("tml-error").text
    item = page.one("tml-item-start_method")
    assert "tml-fix" in item.classes
    assert "tml-folded" not in item.ancestors
    assert "move CellData into a .py module" in item.text
    by_key = {i["key"]: i for i in checklist_for(run)}
    assert (by_key["start_method"]["line"], by_key["start_method"]["cell"]) == (2, None)
    assert by_key["start_method"]["seen"] == "spawn; CellData defined in a notebook cell"


def test_python_314_forkserver_default_with_a_notebook_dataset(shell: Any) -> None:
    run, _, _ = run_cell(shell, SLOW_CELL)
    forkserver = default_start_method((3, 14), "linux")
    items = {i.key: i for i in evaluate(facts_for(run, shell, start_method=forkserver))}
    assert items["num_workers"].status == "fix"
    fix = items["start_method"]
    assert (fix.status, fix.seen) == ("fix", "forkserver; SlowSamples defined in a notebook cell")
    assert fix.site is not None and fix.site.cell is not None  # the setup cell
    html = report_html(run, checklist=list(items.values()))
    assert "move SlowSamples into a .py module and import it" in html


def test_a_loader_built_in_an_earlier_cell_is_found_with_its_cell(shell: Any) -> None:
    built_in = next_cell_number(shell)
    shell.run_cell("n_batches = 4\nloader = DataLoader(SlowSamples(16), batch_size=4)", store_history=True)
    shell.run_cell("val_loader = DataLoader(SlowSamples(8), batch_size=8)", store_history=True)
    cell = """%%traceml --no-live
for x, y in loader:
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
"""
    run, page, _ = run_cell(shell, cell)
    by_key = {i["key"]: i for i in checklist_for(run)}
    assert by_key["num_workers"]["where"] == f"In [{built_in}], line 2"
    assert not page.by_class("tml-dataloader")  # not in this cell
    elsewhere = [e.text for e in page.by_class("tml-elsewhere")]
    assert any(
        f"DataLoader in In [{built_in}], line 2" in text and "loader = DataLoader(SlowSamples(16)" in text
        for text in elsewhere
    ), elsewhere
    assert f"In [{built_in}], line 2" in page.one("tml-item-num_workers").text


@pytest.mark.slow
def test_a_loop_in_a_function_of_an_earlier_cell_is_named(shell: Any) -> None:
    defined_in = next_cell_number(shell)
    shell.run_cell(
        "def train(data):\n    for x, y in data:\n        loss_fn(model(x), y).backward()\n",
        store_history=True,
    )
    cell = "%%traceml --no-live\nloader = DataLoader(SlowSamples(16), batch_size=4)\ntrain(loader)\n"
    run, page, _ = run_cell(shell, cell)
    assert run.result.loop.where is not None and run.result.loop.where.startswith("function train")
    # The loop's own cell is shown first, its loop line marked and its lines timed ...
    (loop_line,) = page.by_class("tml-loop")
    assert "for x, y in data:" in loop_line.text and "tml-loop-cell" in loop_line.ancestors
    assert "The step loop: function train" in page.one("tml-code-pane").text
    assert [r["line"] for r in run.result.line_costs["statements"]] == [3]
    # ... then the traced cell, where the loader is built.
    built = [e for e in page.by_class("tml-dataloader") if "tml-loop-cell" not in e.ancestors]
    assert len(built) == 1 and "DataLoader(SlowSamples(16)" in built[0].text
    text = page.one("tml-code-pane").text
    assert "The step loop is in function train" in text
    assert f"step loop in In [{defined_in}], line 2" in text


def test_cell_text_is_escaped(shell: Any) -> None:
    cell = """%%traceml --no-live
label = "<script>alert('x')</script>"
for x, y in DataLoader(SlowSamples(8), batch_size=2):
    loss_fn(model(x), y).backward()
"""
    run, page, _ = run_cell(shell, cell)
    html = report_html(run)
    assert "<script" not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "label = \"<script>alert('x')</script>\"" in page.line(2).text


@pytest.mark.slow
def test_unmeasured_values_show_n_a_never_zero(shell: Any) -> None:
    cell = "%%traceml --no-live\nfor x in DataLoader(SlowSamples(0)):\n    x.sum().backward()\n"
    with capture_output():
        shell.run_cell(cell, store_history=True)
    run = traceml_jupyter.last()
    assert run is not None and run.verdict == "NO DATA"
    page = Page(report_html(run))
    for tile in page.by_class("tml-number"):
        assert "n/a" in tile.text and "0.0" not in tile.text
    assert "n/a" in page.one("tml-evidence").text
    assert "0.0" not in page.one("tml-evidence").text


def test_the_report_is_self_contained_and_scoped(shell: Any) -> None:
    run, page, _ = run_cell(shell, SLOW_CELL)
    html = report_html(run)
    assert html.startswith(f'<div class="{ROOT_CLASS}"')
    for banned in ("<script", "<style", "<link", "src=", "href=", "@import", "url("):
        assert banned not in html
    text = page.one("tml-text")
    assert text.tag == "details"
    assert "Step Time: INPUT-BOUND" in text.text
    assert "tml-folded" in {c for e in page.elements if e.tag == "details" for c in e.classes}


def test_a_checklist_that_cannot_be_read_never_costs_the_report(
    shell: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import traceml_jupyter.kernel.cells as cells

    def broken(_: Any) -> list[str]:
        raise RuntimeError("history unavailable")

    monkeypatch.setattr(cells, "history_cells", broken)
    run, page, result = run_cell(shell, SLOW_CELL)
    assert result.error_in_exec is None
    assert "Step Time: INPUT-BOUND" in page.one("tml-verdict").text
    assert "The checklist could not be evaluated: RuntimeError: history unavailable" in (
        page.one("tml-notes").text
    )
    assert "tml-line" in page.line(3).classes


# -- cost per line beside the code, copies to the GPU, host-bound loops ------------------------
LINES_CELL = """%%traceml --no-live --name lines
for i, x in enumerate(batches):
    time.sleep(0.005)
    y = x @ x
    if i % 2:
        continue
    time.sleep(0.001)
"""


@pytest.mark.slow
def test_a_cpu_report_shows_ms_per_step_beside_the_body_lines(shell: Any) -> None:
    shell.run_cell("batches = [torch.ones(8, 8) for _ in range(24)]")
    run, page, result = run_cell(shell, LINES_CELL)
    assert result.error_in_exec is None and run.clock == "cpu"
    costs = run.result.line_costs
    assert sorted(r["line"] for r in costs["statements"]) == [3, 4, 5, 7]
    assert_cost_bars(page, costs)  # line 3 (the 5 ms sleep) dearest; `if i % 2: continue` on 5-6


def test_lines_off_shows_no_heat_bars(shell: Any) -> None:
    shell.run_cell("batches = [torch.ones(8, 8) for _ in range(24)]")
    run, page, _ = run_cell(shell, LINES_CELL.replace("--name lines", "--lines off"))
    assert run.result.line_costs is None
    assert not page.by_class("tml-heat") and not page.by_class("tml-heat-note")
    assert "time.sleep(0.005)" in page.line(3).text and "ms per step" not in page.one("tml-code-pane").text


# Traced cells take the CUDA path on a stand-in GPU (tests/fake_gpu.py).
gpu = gpu_fixture(
    "import time\n"
    "from fake_gpu import FakeTensor\n"
    "pageable = [FakeTensor(20_000_000) for _ in range(30)]\n"
    "small = [FakeTensor(400_000, pinned=True) for _ in range(30)]\n"
)


def facts_table(page: Page) -> dict[str, str]:
    cells = [e for e in page.elements if e.tag == "td" and "tml-facts" in e.ancestors]
    return {k.text: v.text for k, v in zip(cells[::2], cells[1::2], strict=True)}


@pytest.mark.slow
def test_an_h2d_bound_report_shows_the_copy_and_points_at_its_line(ip: Any, gpu: FakeGpu) -> None:
    run, page, result = run_cell(
        ip,
        """%%traceml --no-live --name pageable
for x in pageable:
    y = x.work(1.0)
    x = x.to("cuda")
    y = x.work(1.0)
""",
    )
    assert result.error_in_exec is None and run.clock == "gpu"
    assert run.verdict == "H2D-BOUND"
    banner = page.one("tml-verdict")
    assert "Step Time: H2D-BOUND" in banner.text and f"tml-{run.severity}" in banner.classes
    facts = facts_table(page)
    copy = facts["Copy, line 4"]
    assert copy.startswith("20.0 MB/step in ") and " GB/s; pinned: no; non_blocking: no" in copy
    assert "Copy lines" not in facts  # each copying line has its own row
    assert "on line 4 synchronises every step" in facts["Sync stall"]  # the blocking copy

    item = page.one("tml-item-h2d_copies")
    assert "tml-fix" in item.classes and "tml-folded" not in item.ancestors
    assert "pageable, blocking → pinned + non_blocking=True line 4" in item.text
    assert "tml-fix" in page.one("tml-item-non_blocking").classes
    for key in ("batch_size", "launch_overhead"):  # they bear on HOST-BOUND only: folded
        assert "tml-folded" in page.one(f"tml-item-{key}").ancestors
    assert "tml-change" in page.line(4).classes

    gpu_ms = {r["line"]: r["gpu_ms_per_step"] for r in run.result.line_costs["statements"]}
    width, label, host = heat_of(page, 4)
    assert label == ms_fine(gpu_ms[4]) and width is not None and host is not None
    assert max(gpu_ms, key=lambda line: gpu_ms[line]) == 4  # the copy is the costliest line
    assert "GPU ms per step" in page.one("tml-code-pane").text


@pytest.mark.slow
def test_a_host_bound_report_names_the_sync_line_and_the_host_fixes(ip: Any, gpu: FakeGpu) -> None:
    run, page, result = run_cell(
        ip,
        """%%traceml --no-live --name starved
for x in small:
    xg = x.to("cuda", non_blocking=True)
    time.sleep(0.003)  # Python between tiny kernels
    y = xg.work(0.05)
    print(f"{y.item():.2f}", end="")
""",
    )
    assert result.error_in_exec is None and run.clock == "gpu"
    assert (run.verdict, run.severity) == ("HOST-BOUND", "warn")
    banner = page.one("tml-verdict")
    assert "Step Time: HOST-BOUND" in banner.text and "tml-warn" in banner.classes
    assert "y.item() on line 6 synchronises every step" in banner.text
    assert "`" not in banner.text  # the quoted call shows as code
    facts = facts_table(page)
    assert facts["Sync stall"].startswith("y.item() on line 6 synchronises every step: the host waits")
    assert "pinned: yes; non_blocking: yes" in facts["Copy, line 3"]

    for key in ("batch_size", "launch_overhead", "sync"):
        item = page.one(f"tml-item-{key}")
        assert "tml-fix" in item.classes and "tml-folded" not in item.ancestors, key
    sync = page.one("tml-item-sync").text
    assert "y.item() every step" in sync and "every N steps, or out of the step line 6" in sync
    assert "Move it out of the step or do it every N steps" in sync
    launch = page.one("tml-item-launch_overhead").text
    assert "line 4" in launch and "Line 4 takes the most host time" in launch  # the sleep
    for advice in ("torch.compile", "CUDA graphs", "torch.autocast"):
        assert advice in launch
    copies = page.one("tml-item-h2d_copies")
    assert "tml-ok" in copies.classes and "tml-folded" in copies.ancestors
    assert {"tml-change"} <= page.line(6).classes and {"tml-change"} <= page.line(4).classes
