"""`%traceml tune`: the DataLoader alone (no model) under candidate settings, against the model's
measured rate: which setting keeps the model fed, and the predicted step and speed-up.

Each candidate is a new DataLoader over the user's dataset with the user's batching, collate_fn,
worker_init_fn, generator and start method; the user's loader is never iterated or changed.
Side effects stay inside `tune()`: every worker process it starts is gone when it returns, the
random states are put back, and the time budget is a hard bound (SIGALRM on the main thread).
The arithmetic is in analysis/tune_plan.py.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..analysis.resources import saturation_text
from ..analysis.tune_plan import (
    DEEPER_PREFETCH,
    EMPTY,
    ERROR,
    STOPPED,
    ModelCpu,
    ModelRate,
    Row,
    Setting,
    Split,
    code_line,
    conclude,
    is_waiting,
    sweep_done,
    worker_counts,
)
from ..capture.resources.host import usable_cpus
from .measure import measure
from .model_rate import model_rate, run_loader, stand_in_cpu
from .progress import Progress, ProgressViews, progress_view
from .recipe import Recipe, name_of, recipe_of
from .result import DEFAULT_BUDGET_S, TuneResult
from .sandbox import Deadlines, RandomStates, child_pids, reap

if TYPE_CHECKING:
    from ..kernel.cells import FinishedRun

# Kept back from the budget to stop the last candidate's workers and build the result.
RESERVE_S = 0.3
# A candidate may overrun its share by this much (one slow batch) before it is stopped hard.
GRACE_SHARE = 0.25
MIN_SHARE_S = 0.5


class TuneError(ValueError):
    """What tune cannot work with (not a DataLoader, no loader to tune): one line for the user."""


# -- the last tune of each loader (the checklist quotes it) --------------------------------------------


def _remember(loader: Any, result: TuneResult) -> None:
    """Keep the result for the checklist, and refresh the checklist of the last run that trained
    on this loader: its num_workers item now quotes the rates measured."""
    from ..kernel.code_facts import read_kernel_at_end
    from ..kernel_state import RUNS, remember_tune, tuned_for

    remember_tune(loader, dict(result.to_dict()))  # kernel_state (a base module) holds it untyped
    runs: list[FinishedRun] = list(RUNS)
    for run in reversed(runs):
        ref = run.loader_ref
        if ref is not None and tuned_for(ref()) is not None:
            read_kernel_at_end(run)
            break


# -- tune ---------------------------------------------------------------------------------------------


def _check_loader(loader: Any, label: str) -> None:
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader):
        raise TuneError(f"tune needs a torch DataLoader; {label} is a {type(loader).__name__}")


def tune(
    loader: Any = None,
    budget: float = DEFAULT_BUDGET_S,
    compute_ms: float | None = None,
    workers: Sequence[int] | None = None,
    show: bool = True,
    progress: Progress | None = None,
    label: str | None = None,
) -> TuneResult:
    """Measure `loader` alone (default: the training loader of the last `%%traceml` run) under
    candidate settings for at most `budget` seconds, and say which keeps the model fed.

    The model's rate is the last run's (median compute per step x batches per step) or
    `compute_ms` (compute per step, ms). `workers` replaces the num_workers tried (default: 0
    up to the usable CPUs, and one more when samples wait on I/O). `progress` is called with
    a dict per event. The stop button ends it early with what was measured.
    """
    from ..kernel_state import RUNS

    if not budget > 0:
        raise TuneError(f"the budget must be a positive number of seconds, got {budget!r}")
    if compute_ms is not None and not compute_ms > 0:
        raise TuneError(f"compute_ms must be a positive number of ms, got {compute_ms!r}")
    if workers is not None and (not list(workers) or min(workers) < 0):
        raise TuneError(f"workers must be counts of 0 or more, like [0, 1, 2, 4]; got {workers!r}")
    run: FinishedRun | None = RUNS[-1] if RUNS else None
    if loader is None:
        if run is None:
            raise TuneError(
                "tune needs a DataLoader: pass one (%traceml tune LOADER), or run the "
                "training cell under %%traceml first"
            )
        loader = run_loader(run)
        if loader is None:
            raise TuneError(
                f"the training loader of run {run.name!r} is gone (or was not a DataLoader): "
                "name one, %traceml tune LOADER"
            )
        label = label or "the training loader of run " + repr(run.name)
    _check_loader(loader, label or "it")
    from ..kernel.shell import ipython_shell

    shell = ipython_shell()
    names = getattr(shell, "user_ns", None)
    loader_name = name_of(loader, names)
    label = label or loader_name or "the loader"
    recipe = recipe_of(loader, names)
    model, notes = model_rate(loader, run, compute_ms)
    inputs = TuneInputs(
        loader, recipe, model, notes, budget, workers, usable_cpus(), label, loader_name, names, run
    )
    return _tune(inputs, ProgressViews(progress_view(show), progress))


@dataclass
class TuneInputs:
    """What one tune works from, all read before its first candidate."""

    loader: Any
    recipe: Recipe
    model: ModelRate | None
    notes: list[str]
    budget: float
    workers: Sequence[int] | None  # the num_workers asked for (None: the sweep chooses)
    cpus: int
    label: str
    loader_name: str | None
    names: Mapping[str, Any] | None  # the user's namespace (names for the code line)
    run: Any  # the last run (the model's rate), or None


@dataclass
class Sweep:
    """What the candidates measured, and how the sweep ended."""

    rows: list[Row]
    split: Split | None
    cpu: ModelCpu  # how the model's stand-in replays its compute
    stopped: bool = False
    error: str | None = None


def _tune(inputs: TuneInputs, views: ProgressViews) -> TuneResult:
    import torch

    started = time.perf_counter()
    on_cuda = torch.cuda.is_initialized()  # pinning only where the user's code uses CUDA
    model, run = inputs.model, inputs.run
    # The model's compute burns the training process's CPU when it ran on the CPU clock (or,
    # given as compute_ms=, when the code uses no GPU); on a GPU the host mostly waits.
    model_on_cpu = (
        (run.summary.get("clock") == "cpu")
        if model is not None and model.source.startswith("run")
        else not on_cuda
    )
    sweep = _sweep(inputs, views, started + inputs.budget, on_cuda, model_on_cpu)
    result = _result(inputs, sweep, model_on_cpu, started)
    views.finish(result)
    _remember(inputs.loader, result)
    return result


def _sweep(
    inputs: TuneInputs, views: ProgressViews, deadline: float, on_cuda: bool, model_on_cpu: bool
) -> Sweep:
    """Measure the candidates in turn within the budget, the side effects undone at the end:
    num_workers=0 first (the split), then the worker counts, then a deeper queue if needed."""
    model, run = inputs.model, inputs.run
    reserve = min(RESERVE_S, 0.1 * inputs.budget)
    # cpu is refined once num_workers=0 is measured
    sweep = Sweep([], None, stand_in_cpu(run, model, None, model_on_cpu))
    explicit = sorted(set(inputs.workers)) if inputs.workers is not None else None
    # Before num_workers=0 is measured, the sweep's length is a guess (the CPUs, and maybe
    # one more); each candidate's share is what is left over the candidates still expected.
    queue = [Setting(n, n > 0, None, on_cuda) for n in (explicit or [0])]
    phase = "explicit" if explicit is not None else "first"
    expected = len(worker_counts(inputs.cpus, False)) + 1
    before = child_pids()
    states = RandomStates.save(inputs.loader)
    model_rate_value = model.batches_per_s if model is not None else None
    with Deadlines() as deadlines:
        try:
            views.start(inputs.label, inputs.budget, model_rate_value)
            while queue:
                setting = queue.pop(0)
                now = time.perf_counter()
                left = deadline - reserve - now
                if left <= 0.05:
                    break
                remaining = {"first": expected, "sweep": len(queue) + 2}.get(phase, len(queue) + 1)
                share = max(left / remaining, min(MIN_SHARE_S, left))
                soft_end = now + share
                hard_end = min(soft_end + max(0.25, GRACE_SHARE * share), deadline - reserve)
                views.candidate(setting, len(sweep.rows) + 1, len(sweep.rows) + remaining)
                got = measure(
                    inputs.recipe,
                    setting,
                    deadlines,
                    soft_end,
                    hard_end,
                    split=setting.num_workers == 0,
                    pace_ms=model.compute_ms / model.batches_per_step if model else None,
                    cpu=sweep.cpu,
                )
                sweep.rows.append(got.row)
                sweep.split = got.split or sweep.split
                views.measured(got.row, sweep.rows)
                if _ended(sweep, got.row):
                    break
                queue, phase = _next_queue(inputs, sweep, queue, phase, on_cuda, model_on_cpu)
        except KeyboardInterrupt:
            sweep.stopped = True
        finally:
            with deadlines.held():
                deadlines.close_all()
                states.restore()
                reap(before)
    return sweep


def _ended(sweep: Sweep, row: Row) -> bool:
    """The stop button, or a candidate whose loader fails or is empty, ends the sweep."""
    if row.status == STOPPED:
        sweep.stopped = True
        return True
    if row.status in (ERROR, EMPTY):
        sweep.error = f"{row.setting.label()}: {row.message}"
        return True
    return False


def _next_queue(
    inputs: TuneInputs,
    sweep: Sweep,
    queue: list[Setting],
    phase: str,
    on_cuda: bool,
    model_on_cpu: bool,
) -> tuple[list[Setting], str]:
    """After num_workers=0: the worker counts for the CPUs (one more when samples wait on
    I/O); after the sweep: a deeper prefetch queue where the chosen count falls short."""
    model = inputs.model
    if phase == "first":
        sweep.cpu = stand_in_cpu(inputs.run, model, sweep.split, model_on_cpu)
        waiting = is_waiting(sweep.split.cpu_share if sweep.split is not None else None)
        counts = worker_counts(inputs.cpus, waiting)[1:]
        return [Setting(n, True, None, on_cuda) for n in counts], "sweep"
    model_rate_value = model.batches_per_s if model is not None else None
    if phase == "sweep" and (not queue or sweep_done(sweep.rows, model_rate_value)):
        return _deeper_queue(sweep.rows, model_rate_value, on_cuda), "deeper"
    return queue, phase


def _result(inputs: TuneInputs, sweep: Sweep, model_on_cpu: bool, started: float) -> TuneResult:
    """The verdict over the rows (tune_plan.conclude) as the result the user reads."""
    model, run, recipe, rows = inputs.model, inputs.run, inputs.recipe, sweep.rows
    current = recipe.current
    if model is not None:
        model = replace(model, cpu_share=sweep.cpu.share)
    from_run = run is not None and model is not None and model.source.startswith("run")
    saturated = saturation_text(run.summary) if from_run else None
    verdict = conclude(rows, model, current, inputs.cpus, sweep.split, model_on_cpu, saturated)
    dataset_name = name_of(recipe.dataset, inputs.names) or (
        f"{inputs.loader_name}.dataset" if inputs.loader_name else "dataset"
    )
    code = (
        code_line(dataset_name, recipe.batch_text, verdict.changes, current)
        if verdict.best is not None and verdict.changes
        else None
    )
    notes = list(inputs.notes)
    if recipe.iterable and any(r.setting.num_workers > 1 for r in rows):
        notes.append(
            "An IterableDataset: with several workers each one yields the whole stream unless "
            "the dataset splits it with get_worker_info(); the rates count every batch delivered."
        )
    return TuneResult(
        loader_label=inputs.label,
        rows=[r.to_dict() for r in rows],
        best=verdict.changes,
        best_settings=verdict.best.setting.kwargs() if verdict.best is not None else None,
        keeps_up=verdict.keeps_up,
        model_batches_per_s=model.batches_per_s if model is not None else None,
        model_source=model.source if model is not None else None,
        compute_ms=model.compute_ms if model is not None else None,
        batches_per_step=model.batches_per_step if model is not None else None,
        baseline_step_ms=model.step_ms if model is not None else None,
        predicted_step_ms=verdict.predicted_step_ms,
        predicted_speedup=verdict.predicted_speedup,
        code=code,
        split=sweep.split.to_dict() if sweep.split is not None else None,
        advice=list(verdict.advice) if verdict.best is not None or sweep.error is None else [],
        notes=notes + verdict.notes,
        stopped=sweep.stopped,
        error=sweep.error,
        budget_s=inputs.budget,
        elapsed_s=time.perf_counter() - started,
        cpus=inputs.cpus,
        model_cpu_share=sweep.cpu.share if model is not None else None,
    )


def _deeper_queue(rows: Sequence[Row], model: float | None, on_cuda: bool) -> list[Setting]:
    """After the sweep: the chosen worker count with a deeper prefetch queue, measured only when
    that count does not already keep the model fed with room to spare."""
    from ..analysis.tune_plan import choose, keeps_up

    best, _ = choose(rows, model)
    if best is None or best.setting.num_workers == 0 or keeps_up(best, model):
        return []
    return [Setting(best.setting.num_workers, True, DEEPER_PREFETCH, on_cuda)]

