"""The GPU variant: host cost of CUDA events and of the GPU clock per step, of the copy and sync
hooks (finding 16 of the GPU review), then the overhead and accuracy benchmarks with
`--device cuda`. One command on a GPU machine:

    .venv/bin/python tests/benchmarks/bench_gpu.py [--repeats 5] [--no-traceml-ai]

The hooks' pass-through cost (a `.to(dtype)`, a `bool()` of a CPU tensor, with the patches in
place) is measured on any machine; without CUDA the rest is one line saying so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import Table, num, show  # noqa: E402

STEPS = 20_000


def cuda_ready() -> str | None:
    """None when a CUDA device can be used, else why not (never asks the driver on a build
    without CUDA)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.backends.cuda.is_built() or not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, torch.version.cuda={torch.version.cuda})"
    return None


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def best_us(fn: Callable[[], Any], n: int, repeats: int = 5) -> float:
    return min(per_call_us(fn, n) for _ in range(repeats))


def hook_costs(device: str = "cpu") -> Table:
    """Host µs a call adds when torch.Tensor's `.to`, `.cuda` and sync methods are patched by
    the copy and sync watches, for calls that pass through (a dtype conversion, `bool()` of a
    CPU tensor), and on a GPU for a timed copy (a batch dict of 20 tensors) and a timed .item()."""
    import torch

    from traceml_jupyter.capture.gpu.h2d import CopyWatch, EventPool, copies_timed
    from traceml_jupyter.capture.gpu.syncs import SyncWatch, syncs_timed

    on_gpu = device == "cuda"
    steps = [0]
    make: Callable[[], Any] = (lambda: torch.cuda.Event(enable_timing=True)) if on_gpu else (lambda: None)
    watch = CopyWatch(lambda: steps[0], EventPool(make), "<bench>", torch.cuda.current_stream if on_gpu else None)
    syncs = SyncWatch(lambda: steps[0], "<bench>")
    t = torch.ones(16, device=device)
    small = torch.ones(16)
    batch = {f"t{i}": torch.ones(256).pin_memory() if on_gpu else torch.ones(256) for i in range(20)}
    n = 20_000

    def to_dtype() -> Any:
        return t.to(torch.float16)

    def truth() -> Any:
        return bool(small[0])

    def dict_to() -> Any:
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    def item() -> Any:
        return t[0].item()

    cases: list[tuple[str, Callable[[], Any], int]] = [
        ("`.to(dtype)` pass-through", to_dtype, n),
        ("`bool()` of a CPU tensor", truth, n),
    ]
    if on_gpu:
        cases += [("dict of 20 tensors `.to(dev, non_blocking=True)`, timed", dict_to, 500), ("`.item()`, timed", item, 2000)]
    rows = []
    for label, fn, calls in cases:
        fn()
        plain = best_us(fn, calls)
        with copies_timed(watch, torch.Tensor, syncs.synced, syncs.inside), syncs_timed(syncs, torch.Tensor):
            fn()
            patched = best_us(fn, calls)
        if on_gpu:
            torch.cuda.synchronize()
            watch.poll_all()
        rows.append([label, num(plain, 2), num(patched, 2), num(patched - plain, 2)])
    return Table(
        f"Copy and sync hooks: host cost a call ({device})",
        ["call", "plain µs", "with the hooks µs", "added µs"],
        rows,
        ["Each figure is the fastest of 5 runs; the hooks are in place while a traced cell runs "
         "on a GPU (none are installed for a CPU loop)."],
    )


def event_costs() -> Table:
    """Host µs of one event record/query/elapsed_time, and of the GPU clock per step."""
    import torch

    from traceml_jupyter.capture.gpu import cuda_clock
    from traceml_jupyter.capture.steps.recorder import Recorder

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
    rows = [
        ["torch.cuda.Event.record()", num(record_us, 2)],
        ["torch.cuda.Event.query()", num(query_us, 2)],
        ["torch.cuda.Event.elapsed_time()", num(elapsed_us, 2)],
    ]
    if hasattr(cuda_clock, "CudaStepClock"):
        close_ms: list[float] = []

        def loop(with_clock: bool) -> float:
            rec = Recorder()
            steps = cuda_clock.CudaStepClock(rec, 0, cuda_clock.torch_marks(0)) if with_clock else None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k in range(STEPS):
                if steps is not None:
                    steps.before_fetch(k)
                    steps.after_fetch(k)
                x.add_(1.0)  # a tiny kernel per step, as a real body queues work
                if steps is not None:
                    rec.add(0, 0, 0)
                    steps.step_closed(k, k + 1)
            host = time.perf_counter() - t0
            if steps is not None:
                t1 = time.perf_counter()
                steps.close()
                close_ms.append((time.perf_counter() - t1) * 1e3)
            torch.cuda.synchronize()
            return host

        loop(True)  # warm-up: event pool, kernels
        plain = min(loop(False) for _ in range(3))
        timed = min(loop(True) for _ in range(3))
        rows += [
            ["GPU clock per step (cuda_clock.CudaStepClock: 4 events, read when done)", num((timed - plain) / STEPS * 1e6, 2)],
            ["GPU clock close() at the end of a run", num(min(close_ms), 3) + " ms"],
        ]
    return Table(
        f"CUDA events: host cost ({torch.cuda.get_device_name(0)})",
        ["what", "host µs"],
        rows,
        [f"{STEPS:,} steps, each queueing one tiny kernel; per step = the fastest of 3 loops with "
         "the clock minus the fastest of 3 without."],
    )


def allocator_costs() -> Table:
    """GPU memory per step (capture/resources/gpu_memory.py): host µs of the two allocator calls a read
    makes, the watch's read per step with and without it, how far apart it spaces reads for
    1 ms and 10 ms steps, and that no read synchronises."""
    import torch

    from traceml_jupyter.capture.resources.gpu_memory import GpuMemory

    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    pair_us = best_us(lambda: (torch.cuda.memory_stats_as_nested_dict(0), torch.cuda.reset_peak_memory_stats(0)), 2000)
    flat_us = best_us(lambda: torch.cuda.memory_stats(0), 2000)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.cuda.memory_stats_as_nested_dict(0)
        torch.cuda.reset_peak_memory_stats(0)
        syncs = "none (sync debug mode \"error\" raised nothing)"
    except RuntimeError as exc:
        syncs = f"**a sync**: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    rows = [
        ["memory_stats_as_nested_dict() + reset_peak_memory_stats() (one read)", num(pair_us, 2)],
        ["memory_stats() (flattened; what memory_allocated() calls)", num(flat_us, 2)],
        ["synchronisations", syncs],
    ]
    for step_ms in (1.0, 10.0):
        watch = GpuMemory()
        watch.loop_started(0)
        t, n = 0, 2000
        t0 = time.perf_counter()
        for k in range(n):
            t += int(step_ms * 1e6)
            x.add_(1.0)
            watch.step_ended(k, t)
        per_step = (time.perf_counter() - t0) / n * 1e6
        rows.append([f"the watch per step at {step_ms:g} ms steps (a read every {watch.read_every})", num(per_step, 2)])
    del x
    return Table(
        f"GPU memory per step: host cost ({torch.cuda.get_device_name(0)})",
        ["what", "host µs"],
        rows,
        ["Reads are spaced so that they take at most 1 % of the steps' time (READ_BUDGET); each "
         "read's peak covers the steps since the previous read. The per-step figure includes a "
         "tiny kernel a step."],
    )


def measure(repeats: int = 5, with_traceml_ai: bool = True, allow_install: bool = True) -> list[Table]:
    why = cuda_ready()
    if why:
        return [
            hook_costs("cpu"),
            Table("GPU (CUDA) benchmarks", [], notes=[
                f"skipped: {why}. On a CUDA machine: `.venv/bin/python tests/benchmarks/bench_gpu.py` "
                "(or run_all.py, which includes it); scripts/gpu_check.py --all checks the GPU path."
            ]),
        ]
    import bench_accuracy
    import bench_overhead

    tables = [event_costs(), allocator_costs(), hook_costs("cuda")]
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
