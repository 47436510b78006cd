"""The compile watch on a real torch.compile (the eager backend: Dynamo alone): "compiling" is
true exactly while torch's own compile callbacks say a compile is open, the intervals it keeps
are the callbacks' (one per compile, torch's frames inside them), and the live header says
"compiling…" while it is true. Nothing is registered once the watch has finished."""

from __future__ import annotations

import time
from typing import Any

import pytest

from traceml_jupyter.capture.compiled.compile_record import CompileWatch, first_line
from traceml_jupyter.views import live_header

torch = pytest.importorskip("torch")


@pytest.mark.slow  # torch and Dynamo loaded, two compiles
def test_compiling_is_true_between_torchs_compile_start_and_end() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    seen: list[bool] = []
    origin = time.perf_counter_ns()
    watch = CompileWatch(origin, changed=lambda: seen.append(watch.compiling))
    watch.start()
    f = torch.compile(lambda x: (x * 2).sum(), backend="eager")
    try:
        f(torch.ones(4))
        f(torch.ones(4))  # compiled already: no compile
        f(torch.ones(3, 2))  # another rank: compiled again
    finally:
        watch.stop()
    record = watch.record()
    handler = torch._dynamo.callback.callback_handler
    assert watch._started not in handler.start_callbacks and watch._ended not in handler.end_callbacks
    assert seen == [True, False, True, False]  # two compiles, each opened then closed
    assert record is not None and len(record["spans"]) == 2
    assert [f["id"] for f in record["frames"]] == ["0/0", "0/1"]
    for (a, b), frame in zip(record["spans"], record["frames"], strict=True):
        assert frame["start_s"] is not None and frame["seconds"] is not None
        slack = max(0.05, 0.1 * (b - a))  # torch's record ends a little after its end callback
        assert a - slack <= frame["start_s"] and frame["start_s"] + frame["seconds"] <= b + slack
    assert record["frames"][1]["recompile_reason"] is not None


def test_the_live_header_says_compiling_while_dynamo_works() -> None:
    numbers: Any = {
        "name": "run 1", "step": 0, "total": 100, "pass": None, "steps_per_s": None, "samples_per_s": None,
        "eta_s": None, "verdict": "WARMUP", "severity": "info", "share": "", "finished": False,
        "elapsed_s": None, "error": None, "compiling": True,
    }  # fmt: skip
    assert "| step 0 / 100 | compiling… (torch.compile) |" in live_header.header_text(numbers, "")
    numbers["compiling"] = False
    assert "compiling" not in live_header.header_text(numbers, "")


def test_the_live_numbers_read_the_watch_of_the_recording_while_it_records() -> None:
    from types import SimpleNamespace

    import numpy as np

    watch = CompileWatch(0)
    run = SimpleNamespace(name="run 1", finished=False, n_steps=0, batch_size=None, error=None, gpu_used=False,
                          warmup=None, compile_watch=watch)  # fmt: skip
    tail = {k: np.empty(0) for k in ("step", "time_s", "data_wait_ms", "compute_ms", "step_ms")}
    assert live_header.live_numbers(run, tail, 100, None)["compiling"] is False  # type: ignore[arg-type]
    watch._started(None)  # torch's start callback
    assert live_header.live_numbers(run, tail, 100, None)["compiling"] is True  # type: ignore[arg-type]
    watch._ended(None)
    assert live_header.live_numbers(run, tail, 100, None)["compiling"] is False  # type: ignore[arg-type]
    assert len(watch.spans) == 1


def test_a_reason_is_one_line_with_torchs_explanation() -> None:
    reason = "Failed to trace builtin operator\n  Explanation: Dynamo does not know `print`.\n  Hint: avoid it."
    assert first_line(reason) == "Failed to trace builtin operator: Dynamo does not know `print`."
