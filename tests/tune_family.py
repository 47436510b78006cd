"""The `%traceml tune` family: a loader whose per-sample cost is known (a sleep: I/O; or CPU time
burnt in `__getitem__`) feeds a model whose compute per step is known (CPU time burnt in the
cell, as a model on the CPU does; or a sleep, as a host waiting for a GPU does). Each case runs
the way a user runs it: the training cell under `%%traceml` with `num_workers=0`, `%traceml
tune`, then the same cell on a loader built with `tuned.best`; the measured speed-up (the first
run's median step over the rerun's) against the predicted one.

Used by tests/integration/shell/test_tune.py (a few cases) and tests/benchmarks/bench_tune.py (the whole family).
Burns count the thread's CPU time, not the wall clock, so a burn is a fixed amount of work
that takes longer when the cores are shared, as real work does.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from IPython.utils.capture import capture_output

SETUP = '''
import time, torch
import traceml_jupyter
from torch.utils.data import DataLoader, Dataset

def burn(ms):
    """`ms` of this thread's CPU time."""
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass

class FamilySamples(Dataset):
    """Each sample costs `ms`: a sleep (I/O, no CPU) or CPU time burnt."""
    def __init__(self, n, ms, kind):
        self.n, self.ms, self.kind = n, ms, kind
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        if self.kind == "sleep":
            time.sleep(self.ms / 1000)
        else:
            burn(self.ms)
        return torch.full((16,), float(i)), i
'''

TRAIN = """\
%%traceml --no-live --lines off --name {name}
for x, y in family_loader:
    {compute}
"""


@dataclass(frozen=True)
class Case:
    sample: str  # "sleep" (I/O) or "cpu" (CPU time burnt per sample)
    sample_ms: float
    batch: int
    compute_ms: float
    compute: str = "cpu"  # "cpu" (a model on the CPU) or "sleep" (a host waiting on a GPU)

    @property
    def name(self) -> str:
        return (
            f"{self.sample} {self.sample_ms:g} ms x {self.batch}, "
            f"{self.compute} {self.compute_ms:g} ms"
        )

    def steps(self, step_ms: float, seconds: float = 2.5) -> int:
        """Steps for a run of about `seconds`: at least 24, at most 200."""
        return int(min(200, max(24, seconds * 1000 / step_ms)))

    def serial_ms(self) -> float:
        """The step at num_workers=0, from the injected costs."""
        return self.sample_ms * self.batch + self.compute_ms


@dataclass
class Outcome:
    case: Case
    best: dict[str, Any]
    baseline_ms: float
    rerun_ms: float | None
    predicted_ms: float | None
    predicted: float | None  # speed-up
    tune_s: float
    rows: list[dict[str, Any]]
    baseline_again_ms: float | None = None  # the first run repeated after the rerun (again=True)

    @property
    def noise(self) -> float | None:
        """How far the first run's time per step moved when repeated: what the machine's own
        drift does to a measured speed-up."""
        if self.baseline_again_ms is None:
            return None
        return abs(self.baseline_again_ms / self.baseline_ms - 1)

    @property
    def measured(self) -> float | None:
        return self.baseline_ms / self.rerun_ms if self.rerun_ms else None

    @property
    def error(self) -> float | None:
        """Predicted over measured speed-up, less 1."""
        if self.predicted is None or self.measured is None:
            return None
        return self.predicted / self.measured - 1


def _run(shell: Any, cell: str) -> str:
    with capture_output() as out:
        result = shell.run_cell(textwrap.dedent(cell), store_history=True)
    error = result.error_before_exec or result.error_in_exec
    if error is not None:
        raise RuntimeError(f"cell failed: {error!r}\n{cell}\n{out.stdout}{out.stderr}")
    return out.stdout


def per_step(run: Any) -> float:
    """A run's time per step (its mean step over the analysed steps): what an epoch takes."""
    return float(run.summary["stats"]["step_ms"]["mean"])


def run_case(shell: Any, case: Case, budget: float = 20.0, again: bool = False) -> Outcome:
    """Train with num_workers=0, tune, train again with `tuned.best` (see the module docstring);
    `again`: then the first run once more, to see how much the machine drifted meanwhile."""
    import traceml_jupyter

    _run(shell, SETUP)
    steps = case.steps(case.serial_ms())
    compute = (
        f"burn({case.compute_ms})"
        if case.compute == "cpu"
        else f"time.sleep({case.compute_ms / 1000})"
    )
    dataset = f"FamilySamples({steps * case.batch}, {case.sample_ms}, {case.sample!r})"
    _run(shell, f"family_set = {dataset}\nfamily_loader = DataLoader(family_set, batch_size={case.batch})")
    _run(shell, TRAIN.format(name="family_before", compute=compute))
    before = traceml_jupyter.last()
    assert before is not None and per_step(before)
    _run(shell, f"family_tuned = traceml_jupyter.tune(budget={budget}, show=False)")
    tuned = shell.user_ns["family_tuned"]
    best = dict(tuned.best)
    rerun_ms = None
    if best:
        workers = int(best.get("num_workers") or 0)
        fast_steps = case.steps(tuned.predicted_step_ms or case.serial_ms())
        dataset = f"FamilySamples({max(steps, fast_steps) * case.batch}, {case.sample_ms}, {case.sample!r})"
        _run(
            shell,
            f"family_loader = DataLoader({dataset}, batch_size={case.batch}, **family_tuned.best)",
        )
        try:
            _run(shell, TRAIN.format(name="family_after", compute=compute))
        finally:
            if workers:
                _run(shell, "family_loader._iterator._shutdown_workers()")
        after = traceml_jupyter.last()
        assert after is not None
        rerun_ms = per_step(after)
    baseline_again_ms = None
    if again:
        _run(shell, f"family_loader = DataLoader(family_set, batch_size={case.batch})")
        _run(shell, TRAIN.format(name="family_again", compute=compute))
        repeated = traceml_jupyter.last()
        assert repeated is not None
        baseline_again_ms = per_step(repeated)
    return Outcome(
        case,
        best,
        per_step(before),
        rerun_ms,
        tuned.predicted_step_ms,
        tuned.predicted_speedup,
        tuned.elapsed_s,
        list(tuned.rows),
        baseline_again_ms,
    )


# The family: I/O and CPU samples, 1 to 4 ms a sample, batches of 8 to 64, 2 to 20 ms of
# compute a step (on the CPU; two with the host waiting, as on a GPU).
FAMILY = [
    Case("sleep", 1, 8, 20, "sleep"),
    Case("sleep", 4, 16, 10, "sleep"),
    Case("sleep", 2, 8, 6, "sleep"),
    Case("sleep", 2, 8, 6),
    Case("sleep", 1, 8, 2),
    Case("sleep", 1, 64, 20),
    Case("sleep", 4, 16, 10),
    Case("sleep", 4, 64, 20, "sleep"),
    Case("cpu", 1, 8, 2),
    Case("cpu", 1, 8, 6),
    Case("cpu", 2, 16, 10),
    Case("cpu", 1, 64, 20),
    Case("cpu", 4, 8, 20),
    Case("cpu", 4, 32, 10),
]
