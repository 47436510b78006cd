"""Per-step cost of the step model (training events, fetches wherever they happen) next to the
capture before it (the iterator hook alone, commit 8a46db9), on the same cells, in one run.

    .venv/bin/python tests/benchmarks/bench_step_model.py [--repeats 5]

Each version runs in a worker process of its own (the package imported from its own tree:
this checkout, and `git archive` of the old commit); repeats alternate between them. The cost per
step is the slope of process CPU time over steps (a long and a short run) minus the plain
loop's slope, so fixed costs cannot hide in it and other processes cannot inflate it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import Table, num, show, target  # noqa: E402

BEFORE = "8a46db9"  # the last commit before the step model
TARGET_US = 2.0
ROOT = Path(__file__).resolve().parents[2]

SETUP = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
items_short = [(i, i) for i in range({short})]
items_long = [(i, i) for i in range({long})]
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
_ds = TensorDataset(torch.randn({long_train}, 4), torch.randn({long_train}, 1))
train_short = DataLoader(_ds, batch_size=1, sampler=range({short_train}))
train_long = DataLoader(_ds, batch_size=1, sampler=range({long_train}))
"""

# (label, cell body over `{data}`, short, long)
LOOPS = {
    "hook only (empty body, list)": ("for x, y in items_{n}:\n    pass\n", "items", 2_000, 30_000),
    "train step (DataLoader, backward, optimizer)": (
        "for x, y in train_{n}:\n    opt.zero_grad()\n    (model(x) - y).pow(2).mean().backward()\n    opt.step()\n",
        "train",
        500,
        5_000,
    ),
}
VARIANTS = {
    "plain": "",
    "%%traceml --no-live --lines off": "%%traceml --no-live --lines off\n",
    "%%traceml --no-live": "%%traceml --no-live\n",
}


def worker(repeats: int) -> None:
    """In a worker: every loop and variant, `repeats` times; prints one JSON line of CPU times."""
    from shell_cells import run_cell

    lens = {"short": LOOPS["hook only (empty body, list)"][2], "long": LOOPS["hook only (empty body, list)"][3]}
    train = {"short_train": LOOPS["train step (DataLoader, backward, optimizer)"][2]}
    train["long_train"] = LOOPS["train step (DataLoader, backward, optimizer)"][3]
    run_cell(SETUP.format(**lens, **train))
    out: dict[str, dict[str, list[list[float]]]] = {}
    for label, (body, _, _short, _long) in LOOPS.items():
        cells = {v: [head + body.format(n=n) for n in ("short", "long")] for v, head in VARIANTS.items()}
        out[label] = {v: [] for v in VARIANTS}
        for variant in VARIANTS:
            run_cell(cells[variant][0])  # warm-up
        # Variants interleaved within each repeat: this machine's speed drifts over seconds.
        for _ in range(repeats):
            for variant in VARIANTS:
                out[label][variant].append([run_cell(cell)[1] for cell in cells[variant]])
    print("RESULT " + json.dumps(out), flush=True)


def old_tree(tmp: Path) -> Path:
    """The package as it was at BEFORE, extracted under `tmp`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", BEFORE, "traceml_jupyter"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp


def run_worker(tree: Path, repeats: int) -> dict[str, dict[str, list[list[float]]]]:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{Path(__file__).parent}")
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", str(repeats)], env=env, capture_output=True, text=True, check=True
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]


def slope_us(runs: list[list[float]], short: int, long: int) -> float:
    """µs per step from the fastest short and long runs."""
    best_short = min(r[0] for r in runs)
    best_long = min(r[1] for r in runs)
    return (best_long - best_short) / (long - short) * 1e6


def tables(repeats: int = 5) -> list[Table]:
    with tempfile.TemporaryDirectory() as tmp:
        before = old_tree(Path(tmp))
        results = {"step model (now)": [], f"before ({BEFORE})": []}  # type: ignore[var-annotated]
        for _ in range(2):  # alternate the two versions
            results["step model (now)"].append(run_worker(ROOT, repeats))
            results[f"before ({BEFORE})"].append(run_worker(before, repeats))
    table = Table(
        "Per-step cost of the step model, next to the capture before it",
        ["loop", "variant", "before (µs/step)", "now (µs/step)", "now / before", f"target ≤ {TARGET_US:g} µs"],
        notes=[
            f"Process CPU time, slope between a short and a long run, fastest of {2 * repeats} "
            "runs per version; each version in a worker process of its own, alternating.",
            "Before: the located loop's iterator hook only (no DataLoader, backward or optimizer "
            "hooks). Now: the same loop, plus every DataLoader fetch, backward() and optimizer "
            "step going to the step model.",
        ],
    )
    for label, (_, _, short, long) in LOOPS.items():
        for variant in list(VARIANTS)[1:]:
            cost = {}
            for version in results:
                plain = [r for res in results[version] for r in res[label]["plain"]]
                runs = [r for res in results[version] for r in res[label][variant]]
                cost[version] = slope_us(runs, short, long) - slope_us(plain, short, long)
            now, old = cost["step model (now)"], cost[f"before ({BEFORE})"]
            table.rows.append(
                [label, f"`{variant}`", num(old, 2), num(now, 2), num(now / old, 2) if old > 0 else "—",
                 target(now <= TARGET_US, f"{now:.2f} µs") if label.startswith("hook") else "—"]
            )
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
