"""Live view cost: the share of the run spent refreshing the chart for 10^5 fast steps, and the
comm messages it sends, as a table.

    .venv/bin/python tests/benchmarks/bench_live_view.py [--steps 100000] [--step-us 30]

The measuring is done by tests/benchmarks/live_view_cost.py (owned by the live view: real
widgets, every update serialised as a kernel would, `--no-live` and live runs alternating);
this script runs it and turns what it prints into the benchmark table.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import Table, num, show, target  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "live_view_cost.py")
TARGET_MSGS_PER_S = 4.0
TARGET_CPU_RATIO = 1.02

LIVE = re.compile(
    r"live\s+#\d+: cpu\s+([\d.]+) s\s+wall\s+([\d.]+) s\s+(\d+) refreshes, ([\d.]+) ms in them"
)
PLAIN = re.compile(r"no-live\s+#\d+: cpu\s+([\d.]+) s\s+wall\s+([\d.]+) s")
RATIO = re.compile(r"ratio live / no-live: ([\d.]+)")
TOTALS = re.compile(r"(\d+) comm messages, (\d+) kB a run, (\d+) of them updates")


def measure(steps: int = 100_000, step_us: float = 30.0, repeats: int = 4) -> list[Table]:
    title = f"Live view cost: {steps:,} steps of {step_us:g} µs CPU each"
    if not os.path.exists(SCRIPT):
        return [Table(title, [], notes=["not measured: tests/benchmarks/live_view_cost.py does not exist"])]
    cmd = [sys.executable, SCRIPT, "--steps", str(steps), "--step-us", str(step_us), "--repeats", str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = done.stdout
    live = [tuple(map(float, m)) for m in LIVE.findall(out)]
    plain = [tuple(map(float, m)) for m in PLAIN.findall(out)]
    ratio = RATIO.search(out)
    totals = TOTALS.search(out)
    if not live or not plain or ratio is None or totals is None:
        tail = " | ".join((done.stderr or out).strip().splitlines()[-4:])
        return [Table(title, [], notes=[f"live_view_cost.py gave no figures (exit {done.returncode}): {tail}"])]
    msgs_per_run, kb_per_run = int(totals.group(1)), int(totals.group(2))
    rows = []
    for i, (cpu, wall, refreshes, refresh_ms) in enumerate(live):
        rows.append([
            f"live #{i + 1}", num(cpu, 3), num(wall, 3), f"{refreshes:.0f}",
            num(refreshes / wall, 2), num(refresh_ms, 1), num(100 * refresh_ms / 1e3 / wall, 2),
            num(100 * refresh_ms / 1e3 / cpu, 2),
        ])
    for i, (cpu, wall) in enumerate(plain):
        rows.append([f"--no-live #{i + 1}", num(cpu, 3), num(wall, 3), "—", "—", "—", "—", "—"])
    live_wall = statistics.median(w for _, w, _, _ in live)
    refreshes = statistics.median(r for _, _, r, _ in live)
    updates_per_run = int(totals.group(3))
    msgs_per_s = updates_per_run / live_wall
    table = Table(
        title,
        ["run", "CPU s", "wall s", "refreshes", "refreshes/s", "ms refreshing",
         "% of wall", "% of CPU"],
        rows,
        [
            f"Measured by tests/benchmarks/live_view_cost.py (`{' '.join(['python', *cmd[1:]]).replace(os.getcwd() + '/', '')}`): "
            "the live runs build the real widgets and serialise every update as a kernel would.",
            f"Comm messages: {msgs_per_run} a run ({kb_per_run} kB), {msgs_per_run / max(refreshes, 1):.1f} "
            f"per refresh; {updates_per_run} of them update the chart: {msgs_per_s:.1f} per "
            f"second of run (the other {msgs_per_run - updates_per_run} create the widgets, once).",
        ],
    )
    cpu_ratio = float(ratio.group(1))
    targets = Table("Live view targets", ["target", "measured", "result"], [
        [f"update messages ≤ {TARGET_MSGS_PER_S:g} per second of run", f"{msgs_per_s:.1f}/s",
         target(msgs_per_s <= TARGET_MSGS_PER_S, f"≤ {TARGET_MSGS_PER_S:g}/s")],
        [f"refreshes ≤ {TARGET_MSGS_PER_S:g} per second", f"{refreshes / live_wall:.2f}/s (+1 at the end)",
         target(refreshes - 1 <= TARGET_MSGS_PER_S * live_wall + 1, f"≤ {TARGET_MSGS_PER_S:g} Hz")],
        [f"CPU time live / --no-live ≤ {TARGET_CPU_RATIO}", f"{cpu_ratio:.4f}",
         target(cpu_ratio <= TARGET_CPU_RATIO, "the live view's own budget")],
    ])
    return [table, targets]


def main(argv: list[str] | None = None) -> list[Table]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--step-us", type=float, default=30.0)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    tables = measure(args.steps, args.step_us, args.repeats)
    show(tables)
    return tables


if __name__ == "__main__":
    main()
