"""The live view of a traced cell, run through %%traceml with a recording comm: throttled refreshes,
the final refresh, the fallbacks (no bqplot, no widgets, a terminal, Colab), an error or no step,
--no-live."""

from __future__ import annotations

import re
import sys
import threading
import types
from typing import Any

import numpy as np
import pytest
from IPython.utils.capture import capture_output

from traceml_jupyter.views import environment, live, live_svg
from traceml_jupyter.views.live import WIDGET_VIEW

Message = tuple[str, str, dict[str, Any], list[Any]]


# 1.6 s: long enough for chart updates while it runs (the first comes about a second in)
SLOW_LOOP = """
import time
data = list(range(160))
for epoch in range(2):
    for x in data:
        time.sleep(0.005)
"""


class Recording:
    """Every comm message the widgets publish, with the model behind each comm."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.models: dict[str, str] = {}

    def record(self, comm_id: str, msg_type: str, data: Any, buffers: Any) -> None:
        data = data or {}
        if msg_type == "comm_open":
            self.models[comm_id] = data.get("state", {}).get("_model_name", "?")
        self.messages.append((comm_id, msg_type, data, list(buffers or [])))

    def updates(self, model: str) -> list[Message]:
        return [m for m in self.messages if m[1] == "comm_msg" and self.models.get(m[0]) == model]

    def comm_ids(self, model: str) -> list[str]:
        return [cid for cid, name in self.models.items() if name == model]


def array(message: Message, key: str) -> np.ndarray:
    """A bqplot array trait of an update message, rebuilt from its binary buffer."""
    _, _, data, buffers = message
    spec = data["state"][key]
    index = data["buffer_paths"].index([key, "value"])
    return np.frombuffer(buffers[index], dtype=spec["dtype"]).reshape(spec["shape"])


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Recording:
    """Widgets get a comm that records what it would send to the front-end.

    ipywidgets 8 and 7.8 both create comms through `comm.create_comm` (the comm package).
    """
    import comm

    rec = Recording()

    class RecordingComm(comm.DummyComm):
        def publish_msg(
            self,
            msg_type: str,
            data: Any = None,
            metadata: Any = None,
            buffers: Any = None,
            **keys: Any,
        ) -> None:
            rec.record(self.comm_id, msg_type, data, buffers)

    monkeypatch.setattr(comm, "create_comm", lambda *a, **k: RecordingComm(*a, **k))
    return rec


@pytest.fixture
def views(monkeypatch: pytest.MonkeyPatch) -> list[live.LiveView]:
    """The views the traced cells start."""
    started: list[live.LiveView] = []
    real_start = live.start

    def start(run: Any, show: bool = True) -> Any:
        view = real_start(run, show)
        if view is not None:
            started.append(view)
        return view

    monkeypatch.setattr(live, "start", start)
    return started


@pytest.fixture
def widget_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test shell opts in to the widget front-end (it has none of its own)."""
    monkeypatch.setenv(environment.LIVE_ENV, "widget")


def traceml(ip: Any, cell: str, line: str = "") -> Any:
    # IPython drops a cell's leading blank lines before the loop is located; strip them here
    # so run.loop_line and run.cell_source agree (see the report to the lead).
    return ip.run_cell(f"%%traceml {line}\n{cell.lstrip(chr(10))}")


def no_traceml_thread() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("traceml") and t.is_alive()]


# -- the widget view ------------------------------------------------------------------------
@pytest.mark.slow
def test_refreshes_are_throttled_and_each_is_one_batched_update_per_widget(
    ip: Any, recording: Recording, views: list[live.LiveView], widget_mode: None
) -> None:
    with capture_output():
        result = traceml(ip, SLOW_LOOP)
    assert result.error_in_exec is None
    (view,) = views
    run = view.run
    seconds = run.recorder.totals()["step_ms"] / 1e3
    assert run.n_steps == 320
    # The hook refreshes at the first step, then at most every 250 ms, then once at the end.
    assert 2 <= view.refreshes <= 4 * seconds + 2
    headers = recording.updates("HTMLModel")
    bars = recording.updates("BarsModel")
    assert len(headers) <= view.refreshes
    (main_bars, overview_bars) = recording.comm_ids("BarsModel")
    window = [m for m in bars if m[0] == main_bars]
    assert 1 <= len(window) <= view.refreshes
    # x and y of a refresh travel together, in one message
    assert all(set(m[2]["state"]) == {"x", "y"} for m in bars)
    # nothing else is updated after creation: scales fit the data in the browser
    updated = {recording.models[m[0]] for m in recording.messages if m[1] == "comm_msg"}
    assert updated <= {"HTMLModel", "BarsModel"}
    # one message per refresh, the final one redraws all three widgets: 4 a second of run,
    # the final three included
    assert len(headers) + len(bars) <= view.refreshes + 2
    assert run.ended_at is not None
    wall = run.ended_at - run.started_at
    assert len(headers) + len(bars) <= live.MESSAGES_PER_S * wall + 1
    assert no_traceml_thread()


@pytest.mark.slow
def test_the_final_refresh_carries_the_last_step(
    ip: Any, recording: Recording, views: list[live.LiveView], widget_mode: None
) -> None:
    with capture_output():
        traceml(ip, SLOW_LOOP)
    (view,) = views
    n = view.run.n_steps
    assert view.final_done and view.closed
    last_header = recording.updates("HTMLModel")[-1][2]["state"]["value"]
    assert f"done: {n} steps" in last_header
    assert "COMPUTE-BOUND" in last_header
    main_bars = recording.comm_ids("BarsModel")[0]
    last_window = [m for m in recording.updates("BarsModel") if m[0] == main_bars][-1]
    x, y = array(last_window, "x"), array(last_window, "y")
    assert x[-1] == n and len(x) == min(n, live_svg.WINDOW)
    assert y.shape == (len(live_svg.WINDOW_ROWS), len(x))  # data wait, forward, backward, optimizer, the rest
    assert np.all(y[1:].sum(axis=0) >= 4.0)  # compute: the 5 ms sleep of each step
    overview = [m for m in recording.updates("BarsModel") if m[0] != main_bars][-1]
    centre = array(overview, "x")
    assert centre[0] < centre[-1] <= n + 1


@pytest.mark.slow
def test_the_chart_is_displayed_with_a_text_fallback_and_left_in_place(
    ip: Any, recording: Recording, views: list[live.LiveView], widget_mode: None
) -> None:
    with capture_output() as cap:
        traceml(ip, SLOW_LOOP)
    widget_outputs = [o for o in cap.outputs if WIDGET_VIEW in o.data]
    assert len(widget_outputs) == 1
    data = widget_outputs[0].data
    (box,) = recording.comm_ids("VBoxModel")
    assert data[WIDGET_VIEW]["model_id"] == box
    assert data[WIDGET_VIEW]["version_major"] == 2
    assert "Box(" not in data["text/plain"] and "traceml" in data["text/plain"]
    # the chart stays: its widgets are not closed, so the saved notebook keeps its state
    assert not [m for m in recording.messages if m[1] == "comm_close"]
    assert views[0].chart is not None


@pytest.mark.slow
def test_the_header_says_where_the_run_is_and_what_bounds_it(
    ip: Any, recording: Recording, views: list[live.LiveView], widget_mode: None
) -> None:
    cell = """
import time, torch
from torch.utils.data import DataLoader, TensorDataset
EPOCHS = 2
loader = DataLoader(TensorDataset(torch.randn(64, 3), torch.randn(64, 1)), batch_size=8)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(EPOCHS):
    for x, y in loader:
        time.sleep(0.1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
"""
    with capture_output():
        result = traceml(ip, cell)
    assert result.error_in_exec is None
    headers = [m[2]["state"]["value"] for m in recording.updates("HTMLModel")]
    assert re.search(r"step \d+ / 16\b", headers[0])  # len(loader) x EPOCHS
    assert any("ETA" in h for h in headers[1:-1]) or len(headers) == 2
    final = headers[-1]
    assert "done: 16 steps" in final
    assert "samples/s" in final  # batch size 8 read from the batch
    assert "GPU n/a" in final or "GPU " in final


def test_an_error_in_the_cell_still_ends_the_view(
    ip: Any, recording: Recording, views: list[live.LiveView], widget_mode: None
) -> None:
    cell = """
for i in list(range(50)):
    if i == 30:
        raise ValueError("boom")
"""
    with capture_output() as cap:
        result = traceml(ip, cell)
    assert isinstance(result.error_in_exec, ValueError)
    (view,) = views
    assert view.closed
    # A run this short ends before the first chart update: it never builds widgets, and its
    # chart's final picture is the HTML one, updated in place.
    assert not recording.messages
    last_header = [o for o in cap.outputs if o.update][-1].data["text/html"]
    assert "stopped after 31 steps (ValueError: boom)" in last_header  # i = 0..30
    assert no_traceml_thread()


@pytest.mark.slow
def test_a_loop_that_runs_no_step_says_so(
    ip: Any, recording: Recording, views: list[live.LiveView], widget_mode: None
) -> None:
    with capture_output() as out:
        result = traceml(ip, "for x in []:\n    pass\n")
    assert result.error_in_exec is None
    # The chart starts with the first step: a loop without one shows none, only one line.
    assert views == [] and not recording.updates("BarsModel")
    assert "no step ran" in out.stdout


@pytest.mark.slow
def test_the_gpu_note_is_left_on_the_run_for_the_report(
    ip: Any, recording: Recording, views: list[live.LiveView], widget_mode: None
) -> None:
    import traceml_jupyter

    with capture_output():
        traceml(ip, SLOW_LOOP)
    run = traceml_jupyter.last()
    assert run is not None
    samples = run.result.gpu.samples
    assert samples is not None
    assert set(samples) == {"time_s", "gpu_util_pct", "gpu_mem_used_mib", "gpu_clock_mhz", "gpu_temp_c"}
    note = run.result.gpu.note
    if not len(samples["time_s"]):  # no GPU here: the report says why
        assert note is not None and note.startswith("GPU n/a")
        last_header = recording.updates("HTMLModel")[-1][2]["state"]["value"]
        assert note in last_header
    else:
        assert note is None


def test_colab_gets_its_widget_manager_once_before_the_first_widget(
    ip: Any,
    recording: Recording,
    views: list[live.LiveView],
    widget_mode: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []
    google = types.ModuleType("google")
    colab = types.ModuleType("google.colab")
    output = types.ModuleType("google.colab.output")
    output.enable_custom_widget_manager = lambda: seen.append(len(recording.messages))  # type: ignore[attr-defined]
    colab.output = output  # type: ignore[attr-defined]
    google.colab = colab  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    monkeypatch.setattr(environment, "_colab_widgets_enabled", False)
    with capture_output():
        traceml(ip, "for x in list(range(5)):\n    pass\n")
        traceml(ip, "for x in list(range(5)):\n    pass\n")
    assert seen == [0]  # once, before any widget was created
    assert len(views) == 2


@pytest.mark.slow
def test_without_bqplot_a_widget_kernel_gets_the_html_display(
    ip: Any,
    recording: Recording,
    views: list[live.LiveView],
    widget_mode: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "bqplot", None)  # `from bqplot import ...` fails
    with capture_output() as cap:
        result = traceml(ip, SLOW_LOOP)
    assert result.error_in_exec is None
    assert isinstance(views[0].chart, live.HtmlChart)
    assert not [m for m in recording.messages if recording.models.get(m[0]) == "BarsModel"]
    assert any(o.update for o in cap.outputs)


# -- front-ends without widgets -------------------------------------------------------------
@pytest.mark.slow
def test_a_terminal_gets_no_widget_and_no_traceback(
    ip: Any, recording: Recording, views: list[live.LiveView], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(environment.LIVE_ENV, raising=False)
    with capture_output() as cap:
        result = traceml(ip, SLOW_LOOP)
    assert result.error_in_exec is None and result.error_before_exec is None
    texts = [cap.stdout, cap.stderr] + [str(o.data) for o in cap.outputs]
    assert not any("Box(" in t or "children=" in t for t in texts)
    assert not any(WIDGET_VIEW in o.data for o in cap.outputs)
    assert not recording.messages  # no widget was even created
    assert "Traceback" not in cap.stderr
    (view,) = views  # the GPU is still sampled for the report; nothing is shown
    assert view.chart is None and view.closed
    assert no_traceml_thread()


@pytest.mark.slow
def test_a_kernel_without_widgets_gets_an_updating_html_display(
    ip: Any, recording: Recording, views: list[live.LiveView], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(environment.LIVE_ENV, "html")
    with capture_output() as cap:
        result = traceml(ip, SLOW_LOOP)
    assert result.error_in_exec is None
    assert not recording.messages
    live_outputs = [o for o in cap.outputs if "traceml-live-header" in o.data.get("text/html", "")]
    first, updates = live_outputs[0], live_outputs[1:]
    display_id = first.transient["display_id"]
    assert not first.update
    assert updates and all(o.update and o.transient["display_id"] == display_id for o in updates)
    assert len(updates) <= views[0].refreshes
    final = updates[-1].data
    assert "done: 320 steps" in final["text/html"] and "<svg" in final["text/html"]
    assert final["text/plain"].startswith("traceml ") and "done: 320 steps" in final["text/plain"]


@pytest.mark.slow
def test_no_live_shows_no_view_but_still_samples_the_gpu(
    ip: Any, recording: Recording, views: list[live.LiveView], widget_mode: None
) -> None:
    with capture_output() as out:
        traceml(ip, "for x in list(range(5)):\n    pass\n", "--no-live")
    (view,) = views
    assert view.chart is None and view.closed
    assert recording.models == {} or not recording.updates("BarsModel")
    assert not any("application/vnd.jupyter.widget-view+json" in o.data for o in out.outputs)
    assert view.run.gpu_note  # why there are no GPU figures, for the report


# -- the lanes inside the DataLoader (docs/loader-inside.md#live-lanes) ----------------------
@pytest.mark.slow
def test_a_loader_with_two_workers_gets_a_lane_each_growing_to_the_batches_each_made(
    ip: Any, recording: Recording, views: list[live.LiveView], widget_mode: None, tmp_path: Any
) -> None:
    import os
    import tempfile

    from traceml_jupyter.views.live_lanes import bars_per_lane

    # 48 batches of 4 samples of 25 ms, 2 forked workers: about 2.4 s, the chart's widgets
    # come about a second in. The dataset times its own samples in the workers (per pid), and
    # the user's worker_init_fn notes which worker each pid is.
    ip.user_ns["log"] = str(tmp_path)
    ip.run_cell(
        "from loader_cases import CountInits, Samples, loader\n"
        "data = loader(Samples(192, 25.0, log_dir=log), batch_size=4, num_workers=2, "
        "worker_init_fn=CountInits(log), multiprocessing_context='fork')"
    )
    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("traceml-loader-")}
    with capture_output():
        result = traceml(ip, "for x, y in data:\n    x.sum()\n")
    assert result.error_in_exec is None
    # the test's own count of the batches each worker made: its samples / 4, by worker id
    worker_of = {}
    for name in os.listdir(tmp_path):
        if name.startswith("init-"):
            with open(tmp_path / name) as f:
                worker_of[int(name[5:-4])] = int(f.read().split()[0])
    samples: dict[int, int] = {}
    for name in os.listdir(tmp_path):
        if name.startswith("getitem-"):
            with open(tmp_path / name) as f:
                samples[worker_of[int(name[8:-4])]] = sum(1 for line in f if line.strip())
    own = {worker: n // 4 for worker, n in samples.items()}
    assert sorted(own) == [0, 1] and sum(own.values()) == 48
    (view,) = views
    assert isinstance(view.chart, live.WidgetChart) and view.chart.lanes is not None
    (lines_id,) = recording.comm_ids("LinesModel")
    # made with its first lanes (comm_open), then redrawn (one update message each)
    drawn = [m for m in recording.messages if m[0] == lines_id and m[1] in ("comm_open", "comm_msg") and "y" in m[2].get("state", {})]
    assert drawn[0][1] == "comm_open"
    assert array(drawn[0], "y").shape[1] >= 1  # (a Lines opened with no column fails in the browser)
    final = bars_per_lane(array(drawn[-1], "y"))
    assert final == own  # a lane per worker, a bar per batch it made
    # the lanes grew as the run went: drawn while it ran, then once more at its end
    assert len(drawn) >= 2
    assert sum(bars_per_lane(array(drawn[0], "y")).values()) < sum(final.values())
    header = recording.updates("HTMLModel")[-1][2]["state"]["value"]
    assert all(f"worker {w}: {n} batches" in header for w, n in own.items())
    # after the cell: no thread of ours, the watch's directory gone, the lanes read no more
    assert no_traceml_thread()
    assert {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("traceml-loader-")} <= before
    assert view.run.loader_lanes is not None and view.run.loader_lanes.watch is None
