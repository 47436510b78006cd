"""What sampling resources costs on the CPU: the per-step cost of a traced loop with the resource
watch on against the same loop with it off, side by side in one process, and what one sample of
the host sampler costs (the process alone, with 2 DataLoader workers, a worker's private-memory
read on a worker that holds a large Python list).

    .venv/bin/python tests/benchmarks/bench_resources.py [--repeats 5]

The per-step cost is the slope of process CPU time (every thread's: the sampler thread's own
work counts) between a short and a long run, with the watch on minus with it off, the variants
interleaved within each repeat, fastest of the repeats. On the CPU path nothing of the watch
runs per step; what a step pays is the sampler thread's share of the run (4 samples a second).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import Table, noise_of, num, show, target  # noqa: E402

TARGET_US = 0.1
SHORT, LONG = 20_000, 400_000
SETUP = f"items_short = list(range({SHORT}))\nitems_long = list(range({LONG}))\n"
CELL = "%%traceml --no-live --lines off\nfor x in items_{n}:\n    pass\n"


@contextlib.contextmanager
def watch_off() -> Iterator[None]:
    """The capture without its resource watch (what the loop costs when nothing is sampled)."""
    from traceml_jupyter.capture import session as recording

    original = recording.resources_watched

    @contextlib.contextmanager
    def nothing(run: Any, capture: Any) -> Iterator[None]:
        yield None

    recording.resources_watched = nothing  # type: ignore[assignment]
    try:
        yield
    finally:
        recording.resources_watched = original  # type: ignore[assignment]


def slopes(repeats: int) -> dict[str, list[list[float]]]:
    """CPU seconds of the short and the long run, per repeat, with the watch on and off."""
    from shell_cells import run_cell

    run_cell(SETUP)
    out: dict[str, list[list[float]]] = {"on": [], "off": []}
    cells = [CELL.format(n="short"), CELL.format(n="long")]
    for variant in ("on", "off"):  # warm-up
        with watch_off() if variant == "off" else contextlib.nullcontext():
            run_cell(cells[0])
    for _ in range(repeats):
        for variant in ("on", "off"):
            with watch_off() if variant == "off" else contextlib.nullcontext():
                out[variant].append([run_cell(cell)[1] for cell in cells])
    return out


def slope_us(runs: list[list[float]]) -> float:
    return (min(r[1] for r in runs) - min(r[0] for r in runs)) / (LONG - SHORT) * 1e6


def per_cell_ms(runs_on: list[list[float]], runs_off: list[list[float]]) -> float:
    """What the watch adds to a cell (thread start and join, the first sample): the short runs'
    difference less the per-step part."""
    short_on, short_off = min(r[0] for r in runs_on), min(r[0] for r in runs_off)
    return (short_on - short_off) * 1e3 - (slope_us(runs_on) - slope_us(runs_off)) * SHORT / 1e3


def sample_costs() -> list[list[str]]:
    """One sample's cost: the process alone, with 2 workers, and a private-memory read."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    from traceml_jupyter.capture.resources.host import HostSampler

    class Records(Dataset[Any]):
        def __init__(self) -> None:
            self.records = [(float(i), i) for i in range(1_000_000)]

        def __len__(self) -> int:
            return 10**6

        def __getitem__(self, i: int) -> Any:
            time.sleep(0.01)
            return torch.zeros(1)

    rows = []
    alone = HostSampler()
    alone._psutil = __import__("psutil")
    alone._me = alone._psutil.Process()
    n = 200
    t0 = time.process_time()
    for _ in range(n):
        alone.sample_once()
    rows.append(["one sample: the process alone (CPU times, RSS, per-CPU times)", num((time.process_time() - t0) / n * 1e6, 0)])
    loader = DataLoader(Records(), batch_size=1, num_workers=2)
    it = iter(loader)
    try:
        sampler = HostSampler()
        sampler._psutil, sampler._me = alone._psutil, alone._me
        sampler.add_workers([w.pid for w in it._workers], 1)  # type: ignore[attr-defined]
        sampler.sample_once()  # adopts them (and reads their private memory once)
        t0 = time.process_time()
        for _ in range(n):
            sampler.sample_once(uss=False)
        cheap = (time.process_time() - t0) / n * 1e6
        rows.append(["one sample: the process and 2 DataLoader workers", num(cheap, 0)])
        t0 = time.perf_counter()
        for _ in range(10):
            sampler._uss_at = 0.0
            sampler.sample_once()
        uss = (time.perf_counter() - t0) / 10 * 1e6 - cheap
        rows.append(["private-memory read (smaps_rollup) of 2 workers holding a 1M-item list", num(uss, 0)])
        rows.append([
            "the sampler's share of a core: 4 samples/s, private memory spaced to 2 %",
            f"{4 * cheap / 1e6 * 100:.3f} % + at most 2 %",
        ])
    finally:
        del it
    return rows


def tables(repeats: int = 5) -> list[Table]:
    runs = slopes(repeats)
    on, off = slope_us(runs["on"]), slope_us(runs["off"])
    cost = on - off
    noise = noise_of([(r[1] - r[0]) / (LONG - SHORT) * 1e6 for r in runs["off"]])
    resolved = abs(cost) > 2 * noise
    per_step = Table(
        "Resources sampled vs not: per-step cost on the CPU path",
        ["loop", "watch off (µs/step)", "watch on (µs/step)", "added (µs/step)", "± noise", f"target ≤ +{TARGET_US:g} µs", "per cell (ms)"],
        [[
            "`%%traceml --no-live --lines off`, empty body over a list",
            num(off, 3), num(on, 3), num(cost, 3) + ("" if resolved else " (not resolved)"),
            num(noise, 3), target(cost <= TARGET_US, f"{cost:+.3f} µs"), num(per_cell_ms(runs["on"], runs["off"]), 2),
        ]],
        [
            f"Process CPU time (every thread's), slope between {SHORT:,} and {LONG:,} steps, fastest of "
            f"{repeats} interleaved repeats per variant, in one process. Watch off: "
            "`capture.session.resources_watched` replaced by a context that samples nothing.",
            "Nothing of the watch runs per step on the CPU path: a step pays the sampler thread's "
            "share of the run's time; the DataLoader iterator tells it its workers once a pass.",
            "Per cell: the thread's start and join and the first sample (the short runs' difference "
            "less the per-step part).",
        ],
    )
    sampler = Table(
        "The host sampler's own cost",
        ["what", "µs (CPU)"],
        sample_costs(),
        ["A private-memory (USS) read is the kernel's walk of the worker's page tables "
         "(/proc/PID/smaps_rollup), done with the GIL released; reads are spaced so that they "
         "take at most 2 % of one core (USS_BUDGET)."],
    )
    return [per_step, sampler]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    show(tables(args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
