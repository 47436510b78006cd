"""Processes a traced cell starts: the per-step cost in a child next to the in-kernel figure, and
what the start-up hook costs a Python child that does not train.

    .venv/bin/python tests/benchmarks/bench_children.py [--repeats 5]

Per step: the same training loop (DataLoader, backward, optimizer step of a tiny model) run in a
fresh Python process three ways — plain; recorded in that process as `%%traceml` records the
kernel (`capture_session`, the in-kernel figure); and as a child of a traced cell (no code of ours in
the script: the start-up hook arms the child, its first DataLoader pass starts the capture, the
steps stream to this process at the ticks). Per-step overhead = the slope of the loop's CPU time
over steps (a long and a short run, fastest of the repeats) minus the plain loop's slope.

Start-up: the wall time of `python -c pass` and of `python -c "import torch"` (armed, never
trains) with and without the hook in the environment (alternating, median of many), and the
cell's own fixed cost of opening and closing the channel.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import Table, noise_of, show  # noqa: E402

SHORT, LONG = 500, 4000
VARIANTS = ("plain", "in-kernel capture", "child of a traced cell")
CHILD = "child"


def loop(n: int) -> float:
    """CPU seconds of n training steps of a tiny model (DataLoader, backward, optimizer step):
    short steps (tens of µs), so that a few µs of ours per step show above the noise."""
    from bench_ranks import loop as training

    return training(n, tiny=True)


def child_main(n: int, variant: str) -> None:
    """In the measured process: the loop, and its CPU seconds on stdout."""
    import torch
    from bench_ranks import recorded

    torch.set_num_threads(1)
    seconds = recorded(n, loop) if variant == "in-kernel capture" else loop(n)
    print(json.dumps({"seconds": seconds}), flush=True)


def one(n: int, variant: str) -> tuple[float, Any]:
    """The loop's CPU seconds in a fresh process, and (traced child) the run it streamed to."""
    from traceml_jupyter.processes import children
    from traceml_jupyter.run import Run

    command = [sys.executable, os.path.abspath(__file__), CHILD, str(n), variant]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if variant != "child of a traced cell":
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        return float(json.loads(out.stdout.splitlines()[-1])["seconds"]), None
    run = Run("bench child")
    channel = children.Channel()
    collector = children.ChildCollector(run.recording, channel)
    run.recording.rank_collector = collector
    collector.start()
    try:
        out = subprocess.run(command, env={**env, **channel.env(env)}, capture_output=True, text=True, check=True)
    finally:
        collector.adopt_into(run.recording, 3.0)
        channel.close()
    run.finish()
    assert run.n_steps == n, (run.n_steps, run.notes)
    return float(json.loads(out.stdout.splitlines()[-1])["seconds"]), run


def per_step(repeats: int) -> Table:
    best: dict[tuple[str, int], float] = {}
    plain_slopes: list[float] = []
    for r in range(repeats):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for variant in order:
            seen = {}
            for n in (SHORT, LONG):
                seconds, _ = one(n, variant)
                best[(variant, n)] = min(best.get((variant, n), float("inf")), seconds)
                seen[n] = seconds
            if variant == "plain":
                plain_slopes.append((seen[LONG] - seen[SHORT]) / (LONG - SHORT) * 1e6)

    def slope(variant: str) -> float:
        return (best[(variant, LONG)] - best[(variant, SHORT)]) / (LONG - SHORT) * 1e6

    plain, noise = slope("plain"), noise_of(plain_slopes)
    kernel = slope("in-kernel capture") - plain
    rows = [["plain loop", f"{plain:.1f}", "", "", "", f"{noise:.2f}"]]
    for variant in VARIANTS[1:]:
        extra = slope(variant) - plain
        shown = f"{extra:+.2f}" if abs(extra) > 2 * noise else f"{extra:+.2f} (not resolved)"
        ratio = f"{extra / kernel:.2f}" if variant != "in-kernel capture" and abs(kernel) > 1e-9 else ""
        rows.append([variant, f"{slope(variant):.1f}", shown, f"{100 * extra / plain:+.1f} %", ratio, ""])
    return Table(
        "Per-step overhead in a child of a traced cell vs the in-kernel capture (CPU time, µs per step)",
        ["loop", "µs per step", "overhead µs / step", "of the step", "child / in-kernel", "± noise µs / step"],
        rows,
        notes=[
            f"Steps: {SHORT} and {LONG} (slope), fastest of {repeats} alternating repeats, each in a fresh process.",
            "The child runs the plain loop (no code of ours in it): the start-up hook armed it, its first "
            "DataLoader pass started the capture, its steps went to this process at the ticks.",
            "± noise: half the spread of the plain loop's per-repeat slopes; an overhead below twice it is not resolved.",
        ],
    )


def added() -> Table:
    from bench_ranks import tick_us

    tick = tick_us(25)
    return Table(
        "What a child of a traced cell adds to the in-kernel per-step path",
        ["what", "cost", "per step at a 10 ms step", "at a 1 ms step"],
        [["one tick: steps handed out and sent (4 a second)", f"{tick:.0f} µs (25 steps)", f"{tick / 25:.2f} µs", f"{tick_us(250) / 250:.2f} µs"]],
        notes=[
            "Everything else on a child's per-step path is the in-kernel capture itself (session.capture_session, the "
            "same code): the tripwires are taken out before the capture starts, and the tick replaces the live "
            "view's refresh of an in-kernel run. A child that is one rank of several also times backward() (as a "
            "forked rank: bench_ranks.py).",
            "Measured in this process (median of 300 ticks), so it resolves on a busy machine where the table above cannot.",
        ],
    )


def cost_ms(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one process, start to exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = (time.perf_counter() - began) * 1e3
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1e3


def importtime_ms(module: str, env: dict[str, str]) -> float:
    """The cumulative import time of `module` at a child's start-up (`python -X importtime`)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=env, capture_output=True, text=True, check=True)
    for line in out.stderr.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2] == module:
            return int(parts[1]) / 1e3
    return 0.0


ARM = """\
import os, sys, time, importlib.util
import torch
spec = importlib.util.spec_from_file_location("hook", os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "sitecustomize.py"))
hook = importlib.util.module_from_spec(spec); spec.loader.exec_module(hook)
began = time.perf_counter(); hook.arm(); print((time.perf_counter() - began) * 1e3)
assert "traceml_jupyter" not in sys.modules
"""


def arm_ms(env: dict[str, str]) -> float:
    """What setting the tripwires takes in a child, once torch is imported (ms)."""
    out = subprocess.run([sys.executable, "-c", ARM], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def startup(runs: int) -> Table:
    from traceml_jupyter.processes import children
    from traceml_jupyter.run import Run

    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for label, code, n in (
        ("`python -c pass`", "pass", runs),
        ("`python -c \"import torch\"` (armed, never trains)", "import torch", max(6, runs // 4)),
    ):
        run = Run("bench start-up")
        channel = children.Channel()
        collector = children.ChildCollector(run.recording, channel)
        collector.start()
        hooked = {**base, **channel.env(base)}
        seen: dict[str, list[tuple[float, float]]] = {"plain": [], "hook": []}
        try:
            cost_ms([sys.executable, "-c", "pass"], hooked)  # the hook's bytecode is cached once per cell
            for i in range(n):
                for name, env in (("plain", base), ("hook", hooked))[:: 1 if i % 2 else -1]:
                    seen[name].append(cost_ms([sys.executable, "-c", code], env))
            hook_itself = [importtime_ms("sitecustomize", env) for env in (base, hooked) for _ in range(n)]
            armed = [arm_ms(hooked) for _ in range(5)] if code == "import torch" else []
        finally:
            collector.stop(0.0)
            channel.close()
        assert not collector.streams, "a child that does not train connected"
        row = [label]
        for index in (0, 1):  # wall, CPU
            plain = [v[index] for v in seen["plain"]]
            hook = [v[index] for v in seen["hook"]]
            added, noise = statistics.median(hook) - statistics.median(plain), noise_of(plain)
            row += [f"{statistics.median(plain):.1f} → {statistics.median(hook):.1f}",
                    f"{added:+.1f}" + ("" if abs(added) > 2 * noise else f" (± {noise:.1f}: not resolved)")]
        rows.append(row + [str(n)])
        if armed:
            rows.append(["  of which: the tripwires, set once torch is imported (timed in the child)", "", "", "", f"{statistics.median(armed):.2f}", "5"])
        else:
            without, with_hook = statistics.median(hook_itself[:n]), statistics.median(hook_itself[n:])
            rows.append(["  of which: sitecustomize itself (`-X importtime`)", "", "", f"{without:.2f} → {with_hook:.2f}", f"{with_hook - without:+.2f}", str(n)])
    cell = []
    for _ in range(20):
        began = time.perf_counter()
        run = Run("bench channel")
        channel = children.Channel()
        collector = children.ChildCollector(run.recording, channel)
        collector.start()
        with children.child_environment(channel):
            pass
        collector.stop(0.0)
        channel.close()
        cell.append((time.perf_counter() - began) * 1e3)
    rows.append(["a traced cell: open the channel, set and restore the environment, close",
                 f"{statistics.median(cell):.2f} ms", "", "", "", "20"])
    return Table(
        "The start-up hook in a Python child that does not train (ms per process)",
        ["process", "wall: without → with the hook", "added", "CPU: without → with", "added", "runs"],
        rows,
        notes=[
            "Medians over the whole process, alternating with and without the hook in its environment; "
            "± noise: half the spread of the runs without it.",
            "Without torch the hook is one sitecustomize that runs the one it hides, reads two "
            "variables and puts one finder on sys.meta_path. `import torch` adds the tripwires "
            "(four patches; our package is not imported). Neither connects to the kernel.",
        ],
    )


def measure(repeats: int = 5) -> list[Table]:
    return [per_step(repeats), added(), startup(60)]


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == CHILD:
        child_main(int(sys.argv[2]), sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    show(measure(args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
