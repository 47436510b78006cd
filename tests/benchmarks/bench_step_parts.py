"""Per-step cost of the parts of the step (forward, backward, optimizer, the rest: issue 20) on
the CPU path, side by side with the capture before them, in one run.

    .venv/bin/python tests/benchmarks/bench_step_parts.py [--repeats 5]

Each version runs in a worker process of its own (the package imported from its own tree: this
checkout, and `git archive` of the commit before the parts, BEFORE); repeats alternate between
them, the variants interleaved within each repeat. The cost per step is the slope of process CPU
time between a short and a long run, fastest of the repeats, so fixed costs cannot hide in it
and other processes cannot inflate it.

Two loops:

- the located loop of a `%%traceml` cell over a list, with a model and an optimizer in the
  notebook's namespace (so sampled steps patch the model's class and hook the optimizer) and an
  empty body: what every step pays (one decrement in the step model) and the sampled steps'
  arming, amortised;
- a training step under `trace()` whose torch work is a stand-in of the same shape: a call of
  a module (the model's class patched on sampled steps), `torch.autograd.backward` (the
  capture's wrapper around a function that returns at once: its flag read), and an optimizer
  step (torch's step wrapper with its hooks, around a step that does nothing: the capture's
  post hook's flag read, and our pre hook on sampled steps). Real torch work would cost
  hundreds of µs a step here and vary by more than the split adds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_step_model import old_tree, run_worker, slope_us  # noqa: E402
from tables import Table, noise_of, num, show, target  # noqa: E402

BEFORE = "75fa314"  # main before the parts of the step (issue 20)
TARGET_US = 0.3
ROOT = Path(__file__).resolve().parents[2]
SHORT, LONG = 2_000, 30_000

SETUP = """\
import torch
items_short = [(i, i) for i in range({short})]
items_long = [(i, i) for i in range({long})]
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
"""
CELL = "%%traceml --no-live --lines off\nfor x, y in items_{n}:\n    pass\n"
PLAIN = "for x, y in items_{n}:\n    pass\n"


def cell_slopes(repeats: int) -> dict[str, list[list[float]]]:
    """CPU seconds of the short and the long cell, plain and traced, `repeats` times."""
    from shell_cells import run_cell

    run_cell(SETUP.format(short=SHORT, long=LONG))
    cells = {"plain": [PLAIN.format(n=n) for n in ("short", "long")], "traced": [CELL.format(n=n) for n in ("short", "long")]}
    for variant in cells.values():
        run_cell(variant[0])  # warm-up
    out: dict[str, list[list[float]]] = {v: [] for v in cells}
    for _ in range(repeats):
        for variant, pair in cells.items():
            out[variant].append([run_cell(cell)[1] for cell in pair])
    return out


def training_step_slopes(repeats: int) -> dict[str, list[list[float]]]:
    """CPU seconds of SHORT and LONG stand-in training steps, plain and under trace()."""
    import torch

    import traceml_jupyter

    class Tiny(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x

    class Noop(torch.optim.Optimizer):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            return None

    model = Tiny()
    model.register_parameter("w", torch.nn.Parameter(torch.zeros(1)))
    optimizer = Noop(model.parameters(), {})
    real_backward = torch.autograd.backward
    torch.autograd.backward = lambda *a, **k: None  # the capture wraps this stand-in
    x = 0

    def steps(n: int) -> None:
        for _ in range(n):
            model(x)
            torch.autograd.backward(None)
            optimizer.step()

    def plain(n: int) -> float:
        t = time.process_time()
        steps(n)
        return time.process_time() - t

    def traced(n: int) -> float:
        with traceml_jupyter.trace(show=False) as run:
            t = time.process_time()
            for _ in run.loop(range(n)):
                model(x)
                torch.autograd.backward(None)
                optimizer.step()
            return time.process_time() - t

    try:
        plain(SHORT), traced(SHORT)
        out: dict[str, list[list[float]]] = {"plain": [], "traced": []}
        for _ in range(repeats):
            out["plain"].append([plain(SHORT), plain(LONG)])
            out["traced"].append([traced(SHORT), traced(LONG)])
        return out
    finally:
        torch.autograd.backward = real_backward


def worker(repeats: int) -> None:
    result = {"cell": cell_slopes(repeats), "training": training_step_slopes(repeats)}
    print("RESULT " + json.dumps(result), flush=True)


def tables(repeats: int = 5) -> list[Table]:
    now_label, before_label = "parts (now)", f"before ({BEFORE})"
    with tempfile.TemporaryDirectory() as tmp:
        before = old_tree(Path(tmp), BEFORE)
        results: dict[str, list[dict[str, Any]]] = {now_label: [], before_label: []}
        for _ in range(2):  # alternate the two versions
            results[now_label].append(run_worker(ROOT, repeats, __file__))
            results[before_label].append(run_worker(before, repeats, __file__))
    table = Table(
        "Per-step cost of the parts of the step (CPU path), next to the capture before them",
        ["loop", "before (µs/step)", "now (µs/step)", "parts' cost (µs/step)", "± noise (µs/step)", f"target ≤ {TARGET_US:g} µs"],
        notes=[
            f"Process CPU time, slope between {SHORT:,} and {LONG:,} steps, fastest of {2 * repeats} runs per "
            "version and variant (interleaved), each version in a worker process of its own, alternating; "
            "the plain loop's slope is taken out of each.",
            "Sampled steps: every step of the first 64, then one in 16 on average; a sampled step arms "
            "(patches the model's class, hooks the optimizer) and is summed off the per-step path.",
            "± noise: half the spread of the plain loop's per-repeat slopes; a cost below twice it is "
            "not resolved.",
        ],
    )
    for key, label in (("cell", "`%%traceml` loop over a list, empty body (model and optimizer in the namespace)"),
                       ("training", "stand-in training step under `trace()`: module call, backward(), optimizer step")):
        cost, noises = {}, []
        for version, res in results.items():
            plain = [r for w in res for r in w[key]["plain"]]
            traced = [r for w in res for r in w[key]["traced"]]
            cost[version] = slope_us(traced, SHORT, LONG) - slope_us(plain, SHORT, LONG)
            noises.append(noise_of([(r[1] - r[0]) / (LONG - SHORT) * 1e6 for r in plain]))
        now, old = cost[now_label], cost[before_label]
        added = now - old
        table.rows.append([label, num(old, 2), num(now, 2), num(added, 2), num(max(noises), 2),
                           target(added <= TARGET_US, f"{added:+.2f} µs")])
    return [table]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return 0
    show(tables(args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
