"""Issue 23's host cost, side by side in one process: the checks every GPU watch now makes before
touching CUDA (is a graph capture under way?), the one on the CPU path (a training event inside
a capture ends no step), and the own-time accounting per step, next to what they guard.

    .venv/bin/python tests/benchmarks/bench_graph_guards.py

On a CPU machine `notice_foreign_capture()` returns at `is_initialized()`; on a GPU it also asks
CUDA (scripts/gpu_check.py's calibration measures `is_current_stream_capturing()` itself).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import Table, num, show  # noqa: E402

N = 200_000


def ns_per_call(fn: Callable[[], Any], n: int = N, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def measure() -> list[Table]:
    import torch

    from traceml_jupyter import kernel_state
    from traceml_jupyter.capture import session as recording
    from traceml_jupyter.capture.gpu import cuda_graphs
    from traceml_jupyter.capture.steps.step_model import OPTIMIZER
    from traceml_jupyter.run import Run

    state = cuda_graphs._STATE
    empty = ns_per_call(lambda: None)
    capturing = ns_per_call(cuda_graphs.capturing) - empty
    foreign = ns_per_call(cuda_graphs.notice_foreign_capture) - empty
    guard = ns_per_call(lambda: state.active and None) - empty
    clock = ns_per_call(time.perf_counter_ns) - empty

    run = Run("bench")
    capture = recording.Capture(run.recording)
    capture.stamping.active = True  # recording, as between open() and close()
    capture.gpu.deciding = False
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    event = ns_per_call(lambda: capture.training_event(OPTIMIZER, opt), n=20_000) - empty
    kernel_state.RUNS.remove(run)

    table = Table(
        "Issue 23: the capture guards and the own-time accounting (ns a call, best of 5)",
        ["what", "ns", "where", "per step"],
    )
    table.rows = [
        ["`cuda_graphs.capturing()`", num(capturing, 0), "GPU path: each fetch mark, copy, probe, line lap", "2-4 calls"],
        ["`notice_foreign_capture()` (CUDA not initialised)", num(foreign, 0), "GPU path: each step close", "1 call"],
        ["`_CAPTURES.active` check", num(guard, 0), "CPU and GPU path: each training event", "1-2"],
        ["`perf_counter_ns()`", num(clock, 0), "GPU path: own-time accounting", "6 calls"],
        ["`Capture.training_event(OPTIMIZER)` (what the check guards)", num(event, 0), "each optimizer step", "1"],
    ]
    table.notes = [
        f"the CPU path's added check is {guard / event:.1%} of a training event's own cost",
        "measured on the shared 2-core machine; rerun idle for the published figure",
    ]
    return [table]


if __name__ == "__main__":
    show(measure())
