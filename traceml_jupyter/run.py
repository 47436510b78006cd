"""A traced run: what its capture recorded, and the result users read (summary, verdict, text,
JSON). The capture (capture.py) does the measuring; views read the run."""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from .analysis.compare import Comparison, compare_summaries
from .analysis.phases import phase_sentence, phase_verdict, step_definition
from .analysis.resources import finding_lines
from .analysis.step_parts import also_lines, epoch_startup, parts_sentence, parts_summary, trend
from .analysis.summary import summarize, with_batch_size
from .analysis.verdict import Verdict, diagnose
from .analysis.verdict_box import rank_table, report_text, verdict_box
from .capture.host import usable_cpus
from .capture.machine import describe_machine
from .capture.probes import safe_len
from .capture.recorder import Recorder

if TYPE_CHECKING:
    import numpy as np

    from .ranks import Collector, LocalRank

SCHEMA_VERSION = 2  # 2 added, all nullable: the cell, the machine, resources, parts, GPU graphs
REFRESH_NS = 250_000_000  # observers (the live view) run at most 4 times a second

Observer = Callable[["Run"], None]
# Formats other than JSON that `Run.save` writes, by file suffix: a view registers its writer
# (views/report_file.py: ".html", the report as one standalone page); the run knows no view.
FileWriter = Callable[["Run", str], None]
FILE_WRITERS: dict[str, FileWriter] = {}

_RUNS: list[Run] = []


def runs() -> list[Run]:
    """Every run of this kernel, oldest first."""
    return list(_RUNS)


def last() -> Run | None:
    """The most recent run, or None before any."""
    return _RUNS[-1] if _RUNS else None


def find_run(name: str) -> Run | None:
    for run in reversed(_RUNS):
        if run.name == name:
            return run
    return None


def compare(a: Run | str | None = None, b: Run | str | None = None) -> Comparison:
    """Compare two runs (Run objects or names given with --name).

    With no argument: the last two runs. With one: that run against the latest run.
    """
    all_runs = runs()
    if a is None and b is None:
        if len(all_runs) < 2:
            raise ValueError(f"compare needs two runs; this kernel has {len(all_runs)}")
        run_a, run_b = all_runs[-2], all_runs[-1]
    elif a is None or b is None:
        run_a = resolve_run(a if a is not None else b)  # type: ignore[arg-type]
        if not all_runs:
            raise ValueError(f"compare {run_a.name!r} with what? This kernel has no run: name two")
        run_b = all_runs[-1]
        if run_a is run_b:
            raise ValueError(f"{run_a.name!r} is the latest run: name a second run to compare")
    else:
        run_a, run_b = resolve_run(a), resolve_run(b)
    workers = (run_b.loader_info or {}).get("num_workers")
    cpus = (run_b.machine or {}).get("cpus")
    return compare_summaries(
        run_a.name,
        run_a.summary,
        run_a.verdict,
        run_b.name,
        run_b.summary,
        run_b.verdict,
        workers_b=workers if isinstance(workers, int) else None,
        cpus=cpus if isinstance(cpus, int) else usable_cpus(),
        steps_a=run_a.steps,
        steps_b=run_b.steps,
        machine_a=run_a.machine,
        machine_b=run_b.machine,
    )


def resolve_run(which: Run | str) -> Run:
    """A run itself, or the latest run with that name; ValueError names the known runs."""
    if not isinstance(which, str):
        return which
    found = find_run(which)
    if found is None:
        known = ", ".join(repr(r.name) for r in runs()) or "none yet"
        raise ValueError(f"no run named {which!r}; known runs: {known}")
    return found


# The last `%traceml tune` (tuning/) and the loader it measured: the checklist quotes it.
_LAST_TUNE: dict[str, Any] = {}


def remember_tune(loader: Any, result: dict[str, Any]) -> None:
    """Keep the last tune's result (to_dict()) with weak references to what it measured."""
    refs: list[Any] = []
    for obj in (loader, getattr(loader, "dataset", None)):
        try:
            refs.append(weakref.ref(obj))
        except TypeError:
            refs.append(None)
    _LAST_TUNE.clear()
    _LAST_TUNE.update(loader=refs[0], dataset=refs[1], batch_size=getattr(loader, "batch_size", None), result=result)


def tuned_for(loader: Any) -> dict[str, Any] | None:
    """The last tune's result when it measured this loader, or one over the same dataset with
    the same batch size; else None."""
    if loader is None or not _LAST_TUNE:
        return None
    same = _LAST_TUNE["loader"] is not None and _LAST_TUNE["loader"]() is loader
    if not same and _LAST_TUNE["dataset"] is not None:
        same = _LAST_TUNE["dataset"]() is getattr(loader, "dataset", object()) and _LAST_TUNE[
            "batch_size"
        ] == getattr(loader, "batch_size", None)
    return dict(_LAST_TUNE["result"]) if same else None


def clear() -> int:
    """Forget every run of this kernel (their charts stay on screen). Returns how many."""
    n = len(_RUNS)
    _RUNS.clear()
    _KEPT_LOADER.clear()
    return n


# The last run's training loader when the loader itself is gone (built inside a function of a
# script run with `%run`): a copy without its iterator (no worker processes), kept for
# `%traceml tune` until the next run or clear().
_KEPT_LOADER: dict[str, Any] = {}
TWINS_KEPT = 4  # copies of the run's newest DataLoaders kept while it runs


def keep_training_loader(run: Run, twin: Any) -> None:
    """After `run`'s capture: keep `twin` as its training loader if the loader is gone."""
    _KEPT_LOADER.clear()
    ref = run.loader_ref
    if twin is None or ref is None or ref() is not None:
        return
    _KEPT_LOADER.update(run=weakref.ref(run), loader=twin)

    def kept() -> Any:
        owner = _KEPT_LOADER.get("run")
        return _KEPT_LOADER.get("loader") if owner is not None and owner() is run else None

    run.loader_ref = kept


class Run:
    """One traced run: what was captured while it ran (capture.py), then its summary and verdict.

    Steps are what the training does (step_model.py): one optimizer step, else one backward(),
    else one iteration of the located loop, else the interval between two batches.
    """

    frozen = False  # a run read back from its saved JSON (saved.py): nothing of it is live

    def __init__(self, name: str | None = None, warmup: int | None = None) -> None:
        self.name = name or f"run {len(_RUNS) + 1}"
        self.warmup = warmup
        self.started_at = time.time()
        self.recorder = Recorder()
        self.recorder.origin_ns = perf_counter_ns()
        self.batch_size: int | None = None
        self.batch_kind: str | None = None
        self.batches_per_step: float | None = None
        self.loop_line: int | None = None
        self.loop_where: str | None = None  # "this cell", "function train (cell In[3])", ...
        self.loop_is_range = False  # the located loop iterates range(...): its items are no batches
        self.loop_cell_source: str | None = None  # the cell of the function holding the loop
        self.loop_iter_text: str | None = None  # the located loop's iterable as written: `slow()`
        self.loop_iterable_type: str | None = None  # what it was when it ran: "generator", ...
        self.fetch_calls: dict[int, str] = {}  # the loop body's fetch calls by line: get_batch(...)
        self.model_compiled = False  # a torch.compile'd module is in the namespace
        self.cell_source: str | None = None
        self.cell_filename: str | None = None
        self.loader_info: dict[str, Any] | None = None  # the training loader's settings
        self.loader_ref: Callable[[], Any] | None = None
        self.loader_name: str | None = None  # the name the training loader is bound to
        self.expected_steps: int | None = None
        self.step_kind = "none"  # "optimizer", "backward", "iteration", "fetch" or "none"
        self.step_definition = "no step ran"
        self.sources: list[dict[str, Any]] = []  # where batches came from (per loader)
        self.phases: list[dict[str, Any]] = []  # passes kept out of the steps (validation...)
        self.wall_ms: float | None = None  # the whole capture (the cell), for phase shares
        self.process_cpu_ms: float | None = None  # the process's CPU time (all threads) meanwhile
        self.thread_cpu_ms: float | None = None  # the training thread's CPU time (Linux)
        self.thread_wait_ms: float | None = None  # ... and its time ready but waiting for a core
        self.notes: list[str] = []
        self.error: str | None = None
        self.error_before_first_step = False
        self.finished = False
        self.ended_at: float | None = None
        self.cuda_device: int | None = None  # the CUDA device the loop ran on (capture decides)
        self.capture_thread: int | None = None
        self._capture: Any = None  # capture.Capture while recording
        self._gpu_used = False
        self._observers: list[Observer] = []
        self._next_tick = 0
        self._loops_started = 0
        self._loader_infos: dict[Any, dict[str, Any]] = {}
        self._loader_twins: dict[Any, Any] = {}  # stand-ins of its DataLoaders (keep_training_loader)
        self._summary: dict[str, Any] | None = None
        self._columns: dict[str, np.ndarray] | None = None  # once finished (each read is O(steps))
        self._verdict: Verdict | None = None
        # Optional watches (gpu_watch.GpuWatch, line_costs): per-step columns they measure,
        # aligned to the recorder's steps on demand, and the few facts the verdict quotes.
        self.extra_columns: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
        self.watch_summary: dict[str, Any] = {}
        self.gpu_watch: Any = None  # loop_started(device) and step_ended(t); CUDA path only
        self.h2d: dict[str, Any] | None = None  # host-to-device copies by line (h2d.py)
        self.sync_stalls: dict[str, Any] | None = None  # synchronising calls by line
        self.line_costs: dict[str, Any] | None = None  # ms per step of each body line
        # forward / backward / optimizer / rest of sampled steps (capture/step_parts.py), and
        # the steps where each pass over the training loader started (its start-up wait)
        self.step_parts: Any = None
        self.pass_starts: list[int] = []
        self.cuda_graphs: dict[str, Any] | None = None  # CUDA graphs captured/replayed (cuda_graphs.py)
        self._gpu_samples: dict[str, Any] | None = None
        self.gpu_note: str | None = None  # why GPU figures are missing (nvml.py), else None
        self.gpu_device: str | None = None  # e.g. "NVIDIA H200, 0000:17:00.0, 143771 MiB"
        # Resources (capture/resources.py): the watch while the run is captured, then what it
        # saw: host CPU and memory samples and workers (host.py), the GPU memory watch's facts,
        # what earlier cells held on the GPU, an out-of-memory error's facts.
        self.resource_watch: Any = None
        self.host: dict[str, Any] | None = None
        self.gpu_memory: dict[str, Any] | None = None
        self.held_before: dict[str, Any] | None = None
        self.oom: dict[str, Any] | None = None
        # Several processes (ranks.py): every rank's summary once known, and what feeds them
        # while they run (the kernel's reader of forked ranks, or a torchrun rank's own).
        self.ranks: list[dict[str, Any]] | None = None
        # The checklist as the report shows it (set by whoever shows the report: it reads the
        # kernel's history and the loader, which a run does not).
        self.checklist: list[dict[str, Any]] | None = None
        # The earlier cells the report quotes ({"In [2]": text}: where the DataLoader was built,
        # the loop's cell, lines to change), kept with the checklist so a saved run reads the same.
        self.quoted_cells: dict[str, str] | None = None
        self._machine: dict[str, Any] | None = None
        # Several processes: the collector of the forked ranks' steps (ranks.Collector), or this
        # torchrun rank's own backward() per step (ranks.LocalRank); None for one process.
        self.rank_collector: Collector | LocalRank | None = None
        # Processes the cell started (children.py): each one's pid, command, steps, status; and,
        # when the run shows a child's steps, where its loader and its dataset's __getitem__ are.
        self.processes: list[dict[str, Any]] | None = None
        self.loader_site: dict[str, Any] | None = None  # {"file", "line"}
        self.dataset_site: dict[str, Any] | None = None  # {"file", "line", "class"}
        _RUNS.append(self)

    # -- while it runs ----------------------------------------------------------------------
    def loop(self, iterable: Iterable[Any]) -> Iterable[Any]:
        """Iterate `iterable` as a plain for loop would, timing each fetch and each iteration
        (the `trace()` API; inside `%%traceml` the located loop is wrapped for you)."""
        capture = self._capture
        if capture is None or capture.thread != threading.get_ident():
            return iterable
        return capture.loop(iterable)  # type: ignore[no-any-return]

    def current_step(self) -> int | None:
        """Index of the step being run on the capture's thread; None elsewhere or between runs."""
        capture = self._capture
        if capture is None or capture.thread != threading.get_ident():
            return None
        return capture.current_step()  # type: ignore[no-any-return]

    def note_loop_iterable(self, iterable: Any) -> None:
        """After the located loop's first batch: how many iterations a pass has, if it says
        (else the length of the DataLoader it iterates: `enumerate(loader)`, `tqdm(loader)`)."""
        from .capture.sources import loop_iterable_type

        self.expected_steps = safe_len(iterable)
        self.loop_iterable_type = loop_iterable_type(iterable)
        if self.expected_steps is None and self._loader_infos:
            self.expected_steps = list(self._loader_infos.values())[-1].get("len")

    def note_dataloader(self, source: Any, loader: Any) -> None:
        """A DataLoader's first iter() in the run: keep its settings (read once, guarded)."""
        from .capture.dataloaders import describe_loader

        try:
            self._loader_infos[source.key] = describe_loader(loader)
        except Exception:
            self._loader_infos[source.key] = {}
        from .capture.dataloaders import stand_in

        while len(self._loader_twins) >= TWINS_KEPT:
            self._loader_twins.pop(next(iter(self._loader_twins)))
        self._loader_twins[source.key] = stand_in(loader)

    # -- observers (the live view) ---------------------------------------------------------
    def observe(self, observer: Observer) -> None:
        self._observers.append(observer)
        self._next_tick = 0
        if self._capture is not None:
            self._capture.listen()

    def _tick(self, now: int) -> None:
        self._next_tick = now + REFRESH_NS
        for observer in list(self._observers):
            try:
                observer(self)
            except Exception as exc:  # a broken view must never stop training
                self._observers.remove(observer)
                self.notes.append(f"The live view stopped: {type(exc).__name__}: {exc}")

    # -- the end ---------------------------------------------------------------------------
    def captured(self, capture: Any, wall_ns: int) -> None:
        """What the capture saw, once it closed: where batches came from, which of them fed the
        steps (the training loader), the phases kept out, and what a step was."""
        from .capture.sources import describe_run_sources

        self.wall_ms = wall_ns / 1e6
        facts = describe_run_sources(self, capture)
        self.sources, self.phases = facts.sources, facts.phases
        self.step_kind, self.batches_per_step = facts.step_kind, facts.batches_per_step
        self.step_definition = step_definition(
            facts.step_kind, facts.optimizer, facts.batches_per_step, self.loop_line, self.loop_where
        )
        self.model_compiled = facts.model_compiled
        self.batch_size, self.batch_kind = facts.batch_size, facts.batch_kind
        if facts.loader_info is not None:
            self.loader_info = facts.loader_info
        self.loader_ref, self.loader_name = facts.loader_ref, facts.loader_name
        self.pass_starts = list(facts.pass_steps)
        self.notes.extend(facts.notes)
        key = next((s.key for s in capture.model.sources.values() if s.ref is not None and s.ref is facts.loader_ref), None)
        keep_training_loader(self, self._loader_twins.get(key) if key is not None else None)
        self._loader_twins.clear()
        if isinstance(key, int) and key in capture.loader_sites:  # built while the run recorded
            from .capture.dataloaders import split_site

            self.loader_site, self.dataset_site = split_site(capture.loader_sites[key])

    def finish(self, error: BaseException | None = None) -> Run:
        """Close the run (after its capture): the final refresh of its views, then the summary
        and the verdict are computed when first read."""
        if self.finished:
            return self
        if error is not None:
            self.error = f"{type(error).__name__}: {error}".rstrip(": ")
            self.error_before_first_step = self.recorder.n_steps == 0
        self.finished = True
        self.ended_at = time.time()
        for observer in list(self._observers):
            try:
                observer(self)
            except Exception:
                pass
        self._observers.clear()
        return self

    def columns(self) -> dict[str, np.ndarray]:
        """The recorder's kept steps, with the columns of the optional watches and the NVML
        samples (gpu_util_pct, gpu_mem_used_mib) placed on the same steps."""
        if self._columns is not None and self.finished:
            return dict(self._columns)
        cols = self._read_columns()
        if self.finished:
            self._columns = cols
            return dict(cols)
        return cols

    def _read_columns(self) -> dict[str, np.ndarray]:
        cols = self.recorder.columns()
        for name, column in self.extra_columns.items():
            cols[name] = column(cols["step"])
        if self.step_parts is not None:
            cols.update(self.step_parts.columns(cols))
        samples = self._gpu_samples
        if samples is not None and len(samples.get("time_s", ())):
            from .capture.nvml import at_steps

            cols.update(at_steps(samples, cols["time_s"], cols.get("gpu_backlog_ms")))
        return cols

    @property
    def gpu_samples(self) -> dict[str, Any] | None:
        """NVML samples of the run's GPU (time_s, gpu_util_pct, gpu_mem_used_mib), set by the
        live view when it closes; setting them refreshes the summary."""
        return self._gpu_samples

    @gpu_samples.setter
    def gpu_samples(self, samples: dict[str, Any] | None) -> None:
        self._gpu_samples = samples
        self._summary, self._verdict, self._columns = None, None, None

    def _analysis(self) -> tuple[dict[str, Any], Verdict]:
        if self._summary is None or self._verdict is None or not self.finished:
            rec = self.recorder
            cols = self.columns()
            summary = summarize(cols, rec.n_steps, self.warmup, self._gpu_used, rec.totals())
            summary.update(self.watch_summary)
            summary.update(self._source_summary())
            summary.update(self._inside_the_step(cols, summary))
            with_batch_size(summary, self.batch_size, self.batches_per_step)
            summary.update(self._resource_summary(cols, int(summary["warmup_steps"])))
            verdict = diagnose(summary)
            if self.ranks:
                from .analysis.rank_verdict import with_ranks

                summary, verdict = with_ranks(summary, self.ranks)
            if not self.finished:
                return summary, verdict
            self._summary, self._verdict = summary, verdict
        return self._summary, self._verdict

    def _source_summary(self) -> dict[str, Any]:
        """What the verdict quotes of the data sources and the phases."""
        training = next((src for src in self.sources if src.get("training")), None)
        return {
            "step_kind": self.step_kind,
            "step_definition": self.step_definition,
            "batches_per_step": self.batches_per_step,
            "data_source": training.get("label") if training else None,
            "data_source_kind": training.get("kind") if training else None,
            "data_source_type": training.get("type") if training else None,
            "data_source_line": training.get("line") if training else None,
            "phases": list(self.phases),
            "wall_ms": self.wall_ms,
            "model_compiled": self.model_compiled,
        }

    def _inside_the_step(self, cols: dict[str, np.ndarray], summary: dict[str, Any]) -> dict[str, Any]:
        """The parts of the step, the trend over the run and each epoch's start-up wait."""
        analysed = cols["step"] >= int(summary["warmup_steps"])
        clock = str(summary["clock"])
        out = parts_summary(cols, analysed, clock)
        parts = self.step_parts
        out.update(parts.facts() if parts is not None else {"forward_state": None, "forward_modules": [], "optimizers": []})
        out["trend"] = trend(cols, analysed, clock)
        total = (summary.get("totals_ms") or {}).get("step_gpu_ms" if clock == "gpu" else "step_ms")
        out["epoch_startup"] = epoch_startup(cols, self.pass_starts, total, self.loader_info, clock)
        return out

    def also(self) -> list[tuple[str, str]]:
        """(severity, text) of the lines after the verdict: the rest of the step, advice by the
        part that dominates, each epoch's start-up, the trend over the run."""
        source = self.loop_cell_source if self.loop_cell_source else self.cell_source
        return also_lines(self.summary, self.line_costs, (source or "").splitlines())

    def _resource_summary(self, cols: dict[str, Any], warmup: int) -> dict[str, Any]:
        """GPU memory, CPU and host memory in numbers and findings (analysis/resources.py)."""
        from .analysis.kept_graph import kept_graphs
        from .analysis.resources import ResourceFacts, resource_summary
        from .capture.gpu_memory import module_names
        from .capture.probes import user_namespace

        source = self.loop_cell_source or self.cell_source
        kept = [k.to_dict() for k in kept_graphs(source, self.loop_line, module_names(user_namespace()))]
        loader = self.loader_ref() if self.loader_ref is not None else None
        facts = ResourceFacts(
            columns=cols,
            warmup=warmup,
            gpu_memory=self.gpu_memory,
            host=self.host,
            kept=kept,
            python_objects=list((self.loader_info or {}).get("python_objects") or []),
            loader_name=self.loader_name,
            training_loader=id(loader) if loader is not None else None,
            held=self.held_before,
            oom=self.oom,
            device=self.cuda_device,
        )
        summary = resource_summary(facts)
        summary["kept_graphs"] = kept
        return summary

    # -- the result API --------------------------------------------------------------------
    @property
    def summary(self) -> dict[str, Any]:
        return self._analysis()[0]

    @property
    def verdict_detail(self) -> Verdict:
        return self._analysis()[1]

    @property
    def verdict(self) -> str:
        return self.verdict_detail.label

    @property
    def severity(self) -> str:
        return self.verdict_detail.severity

    @property
    def clock(self) -> str:
        return str(self.summary["clock"])

    @property
    def n_steps(self) -> int:
        return self.recorder.n_steps

    @property
    def machine(self) -> dict[str, Any] | None:
        """What the run ran on (capture/machine.py: python, torch, cuda, platform, cpu, cpus,
        gpu), read once the run has finished; None before."""
        if self._machine is None and self.finished:
            try:
                self._machine = describe_machine(usable_cpus(), self.cuda_device, self.gpu_device)
            except Exception as exc:  # never cost the run its result
                self.notes.append(f"The machine could not be described: {type(exc).__name__}: {exc}")
                self._machine = {}
        return self._machine

    @property
    def straggler(self) -> dict[str, Any] | None:
        """Several ranks: {"rank", "cause": input|h2d|compute|unknown, "score"} of the rank that
        holds the others back (RANK STRAGGLER), else None."""
        if not self.ranks:
            return None
        found = self.summary.get("straggler")
        return dict(found) if found else None

    @property
    def steps(self) -> dict[str, Any]:
        """Per-step columns (numpy arrays): step, time_s, data_wait_ms, compute_ms, step_ms,
        and the GPU columns (NaN where not measured)."""
        return self.columns()

    def box(self) -> str:
        return verdict_box(self.verdict, self.summary)

    def text(self) -> str:
        v = self.verdict_detail
        head = f"traceml: {self.name} - {self.n_steps} steps ({self.step_definition})"
        if self.loop_line is not None:
            head += f", loop on line {self.loop_line}"
        if self.loop_where and self.loop_where != "this cell":
            head += f" of {self.loop_where}"
        lines = [report_text(head, v.label, v.why, v.next, self.summary)]
        split = parts_sentence(self.summary)
        if split:
            lines.append(f"Parts: {split}")
        lines.extend(f"Also: {text}" for _, text in self.also())
        if self.ranks:
            lines.append(rank_table(self.ranks, self.straggler, self.summary.get("rank_notes") or []))
        lines.extend(f"Phase: {phase_sentence(phase)}" for phase in self.phases)
        slow_phase = phase_verdict(self.phases)
        if slow_phase:
            lines.append(f"Also: {slow_phase}")
        lines.extend(f"Also: {line}" for line in finding_lines(self.summary))
        if self.error:
            lines.append(f"Stopped by: {self.error}")
        lines.extend(f"Note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<traceml run {self.name!r}: {self.verdict}, {self.n_steps} steps>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def to_dict(self) -> dict[str, Any]:
        """What --save writes: JSON-ready, unmeasured values as null."""
        cols = self.steps
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "verdict": self.verdict_detail.to_dict(),
            "summary": _jsonable(self.summary),
            "loop": {"line": self.loop_line, "where": self.loop_where},
            "cpu": {
                "process_ms": self.process_cpu_ms,
                "thread_ms": self.thread_cpu_ms,
                "thread_wait_ms": self.thread_wait_ms,
            },
            "step": {"kind": self.step_kind, "definition": self.step_definition},
            "loader": _jsonable(self.loader_info),
            "sources": _jsonable(self.sources),
            "phases": _jsonable(self.phases),
            "checklist": self.checklist,
            "error": self.error,
            "notes": list(self.notes),
            "steps": {k: _jsonable(v.tolist()) for k, v in cols.items()},
            "stride": self.recorder.stride,
            "h2d": _jsonable(self.h2d),
            "sync_stalls": _jsonable(self.sync_stalls),
            "line_costs": _jsonable(self.line_costs),
            "cuda_graphs": _jsonable(self.cuda_graphs),
            "ranks": _jsonable(self.ranks),
            "straggler": _jsonable(self.straggler),
            "trend": _jsonable(self.summary.get("trend")),
            "epoch_startup": _jsonable(self.summary.get("epoch_startup")),
            "processes": _jsonable(self.processes),
            "loader_site": _jsonable(self.loader_site),
            "dataset_site": _jsonable(self.dataset_site),
            # What a run read back needs to be shown and compared as it was (saved.py):
            "cell": {"source": self.cell_source, "loop_cell_source": self.loop_cell_source},
            "quoted_cells": self.quoted_cells,
            "machine": _jsonable(self.machine),
            "batch": {
                "size": self.batch_size,
                "kind": self.batch_kind,
                "per_step": self.batches_per_step,
            },
            "warmup": self.warmup,
            "wall_ms": self.wall_ms,
            "expected_steps": self.expected_steps,
            "gpu": {
                "used": bool(self._gpu_used),
                "cuda_device": self.cuda_device,
                "device": self.gpu_device,
                "note": self.gpu_note,
                "samples": _jsonable(
                    {k: _list(v) for k, v in self._gpu_samples.items()}
                    if self._gpu_samples
                    else None
                ),
            },
            "resources": _jsonable(self.resources_dict()),
        }

    def resources_dict(self) -> dict[str, Any]:
        """What --save writes of the resources: the host's samples (columns) and workers, the
        GPU memory watch, what earlier cells held, an out-of-memory error, the findings; null
        where not measured. The per-step GPU memory columns are in `steps`."""
        host = dict(self.host) if self.host is not None else None
        if host is not None:
            host["samples"] = {k: v.tolist() for k, v in host.get("samples", {}).items()}
        return {
            "host": host,
            "gpu_memory": self.gpu_memory,
            "held_before": self.held_before,
            "oom": self.oom,
            "findings": self.summary.get("resource_findings"),
        }

    def save(self, path: str) -> str:
        """Write the run to `path`: the report as one standalone HTML page for `.html` (no
        script, no network: it opens in any browser), else JSON (what `traceml_jupyter.load`
        reads back)."""
        writer = FILE_WRITERS.get(os.path.splitext(path)[1].lower())
        if writer is not None:
            writer(self, path)
            return path
        if path.lower().endswith((".html", ".htm")):
            raise ValueError(f"{path}: no HTML writer (import traceml_jupyter.views.report_file)")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1, allow_nan=False)
        return path


def _list(values: Any) -> list[Any]:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _jsonable(value: Any) -> Any:
    """NaN and infinities become null (unmeasured), containers are walked."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
