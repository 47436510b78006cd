"""The one codec of a run's result: `to_dict` writes the JSON of `--save`, the history and
`Run.to_dict`; `from_dict` reads every schema version this package wrote back into a
`RunResult` (1, the first, and 2, whose added keys are all nullable: read where present, None
and named in `unsaved` where not). Keys this version does not know are kept and written back as
read. A document that is not a saved run raises LoadError with one line saying why."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypedDict, TypeVar, cast

import numpy as np

from ..analysis.checklist.facts import ItemRow
from ..analysis.compile import CompileFacts
from ..analysis.findings import FindingRow
from ..analysis.loader_inside import LoaderInside
from ..analysis.summary_keys import LineCosts, RankRow
from ..analysis.verdict import Verdict
from ..facts.gpu import Copies, CudaGraphs, SyncStalls
from ..facts.loader import CodeSite, LoaderFacts, PhaseRow, SourceRow
from ..facts.machine import MachineFacts
from ..facts.processes import ProcessRow
from ..facts.resources import GpuMemoryFacts, HeldBefore, HostFacts, OomFacts
from .value import (
    Columns,
    DataFeed,
    Facts,
    Gpu,
    KernelRead,
    Loop,
    Resources,
    RunResult,
    Steps,
    frozen_as,
    frozen_facts,
    frozen_rows,
    frozen_summary,
    jsonable,
    read_only,
)

T = TypeVar("T")
SCHEMA_VERSION = 2  # 2 added, all nullable: the cell, the machine, resources, parts, GPU graphs
KNOWN_SCHEMAS = range(1, SCHEMA_VERSION + 1)
REQUIRED_COLUMNS = ("step_ms", "data_wait_ms", "compute_ms")
# Where each field of a result is in the JSON (a dotted path; derived keys are not fields:
# straggler, trend, epoch_startup and resources.findings are read off the summary).
PATHS = {
    "name": "name", "started_at": "started_at", "ended_at": "ended_at", "summary": "summary",
    "verdict": "verdict", "line_costs": "line_costs", "compiled": "compile", "ranks": "ranks", "processes": "processes",
    "machine": "machine", "notes": "notes", "error": "error",
    "steps.columns": "steps", "steps.n_steps": "summary.n_steps", "steps.stride": "stride", "steps.kind": "step.kind",
    "steps.definition": "step.definition", "steps.warmup": "warmup",
    "steps.expected": "expected_steps", "steps.batch_size": "batch.size",
    "steps.batch_kind": "batch.kind", "steps.batches_per_step": "batch.per_step",
    "loop.line": "loop.line", "loop.where": "loop.where", "loop.cell_source": "cell.source",
    "loop.cell_filename": "cell.filename", "loop.loop_cell_source": "cell.loop_cell_source",
    "loop.wall_ms": "wall_ms", "loop.process_cpu_ms": "cpu.process_ms",
    "loop.thread_cpu_ms": "cpu.thread_ms", "loop.thread_wait_ms": "cpu.thread_wait_ms",
    "data.loader": "loader", "data.sources": "sources", "data.phases": "phases",
    "data.loader_site": "loader_site", "data.dataset_site": "dataset_site", "data.inside": "loader_inside",
    "gpu.used": "gpu.used", "gpu.cuda_device": "gpu.cuda_device", "gpu.device": "gpu.device",
    "gpu.note": "gpu.note", "gpu.samples": "gpu.samples", "gpu.h2d": "h2d",
    "gpu.sync_stalls": "sync_stalls", "gpu.cuda_graphs": "cuda_graphs",
    "resources.host": "resources.host", "resources.gpu_memory": "resources.gpu_memory",
    "resources.held_before": "resources.held_before", "resources.oom": "resources.oom",
    "reading.checklist": "checklist", "reading.quoted_cells": "quoted_cells",
}  # fmt: skip
FIELD_AT = {path: field for field, path in PATHS.items()}  # the field a document's key holds
DERIVED = ("straggler", "trend", "epoch_startup", "resources.findings", "schema_version")


class LoadError(ValueError):
    """A file that could not be read back as a run; the message is one line: 'PATH: why'."""


# -- writing ----------------------------------------------------------------------------------------


def to_dict(result: RunResult) -> dict[str, Any]:
    """What --save writes: JSON-ready, unmeasured values as null (docs/api.md, "The JSON")."""
    r, steps, loop, data, gpu = result, result.steps, result.loop, result.data, result.gpu
    checklist = r.reading.checklist
    out = {
        "schema_version": SCHEMA_VERSION,
        "name": r.name,
        "started_at": _number(r.started_at),
        "ended_at": r.ended_at,
        "verdict": r.verdict.to_dict(),
        "summary": jsonable(r.summary),
        "loop": {"line": loop.line, "where": loop.where},
        "cpu": {"process_ms": loop.process_cpu_ms, "thread_ms": loop.thread_cpu_ms, "thread_wait_ms": loop.thread_wait_ms},
        "step": {"kind": steps.kind, "definition": steps.definition},
        "loader": jsonable(data.loader),
        "sources": jsonable(data.sources),
        "phases": jsonable(data.phases),
        "checklist": jsonable(checklist) if checklist is not None else None,
        "error": r.error,
        "notes": list(r.notes),
        "steps": {k: jsonable(v.tolist()) for k, v in steps.columns.items()},
        "stride": steps.stride,
        "h2d": jsonable(gpu.h2d),
        "sync_stalls": jsonable(gpu.sync_stalls),
        "line_costs": jsonable(r.line_costs),
        "compile": jsonable(r.compiled),
        "cuda_graphs": jsonable(gpu.cuda_graphs),
        "ranks": jsonable(r.ranks),
        "straggler": jsonable(r.straggler),
        "trend": jsonable(r.summary.get("trend")),
        "epoch_startup": jsonable(r.summary.get("epoch_startup")),
        "processes": jsonable(r.processes),
        "loader_site": jsonable(data.loader_site),
        "dataset_site": jsonable(data.dataset_site),
        "loader_inside": jsonable(data.inside),
        "cell": {"source": loop.cell_source, "filename": loop.cell_filename, "loop_cell_source": loop.loop_cell_source},
        "quoted_cells": jsonable(r.reading.quoted_cells),
        "machine": jsonable(r.machine),
        "batch": {"size": steps.batch_size, "kind": steps.batch_kind, "per_step": steps.batches_per_step},
        "warmup": steps.warmup,
        "wall_ms": loop.wall_ms,
        "expected_steps": steps.expected,
        "gpu": {
            "used": bool(gpu.used),
            "cuda_device": gpu.cuda_device,
            "device": gpu.device,
            "note": gpu.note,
            "samples": jsonable({k: v.tolist() for k, v in gpu.samples.items()}) if gpu.samples is not None else None,
        },
        "resources": jsonable(resources_dict(r)),
    }
    for key, value in r.kept.items():  # what a later version wrote, as it was read
        if key == "steps":
            out["steps"].update(value)
        else:
            out.setdefault(key, value)
    return out


class ResourcesRow(TypedDict):
    """The JSON's `resources` (resources_dict): docs/resources.md says what each holds."""

    host: dict[str, object] | None
    gpu_memory: GpuMemoryFacts | None
    held_before: HeldBefore | None
    oom: OomFacts | None
    findings: list[FindingRow] | None


def resources_dict(result: RunResult) -> ResourcesRow:
    """What --save writes of the resources: the host's samples (columns) and workers, the
    GPU memory watch, what earlier cells held, an out-of-memory error, the findings; null
    where not measured. The per-step GPU memory columns are in `steps`."""
    res = result.resources
    host: dict[str, object] | None = None
    if res.host is not None:
        host = dict(res.host)
        host["samples"] = {k: _list(v) for k, v in (res.host.get("samples") or {}).items()}
    return {
        "host": host,
        "gpu_memory": res.gpu_memory,
        "held_before": res.held_before,
        "oom": res.oom,
        "findings": result.summary.get("resource_findings"),
    }


def _list(values: Any) -> list[Any]:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None


# -- reading ----------------------------------------------------------------------------------------


def check_document(document: Any, shown: str) -> Mapping[str, Any]:
    """The document itself when it is a saved run of a known schema version; LoadError else."""
    if not isinstance(document, Mapping) or "schema_version" not in document:
        raise LoadError(f"{shown}: not a traceml run (a JSON file without schema_version)")
    version = document["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise LoadError(f"{shown}: not a traceml run (schema_version {version!r})")
    if version > KNOWN_SCHEMAS[-1]:
        raise LoadError(
            f"{shown}: written by a newer traceml_jupyter (schema_version {version}; this one "
            f"reads 1 to {KNOWN_SCHEMAS[-1]}): upgrade traceml_jupyter to load it"
        )
    if version < 1:
        raise LoadError(f"{shown}: not a traceml run (schema_version {version})")
    for key, kind in (("name", str), ("summary", dict), ("verdict", dict), ("steps", dict)):
        if not isinstance(document.get(key), kind):
            what = "missing" if key not in document else f"a {type(document[key]).__name__}"
            raise LoadError(f"{shown}: not a complete traceml run ({key} is {what})")
    if not isinstance(document["verdict"].get("label"), str):
        raise LoadError(f"{shown}: not a complete traceml run (the verdict has no label)")
    return document


def from_dict(document: Mapping[str, Any], shown: str = "the document") -> RunResult:
    """The result a document of any known schema version holds (LoadError: one line on why it
    is not one). Fields its version did not write are None (or empty) and named in `unsaved`."""
    doc = check_document(document, shown)
    got = _Reader(doc)
    summary = doc["summary"]
    columns, odd_columns = _columns(doc["steps"], shown)
    gpu_samples = got.facts("gpu.samples")
    result = RunResult(
        name=str(doc["name"]),
        started_at=_float(doc.get("started_at")) or math.nan,
        ended_at=_float(doc.get("ended_at")),
        summary=frozen_summary(summary),
        verdict=Verdict.from_dict(doc["verdict"]),
        steps=_steps(got, read_only(columns), summary),
        loop=Loop(
            line=got.count("loop.line"),
            where=got.text("loop.where"),
            cell_source=got.text("cell.source"),
            cell_filename=got.text("cell.filename"),
            loop_cell_source=got.text("cell.loop_cell_source"),
            wall_ms=got.number("wall_ms"),
            process_cpu_ms=got.number("cpu.process_ms"),
            thread_cpu_ms=got.number("cpu.thread_ms"),
            thread_wait_ms=got.number("cpu.thread_wait_ms"),
        ),
        data=DataFeed(
            loader=frozen_as(LoaderFacts, got.facts("loader")),
            sources=got.rows(SourceRow, "sources") or (),
            phases=got.rows(PhaseRow, "phases") or (),
            loader_site=frozen_as(CodeSite, got.facts("loader_site")),
            dataset_site=frozen_as(CodeSite, got.facts("dataset_site")),
            inside=frozen_as(LoaderInside, got.facts("loader_inside")),
        ),
        gpu=Gpu(
            used=bool(got.value("gpu.used")) or summary.get("clock") == "gpu",
            cuda_device=got.count("gpu.cuda_device"),
            device=got.text("gpu.device"),
            note=got.text("gpu.note"),
            samples=read_only(_float_columns(gpu_samples)) if gpu_samples is not None else None,
            h2d=frozen_as(Copies, got.facts("h2d")),
            sync_stalls=frozen_as(SyncStalls, got.facts("sync_stalls")),
            cuda_graphs=frozen_as(CudaGraphs, got.facts("cuda_graphs")),
        ),
        resources=Resources(
            host=host_from_json(got.value("resources.host")),
            gpu_memory=frozen_as(GpuMemoryFacts, got.facts("resources.gpu_memory")),
            held_before=frozen_as(HeldBefore, got.facts("resources.held_before")),
            oom=frozen_as(OomFacts, got.facts("resources.oom")),
        ),
        line_costs=frozen_as(LineCosts, got.facts("line_costs")),
        compiled=frozen_as(CompileFacts, got.facts("compile")),
        ranks=got.rows(RankRow, "ranks"),
        processes=got.rows(ProcessRow, "processes"),
        machine=frozen_as(MachineFacts, got.facts("machine")),
        # the file's checklist rows as Item.to_dict wrote them (Item.from_dict reads any row)
        reading=KernelRead(got.rows(ItemRow, "checklist"), got.facts("quoted_cells")),
        notes=tuple(str(n) for n in doc.get("notes") or []),
        error=got.text("error"),
        schema_version=int(doc["schema_version"]),
        unsaved=frozenset(got.missing),
        kept=MappingProxyType(_unknown(doc, odd_columns)),
    )
    return result


def _steps(got: _Reader, columns: Columns, summary: Mapping[str, Any]) -> Steps:
    """The steps of a document: its columns, what a step was, the batch (older versions: from
    the summary)."""
    n_steps = _int_or_none(summary.get("n_steps"))
    return Steps(
        columns=columns,
        n_steps=n_steps if n_steps is not None else len(columns["step"]),
        stride=got.count("stride") or 1,
        kind=str(got.text("step.kind") or summary.get("step_kind") or "none"),
        definition=str(got.text("step.definition") or summary.get("step_definition") or "no step ran"),
        warmup=got.count("warmup"),
        expected=got.count("expected_steps"),
        batch_size=got.count("batch.size") or _int_or_none(summary.get("batch_size")),
        batch_kind=got.text("batch.kind"),
        batches_per_step=got.number("batch.per_step") or _float(summary.get("batches_per_step")),
    )


class _Reader:
    """Typed reads of a document's dotted keys; the fields whose key is absent are `missing`
    (the field's name as the result names it)."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        self.document = document
        self.missing: set[str] = set()

    def value(self, dotted: str) -> Any:
        value: Any = self.document
        for key in dotted.split("."):
            if not isinstance(value, Mapping) or key not in value:
                self.missing.add(FIELD_AT.get(dotted, dotted))
                return None
            value = value[key]
        return value

    def count(self, dotted: str) -> int | None:
        return _int_or_none(self.value(dotted))

    def number(self, dotted: str) -> float | None:
        return _float(self.value(dotted))

    def text(self, dotted: str) -> str | None:
        value = self.value(dotted)
        return value if isinstance(value, str) else None

    def facts(self, dotted: str) -> Facts | None:
        value = self.value(dotted)
        return frozen_facts(value) if isinstance(value, Mapping) else None

    def rows(self, kind: type[T], dotted: str) -> tuple[T, ...] | None:
        value = self.value(dotted)
        if not isinstance(value, list):
            return None
        return frozen_rows(kind, [row for row in value if isinstance(row, Mapping)])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_or_none(value: Any) -> int | None:
    return int(value) if _is_int(value) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _known_paths() -> set[str]:
    return {path.split(".")[0] for path in PATHS.values()} | {p.split(".")[0] for p in DERIVED}


def _unknown(document: Mapping[str, Any], odd_columns: Mapping[str, Any]) -> dict[str, Any]:
    """What a document holds that this version does not read (a later version's keys, a step
    column of another kind): kept to be written back as read."""
    known = _known_paths()
    out = {k: v for k, v in document.items() if k not in known}
    if odd_columns:
        out["steps"] = dict(odd_columns)
    return out


def _column(name: str, values: Any) -> np.ndarray | None:
    if not isinstance(values, list):
        return None
    try:
        array = np.array([math.nan if v is None else v for v in values], dtype=np.int64 if name == "step" else np.float64)
    except (TypeError, ValueError, OverflowError):
        return None
    if array.ndim != 1:
        return None
    array.flags.writeable = False
    return array


def _columns(steps: Mapping[str, Any], shown: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The saved per-step columns as read-only numpy arrays (null: NaN), and what `steps` holds
    that is no column of numbers of the steps' length (a later version's column of another kind,
    a column left null): kept as read. The step's own columns must be numbers, all of one length."""
    out: dict[str, np.ndarray] = {}
    for name in REQUIRED_COLUMNS:
        array = _column(name, steps.get(name))
        if array is None:
            what = "missing" if name not in steps else "not a list of numbers"
            raise LoadError(f"{shown}: steps.{name} is {what}")
        out[name] = array
    lengths = {len(a) for a in out.values()}
    if len(lengths) > 1:
        raise LoadError(f"{shown}: the per-step columns have different lengths {sorted(lengths)}")
    n = lengths.pop()
    odd: dict[str, Any] = {}
    for name, values in steps.items():
        if name in out:
            continue
        array = _column(str(name), values)
        if array is not None and len(array) == n:
            out[str(name)] = array
        else:
            odd[str(name)] = values
    if "step" not in out:
        out["step"] = np.arange(n, dtype=np.int64)
        out["step"].flags.writeable = False
    return out, odd


def _float_columns(columns: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {
        str(k): np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)
        for k, values in columns.items()
        if isinstance(values, (list, tuple, np.ndarray))
    }


def host_from_json(host: Any) -> HostFacts | None:
    """The host's samples as the report's plots read them (numpy columns, null: NaN), from
    their JSON (a saved run's, a child process's end)."""
    if not isinstance(host, Mapping):
        return None
    out: dict[str, Any] = dict(host)
    out["samples"] = read_only(_float_columns(out.get("samples") or {}))
    return cast(HostFacts, MappingProxyType(out))
