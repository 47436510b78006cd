"""The cost of watching inside the DataLoader's workers (docs/loader-inside.md), side by side.

    PYTHONPATH=. .venv/bin/python tests/benchmarks/bench_loader_inside.py [--rounds 5]

1. A worker's fetch, in this process: batches of 8 samples that cost nothing, fetched by
   torch's own fetcher with and without the timing (worker_side.py), alternated, the fastest of
   each: the microseconds added a sample, and what they are of a 2 ms sample. (Timing 2 ms
   samples themselves on a shared machine measures its load, not the watch.)
2. End to end: a traced loop over a DataLoader (2 workers, 2 ms a sample, batches of 8) against
   the same loop traced with the watch inside the workers turned off (the rest of the capture
   the same), alternated, the median of each: the ratio of the wall times. Target: <= 1.03.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torch.utils.data._utils.fetch import _MapDatasetFetcher

import traceml_jupyter
from traceml_jupyter.capture.loader import watch, worker_side


class Spinning(Dataset[Any]):
    """Each sample spins `ms` of CPU, or sleeps it (`sleep`)."""

    def __init__(self, n: int, ms: float, sleep: bool = False) -> None:
        self.n, self.ms, self.sleep = n, ms, sleep

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.sleep:
            time.sleep(self.ms / 1000)
        else:
            end = time.perf_counter() + self.ms / 1000
            while time.perf_counter() < end:
                pass
        return torch.zeros(16), i


def fetch_cost(ms: float, batches: int) -> tuple[float, float]:
    """(plain, watched) seconds a batch of 8 through torch's fetcher, in this process."""
    fetcher = _MapDatasetFetcher(Spinning(8, ms), True, default_collate, False)
    index = list(range(8))

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(batches):
            fetcher.fetch(index)
        return (time.perf_counter() - t0) / batches

    plain = []
    watched = []
    directory = tempfile.mkdtemp(prefix="traceml-bench-")
    for _ in range(7):
        plain.append(timed())
        worker_side._Timing.start(directory, 0)
        try:
            watched.append(timed())
        finally:
            assert worker_side._Timing.active is not None
            worker_side._Timing.active.stop()
    shutil.rmtree(directory)
    return min(plain), min(watched)


def loop_wall(with_inside: bool, n: int) -> float:
    """A traced pass over a 2-worker loader (2 ms a sample, sleeping): its wall time (s)."""
    loader = DataLoader(Spinning(n, 2.0, sleep=True), batch_size=8, num_workers=2, multiprocessing_context="fork")
    patches = watch.LoaderInside.patches
    if not with_inside:  # the watch off: its patches pass everything through
        watch.LoaderInside.patches = _no_patches  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        with traceml_jupyter.trace("bench", show=False):
            for x, _ in loader:
                x.sum()
        return time.perf_counter() - t0
    finally:
        watch.LoaderInside.patches = patches  # type: ignore[method-assign]


def _no_patches(self: Any) -> Any:
    from contextlib import nullcontext

    return nullcontext()


def lanes_read_cost(total: int, per_tick: int, workers: int = 4) -> tuple[float, list[tuple[int, int]], float]:
    """`total` batches of `workers` workers, `per_tick` new records a tick (and as many
    receptions), read at each tick: (the median tick's µs, [(batches so far, points the
    lanes' chart draws)], the µs of the window and its lines, median)."""
    import types

    from traceml_jupyter.capture.loader.lanes import LiveLanes
    from traceml_jupyter.views.live_lanes import lane_lines

    directory = tempfile.mkdtemp(prefix="traceml-bench-")
    watch = types.SimpleNamespace(directory=directory, receptions=[], began_ns=0)
    lanes = LiveLanes(watch)
    files = [open(os.path.join(directory, f"w{w}-{1000 + w}.bin"), "ab", buffering=0) for w in range(workers)]  # noqa: SIM115
    made = [0] * workers
    points: list[tuple[int, int]] = []
    ticks, draws = [], []
    try:
        for tick in range(total // per_tick):
            for i in range(per_tick):
                w = i % workers
                k, t = made[w], (tick * per_tick + i) * 1_000_000
                files[w].write(worker_side.RECORD.pack(0, 1000 + w, w, 0, k, k, t, t + 600_000, t + 900_000, 1, 8, 64, *([-1, 0] * 4)))
                watch.receptions.append((1000 + w, 0, k, t + 800_000, t + 1_000_000))
                made[w] += 1
            t0 = time.perf_counter_ns()
            lanes.read()
            ticks.append(time.perf_counter_ns() - t0)
            done = (tick + 1) * per_tick
            if done in (1_000, 10_000) or done % 20_000 == 0:
                t0 = time.perf_counter_ns()
                x, _ = lane_lines(*lanes.window())
                draws.append(time.perf_counter_ns() - t0)
                points.append((done, int(x.size)))
    finally:
        for f in files:
            f.close()
        shutil.rmtree(directory)
    return statistics.median(ticks) / 1e3, points, statistics.median(draws) / 1e3


def refresh_cost(with_lanes: bool, refreshes: int = 200, per_tick: int = 250) -> float:
    """µs a live-view refresh (bqplot chart, no front-end) over a run of 4 workers' batches."""
    import types

    from traceml_jupyter import kernel_state
    from traceml_jupyter.capture.loader.lanes import LiveLanes
    from traceml_jupyter.run import Run
    from traceml_jupyter.views import live

    directory = tempfile.mkdtemp(prefix="traceml-bench-")
    handle = Run("bench-lanes")
    run = handle.recording
    run.recorder.origin_ns = (run.recorder.origin_ns or 0) - 3600 * 10**9  # (no update skipped)
    watch = types.SimpleNamespace(directory=directory, receptions=[], began_ns=0)
    run.loader_lanes = LiveLanes(watch) if with_lanes else None
    chart = live.WidgetChart(run.name)
    view = live.LiveView(run, chart)
    files = [open(os.path.join(directory, f"w{w}-{1000 + w}.bin"), "ab", buffering=0) for w in range(4)]  # noqa: SIM115
    made, step = [0] * 4, 0
    try:
        for tick in range(refreshes):
            for i in range(per_tick):
                w, t = i % 4, (tick * per_tick + i) * 1_000_000
                files[w].write(worker_side.RECORD.pack(0, 1000 + w, w, 0, made[w], made[w], t, t + 600_000, t + 900_000, 1, 8, 64, *([-1, 0] * 4)))
                watch.receptions.append((1000 + w, 0, made[w], t + 800_000, t + 1_000_000))
                made[w] += 1
                o = run.recorder.origin_ns + step * 1_000_000
                run.recorder.add(o, o + 100_000, o + 1_000_000)
                step += 1
            view.refresh(run)
        return view.refresh_ns / 1e3 / view.refreshes
    finally:
        for f in files:
            f.close()
        shutil.rmtree(directory)
        for widget in live.widgets_under(chart.box):
            widget.close()
        kernel_state.RUNS.remove(handle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args()
    plain, watched = fetch_cost(0.0, 500)
    added = (watched - plain) / 8
    print(f"fetch of 8 free samples: {plain * 1e6:.1f} -> {watched * 1e6:.1f} us a batch: +{added * 1e6:.1f} us a sample, "
          f"{100 * added / 2e-3:.2f} % of a 2 ms sample")
    off, on = [], []
    for _ in range(args.rounds):
        off.append(loop_wall(False, args.samples))
        on.append(loop_wall(True, args.samples))
    a, b = statistics.median(off), statistics.median(on)
    tick_us = {n: lanes_read_cost(100_000 if n >= 250 else 20_000, n) for n in (25, 250, 2500)}
    marginal = (tick_us[2500][0] - tick_us[250][0]) / 2250
    print("live lanes, 4 workers' files read at each tick, the median tick: "
          + ", ".join(f"{n} new records {us:.0f} us ({us / n:.1f} us a record)" for n, (us, _, _) in tick_us.items())
          + f"; {marginal:.2f} us a record more past 250; window + lines {tick_us[250][2]:.0f} us (a lanes turn)")
    print(f"live lanes, points the chart draws (batches so far, x points): {tick_us[250][1]}")
    for per_tick in (25, 250):
        plain_us, lanes_us = [], []
        for _ in range(3):
            plain_us.append(refresh_cost(False, per_tick=per_tick))
            lanes_us.append(refresh_cost(True, per_tick=per_tick))
        print(f"live view refresh over {per_tick} new batches a tick (4 workers): {min(plain_us):.0f} us without the lanes, "
              f"{min(lanes_us):.0f} us with them (fastest of 3, alternated; the lanes read 4 refreshes in 8, drawn 2 in 8)")
    print(f"end to end, {args.samples} samples of 2 ms, 2 workers: {a:.3f} s without, {b:.3f} s with the watch "
          f"(x{b / a:.3f}; target <= 1.03); rounds: without {[round(v, 3) for v in off]}, with {[round(v, 3) for v in on]}")
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
