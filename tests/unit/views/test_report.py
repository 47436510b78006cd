"""The report's pieces on values, read from the HTML as a user reads it: a run traced from code,
GPU utilisation from NVML samples, a GPU-clock run's facts and copy, the heat bars on CUDA. The
report of a traced cell: tests/integration/shell/test_report_of_a_traced_cell.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from report_page import Page

import traceml_jupyter
from traceml_jupyter.result import Gpu
from traceml_jupyter.run import Run
from traceml_jupyter.views.report import report_html
from traceml_jupyter.views.report_code import line_bars
from traceml_jupyter.views.report_evidence import gpu_utilisation


def test_a_run_traced_from_code_has_no_cell_pane() -> None:
    with traceml_jupyter.trace("from code", show=False) as run:
        for _ in run.loop([1, 2, 3, 4]):
            pass
    page = Page(report_html(run))
    assert "No cell source" in page.one("tml-code-pane").text
    # No DataLoader: the checklist speaks of what fed the steps (a list), not of loader settings.
    assert "tml-item-data_source" in {c for e in page.by_class("tml-item") for c in e.classes}
    assert run.summary["data_source_type"] == "list"


def test_gpu_utilisation_from_nvml_samples_or_why_not() -> None:
    samples = {
        "time_s": np.array([0.1, 0.2, 0.3]),
        "gpu_util_pct": np.array([40.0, 90.0, 60.0]),
        "gpu_mem_used_mib": np.array([1024.0, 2048.0, 1536.0]),
    }
    def result(**gpu: Any) -> Any:
        return SimpleNamespace(gpu=Gpu(**gpu))

    assert gpu_utilisation(result(samples=samples)) == "median 60 %, max 90 %, memory up to 2.0 GiB (3 samples, NVML)"
    assert gpu_utilisation(result(note="no NVML")) == "n/a (no NVML)"
    assert gpu_utilisation(result(note="GPU n/a (no NVML)")) == "n/a (no NVML)"
    assert gpu_utilisation(result(used=False)) == "n/a (no GPU used)"


def test_a_gpu_clock_run_reports_gpu_compute_utilisation_and_the_blocking_copy() -> None:
    run = Run("gpu")
    rec = run.recording
    t = rec.recorder.origin_ns or 0
    for k in range(40):  # 2 ms host wait, 8 ms host body; on the GPU 3 ms starved, 7 ms busy
        rec.recorder.add(t, t + 2_000_000, t + 10_000_000)
        rec.recorder.add_gpu(k, 3.0, 7.0)
        t += 10_000_000
    rec.gpu_used = True
    rec.cell_source = "%%traceml\nfor x, y in loader:\n    x = x.to('cuda')\n    model(x).sum().backward()\n"
    rec.loop_line, rec.loop_where = 2, "this cell"
    rec.loader_info = {"num_workers": 2, "pin_memory": False, "dataset_type": "Images", "dataset_module": "mydata"}
    rec.gpu_samples = {  # as the resource watch leaves them, before the run finishes
        "time_s": np.linspace(0.0, 0.4, 5),
        "gpu_util_pct": np.array([50.0, 60.0, 70.0, 80.0, 90.0]),
        "gpu_mem_used_mib": np.full(5, 4096.0),
    }
    run.finish()
    assert run.clock == "gpu"
    page = Page(report_html(run))
    assert page.by_class("tml-number")[1].text.startswith("GPU compute 7.00 ms")
    facts = page.one("tml-facts").text
    assert "GPU (CUDA events)" in facts
    assert "median 70 %, max 90 %, memory up to 4.0 GiB (5 samples, NVML)" in facts
    copy = page.one("tml-item-non_blocking")
    assert "tml-fix" in copy.classes and "x.to('cuda') → non_blocking=True line 3" in copy.text
    assert "tml-fix" in page.one("tml-item-pin_memory").classes
    assert "tml-change" in page.line(3).classes


def test_heat_bars_on_cuda_are_gpu_time_with_the_host_time_under_them() -> None:
    costs = {
        "statements": [
            {"line": 3, "end_line": 3, "text": "a", "ms_per_step": 0.5, "gpu_ms_per_step": 4.0},
            {"line": 4, "end_line": 6, "text": "b", "ms_per_step": 2.0, "gpu_ms_per_step": 1.0},
            {"line": 9, "end_line": 9, "text": "c", "ms_per_step": None, "gpu_ms_per_step": None},
        ],
        "gpu_ms_per_step": {3: 4.0, 4: 1.0, 9: None},
        "loop_line": 2,
        "fetch_ms_per_step": 8.0,
    }
    bars = line_bars(costs, 8)
    assert sorted(bars) == [2, 3, 4, 5, 6]  # line 9 is past the cell's end
    assert (bars[2].width, bars[2].label) == (1.0, "8.00 ms")  # data wait sets the scale
    assert (bars[3].width, bars[3].host_width, bars[3].label) == (0.5, 0.0625, "4.00 ms")
    assert (bars[4].width, bars[4].host_width) == (0.125, 0.25)
    assert bars[6].label == "" and not bars[6].first and bars[6].width == bars[4].width
    assert "GPU 4.00 ms, host 0.50 ms per step" in bars[3].title
    assert line_bars(None, 8) == {} and line_bars({"statements": []}, 8) == {}
