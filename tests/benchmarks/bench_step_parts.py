"""Per-step cost of the parts of the step (forward, backward, optimizer, the rest: issue 20) on
the CPU path: side by side in one process (this tree with the parts on and off), and against
the capture before them (another process).

    .venv/bin/python tests/benchmarks/bench_step_parts.py [--repeats 5]

Each tree runs in a worker process of its own (the package imported from its own tree: this
checkout, and `git archive` of the commit before the parts, BEFORE); in each, the variants
(plain, traced with the parts on, and off where the tree has them) are interleaved within each
repeat. The cost per step is the slope of process CPU time between a short and a long run,
fastest of the repeats, so fixed costs cannot hide in it and other processes cannot inflate it.

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

BEFORE = "caea403"  # main before the parts of the step (issue 20): issues 18, 19, 21 and 23 merged
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


def parts_switch() -> Any:
    """Turns the parts on or off in this process (None in a tree without them): off, the
    capture starts no sampling, so the step model's countdown never fires."""
    try:
        from traceml_jupyter.capture.inside import step_parts
    except ImportError:
        return None
    begin = step_parts.StepParts.begin

    def switch(on: bool) -> None:
        step_parts.StepParts.begin = begin if on else (lambda self: None)  # type: ignore[method-assign]

    return switch


def variants() -> dict[str, Any]:
    """plain, and traced with the parts on and (where the tree has them) off."""
    switch = parts_switch()
    out: dict[str, Any] = {"plain": None, "on": (lambda: switch(True)) if switch else (lambda: None)}
    if switch is not None:
        out["off"] = lambda: switch(False)
    return out


def cell_slopes(repeats: int) -> dict[str, list[list[float]]]:
    """CPU seconds of the short and the long cell per variant, `repeats` times interleaved."""
    from shell_cells import run_cell

    run_cell(SETUP.format(short=SHORT, long=LONG))
    out: dict[str, list[list[float]]] = {}
    for _ in range(repeats + 1):  # the first round warms up
        for name, set_up in variants().items():
            template = PLAIN if set_up is None else CELL
            if set_up is not None:
                set_up()
            runs = [run_cell(template.format(n=n))[1] for n in ("short", "long")]
            out.setdefault(name, []).append(runs)
    return {name: runs[1:] for name, runs in out.items()}


def training_step_slopes(repeats: int) -> dict[str, list[list[float]]]:
    """CPU seconds of SHORT and LONG stand-in training steps per variant, 3 x `repeats` times
    interleaved (a step here is a few µs: the fastest of many runs)."""
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

    def plain(n: int) -> float:
        t = time.process_time()
        for _ in range(n):
            model(x)
            torch.autograd.backward(None)
            optimizer.step()
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
        out: dict[str, list[list[float]]] = {}
        for _ in range(3 * repeats + 1):
            for name, set_up in variants().items():
                if set_up is not None:
                    set_up()
                go = plain if set_up is None else traced
                out.setdefault(name, []).append([go(SHORT), go(LONG)])
        return {name: runs[1:] for name, runs in out.items()}
    finally:
        torch.autograd.backward = real_backward
        switch = parts_switch()
        if switch is not None:
            switch(True)


def worker(repeats: int) -> None:
    result = {"cell": cell_slopes(repeats), "training": training_step_slopes(repeats)}
    print("RESULT " + json.dumps(result), flush=True)


def tables(repeats: int = 5) -> list[Table]:
    with tempfile.TemporaryDirectory() as tmp:
        before = old_tree(Path(tmp), BEFORE)
        now_runs, before_runs = [], []
        for _ in range(2):  # alternate the two trees
            now_runs.append(run_worker(ROOT, repeats, __file__))
            before_runs.append(run_worker(before, repeats, __file__))
    table = Table(
        "Per-step cost of the parts of the step (CPU path)",
        ["loop", "comparison", "without (µs/step)", "with (µs/step)", "parts' cost (µs/step)", "± noise (µs/step)",
         f"target ≤ {TARGET_US:g} µs"],
        notes=[
            f"Process CPU time, slope between {SHORT:,} and {LONG:,} steps, less the plain loop's; fastest "
            "of the runs of each variant, the variants interleaved within each repeat.",
            "In one process: this tree with the parts on and off (the capture starts no sampling: the step "
            "model's countdown never fires, backward() and the optimizer hook read one flag). Against the "
            f"commit before the parts ({BEFORE}): each tree in a worker process of its own, alternating "
            "(this machine's speed drifts between processes by more than the parts cost: informational).",
            "Sampled steps: every step of the first 64, then one in 16, 64 or 256 on average by the step's "
            "length; a sampled step arms (patches the model's class, hooks the optimizer) and is summed off "
            "the per-step path.",
            "± noise: half the spread of the plain loop's per-repeat slopes; a figure under twice it is not "
            "resolved.",
        ],
    )
    rows = (
        ("cell", "`%%traceml` loop over a list, empty body (model and optimizer in the namespace)"),
        ("training", "stand-in training step under `trace()`: module call, backward(), optimizer step"),
    )
    for key, label in rows:
        now = {name: [r for w in now_runs for r in w[key][name]] for name in now_runs[0][key]}
        old = {name: [r for w in before_runs for r in w[key][name]] for name in before_runs[0][key]}
        noise = max(noise_of([(r[1] - r[0]) / (LONG - SHORT) * 1e6 for r in runs["plain"]]) for runs in (now, old))

        def cost(runs: dict[str, list[list[float]]], variant: str) -> float:
            return slope_us(runs[variant], SHORT, LONG) - slope_us(runs["plain"], SHORT, LONG)

        for comparison, without, with_ in (
            ("parts off / on, one process", cost(now, "off"), cost(now, "on")),
            (f"before ({BEFORE}) / now, two processes", cost(old, "on"), cost(now, "on")),
        ):
            added = with_ - without
            resolved = abs(added) > 2 * noise or noise < 0.05
            primary = comparison.startswith("parts off")
            verdict = target(added <= TARGET_US, f"{added:+.2f} µs") if resolved and primary else ("—" if resolved else "not resolved")
            table.rows.append([label, comparison, num(without, 2), num(with_, 2), num(added, 2), num(noise, 2), verdict])
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
