"""The run as its capture and its views meet it: the recording they write while it runs, its
observers (the live chart, the ranks' senders), and the result frozen when the run finishes,
after which the handle holds the result alone (the recording, and its buffers, are gone)."""

from __future__ import annotations

import dataclasses
import gc
import re
import weakref
from collections.abc import Iterator

import pytest
from helpers import REPO

from traceml_jupyter import kernel_state
from traceml_jupyter import result as render
from traceml_jupyter.analysis.rank_verdict import with_ranks
from traceml_jupyter.capture.gpu.gpu_watch import watch_summary
from traceml_jupyter.recording import REFRESH_NS, Recording
from traceml_jupyter.result import RunResult
from traceml_jupyter.run import Run


@pytest.fixture
def run() -> Iterator[Run]:
    made = Run("observed")
    yield made
    if made in kernel_state.RUNS:
        kernel_state.RUNS.remove(made)


def recorded(run: Run, steps: int) -> Run:
    rec = run.recording
    t = rec.recorder.origin_ns or 0
    for _ in range(steps):
        rec.recorder.add(t, t + 2_000_000, t + 10_000_000)
        t += 10_000_000
    return run


def test_observers_are_called_at_the_ticks_and_once_at_the_end(run: Run) -> None:
    seen: list[tuple[str, bool]] = []

    def first(r: Recording) -> None:
        seen.append(("first", r.finished))

    def second(r: Recording) -> None:
        seen.append(("second", r.finished, r.result.name))

    rec = run.recording
    run.observe(first)
    run.observe(second)
    assert rec.tick_due(0)
    rec.tick(1_000)
    assert not rec.tick_due(1_000 + REFRESH_NS - 1) and rec.tick_due(1_000 + REFRESH_NS)
    run.stop_observing(first)
    run.stop_observing(first)  # not observing any more: nothing happens
    run.finish()
    assert seen == [("first", False), ("second", False, "observed"), ("second", True, "observed")]


def test_observe_only_replaces_the_observers_and_makes_the_next_tick_due(run: Run) -> None:
    seen: list[str] = []
    rec = run.recording
    rec.observe(lambda r: seen.append("chart"))
    rec.tick(1_000)
    rec.observe_only(lambda r: seen.append("sender"))
    assert rec.tick_due(1_001)
    rec.tick(1_001)
    assert seen == ["chart", "sender"]


def test_an_observer_that_raises_is_dropped_with_a_note(run: Run) -> None:
    calls: list[int] = []

    def broken(r: Recording) -> None:
        calls.append(1)
        raise RuntimeError("front-end gone")

    run.observe(broken)
    run.recording.tick(0)
    run.recording.tick(REFRESH_NS)
    assert calls == [1]
    assert run.notes == ["The live view stopped: RuntimeError: front-end gone"]


def test_finish_freezes_the_result_that_the_renderers_read(run: Run) -> None:
    recorded(run, 30)
    live = run.summary
    assert live["n_steps"] == 30 and run.result is not run.result  # computed at each read
    run.finish()
    frozen = run.result
    assert isinstance(frozen, RunResult) and frozen is run.result
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.summary = {}  # type: ignore[misc]
    with pytest.raises(ValueError, match="read-only"):
        frozen.columns["step_ms"][0] = 0.0
    assert isinstance(frozen.notes, tuple)
    with pytest.raises(RuntimeError, match="finished"):  # nothing records into a finished run
        recorded(run, 5)
    assert run.summary == dict(frozen.summary) and frozen.summary["n_steps"] == 30
    assert run.verdict == frozen.verdict.label and len(run.steps["step_ms"]) == 30
    assert run.text() == render.text(frozen) and run.to_dict() == render.to_dict(frozen)
    assert run.to_dict()["steps"]["step_ms"] == frozen.columns["step_ms"].tolist()
    run.keep_reading([{"key": "workers"}], None)  # the kernel's reading: a new value
    assert frozen is not run.result and run.result.reading.checklist == ({"key": "workers"},)
    assert frozen.reading.checklist is None  # the value before is left as it was


def test_the_finished_run_holds_its_result_and_lets_its_recording_go(run: Run) -> None:
    recording = recorded(run, 12).recording
    recorder = weakref.ref(recording.recorder)
    del recording
    run.finish()
    gc.collect()
    assert recorder() is None  # the per-step buffers went with the recording
    assert run.finished and run.n_steps == 12 and len(run.steps["step_ms"]) == 12
    assert run.loop(range(3)) == range(3) and run.current_step() is None  # nothing to time now


def test_a_run_read_back_is_a_handle_on_its_result_alone(run: Run) -> None:
    result = recorded(run, 8).finish().result
    loaded = Run(result=result, path="x.json")
    assert loaded.finished and loaded.read_back and loaded.result is result and loaded.name == "observed"
    with pytest.raises(RuntimeError, match="finished"):
        _ = loaded.recording


def documented_summary_keys() -> set[str]:
    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split("### The summary", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {key for row in rows for key in re.findall(r"`([a-z_0-9]+)`", row)}


def produced_summary_keys(run: Run) -> set[str]:
    """Every key a run's summary can hold: a run's own, the GPU watch's, the ranks', and those
    the capture writes one by one."""
    keys = set(recorded(run, 30).finish().summary)
    site = {"line": 3, "in_cell": True, "pageable_non_blocking": True, "waited": True,
            "waited_ms_per_step": 1.0, "ms_per_step": 1.0}
    sync = {"line": 4, "in_cell": True, "call": "item", "calls_per_step": 1, "every_step": True,
            "wait_ms_per_step": 1.0, "share": 0.1}
    keys |= set(watch_summary({"sites": [site]}, {"sites": [sync], "hidden": ["x"]}))
    ranks = [{"rank": r, "n_analysed": 10, "step_ms": 10.0 + 5 * r, "data_wait_ms": 5.0 * r} for r in (0, 1)]
    keys |= set(with_ranks(run.summary, ranks)[0])
    pattern = re.compile(r'summary\["([a-z_0-9]+)"\]\s*=')
    for path in (REPO / "traceml_jupyter").rglob("*.py"):
        keys |= set(pattern.findall(path.read_text(encoding="utf-8")))
    return keys


def test_every_summary_key_is_documented(run: Run) -> None:
    produced = produced_summary_keys(run)
    assert {"data_wait_ms", "sync_top", "straggler", "host_top_line", "cuda_graphs_used"} <= produced
    missing = sorted(produced - documented_summary_keys())
    assert not missing, f"summary keys not in docs/api.md (The summary): {missing}"
