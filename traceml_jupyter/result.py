"""A run's result: what a finished run measured and concluded, frozen when it finishes
(`Run.finish`), and its renderers: the text box, the lines after the verdict, the JSON of
`--save`. The HTML report (views/report.py) and the live chart's final state read the same.

As a profiler's session and its renderers: the capture writes into the run (the recording)
while the cell runs; the result is built from it once, and nothing renders the recording."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .analysis.phases import phase_sentence, phase_verdict
from .analysis.resources import finding_lines
from .analysis.step_parts import also_lines, parts_sentence
from .analysis.verdict import Verdict
from .analysis.verdict_box import rank_table, report_text, verdict_box

if TYPE_CHECKING:
    import numpy as np

SCHEMA_VERSION = 2  # 2 added, all nullable: the cell, the machine, resources, parts, GPU graphs


@dataclass(frozen=True)
class Result:
    """What a run measured and concluded; `run.result` once the run has finished.

    The verdict and its numbers:
        summary: the medians, shares and counts the verdict read (every key: docs/api.md,
            "The summary"); verdict: the Verdict (label, severity, why, next, evidence).
        columns: the per-step columns (numpy arrays: step, time_s, data_wait_ms, compute_ms,
            step_ms, their *_gpu_ms, the parts' forward_ms ... rest_ms; NaN where unmeasured);
        n_steps: the steps recorded; stride: 1, or every stride-th step kept (bounded memory).
    What ran:
        name, started_at, ended_at (time.time()), wall_ms (the whole cell), warmup (as asked);
        loop_line, loop_where ("this cell", "function train (cell In[3])"), cell_source,
        loop_cell_source (the cell of the function that holds the loop);
        step_kind ("optimizer", "backward", "iteration", "fetch", "none"), step_definition;
        loader_info (the training DataLoader's settings), sources (what fed the steps),
        phases (passes kept out of the steps), expected_steps, batch_size, batch_kind,
        batches_per_step; process_cpu_ms, thread_cpu_ms, thread_wait_ms (CPU time meanwhile).
    What ran it: machine (python, torch, cuda, platform, cpu, cpus, gpu), gpu_used,
        cuda_device, gpu_device, gpu_note (why GPU figures are missing), gpu_samples (NVML).
    Per feature (None where not measured): h2d, sync_stalls, line_costs, cuda_graphs, ranks,
        processes, loader_site, dataset_site; the resources: host, gpu_memory, held_before, oom.
    The kernel's reading: checklist (its items as dicts), quoted_cells (the earlier cells the
        report quotes). notes (what could not be measured or shown: the run's own list, which
        a view that fails later adds to) and error (what stopped the cell).
    Read back from a file (saved.py): unsaved names the fields its file did not hold (an older
    version wrote fewer keys); empty for a run of this kernel.
    """

    name: str
    started_at: float
    ended_at: float | None
    warmup: int | None
    summary: dict[str, Any]
    verdict: Verdict
    columns: dict[str, np.ndarray]
    n_steps: int
    stride: int
    wall_ms: float | None
    loop_line: int | None
    loop_where: str | None
    cell_source: str | None
    loop_cell_source: str | None
    step_kind: str
    step_definition: str
    loader_info: dict[str, Any] | None
    sources: list[dict[str, Any]]
    phases: list[dict[str, Any]]
    expected_steps: int | None
    batch_size: int | None
    batch_kind: str | None
    batches_per_step: float | None
    process_cpu_ms: float | None
    thread_cpu_ms: float | None
    thread_wait_ms: float | None
    machine: dict[str, Any] | None
    gpu_used: bool
    cuda_device: int | None
    gpu_device: str | None
    gpu_note: str | None
    gpu_samples: dict[str, Any] | None
    h2d: dict[str, Any] | None
    sync_stalls: dict[str, Any] | None
    line_costs: dict[str, Any] | None
    cuda_graphs: dict[str, Any] | None
    ranks: list[dict[str, Any]] | None
    processes: list[dict[str, Any]] | None
    loader_site: dict[str, Any] | None
    dataset_site: dict[str, Any] | None
    host: dict[str, Any] | None
    gpu_memory: dict[str, Any] | None
    held_before: dict[str, Any] | None
    oom: dict[str, Any] | None
    checklist: list[dict[str, Any]] | None
    quoted_cells: dict[str, str] | None
    notes: list[str]
    error: str | None
    unsaved: frozenset[str] = frozenset()

    @property
    def straggler(self) -> dict[str, Any] | None:
        """Several ranks: {"rank", "cause": input|h2d|compute|unknown, "score"} of the rank that
        holds the others back (RANK STRAGGLER), else None."""
        if not self.ranks:
            return None
        found = self.summary.get("straggler")
        return dict(found) if found else None


# -- renderers ------------------------------------------------------------------------------------


def box(result: Result) -> str:
    """The verdict box alone."""
    return verdict_box(result.verdict.label, result.summary)


def also(result: Result) -> list[tuple[str, str]]:
    """(severity, text) of the lines after the verdict: the rest of the step, advice by the
    part that dominates, each epoch's start-up, the trend over the run."""
    source = result.loop_cell_source if result.loop_cell_source else result.cell_source
    return also_lines(result.summary, result.line_costs, (source or "").splitlines())


def text(result: Result) -> str:
    """The text box: the verdict with its numbers, then the parts, the ranks, the phases, the
    findings, what stopped the cell and the notes (what a terminal prints)."""
    v, summary = result.verdict, result.summary
    head = f"traceml: {result.name} - {result.n_steps} steps ({result.step_definition})"
    if result.loop_line is not None:
        head += f", loop on line {result.loop_line}"
    if result.loop_where and result.loop_where != "this cell":
        head += f" of {result.loop_where}"
    lines = [report_text(head, v.label, v.why, v.next, summary)]
    split = parts_sentence(summary)
    if split:
        lines.append(f"Parts: {split}")
    lines.extend(f"Also: {line}" for _, line in also(result))
    if result.ranks:
        lines.append(rank_table(result.ranks, result.straggler, summary.get("rank_notes") or []))
    lines.extend(f"Phase: {phase_sentence(phase)}" for phase in result.phases)
    slow_phase = phase_verdict(result.phases)
    if slow_phase:
        lines.append(f"Also: {slow_phase}")
    lines.extend(f"Also: {line}" for line in finding_lines(summary))
    if result.error:
        lines.append(f"Stopped by: {result.error}")
    lines.extend(f"Note: {note}" for note in result.notes)
    return "\n".join(lines)


def to_dict(result: Result) -> dict[str, Any]:
    """What --save writes: JSON-ready, unmeasured values as null (docs/api.md, "The JSON")."""
    r, samples = result, result.gpu_samples
    return {
        "schema_version": SCHEMA_VERSION,
        "name": r.name,
        "started_at": r.started_at,
        "ended_at": r.ended_at,
        "verdict": r.verdict.to_dict(),
        "summary": jsonable(r.summary),
        "loop": {"line": r.loop_line, "where": r.loop_where},
        "cpu": {"process_ms": r.process_cpu_ms, "thread_ms": r.thread_cpu_ms, "thread_wait_ms": r.thread_wait_ms},
        "step": {"kind": r.step_kind, "definition": r.step_definition},
        "loader": jsonable(r.loader_info),
        "sources": jsonable(r.sources),
        "phases": jsonable(r.phases),
        "checklist": r.checklist,
        "error": r.error,
        "notes": list(r.notes),
        "steps": {k: jsonable(v.tolist()) for k, v in r.columns.items()},
        "stride": r.stride,
        "h2d": jsonable(r.h2d),
        "sync_stalls": jsonable(r.sync_stalls),
        "line_costs": jsonable(r.line_costs),
        "cuda_graphs": jsonable(r.cuda_graphs),
        "ranks": jsonable(r.ranks),
        "straggler": jsonable(r.straggler),
        "trend": jsonable(r.summary.get("trend")),
        "epoch_startup": jsonable(r.summary.get("epoch_startup")),
        "processes": jsonable(r.processes),
        "loader_site": jsonable(r.loader_site),
        "dataset_site": jsonable(r.dataset_site),
        # What a run read back needs to be shown and compared as it was (saved.py):
        "cell": {"source": r.cell_source, "loop_cell_source": r.loop_cell_source},
        "quoted_cells": r.quoted_cells,
        "machine": jsonable(r.machine),
        "batch": {"size": r.batch_size, "kind": r.batch_kind, "per_step": r.batches_per_step},
        "warmup": r.warmup,
        "wall_ms": r.wall_ms,
        "expected_steps": r.expected_steps,
        "gpu": {
            "used": bool(r.gpu_used),
            "cuda_device": r.cuda_device,
            "device": r.gpu_device,
            "note": r.gpu_note,
            "samples": jsonable({k: _list(v) for k, v in samples.items()} if samples else None),
        },
        "resources": jsonable(resources_dict(r)),
    }


def resources_dict(result: Result) -> dict[str, Any]:
    """What --save writes of the resources: the host's samples (columns) and workers, the
    GPU memory watch, what earlier cells held, an out-of-memory error, the findings; null
    where not measured. The per-step GPU memory columns are in `steps`."""
    host = dict(result.host) if result.host is not None else None
    if host is not None:
        host["samples"] = {k: v.tolist() for k, v in host.get("samples", {}).items()}
    return {
        "host": host,
        "gpu_memory": result.gpu_memory,
        "held_before": result.held_before,
        "oom": result.oom,
        "findings": result.summary.get("resource_findings"),
    }


def _list(values: Any) -> list[Any]:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def jsonable(value: Any) -> Any:
    """NaN and infinities become null (unmeasured), containers are walked."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
