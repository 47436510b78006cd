"""The GPU variant: host cost of recording and querying CUDA events (CudaClock), then the
overhead and accuracy benchmarks with `--device cuda`. One command on a GPU machine:

    .venv/bin/python tests/benchmarks/bench_gpu.py [--repeats 5] [--no-traceml-ai]

Without CUDA it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import Table, num, show  # noqa: E402

STEPS = 20_000


def cuda_ready() -> str | None:
    """None when a CUDA device can be used, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, torch.version.cuda={torch.version.cuda})"
    return None


def per_call_us(fn: Any, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def event_costs() -> Table:
    """Host µs of one event record/query/elapsed_time, and of CudaClock per step."""
    import torch

    from traceml_jupyter.cuda_clock import CudaClock
    from traceml_jupyter.recorder import Recorder

    x = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    ev = torch.cuda.Event(enable_timing=True)
    other = torch.cuda.Event(enable_timing=True)
    record_us = per_call_us(ev.record, STEPS)
    torch.cuda.synchronize()
    query_us = per_call_us(ev.query, STEPS)
    other.record()
    other.synchronize()
    elapsed_us = per_call_us(lambda: ev.elapsed_time(other), STEPS)

    sync_ms: list[float] = []

    def loop(with_clock: bool) -> float:
        clock = CudaClock(Recorder()) if with_clock else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a = clock.mark() if clock else None
        for _ in range(STEPS):
            b = clock.mark() if clock else None
            x.add_(1.0)  # a tiny kernel per step, as a real body queues work
            if clock:
                c = clock.mark()
                clock.step(a, b, c)
                a = c
        host = time.perf_counter() - t0
        if clock:
            t1 = time.perf_counter()
            clock.synchronize()
            sync_ms.append((time.perf_counter() - t1) * 1e3)
        torch.cuda.synchronize()
        return host

    loop(True)  # warm-up: event pool, kernels
    plain = min(loop(False) for _ in range(3))
    timed = min(loop(True) for _ in range(3))
    per_step = (timed - plain) / STEPS * 1e6
    return Table(
        f"CUDA events: host cost ({torch.cuda.get_device_name(0)})",
        ["what", "host µs"],
        [
            ["torch.cuda.Event.record()", num(record_us, 2)],
            ["torch.cuda.Event.query()", num(query_us, 2)],
            ["torch.cuda.Event.elapsed_time()", num(elapsed_us, 2)],
            ["CudaClock per step (2 mark() + step(), events pooled and polled)", num(per_step, 2)],
            ["CudaClock.synchronize() at the end of a run", num(min(sync_ms), 3) + " ms"],
        ],
        [f"{STEPS:,} steps, each queueing one tiny kernel; per step = the fastest of 3 loops with "
         "the clock minus the fastest of 3 without."],
    )


def measure(repeats: int = 5, with_traceml_ai: bool = True, allow_install: bool = True) -> list[Table]:
    why = cuda_ready()
    if why:
        return [Table("GPU (CUDA) benchmarks", [], notes=[
            f"skipped: {why}. On a CUDA machine: `.venv/bin/python tests/benchmarks/bench_gpu.py` "
            "(or run_all.py, which includes it)."
        ])]
    import bench_accuracy
    import bench_overhead

    tables = [event_costs()]
    tables += bench_overhead.measure(repeats, "cuda", with_traceml_ai, allow_install)
    tables += bench_accuracy.measure("cuda", with_traceml_ai, allow_install)
    return tables


def main(argv: list[str] | None = None) -> list[Table]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-traceml-ai", action="store_true")
    parser.add_argument("--no-install", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    tables = measure(args.repeats, not args.no_traceml_ai, not args.no_install)
    show(tables)
    return tables


if __name__ == "__main__":
    main()
