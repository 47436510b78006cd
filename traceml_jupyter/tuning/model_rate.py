"""The model's side of `%traceml tune`: its rate (from compute_ms= or the last run on this loader)
and how its stand-in replays its compute (CPU work burnt, the rest slept)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..analysis.tune_plan import ModelCpu, ModelRate, Split, model_cpu


def run_loader(run: Any) -> Any:
    """The DataLoader the run trained on, while it is alive; else None."""
    ref = getattr(run, "loader_ref", None)
    return ref() if ref is not None else None


def model_rate(
    loader: Any, run: Any, compute_ms: float | None
) -> tuple[ModelRate | None, list[str]]:
    """The model's rate: from `compute_ms`, else from the last run when it trained on this
    loader (or on one with the same dataset and batch size)."""
    notes: list[str] = []
    summary: Mapping[str, Any] = {}
    same = False
    if run is not None:
        trained = run_loader(run)
        same = trained is loader or (
            trained is not None
            and getattr(trained, "dataset", None) is getattr(loader, "dataset", object())
            and getattr(trained, "batch_size", None) == getattr(loader, "batch_size", None)
        )
        if trained is None and loader is not None:
            same = True
            notes.append(
                f"The model's rate is run {run.name!r}'s; its loader is gone, so the same "
                "batches are assumed."
            )
        if same:
            summary = run.summary
        elif compute_ms is None:
            notes.append(
                f"The last run ({run.name!r}) trained on another loader: pass compute_ms= "
                "(compute per step, ms) to predict the step."
            )
    per_step = summary.get("batches_per_step")
    batches = float(per_step) if per_step else 1.0
    # The speed-up's base is the run's time per step (its mean step): what an epoch takes. A
    # loader whose workers deliver in bursts gives many short steps and a few long ones, and
    # the median step would miss the long ones.
    step = ((summary.get("stats") or {}).get("step_ms") or {}).get("mean") or summary.get("step_ms")
    if compute_ms is not None:
        return ModelRate(float(compute_ms), batches, f"compute_ms={compute_ms:g}", step), notes
    compute = summary.get("compute_ms")
    if compute is None or not compute > 0:
        return None, notes
    return ModelRate(float(compute), batches, f"run {run.name!r}", step), notes


def stand_in_cpu(run: Any, model: ModelRate | None, split: Split | None, on_cpu: bool) -> ModelCpu:
    """How the model's stand-in replays its compute (paced()): the run's measured CPU work
    (model_cpu), else all of it burnt on the CPU clock and all of it slept on a GPU."""
    found = None
    if model is not None and model.source.startswith("run") and run is not None:
        import numpy as np

        steps = run.steps
        loading = None
        if split is not None and split.cpu_share is not None:
            loading = split.cpu_share * split.batch_ms  # CPU ms a batch at num_workers=0
        found = model_cpu(
            run.result.loop.process_cpu_ms,
            float(np.nansum(steps["compute_ms"])),
            len(steps["compute_ms"]) * model.batches_per_step,
            loading,
            float(np.nansum(steps["data_wait_ms"])),
            run.result.loop.thread_cpu_ms,
            run.result.loop.thread_wait_ms,
        )
    return found if found is not None else ModelCpu(1.0 if on_cpu else 0.0)


