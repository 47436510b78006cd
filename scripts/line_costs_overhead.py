"""Per-step cost of the per-line timing (`--lines on`, the default) against `--lines off` and
the plain loop, in one process: the slope between a long and a short run of the same cell, so
fixed costs stay out of it; and the fixed cost per cell (the intercept). Prints a table;
asserts nothing.

    .venv/bin/python scripts/line_costs_overhead.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from IPython.testing.globalipapp import get_ipython

SHORT, LONG = 20_000, 120_000
BODIES = {
    1: "    y = x + 1\n",
    5: "    y = x + 1\n    y = y + 1\n    y = y + 1\n    y = y + 1\n    y = y + 1\n",
    10: "".join("    y = x + 1\n" for _ in range(10)),
}
VARIANTS = {"plain": None, "traceml": "--no-live --lines off", "traceml --lines": "--no-live"}


def cell(n: int, body: str) -> str:
    return f"for x in data[:{n}]:  # traceml: loop\n{body}"


def timed(shell: object, n: int, body: str, magic: str | None) -> float:
    source = cell(n, body)
    if magic is not None:
        source = f"%%traceml {magic}\n{source}"
    t0 = time.perf_counter()
    result = shell.run_cell(source, silent=True)  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - t0
    if result.error_in_exec is not None:
        raise result.error_in_exec
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    shell = get_ipython()  # type: ignore[no-untyped-call, unused-ignore]
    shell.run_line_magic("load_ext", "traceml_jupyter")
    shell.run_cell(f"data = list(range({LONG}))", silent=True)
    print(f"µs per step (median of {args.repeats} slopes between {SHORT:,} and {LONG:,} steps)")
    print(
        f"{'statements':>10} | {'plain':>7} | {'lines off':>9} | {'lines on':>8} | "
        f"{'lines adds':>10} | {'fixed ms off':>12} | {'fixed ms on':>11}"
    )
    for k, body in BODIES.items():
        slopes: dict[str, list[float]] = {v: [] for v in VARIANTS}
        fixed: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for name, magic in VARIANTS.items():  # alternate, so drift hits all alike
                short = timed(shell, SHORT, body, magic)
                long = timed(shell, LONG, body, magic)
                slope = (long - short) / (LONG - SHORT)
                slopes[name].append(slope * 1e6)
                fixed[name].append((short - slope * SHORT) * 1e3)
        med = {v: statistics.median(s) for v, s in slopes.items()}
        icpt = {v: statistics.median(s) for v, s in fixed.items()}
        extra = med["traceml --lines"] - med["traceml"]
        print(
            f"{k:>10} | {med['plain']:7.3f} | {med['traceml'] - med['plain']:+9.3f} | "
            f"{med['traceml --lines'] - med['plain']:+8.3f} | {extra:+10.3f} | "
            f"{icpt['traceml'] - icpt['plain']:12.2f} | {icpt['traceml --lines'] - icpt['plain']:11.2f}"
        )
    print("µs per step over the plain loop; fixed: ms per cell over the plain cell")


if __name__ == "__main__":
    main()
