"""A finished run as a value: `RunResult`, made of one frozen section per feature. Built once
when a run finishes (`Run.finish`) or read back from its JSON (codec.from_dict); nothing
sets a field of it afterwards — the kernel's reading (the checklist, the cells it quotes) makes a
new value (`with_reading`). Its per-step arrays are read-only, its lists are tuples, its
mappings read-only views."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from types import MappingProxyType
from typing import Any, TypeVar, cast

import numpy as np

from ..analysis.checklist.facts import ItemRow
from ..analysis.compile import CompileFacts
from ..analysis.loader_inside import LoaderInside
from ..analysis.summary_keys import LineCosts, RankRow, Straggler, Summary
from ..analysis.verdict import Verdict
from ..facts.gpu import Copies, CudaGraphs, SyncStalls
from ..facts.loader import CodeSite, LoaderFacts, PhaseRow, SourceRow
from ..facts.machine import MachineFacts
from ..facts.processes import ProcessRow
from ..facts.resources import GpuMemoryFacts, HeldBefore, HostFacts, OomFacts

# One measured feature's facts, as the capture described them and the JSON holds them (its keys:
# docs/api.md and the feature's page).
Facts = Mapping[str, Any]
Columns = Mapping[str, np.ndarray]
T = TypeVar("T")
NO_FACTS: Facts = MappingProxyType({})


def jsonable(value: Any) -> Any:
    """Plain JSON-ready values: NaN and infinities become null (unmeasured), mappings dicts,
    tuples and arrays lists, numpy scalars Python numbers, sections dicts of their fields."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in fields(value)}
    return value


def read_only(columns: Mapping[str, np.ndarray]) -> Columns:
    """The columns as a read-only mapping of read-only arrays: an array that owns its data is
    locked in place (the recorder hands out fresh ones), a writable view is copied first (its
    base may still be written)."""
    out = {}
    for name, array in columns.items():
        if array.flags.writeable:
            if array.base is not None or not array.flags.owndata:
                array = array.copy()
            array.flags.writeable = False
        out[name] = array
    return MappingProxyType(out)


def frozen_facts(facts: Mapping[str, Any] | None) -> Facts | None:
    """A read-only view of a copy of `facts` (None stays None)."""
    return None if facts is None else MappingProxyType(dict(facts))


def frozen_summary(summary: Mapping[str, Any]) -> Summary:
    """A read-only view of a copy of `summary` (setting a key raises TypeError), read as the
    Summary it holds; `.copy()` gives a plain dict of it."""
    return cast(Summary, MappingProxyType(dict(summary)))


def frozen_as(kind: type[T], facts: Mapping[str, Any] | None) -> T | None:
    """A read-only view of a copy of `facts` (None stays None), read as the TypedDict `kind` its
    builder (or the file it was read from) gives it."""
    return None if facts is None else cast(T, MappingProxyType(dict(facts)))


def frozen_rows(kind: type[T], rows: Sequence[Mapping[str, Any]] | None) -> tuple[T, ...] | None:
    """Rows (ranks, processes, sources) as a tuple of read-only views (None stays None), each
    read as the TypedDict `kind` its builder (or the file it was read from) gives it."""
    return None if rows is None else tuple(cast(T, MappingProxyType(dict(row))) for row in rows)


@dataclass(frozen=True, eq=False)  # arrays: compare results (RunResult.__eq__)
class Steps:
    """The steps: their per-step columns (step, time_s, data_wait_ms, compute_ms, step_ms, their
    *_gpu_ms, the parts' forward_ms ... rest_ms, the GPU memory and NVML columns; NaN where
    unmeasured), how many were recorded, `stride` (1, or every stride-th step kept: bounded
    memory), what a step was (`kind`: optimizer | backward | iteration | fetch | none, and the
    sentence `definition`), the warm-up as asked, the steps a pass was expected to have, the
    batch (size, kind, batches per step)."""

    columns: Columns
    n_steps: int
    stride: int = 1
    kind: str = "none"
    definition: str = "no step ran"
    warmup: int | None = None
    expected: int | None = None
    batch_size: int | None = None
    batch_kind: str | None = None
    batches_per_step: float | None = None


@dataclass(frozen=True)
class Loop:
    """Where the loop was and what ran it: its line and place ("this cell", "function train
    (cell In[3])"), the traced cell's text and its file name (linecache's), the text of the cell
    whose function holds the loop, the whole cell's wall time, and the CPU time meanwhile (the
    process's, the training thread's, and the thread's wait for a core)."""

    line: int | None = None
    where: str | None = None
    cell_source: str | None = None
    cell_filename: str | None = None
    loop_cell_source: str | None = None
    wall_ms: float | None = None
    process_cpu_ms: float | None = None
    thread_cpu_ms: float | None = None
    thread_wait_ms: float | None = None


@dataclass(frozen=True)
class DataFeed:
    """What fed the steps: the training DataLoader's settings (`loader`), every data source
    (`sources`) and the passes kept out of the steps (`phases`), where the loader and its dataset
    were built (file, line[, class]), what happened inside its workers (`inside`:
    docs/loader-inside.md)."""

    loader: LoaderFacts | None = None
    sources: tuple[SourceRow, ...] = ()
    phases: tuple[PhaseRow, ...] = ()
    loader_site: CodeSite | None = None
    dataset_site: CodeSite | None = None
    inside: LoaderInside | None = None


@dataclass(frozen=True, eq=False)  # arrays: compare results (RunResult.__eq__)
class Gpu:
    """The GPU side (docs/gpu.md): whether the loop ran on CUDA, its device index and name, why
    GPU figures are missing (`note`), the NVML samples (time_s, gpu_util_pct, gpu_mem_used_mib),
    the copies to the GPU (`h2d`), the syncs that stalled the host, the CUDA graphs replayed."""

    used: bool = False
    cuda_device: int | None = None
    device: str | None = None
    note: str | None = None
    samples: Columns | None = None
    h2d: Copies | None = None
    sync_stalls: SyncStalls | None = None
    cuda_graphs: CudaGraphs | None = None


@dataclass(frozen=True, eq=False)  # arrays: compare results (RunResult.__eq__)
class Resources:
    """The resources (docs/resources.md): the host's CPU and memory samples and workers, the GPU
    memory watch, what earlier cells held on the GPU, an out-of-memory error's facts."""

    host: HostFacts | None = None
    gpu_memory: GpuMemoryFacts | None = None
    held_before: HeldBefore | None = None
    oom: OomFacts | None = None


@dataclass(frozen=True)
class KernelRead:
    """What the kernel read when the run ended: the checklist as evaluated (its items as dicts)
    and the earlier cells the report quotes ({"In [2]": text})."""

    checklist: tuple[ItemRow, ...] | None = None
    quoted_cells: Mapping[str, str] | None = None


@dataclass(frozen=True)
class RunResult:
    """What a run measured and concluded: `run.result` once it has finished, and what
    `traceml_jupyter.load` reads back. Every renderer (the text box, the HTML report, the live
    chart's last frame, JSON, compare) takes this value.

        name, started_at, ended_at (time.time()), summary (the numbers the verdict read: every
        key in docs/api.md), verdict (label, severity, why, next, evidence);
        steps (Steps), loop (Loop), data (DataFeed), gpu (Gpu), resources (Resources);
        line_costs (cost per line of the loop body), compiled (what torch.compile did: its
        compile intervals, frames compiled, graph breaks; docs/compile.md), ranks (one row per rank), processes (the
        child processes the cell started), machine (python, torch, cuda, platform, cpu, cpus,
        gpu); reading (KernelRead: the checklist, the quoted cells); notes (what could not be
        measured or shown), error (what stopped the cell).
    Read back from a file: schema_version (the file's), unsaved (the fields its file did not
    hold: an older version wrote fewer keys) and kept (what the file held that this version
    does not read: written back as read)."""

    name: str
    started_at: float
    ended_at: float | None
    summary: Summary
    verdict: Verdict
    steps: Steps
    loop: Loop = field(default_factory=Loop)
    data: DataFeed = field(default_factory=DataFeed)
    gpu: Gpu = field(default_factory=Gpu)
    resources: Resources = field(default_factory=Resources)
    line_costs: LineCosts | None = None
    compiled: CompileFacts | None = None
    ranks: tuple[RankRow, ...] | None = None
    processes: tuple[ProcessRow, ...] | None = None
    machine: MachineFacts | None = None
    reading: KernelRead = field(default_factory=KernelRead)
    notes: tuple[str, ...] = ()
    error: str | None = None
    schema_version: int | None = None
    unsaved: frozenset[str] = frozenset()
    kept: Facts = field(default_factory=lambda: NO_FACTS)

    def __eq__(self, other: object) -> bool:
        """Two results are equal when their fields hold the same values (arrays by value, NaN
        as null: what their JSON would hold), whatever file or kernel they came from (where
        they came from — schema_version, unsaved, kept — is not compared)."""
        if not isinstance(other, RunResult):
            return NotImplemented
        return bool(_content(self) == _content(other))

    __hash__ = None  # type: ignore[assignment]

    @property
    def n_steps(self) -> int:
        """The steps recorded."""
        return self.steps.n_steps

    @property
    def columns(self) -> Columns:
        """The per-step columns (Steps.columns)."""
        return self.steps.columns

    @property
    def straggler(self) -> Straggler | None:
        """Several ranks: {"rank", "cause": input|h2d|compute|unknown, "score"} of the rank that
        holds the others back (RANK STRAGGLER), else None."""
        found = self.summary.get("straggler") if self.ranks else None
        return cast(Straggler, MappingProxyType(dict(found))) if found else None

    def with_reading(self, checklist: Sequence[ItemRow] | None, quoted_cells: Mapping[str, str] | None) -> RunResult:
        """The same result with what the kernel read at its end (a new value)."""
        cells = MappingProxyType(dict(quoted_cells)) if quoted_cells is not None else None
        rows = tuple(cast(ItemRow, MappingProxyType(dict(row))) for row in checklist) if checklist is not None else None
        return replace(self, reading=KernelRead(rows, cells))


PROVENANCE = ("schema_version", "unsaved", "kept")


def _content(result: RunResult) -> Any:
    return {f.name: jsonable(getattr(result, f.name)) for f in fields(result) if f.name not in PROVENANCE}
