"""What the capture's hooks cost a training step when a model is in the namespace (the step-parts
sampler then samples steps; with fewer than 512 steps to the next sampled one the hooks report
each event at once, capture/stamping.py), at a chosen sampling rate, for this checkout or
another tree of the package.

    .venv/bin/python tests/benchmarks/bench_hooks_with_model.py [--every 16] [--repeats 5]
    PYTHONPATH=/tmp/old .venv/bin/python tests/benchmarks/bench_hooks_with_model.py   # another tree
    (git archive 9fc1c6f traceml_jupyter | tar -x -C /tmp/old)

A `%%traceml --no-live` cell in a real InteractiveShell drives the hooks directly (a DataLoader
fetch as the patched `__next__` reports it, a `backward()`, an optimizer step) around a trivial
stand-in for torch's work, with `model = nn.Linear(2, 2)` in the namespace. The cost per step
is the slope of process CPU time between a long and a short run, minus the plain loop's:
fixed costs (locate, report) cancel. Repeats alternate; the median and the spread are printed.
Run the two trees one after the other, and again in the other order: the machine drifts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output

SETUP = """
from torch import nn
from traceml_jupyter.capture.instrument import hooks
from traceml_jupyter.capture.steps.step_model import BACKWARD, OPTIMIZER
model = nn.Linear(2, 2)

class Batches:
    def __init__(self, n):
        self.n = n
    def next(self):
        if self.n == 0:
            raise StopIteration
        self.n -= 1
        return self.n

class Optimizer:
    pass

optimizer = Optimizer()

class Loader:  # a DataLoader iterator's patched __next__, as the capture sees it
    def __init__(self, n):
        self.b = Batches(n)
    def __iter__(self):
        return self
    def __next__(self):
        return hooks.active.dataloader_next(self.b, Batches.next)

def plain(n):
    b = Batches(n)
    while True:
        try:
            b.next()
        except StopIteration:
            break
"""

CELL = """%%traceml --no-live --name hooks
for _ in Loader(N):
    hooks.active.training_event(BACKWARD)
    hooks.active.training_event(OPTIMIZER, optimizer)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=256, help="sample one step in this many (after the first 64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long", type=int, default=20_000)
    parser.add_argument("--short", type=int, default=4_000)
    args = parser.parse_args()

    from traceml_jupyter.capture.inside import step_parts

    step_parts.EVERY_BY_STEP_NS = ((0, args.every),)  # type: ignore[assignment]
    ip: Any = start_ipython()
    ip.run_line_magic("load_ext", "traceml_jupyter")
    ip.run_cell(SETUP)

    def cost(n: int) -> float:
        ip.user_ns["N"] = n
        began = time.process_time()
        ip.run_cell("plain(N)")
        plain = time.process_time() - began
        with capture_output():  # the report, printed each time
            began = time.process_time()
            ip.run_cell(CELL)
            return time.process_time() - began - plain

    cost(args.short)  # warm up
    slopes = []
    for _ in range(args.repeats):
        slopes.append((cost(args.long) - cost(args.short)) / (args.long - args.short) * 1e6)
    import traceml_jupyter

    print(
        f"{traceml_jupyter.__file__}: one sampled step in {args.every}: "
        f"median {statistics.median(slopes):.2f} µs/step (min {min(slopes):.2f}, max {max(slopes):.2f}, "
        f"{args.repeats} repeats)"
    )


if __name__ == "__main__":
    main()
