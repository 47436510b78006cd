"""Finished runs' results made from values, no cell run: steps written into a recording as the
capture writes them, then frozen (`Run.finish`). The renderer and codec tests take these."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from traceml_jupyter import kernel_state
from traceml_jupyter.result import RunResult
from traceml_jupyter.run import Run

LOOP_CELL = "%%traceml\nfor x, y in loader:\n    loss = model(x).sum()\n    loss.backward()\n    opt.step()\n"
LOADER = {"num_workers": 0, "pin_memory": False, "persistent_workers": False, "batch_size": 32, "len": 40}


def result_of(
    name: str,
    wait_ms: Sequence[float],
    compute_ms: Sequence[float],
    *,
    gpu_ms: Sequence[tuple[float, float]] | None = None,
    warmup: int | None = None,
    **recorded: Any,
) -> RunResult:
    """The result of a run whose steps waited `wait_ms` and computed `compute_ms` (CPU clock;
    with `gpu_ms`, (wait, compute) on the GPU clock too), with `recorded` set on the recording
    as the capture would (loop_line, loader_info, ranks, notes, error, ...)."""
    run = Run(name, warmup)
    kernel_state.RUNS.remove(run)  # a value, not a run of this kernel
    t = run.recorder.origin_ns or 0
    for k, (wait, compute) in enumerate(zip(wait_ms, compute_ms, strict=True)):
        fetched = t + int(wait * 1e6)
        end = fetched + int(compute * 1e6)
        run.recorder.add(t, fetched, end)
        if gpu_ms is not None:
            run.recorder.add_gpu(k, *gpu_ms[k])
        t = end
    if gpu_ms is not None:
        run.loop_on_gpu(0)
    notes = recorded.pop("notes", [])
    for key, value in recorded.items():
        setattr(run, key, value)
    run.notes.extend(notes)
    run.wall_ms = (t - (run.recorder.origin_ns or 0)) / 1e6
    return run.finish().result


def _training(**more: Any) -> dict[str, Any]:
    return {"cell_source": LOOP_CELL, "loop_line": 2, "loop_where": "this cell", "loader_info": dict(LOADER),
            "step_kind": "optimizer", "step_definition": "one optimizer step", **more}  # fmt: skip


CANNED: dict[str, Callable[[], RunResult]] = {
    "input-bound": lambda: result_of("slow", [30.0] * 40, [10.0] * 40, **_training()),
    "compute-bound": lambda: result_of("fast", [0.2] * 40, [10.0] * 40, **_training()),
    "spiky": lambda: result_of("spiky", [0.2 if k % 10 else 200.0 for k in range(40)], [10.0] * 40, **_training()),
    "no steps": lambda: result_of("empty", [], [], notes=["No step ended."]),
    "stopped by an error": lambda: result_of(
        "broken", [1.0] * 6, [5.0] * 6, error="ValueError: corrupt sample 7", **_training()
    ),
    "gpu clock": lambda: result_of(
        "gpu", [2.0] * 30, [8.0] * 30, gpu_ms=[(3.0, 7.0)] * 30, gpu_note=None, gpu_device="Stand-in GPU", **_training()
    ),
    "two ranks": lambda: result_of(
        "ranks",
        [1.0] * 30,
        [10.0] * 30,
        ranks=[
            {"rank": 0, "n_analysed": 27, "step_ms": 11.0, "data_wait_ms": 1.0, "compute_ms": 10.0},
            {"rank": 1, "n_analysed": 27, "step_ms": 16.0, "data_wait_ms": 6.0, "compute_ms": 10.0},
        ],
    ),
}
