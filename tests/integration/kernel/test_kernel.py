"""A traced notebook run in a real kernel (nbclient): the live chart streams, its state is saved
with the notebook, the HTML report lands in the outputs, and an error stops the run after it."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import nbformat
import numpy as np
import pytest
from jupyter_harness import (
    BATCHES_PER_EPOCH,
    KERNEL_NAME,
    WIDGET_VIEW,
    ensure_python3_kernel,
    loader_cell,
    message_arrays,
    model_arrays,
    notebook,
    traced_cell,
    widget_models,
)

nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.kernel

EPOCHS = 2
N_STEPS = EPOCHS * BATCHES_PER_EPOCH
SLEEP_MS = 4.0  # per sample, 8 samples a batch: >= 32 ms of data wait a step, >= 2 s in all
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# The cell after the traced one: what the kernel recorded, to place each chart update in the run.
RUN_FACTS = """\
import json, traceml_jupyter
run = traceml_jupyter.last()
cols = run.steps
print(json.dumps({"n_steps": run.n_steps, "verdict": run.verdict,
                  "started_at": run.started_at,
                  "data_wait_ms": cols["data_wait_ms"].tolist(),
                  "compute_ms": cols["compute_ms"].tolist(),
                  "step_end_s": (cols["time_s"] + cols["step_ms"] / 1000.0).tolist()}))"""


class RecordingClient(nbclient.NotebookClient):  # type: ignore[misc,name-defined]
    """Keeps every iopub message of the run, in arrival order, with the index of its cell."""

    def __init__(self, nb: nbformat.NotebookNode, **kw: Any) -> None:
        super().__init__(nb, **kw)
        self.messages: list[tuple[int, dict[str, Any]]] = []

    def process_message(
        self, msg: dict[str, Any], cell: nbformat.NotebookNode, cell_index: int
    ) -> Any:
        self.messages.append((cell_index, msg))
        return super().process_message(msg, cell, cell_index)


def execute(nb: nbformat.NotebookNode) -> RecordingClient:
    client = RecordingClient(nb, timeout=120, startup_timeout=60, kernel_name=KERNEL_NAME)
    client.execute()
    return client


def sent_at(msg: dict[str, Any]) -> float:
    date = msg["header"]["date"]
    if isinstance(date, str):
        date = datetime.fromisoformat(date.replace("Z", "+00:00"))
    return float(date.timestamp())


def plain(text: str) -> str:
    return ANSI.sub("", text)


def bqplot_marks(messages: list[dict[str, Any]]) -> dict[str, str]:
    """comm id -> model name of every bqplot mark (lines, bars, ...) opened during the run."""
    marks = {}
    for msg in messages:
        if msg["msg_type"] != "comm_open":
            continue
        state = msg["content"]["data"].get("state", {})
        if state.get("_model_module") == "bqplot" and state.get("_view_name") in {
            "Lines",
            "Bars",
            "FlexLine",
            "Scatter",
        }:
            marks[msg["content"]["comm_id"]] = state["_model_name"]
    return marks


@pytest.fixture(scope="module")
def traced_run() -> tuple[nbformat.NotebookNode, RecordingClient, dict[str, Any]]:
    ensure_python3_kernel()
    nb = notebook(
        "%load_ext traceml_jupyter",
        loader_cell(SLEEP_MS),
        traced_cell(EPOCHS),
        RUN_FACTS,
    )
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TRACEML_LIVE", raising=False)  # the kernel detects its front-end itself
        client = execute(nb)
    facts = json.loads(nb.cells[3].outputs[0]["text"])
    return nb, client, facts


def test_the_traced_cell_shows_the_live_widget_and_leaves_the_html_report(
    traced_run: tuple[nbformat.NotebookNode, RecordingClient, dict[str, Any]],
) -> None:
    nb, _, facts = traced_run
    assert facts["n_steps"] == N_STEPS
    assert facts["verdict"] == "INPUT-BOUND"
    outputs = nb.cells[2].outputs
    assert not [o for o in outputs if o["output_type"] == "error"]
    reports = [
        o
        for o in outputs
        if "text/plain" in o.get("data", {}) and "traceml:" in o["data"]["text/plain"]
    ]
    assert reports, f"no report among the outputs: {outputs}"
    report = reports[-1]["data"]
    assert "INPUT-BOUND" in report["text/plain"]
    assert f"{N_STEPS} steps" in report["text/plain"]
    # the static HTML report, next to the text box
    html = report.get("text/html", "")
    assert "INPUT-BOUND" in html, "the report has no text/html with the verdict"
    assert "num_workers" in html, "the report's checklist does not mention num_workers"
    # the live chart: a widget view, before the report
    views = [i for i, o in enumerate(outputs) if WIDGET_VIEW in o.get("data", {})]
    assert views, "no widget view among the traced cell's outputs"
    assert views[0] < outputs.index(reports[-1])
    view_id = outputs[views[0]]["data"][WIDGET_VIEW]["model_id"]
    assert view_id in widget_models(nb), "the widget view's model is not in the saved state"


def test_the_saved_widget_state_holds_every_step(
    traced_run: tuple[nbformat.NotebookNode, RecordingClient, dict[str, Any]],
) -> None:
    nb, _, facts = traced_run
    models = widget_models(nb)
    marks = [
        m
        for m in models.values()
        if m["model_module"] == "bqplot" and m["state"].get("_view_name") in {"Lines", "Bars"}
    ]
    names = [m["model_name"] for m in models.values()]
    assert marks, f"no bqplot Lines/Bars in the saved widget state: {names}"
    wait, compute = np.asarray(facts["data_wait_ms"]), np.asarray(facts["compute_ms"])
    for mark in marks:
        # Both the recent-steps chart (300) and the overview (128 bins) still hold every step
        # of a 64-step run: stacked rows, data wait then compute (the window splits compute
        # into forward, backward, optimizer and the rest), equal to the run's columns.
        arrays = model_arrays(mark)
        assert arrays["x"].shape == (N_STEPS,), {k: a.shape for k, a in arrays.items()}
        assert arrays["y"].shape in ((2, N_STEPS), (5, N_STEPS)), {k: a.shape for k, a in arrays.items()}
        np.testing.assert_allclose(arrays["x"], np.arange(1, N_STEPS + 1))
        np.testing.assert_allclose(arrays["y"][0], wait, rtol=1e-6)
        np.testing.assert_allclose(arrays["y"][1:].sum(axis=0), compute, rtol=1e-5)
    headers = [
        m["state"].get("value", "") for m in models.values() if m["model_name"] == "HTMLModel"
    ]
    assert any(f"done: {N_STEPS} steps" in h and "INPUT-BOUND" in h for h in headers), headers


def test_chart_updates_stream_while_the_loop_runs(
    traced_run: tuple[nbformat.NotebookNode, RecordingClient, dict[str, Any]],
) -> None:
    _, client, facts = traced_run
    messages = [m for i, m in client.messages if i == 2]
    marks = list(bqplot_marks(messages))
    assert marks, "no bqplot mark was opened by the traced cell"
    chart = marks[0]  # the chart of the recent steps (the overview strip is created after it)
    updates = [
        m
        for m in messages
        if m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == chart
        and m["content"]["data"].get("method") == "update"
        and m["content"]["data"].get("buffer_paths")
    ]
    assert len(updates) >= 3, f"only {len(updates)} chart updates for {N_STEPS} steps"
    # The chart grows: successive updates carry more steps.
    lengths = []
    for msg in updates:
        ys = [a for k, a in message_arrays(msg).items() if k.split(".")[0] in {"x", "y"}]
        if ys:
            lengths.append(max(a.shape[-1] for a in ys))
    assert lengths == sorted(lengths) and len(set(lengths)) >= 3, lengths
    # Sent while the loop ran: place each update among the steps the kernel recorded.
    ends = facts["started_at"] + np.asarray(facts["step_end_s"])
    done = [int(np.searchsorted(ends, sent_at(m))) for m in updates]
    mid_run = [d for d in done if 0 < d < N_STEPS]
    assert len(mid_run) >= 2, f"steps done when each update was sent: {done}"
    # The header counts the steps as they happen: "step k / 64".
    headers = {
        m["content"]["comm_id"]
        for m in messages
        if m["msg_type"] == "comm_open"
        and m["content"]["data"].get("state", {}).get("_model_name") == "HTMLModel"
    }
    texts = [
        str(m["content"]["data"].get("state", {}).get("value", ""))
        for m in messages
        if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] in headers
    ]
    counted = [int(n) for t in texts for n in re.findall(rf"step (\d+) / {N_STEPS}\b", t)]
    assert len(set(counted)) >= 2 and counted == sorted(counted), counted


def test_an_error_in_the_traced_cell_stops_the_notebook_after_the_report() -> None:
    ensure_python3_kernel()
    broken = """\
%%traceml --name broken
for step, (x, y) in enumerate(loader):
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    if step == 5:
        raise ValueError("bad batch at step 5")
    opt.step()"""
    nb = notebook("%load_ext traceml_jupyter", loader_cell(1.0), broken, "print('after')")
    with pytest.raises(nbclient.exceptions.CellExecutionError) as info:
        execute(nb)
    message = plain(str(info.value))
    assert "ValueError: bad batch at step 5" in message
    assert re.search(r"Cell In\[\d+\], line 6", message), message
    assert 'raise ValueError("bad batch at step 5")' in message
    assert not nb.cells[3].get("outputs"), "the cell after the error ran"
    outputs = nb.cells[2].outputs
    kinds = [o["output_type"] for o in outputs]
    assert kinds[-1] == "error"
    error = outputs[-1]
    traceback = plain("\n".join(error["traceback"]))
    assert re.search(r"----> 6\s+raise ValueError", traceback), traceback
    reports = [
        i
        for i, o in enumerate(outputs)
        if "traceml: broken" in o.get("data", {}).get("text/plain", "")
    ]
    assert reports and reports[0] < len(outputs) - 1, f"no report before the error: {kinds}"
    report = outputs[reports[0]]["data"]
    assert "Stopped by: ValueError: bad batch at step 5" in report["text/plain"]
    assert "bad batch at step 5" in report.get("text/html", ""), "no HTML report after the error"
