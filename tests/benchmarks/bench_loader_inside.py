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
    print(f"end to end, {args.samples} samples of 2 ms, 2 workers: {a:.3f} s without, {b:.3f} s with the watch "
          f"(x{b / a:.3f}; target <= 1.03); rounds: without {[round(v, 3) for v in off]}, with {[round(v, 3) for v in on]}")
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
