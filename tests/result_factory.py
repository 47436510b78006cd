"""Finished runs' results made from values, no cell run: steps written into a recording as the
capture writes them, then frozen (`Run.finish`). The renderer and codec tests take these: CANNED
names one result for each branch a renderer has (each verdict, no step, an error, the GPU clock,
ranks, passes kept out of the steps, cost per line, resource findings, the kernel's checklist)."""

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
    rec = run.recording
    t = rec.recorder.origin_ns or 0
    for k, (wait, compute) in enumerate(zip(wait_ms, compute_ms, strict=True)):
        fetched = t + int(wait * 1e6)
        end = fetched + int(compute * 1e6)
        rec.recorder.add(t, fetched, end)
        if gpu_ms is not None:
            rec.recorder.add_gpu(k, *gpu_ms[k])
        t = end
    if gpu_ms is not None:
        rec.loop_on_gpu(0)
    notes = recorded.pop("notes", [])
    for key, value in recorded.items():
        assert hasattr(rec, key), f"the recording has no {key}"
        setattr(rec, key, value)
    rec.notes.extend(notes)
    rec.wall_ms = (t - (rec.recorder.origin_ns or 0)) / 1e6
    return run.finish().result


def _training(**more: Any) -> dict[str, Any]:
    return {"cell_source": LOOP_CELL, "loop_line": 2, "loop_where": "this cell", "loader_info": dict(LOADER),
            "step_kind": "optimizer", "step_definition": "one optimizer step", **more}  # fmt: skip


# The cost per line of a loop whose first body line sleeps 5 ms (as line_costs.py measures it).
LINES_CELL = (
    "%%traceml\nfor x, y in loader:\n    time.sleep(0.005)\n    loss = model(x).sum()\n"
    "    if loss > 0:\n        continue\n    opt.step()\n"
)
LINE_COSTS = {
    "statements": [
        {"line": 3, "end_line": 3, "text": "time.sleep(0.005)", "ms_per_step": 5.0, "share": 0.6, "runs": 40, "gpu_ms_per_step": None},
        {"line": 4, "end_line": 4, "text": "loss = model(x).sum()", "ms_per_step": 2.0, "share": 0.25, "runs": 40, "gpu_ms_per_step": None},
        {"line": 5, "end_line": 6, "text": "if loss > 0:", "ms_per_step": 0.5, "share": 0.06, "runs": 40, "gpu_ms_per_step": None},
        {"line": 7, "end_line": 7, "text": "opt.step()", "ms_per_step": 1.0, "share": 0.12, "runs": 0, "gpu_ms_per_step": None},
    ],
    "ms_per_step": {3: 5.0, 4: 2.0, 5: 0.5, 7: 1.0},
    "gpu_ms_per_step": None, "timed_steps": 36, "warmup_steps": 4, "step_ms": 8.2, "loop_line": 2,
    "fetch_ms_per_step": 0.2, "clock": "wall clock", "sampling": "every step for the first 16, then one in 16",
    "gpu_sampled_steps": 0,
}  # fmt: skip
# Validation passes kept out of the steps: 45 % of the cell, mostly waiting for their loader.
VALIDATION = {"kind": "validation", "label": "`val_loader`", "time_ms": 900.0, "share_of_cell": 0.45, "wait_share": 0.8,
              "passes": 2, "batches": 20, "num_workers": 0, "source_kind": "dataloader"}  # fmt: skip
# CUDA ran out of memory in step 8, as gpu_memory.oom_facts() describes it.
OOM = {"step": 8, "completed_steps": 8, "device": 0, "requested_mib": 2048.0, "capacity_mib": 16384.0, "free_mib": 512.0}
# What the kernel read at the run's end: two checklist items and the earlier cell one of them quotes.
CHECKLIST = [
    {"key": "num_workers", "title": "DataLoader workers", "status": "fix", "seen": "0", "to_try": "4", "line": 2,
     "cell": "In [3]", "where": "In [3], line 2", "reason": "the steps wait for batches made one at a time",
     "bears_on_verdict": True},
    {"key": "pin_memory", "title": "Pinned memory", "status": "ok", "seen": "False", "to_try": None, "line": None,
     "cell": None, "where": None, "reason": "Not applicable: the loop runs on the CPU", "bears_on_verdict": False},
]  # fmt: skip
# torch.compile (capture/compiled/compile_record.py): the first step compiled 1.9 s of its 2 s, a
# graph break at the cell's line 4 (a print), the last batch (7 samples) compiled again for 0.26 s.
COMPILED_CELL = "%%traceml\nfor x, y in loader:\n    loss = model(x).sum()\n    print(loss)\n    loss.backward()\n    opt.step()\n"


def frame(id: str, function: str, start_s: float, seconds: float, **more: Any) -> dict[str, Any]:
    """One frame compiled, as the capture reads it off torch's compilation metrics."""
    return {"id": id, "function": function, "filename": "<cell>", "line": 2, "start_s": start_s, "seconds": seconds,
            "recompile_reason": None, "break_reasons": [], "failed": None, **more}  # fmt: skip


COMPILED = {
    "torch": "2.13.0",
    "spans": [[0.05, 1.95], [2.42, 2.68]],
    "frames": [
        frame("0/0", "forward", 0.05, 1.5, break_reasons=["Failed to trace builtin operator: Dynamo does not know how to trace builtin operator `print`"]),
        frame("1/0", "torch_dynamo_resume_in_forward_at_4", 1.56, 0.39, line=4),
        frame("0/1", "forward", 2.42, 0.2, recompile_reason="0/0: tensor 'x' size mismatch at index 0. expected 32, actual 7"),
    ],
    "graph_breaks": 2,
    "graph_break_reasons": {"Failed to trace builtin operator: Dynamo does not know how to trace builtin operator `print`": 2},
    "recompile_limit": 8,
}  # fmt: skip
QUOTED = {"In [3]": "n_batches = 40\nloader = DataLoader(SlowSamples(), batch_size=32)"}


CANNED: dict[str, Callable[[], RunResult]] = {
    "input-bound": lambda: result_of("slow", [30.0] * 40, [10.0] * 40, **_training()),
    "compute-bound": lambda: result_of("fast", [0.2] * 40, [10.0] * 40, **_training()),
    "spiky": lambda: result_of("spiky", [200.0 if k in (9, 26) else 0.2 for k in range(40)], [10.0] * 40, **_training()),
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
    "validation kept out": lambda: result_of("validated", [0.2] * 40, [10.0] * 40, phases=[VALIDATION], **_training()),
    "cost per line": lambda: result_of(
        "lines", [0.2] * 40, [8.0] * 40, **_training(cell_source=LINES_CELL, line_costs=LINE_COSTS)
    ),
    "out of memory": lambda: result_of(
        "oom", [1.0] * 8, [20.0] * 8, oom=OOM, error="OutOfMemoryError: CUDA out of memory.", **_training()
    ),
    "compiled": lambda: result_of(
        "compiled", [0.2] * 40, [2000.0] + [10.0] * 38 + [300.0],
        **_training(cell_source=COMPILED_CELL, cell_filename="<cell>", compiled=COMPILED),
    ),
    "checklist read": lambda: result_of("slow", [30.0] * 40, [10.0] * 40, **_training()).with_reading(
        CHECKLIST, QUOTED
    ),
}
