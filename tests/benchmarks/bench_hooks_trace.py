"""What the capture's hooks cost a training step, driven from a `trace()` block (no cell, no
rewriting: the steadiest of the hook benchmarks), with a model in the namespace so the step-parts
sampler samples one step in `--every`.

Each iteration of the loop is a DataLoader-style fetch through the capture's `dataloader_next`,
then a backward() and an optimizer step reported as torch's patches report them
(bench_step_model.hooks_alone_us, its "our work in a training step" row). The figure is the
process CPU time per step of the traced loop minus that of the same fetches without it, each
the fastest of `--repeats` (interleaved). `--at-once` makes every event be reported to the step model when it
happens (the GPU path's way, timed on the CPU clock): the switch that says what the stamps buy.
`--hook-only` times the located loop alone over a list with an empty body (no fetch, backward
or optimizer hook: the loop with no model, where the stamps are replayed in bulk).

For this checkout or another tree of the package (the A/B in docs/benchmarks.md):

    for tree in /work/main /tmp/old9; do   # /tmp/old9: `git archive 9fc1c6f traceml_jupyter | tar -x -C /tmp/old9`
        PYTHONPATH=$tree .venv/bin/python tests/benchmarks/bench_hooks_trace.py --every 16
    done
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any

from bench_step_model import hooks_alone_us  # the same loop, driven the same way (this folder)
from torch import nn

import traceml_jupyter
from traceml_jupyter.capture.inside import step_parts

model = nn.Linear(2, 2)  # found in __main__ by the step-parts sampler


def hook_only_us(steps: int, repeats: int) -> float:
    """µs per step of the located loop's hook alone (`run.loop` over a list, empty body), minus
    the same loop without it."""
    items = list(range(steps))

    def plain() -> float:
        t = time.process_time()
        for _ in items:
            pass
        return time.process_time() - t

    def traced() -> float:
        run: Any
        with traceml_jupyter.trace(show=False) as run:
            t = time.process_time()
            for _ in run.loop(items):
                pass
            return time.process_time() - t

    plain(), traced()
    best_plain = best_traced = float("inf")
    for _ in range(repeats):  # interleaved: this machine's speed drifts over seconds
        best_plain = min(best_plain, plain())
        best_traced = min(best_traced, traced())
    return (best_traced - best_plain) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--every", type=int, default=16, help="sample one step in this many (after the first 64)")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--at-once", action="store_true", help="report every event when it happens (no stamps)")
    parser.add_argument("--hook-only", action="store_true", help="the located loop alone, empty body (no model's steps)")
    args = parser.parse_args()
    step_parts.EVERY_BY_STEP_NS = ((0, args.every),)
    if args.at_once:  # a budget no run reaches: the hooks never stamp (in whichever modules hold it)
        for name in ("recording", "stamping", "step_hooks"):
            try:
                module = importlib.import_module(f"traceml_jupyter.capture.{name}")
            except ImportError:  # an older tree without the module
                continue
            if hasattr(module, "MIN_BUDGET"):
                module.MIN_BUDGET = 10**9  # type: ignore[attr-defined]
    us = (hook_only_us if args.hook_only else hooks_alone_us)(args.steps, args.repeats)
    how = "every event reported at once" if args.at_once else f"one sampled step in {args.every}"
    how = f"{'hook only' if args.hook_only else 'training step'}, {how}"
    print(f"{traceml_jupyter.__file__}: {how}: {us:.2f} µs/step (fastest of {args.repeats})")


if __name__ == "__main__":
    main()
