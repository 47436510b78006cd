"""How honest `compare`'s interval is, and what it costs: pairs of synthetic runs of one process
(no true change) whose steps drift (AR(1): each step keeps `phi` of the last one's offset), for
several run lengths; the share of pairs whose 95 % interval excludes "no change" should be about
5 %. Block bootstrap (what compare does) beside the bootstrap of single steps as if independent,
and how often compare's rule (the interval, and a change of 5 % or more) calls the pair a change
(steps jitter by 5 % of their mean here). Then the time one comparison takes at the recorder's
cap (131072 kept steps a run).

    .venv/bin/python tests/benchmarks/bench_noise.py [--pairs 200]

Pure numpy, seeded: the figures are the same on every machine; only the timing is the machine's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from synthetic import drifting_steps as ar1  # noqa: E402

from traceml_jupyter.analysis.noise import judge  # noqa: E402


def excluded_iid(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> bool:
    """Whether the 95 % interval of mean(B) - mean(A), single steps resampled, excludes 0."""
    reps = 400
    ma = a[rng.integers(0, len(a), (reps, len(a)))].mean(axis=1)
    mb = b[rng.integers(0, len(b), (reps, len(b)))].mean(axis=1)
    low, high = np.percentile(mb - ma, [2.5, 97.5])
    return bool(low > 0 or high < 0)


def judged(a: np.ndarray, b: np.ndarray) -> tuple[bool, bool]:
    """compare's block interval excludes 0; compare calls it a change."""
    got = judge({"step_ms": a}, {"step_ms": b}, replicates=400)
    assert got is not None
    step = got.columns[0]
    return bool(step.diff_low > 0 or step.diff_high < 0), step.verdict != "within noise"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200)
    args = parser.parse_args()
    print(
        "| steps a run | phi (drift) | interval excludes 0: single steps | blocks (compare) "
        "| compare calls it a change |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in (30, 300, 3000):
        for phi in (0.0, 0.5, 0.9, 0.99):
            rng = np.random.default_rng(n * 100 + int(phi * 100))
            block = called = iid = 0
            for _ in range(args.pairs):
                a, b = ar1(n, phi, rng), ar1(n, phi, rng)
                outside, change = judged(a, b)
                block, called = block + outside, called + change
                iid += excluded_iid(a, b, rng) if n <= 300 else 0
            shown_iid = f"{100 * iid / args.pairs:.0f} %" if n <= 300 else "-"
            print(
                f"| {n} | {phi} | {shown_iid} | {100 * block / args.pairs:.0f} % "
                f"| {100 * called / args.pairs:.0f} % |"
            )
    rng = np.random.default_rng(0)
    big = {
        "step_ms": 40 + rng.normal(0, 2, 131_072),
        "data_wait_ms": 4 + rng.normal(0, 1, 131_072),
        "compute_ms": 36 + rng.normal(0, 2, 131_072),
    }
    times = []
    for _ in range(5):
        began = time.perf_counter()
        judge(big, big)
        times.append(time.perf_counter() - began)
    print(f"\none judgement of 2 x 131072 steps, 3 columns, 2000 replicates: {1000 * min(times):.0f} ms")


if __name__ == "__main__":
    main()
