"""Run every benchmark and write one markdown page of tables (docs/benchmarks.md):

    .venv/bin/python tests/benchmarks/run_all.py --out docs/benchmarks.md

Overhead, accuracy, memory, live-view cost, long sessions (real kernels), the resource
sampler's cost, ranks and `%traceml tune`'s predictions on the CPU; the GPU variant too where
CUDA is available (otherwise one line says it was skipped). traceml-ai, the peer, is installed
on first use into its own venv (/tmp/venv-traceml, never pulling torch); `--no-traceml-ai`
leaves it out. About fifteen minutes on a 2-core machine (tune's family about five of them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import Table, machine_table, show  # noqa: E402

HEADER = """# Benchmarks

Measured side by side in one run by `{command}` ({minutes:.1f} min).
Each section says how it was measured; a target that was not met says **MISSED**.
These are scripts that print figures, not tests: `pytest tests` does not run them.

"""


def section(name: str, run: Callable[[], list[Table]]) -> list[Table]:
    """One benchmark's tables; a benchmark that fails gives a table saying why, not a crash."""
    print(f"== {name}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        tables = run()
    except Exception as exc:
        traceback.print_exc()
        tables = [Table(name, [], notes=[f"failed: {type(exc).__name__}: {exc}"])]
    print(f"   {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    show(tables)
    return tables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=None, help="markdown file to write (e.g. docs/benchmarks.md)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats of the overhead runs")
    parser.add_argument("--no-traceml-ai", action="store_true", help="leave the traceml-ai peer out")
    parser.add_argument("--no-install", action="store_true", help="never install traceml-ai")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    peer, install = not args.no_traceml_ai, not args.no_install

    import bench_accuracy
    import bench_children
    import bench_gpu
    import bench_live_view
    import bench_memory
    import bench_overhead
    import bench_ranks
    import bench_resources
    import bench_session
    import bench_step_model
    import bench_step_parts
    import bench_tune

    began = time.perf_counter()
    machine = machine_table()
    parts: list[tuple[str, list[Table]]] = [
        ("Overhead per step and per cell (CPU)", section("overhead", lambda: bench_overhead.measure(args.repeats, "cpu", peer, install))),
        ("The per-step cost: the floor, the captures before, what remains", section("step model", lambda: bench_step_model.tables(max(args.repeats, 5)))),
        ("The parts of the step (forward, backward, optimizer, the rest)", section("step parts", lambda: bench_step_parts.tables(max(args.repeats, 5)))),
        ("Accuracy (CPU)", section("accuracy", lambda: bench_accuracy.measure("cpu", peer, install))),
        ("Memory and scale", section("memory", bench_memory.measure)),
        ("Live view cost", section("live view", bench_live_view.measure)),
        ("Long sessions (real kernels)", section("session", bench_session.measure)),
        ("Several processes (ranks forked from a traced cell)", section("ranks", lambda: bench_ranks.measure(max(args.repeats, 5)))),
        ("Processes a cell starts (`!python`, the command line)", section("children", lambda: bench_children.measure(max(args.repeats, 5)))),
        ("Resources: CPU and memory sampling", section("resources", lambda: bench_resources.tables(max(args.repeats, 5)))),
        ("`%traceml tune`: predicted against measured speed-up", section("tune", bench_tune.measure)),
        ("GPU", section("gpu", lambda: bench_gpu.measure(args.repeats, peer, install))),
    ]
    minutes = (time.perf_counter() - began) / 60
    machine.rows.append(["load average after the run", ", ".join(f"{x:.2f}" for x in os.getloadavg())])
    command = " ".join([".venv/bin/python", "tests/benchmarks/run_all.py", *(sys.argv[1:] if argv is None else argv)])
    page = [HEADER.format(command=command, minutes=minutes), machine.markdown()]
    for title, tables in parts:
        page.append(f"## {title}\n")
        page.extend(t.markdown() for t in tables)
    text = "\n".join(page)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"wrote {args.out} ({minutes:.1f} min)", file=sys.stderr)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
