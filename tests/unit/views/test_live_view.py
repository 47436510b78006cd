"""The live view's pieces on values: a refresh reads only its window however long the run, GPU
figures reach the header, passes, header wording, durations, shares, the overview and the SVG
fallback. The live view of a traced cell (its comm messages, the fallbacks):
tests/integration/shell/test_live_view_of_a_cell.py."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import numpy as np
import pytest

from traceml_jupyter.views import live, live_header, live_svg, loop_passes

# -- bounded work and the pure pieces --------------------------------------------------------


class FakeChart(live.HtmlChart):
    def __init__(self) -> None:
        super().__init__("fake")
        self.windows: list[int] = []

    def draw_window(self, step: np.ndarray, wait: np.ndarray, compute: np.ndarray, parts: Any = None) -> None:
        self.windows.append(len(step))


def test_a_refresh_reads_only_the_window_however_long_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from traceml_jupyter import kernel_state
    from traceml_jupyter.run import Run

    handle = Run("long")
    run = handle.recording
    run.recorder.origin_ns = (run.recorder.origin_ns or 0) - 60 * 10**9  # a minute-long run
    try:
        origin = run.recorder.origin_ns
        for i in range(200_000):
            t = origin + i * 100_000
            run.recorder.add(t, t + 10_000, t + 100_000)

        def whole_history() -> Any:
            raise AssertionError("the live view read the whole history")

        monkeypatch.setattr(run.recorder, "columns", whole_history)
        chart = FakeChart()
        view = live.LiveView(run, chart)
        view.refresh(run)  # the first refresh draws the header
        view.refresh(run)  # the second the bars
        assert chart.windows == [live_svg.WINDOW]
        assert "step 200,000" in chart._header
        assert view.overview.count.sum() == 200_000
    finally:
        kernel_state.RUNS.remove(handle)


def test_gpu_figures_sampled_by_the_capture_reach_the_header_and_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from traceml_jupyter import kernel_state
    from traceml_jupyter.capture.resources import nvml
    from traceml_jupyter.capture.resources.watch import ResourceWatch
    from traceml_jupyter.run import Run

    fake = types.ModuleType("pynvml")
    fake.nvmlInit = fake.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByPciBusId = lambda bus: "gpu"  # type: ignore[attr-defined]
    fake.nvmlDeviceGetName = lambda h: "NVIDIA Fake"  # type: ignore[attr-defined]
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=93)  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 * 2**30, total=80 * 2**30)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml, "cuda_available", lambda: True)
    monkeypatch.setattr(nvml, "cuda_device_of_loop", lambda device=None: ("pci", "0000:17:00.0", None))
    handle = Run("gpu")
    run = handle.recording
    run.cuda_device = 0  # what the capture decides once the loop allocated on the GPU
    run.recorder.origin_ns = (run.recorder.origin_ns or 0) - 60 * 10**9  # a minute-long run
    # The capture owns the sampling (the view only reads): its resource watch, by hand here.
    watch = ResourceWatch(run, types.SimpleNamespace(memory=None, on_workers=None))
    run.resource_watch = watch
    try:
        chart = FakeChart()
        view = live.LiveView(run, chart)
        origin = run.recorder.origin_ns or 0
        for i in range(10):
            t = origin + i * 1_000_000
            run.recorder.add(t, t + 100_000, t + 1_000_000)
        watch.tick(run)  # the run's tick starts NVML once the loop's GPU is known
        assert watch.gpu.running
        for _ in range(500):  # the first sample is taken as the thread starts
            if len(watch.gpu.samples):
                break
            threading.Event().wait(0.01)
        view.refresh(run)
        assert "GPU 93 % | mem 3.0 / 80 GiB" in chart._header
        run.resource_watch = None
        watch.stop()  # what the capture does as the cell ends
        assert not watch.gpu.running
        handle.finish()
        view.refresh(run)
        assert "GPU 93 % on average" in chart._header
        gpu = handle.result.gpu
        assert gpu.samples is not None and len(gpu.samples["gpu_util_pct"]) >= 1
        assert gpu.note is None
        assert gpu.device == "NVIDIA Fake, 0000:17:00.0, 81920 MiB"
        view.close()
    finally:
        kernel_state.RUNS.remove(handle)


def test_passes_are_read_off_the_loops_around_the_step_loop() -> None:
    cell = "%%traceml\nfor epoch in range(1, EPOCHS + 1):\n    for x in loader:\n        pass\n"
    loops = loop_passes.loops_around(cell, 3)
    assert loop_passes.passes_of(loops, {"EPOCHS": 3}) == 3
    assert loop_passes.passes_of(loops, {}) is None
    assert loop_passes.passes_of(loop_passes.loops_around(cell, 2), {}) == 1
    nested = "%%traceml\nfor a in tqdm(range(2)):\n    for b in range(3):\n        for x in dl:\n            pass\n"
    assert loop_passes.passes_of(loop_passes.loops_around(nested, 4), {}) == 6
    looped = "%%traceml\nwhile True:\n    for x in loader:\n        break\n    break\n"
    assert loop_passes.loops_around(looped, 3) is None
    in_def = "%%traceml\ndef train():\n    for x in loader:\n        pass\ntrain()\n"
    assert loop_passes.loops_around(in_def, 3) is None
    assert loop_passes.loops_around("%%traceml\n!ls\nfor x in y:\n  pass\n", 3) is None


def test_header_wording() -> None:
    numbers: dict[str, Any] = {
        "name": "run 1",
        "step": 1234,
        "total": 2000,
        "pass": None,
        "steps_per_s": 812.4,
        "samples_per_s": 25996.8,
        "eta_s": 0.94,
        "verdict": "INPUT-BOUND",
        "severity": "critical",
        "share": live_header.verdict_share("INPUT-BOUND", {"data_wait_share": 0.94}),
        "finished": False,
        "elapsed_s": None,
        "error": None,
    }
    text = live_header.header_text(numbers, "GPU n/a (no NVML)")
    assert text == (
        "traceml run 1 | step 1,234 / 2,000 | 812 steps/s | 25,997 samples/s | ETA 0.9 s | "
        "INPUT-BOUND: data wait 94 % of step | GPU n/a (no NVML)"
    )
    html = live_header.header_html(numbers, "GPU n/a (no NVML)")
    assert '<b style="color:#c0392b">INPUT-BOUND</b>' in html
    assert (
        html.index("data wait 94 %")
        < html.index("GPU n/a")
        < html.index("&#9632;</span> data wait")
    )
    numbers.update(total=None, pass_info=None, **{"pass": (234, 1000, 2)})
    assert "step 1,234 (pass 2: 234 / 1,000)" in live_header.header_text(numbers, "")
    numbers.update(finished=True, elapsed_s=75.0)
    assert "done: 1,234 steps in 1 min 15 s" in live_header.header_text(numbers, "")
    assert "ETA" not in live_header.header_text(numbers, "")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.04, "<0.1 s"),
        (0.94, "0.9 s"),
        (12.4, "12 s"),
        (185, "3 min 05 s"),
        (3725, "1 h 02 min"),
        (None, "?"),
    ],
)
def test_durations(seconds: float | None, text: str) -> None:
    assert live_header.format_duration(seconds) == text


def test_verdict_shares() -> None:
    summary = {"data_wait_share": 0.3, "compute_share": 0.7, "straggler_share": 0.15}
    assert live_header.verdict_share("COMPUTE-BOUND", summary) == "compute 70 % of step"
    assert live_header.verdict_share("MIXED", summary) == "data wait 30 %, compute 70 % of step"
    assert live_header.verdict_share("INPUT STRAGGLER", summary) == "stalls cost 15 % of the time"
    assert live_header.verdict_share("WARMUP", summary) == "warming up"


def test_the_overview_bins_the_whole_run() -> None:
    overview = live_svg.Overview(bins=16)
    step = np.arange(1000)
    overview.add(step[:600], np.full(600, 1.0), np.full(600, 3.0))
    overview.add(step[600:], np.full(400, 2.0), np.full(400, 3.0))
    centre, wait, compute = overview.means()
    assert overview.width == 64
    assert overview.count.sum() == 1000
    assert np.all(np.diff(centre) > 0) and centre[-1] <= 1000 + overview.width
    assert wait[0] == 1.0 and wait[-1] == 2.0 and np.all(compute == 3.0)


def test_the_gpu_clock_is_used_for_steps_whose_timings_resolved() -> None:
    tail = {
        "step": np.arange(4),
        "step_ms": np.full(4, 2.0),
        "step_gpu_ms": np.array([1.0, 1.0, 1.0, np.nan]),
    }
    cols, on_gpu = live_header.clock_columns(tail, gpu_used=True)
    assert on_gpu and cols["step"].tolist() == [0, 1, 2]
    cols, on_gpu = live_header.clock_columns(tail, gpu_used=False)
    assert not on_gpu and len(cols["step"]) == 4


def test_the_html_fallback_chart_is_a_small_svg() -> None:
    svg = live_svg.svg_chart(np.array([1.0, 2.0, 0.5]), np.array([3.0, 3.0, 3.0]))
    assert svg.startswith("<svg") and svg.count("<polygon") == 2 and "nan" not in svg
    assert live_svg.svg_chart(np.array([1.0]), np.array([1.0])) == ""


# -- the lanes inside the DataLoader (docs/loader-inside.md#live-lanes) ----------------------
def _run_with_lanes(tmp_path: Any, records: int) -> Any:
    """A minute-long run of 100 steps whose watch inside the loader has `records` batches of
    worker 0 and of worker 1 written (the records the test writes itself)."""
    from traceml_jupyter.capture.loader.lanes import LiveLanes
    from traceml_jupyter.capture.loader.worker_side import RECORD
    from traceml_jupyter.run import Run

    handle = Run("lanes")
    run = handle.recording
    run.recorder.origin_ns = (run.recorder.origin_ns or 0) - 60 * 10**9
    origin = run.recorder.origin_ns
    for i in range(100):
        t = origin + i * 1_000_000
        run.recorder.add(t, t + 100_000, t + 1_000_000)
    for worker in (0, 1):
        with open(tmp_path / f"w{worker}-{100 + worker}.bin", "wb") as f:
            for k in range(records):
                f.write(RECORD.pack(0, 100 + worker, worker, 0, k, k, k * 10**6, k * 10**6 + 500_000, k * 10**6 + 900_000, 1, 1, 1, *([-1, 0] * 4)))
    run.loader_lanes = LiveLanes(types.SimpleNamespace(directory=str(tmp_path), receptions=[], began_ns=0))
    return handle


def test_the_html_fallback_never_reads_the_lanes(tmp_path: Any) -> None:
    from traceml_jupyter import kernel_state

    handle = _run_with_lanes(tmp_path, 5)
    run = handle.recording
    try:
        chart = FakeChart()
        view = live.LiveView(run, chart)
        for _ in range(8):
            view.refresh(run)
        assert run.loader_lanes.reads == 0 and "Inside the DataLoader" not in chart._header
    finally:
        kernel_state.RUNS.remove(handle)


def test_the_widget_chart_gets_lanes_only_when_workers_wrote(tmp_path: Any) -> None:
    pytest.importorskip("bqplot")
    from traceml_jupyter import kernel_state
    from traceml_jupyter.views.live_lanes import bars_per_lane

    for records in (0, 5):  # no worker wrote (num_workers=0 writes nothing), then 5 batches each
        (tmp_path / str(records)).mkdir()
        handle = _run_with_lanes(tmp_path / str(records), records)
        run = handle.recording
        try:
            chart = live.WidgetChart(run.name)
            view = live.LiveView(run, chart)
            for _ in range(8):  # a whole rotation
                view.refresh(run)
            if records == 0:
                assert chart.lanes is None and len(chart.box.children) == 3
                assert "Inside the DataLoader" not in chart.header.value
                assert "tml-inside-lanes" not in chart.picture("text").body
            else:
                assert chart.lanes is not None and chart.box.children[-1] is chart.lanes.figure
                assert bars_per_lane(np.asarray(chart.lanes.lines.y)) == {0: 5, 1: 5}
                assert "worker 0: 5 batches, 0.9 ms a batch" in chart.header.value
                # released to a static picture (an older run's chart), the lanes stay, as the report draws them
                lanes = chart.picture("text").body.split('<svg class="tml-inside-lanes"')[1]
                assert lanes.count(">worker ") == 2 and lanes.count("<rect") == 2 * 5 * 2  # __getitem__ and collate_fn bars
            for widget in live.widgets_under(chart.box):
                widget.close()
        finally:
            kernel_state.RUNS.remove(handle)
