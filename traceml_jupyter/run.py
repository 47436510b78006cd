"""A traced run: the recording its capture writes into while the cell runs, the handle users
read, and this kernel's runs (runs, last, find_run). `finish()` freezes the run's result
(result/: the RunResult value, its codec and text renderers); the capture does the measuring;
views render the result."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Protocol

from . import kernel_state
from . import result as render
from .analysis.checklist.facts import ItemRow
from .analysis.phases import step_definition
from .analysis.summary_keys import LineCosts, Straggler, Summary
from .analysis.verdict import Verdict
from .capture.data.probes import safe_len
from .capture.resources.host import usable_cpus
from .capture.resources.machine import describe_machine
from .capture.steps.recorder import Recorder
from .failures import failure_text, never_raise
from .result import SCHEMA_VERSION, DataFeed, Gpu, Loop, Resources, RunResult, Steps
from .result.value import (
    Copies,
    SyncStalls,
    frozen_as,
    frozen_facts,
    frozen_rows,
    frozen_summary,
    read_only,
)
from .run_summary import analyse

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SCHEMA_VERSION", "Observer", "Run", "RunResult", "find_run", "last", "runs"]
REFRESH_NS = 250_000_000  # observers (the live view) run at most 4 times a second


class Observer(Protocol):
    """What watches a run while it records (the live chart's refresh, a rank's sender, the
    resource watch): called with the run at its ticks, on the capture's thread, at most 4 times
    a second, and once more when the run finishes. An observer that raises is dropped (a note
    says so): a view never stops the training."""

    def __call__(self, run: Run, /) -> None: ...


def runs() -> list[Run]:
    """Every run of this kernel, oldest first."""
    return list(kernel_state.RUNS)


def last() -> Run | None:
    """The most recent run, or None before any."""
    return kernel_state.RUNS[-1] if kernel_state.RUNS else None


def find_run(name: str) -> Run | None:
    """The latest run of this kernel with that name, or None."""
    return next((run for run in reversed(kernel_state.RUNS) if run.name == name), None)


COPIES_KEPT = 4  # copies of the run's newest DataLoaders kept while it runs (kernel_state)


class Run:
    """One traced run: the recording its capture writes into while the cell runs, and the
    handle users read. `finish()` freezes its result (`run.result`, a RunResult: summary,
    verdict, per-step columns, what ran and on what); `summary`, `verdict`, `steps`, `text()`,
    `to_dict()`, `save()` read that result, and the views render it.

    Steps are what the training does (step_model.py): one optimizer step, else one backward(),
    else one iteration of the located loop, else the interval between two batches.

    A run read back from its file (`traceml_jupyter.load`, `Run(result=..., path=...)`) holds
    its result alone: `read_back` is True, `path` the file it came from, and its recording is
    empty.

    What the capture writes while the run records (the result's sections copy most of it
    when the run finishes):
        recorder (per-step columns, capture/steps/recorder.py); loop_is_range (the located loop
        iterates range(...)); loop_iter_text, loop_iterable_type (the loop's iterable as
        written and as it ran); fetch_calls (the loop body's fetch calls by line);
        model_compiled; cell_filename; loader_ref, loader_name (the training loader and its
        name); extra_columns, watch_summary (what the optional watches measure: per-step
        columns aligned on demand, facts the verdict quotes); gpu_watch, resource_watch,
        step_parts, pass_starts (the steps where each pass over the training loader began);
        rank_collector (the forked ranks' steps, ranks.Collector, or this torchrun rank's own,
        ranks.LocalRank); capture_thread; error_before_first_step; finished. The capture reads
        next_tick (perf_counter_ns when the observers are next due; tick() moves it).
    """

    def __init__(
        self, name: str | None = None, warmup: int | None = None, *, result: RunResult | None = None, path: str = ""
    ) -> None:
        self.name = result.name if result is not None else name or f"run {len(kernel_state.RUNS) + 1}"
        self.warmup = warmup
        self.started_at = result.started_at if result is not None else time.time()
        self.read_back = result is not None  # from its file: nothing of it is live
        self.path = path
        self.ended_at: float | None = None
        self.recorder = Recorder()
        self.recorder.origin_ns = perf_counter_ns()
        self.batch_size: int | None = None
        self.batch_kind: str | None = None
        self.batches_per_step: float | None = None
        self.loop_line: int | None = None
        self.loop_where: str | None = None
        self.loop_is_range = False
        self.loop_cell_source: str | None = None
        self.loop_iter_text: str | None = None
        self.loop_iterable_type: str | None = None
        self.fetch_calls: dict[int, str] = {}
        self.model_compiled = False
        self.cell_source: str | None = None
        self.cell_filename: str | None = None
        self.loader_info: dict[str, Any] | None = None
        self.loader_ref: Callable[[], Any] | None = None
        self.loader_name: str | None = None
        self.expected_steps: int | None = None
        self.step_kind = "none"
        self.step_definition = "no step ran"
        self.sources: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []
        self.wall_ms: float | None = None
        self.process_cpu_ms: float | None = None
        self.thread_cpu_ms: float | None = None
        self.thread_wait_ms: float | None = None
        self.notes: list[str] = []
        self.error: str | None = None
        self.error_before_first_step = False
        self.cuda_device: int | None = None
        self.capture_thread: int | None = None
        self.extra_columns: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
        self.watch_summary: dict[str, Any] = {}
        self.gpu_watch: Any = None  # loop_started(device) and step_ended(t); CUDA path only
        self.h2d: dict[str, Any] | None = None
        self.sync_stalls: dict[str, Any] | None = None
        self.line_costs: dict[str, Any] | None = None
        self.step_parts: Any = None  # capture/inside/step_parts.py: columns(cols) and facts()
        self.pass_starts: list[int] = []
        self.cuda_graphs: dict[str, Any] | None = None
        self.gpu_note: str | None = None
        self.gpu_device: str | None = None
        self.resource_watch: Any = None  # capture/resources.ResourceWatch while recording
        self.host: dict[str, Any] | None = None
        self.gpu_memory: dict[str, Any] | None = None
        self.held_before: dict[str, Any] | None = None
        self.oom: dict[str, Any] | None = None
        self.ranks: list[dict[str, Any]] | None = None
        # ranks.Collector or ranks.LocalRank, which check what they are given (isinstance): the
        # run names no type of the ranks above it.
        self.rank_collector: object = None
        self.processes: list[dict[str, Any]] | None = None
        self.loader_site: dict[str, Any] | None = None
        self.dataset_site: dict[str, Any] | None = None
        # NVML samples of the run's GPU (time_s, gpu_util_pct, gpu_mem_used_mib), left by the
        # resource watch when it stops, before the run finishes.
        self.gpu_samples: dict[str, Any] | None = None
        self._capture: Any = None  # capture.Capture while recording
        self._gpu_used = False
        self._observers: list[Observer] = []
        self.next_tick = 0
        self._loops_started = 0
        self._loader_infos: dict[Any, dict[str, Any]] = {}
        self._loader_copies: dict[Any, Any] = {}  # copies of its DataLoaders (kernel_state.keep_loader_copy)
        self._machine: dict[str, Any] | None = None
        self._result: RunResult | None = result
        self.finished = result is not None
        if result is None:
            kernel_state.RUNS.append(self)

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
        from .capture.data.sources import loop_iterable_type

        self.expected_steps = safe_len(iterable)
        self.loop_iterable_type = loop_iterable_type(iterable)
        if self.expected_steps is None and self._loader_infos:
            self.expected_steps = list(self._loader_infos.values())[-1].get("len")

    def note_dataloader(self, source: Any, loader: Any) -> None:
        """A DataLoader's first iter() in the run: keep its settings (read once, guarded)."""
        from .capture.data.dataloaders import describe_loader, loader_copy

        try:
            self._loader_infos[source.key] = describe_loader(loader)
        except Exception:
            self._loader_infos[source.key] = {}
        while len(self._loader_copies) >= COPIES_KEPT:
            self._loader_copies.pop(next(iter(self._loader_copies)))
        self._loader_copies[source.key] = loader_copy(loader)

    def loader_settings(self, key: Any) -> dict[str, Any]:
        """The settings note_dataloader() kept of the DataLoader of that source key ({}: none)."""
        return self._loader_infos.get(key) or {}

    def recorded_by(self, capture: Any) -> None:
        """The capture (capture.Capture) that records the run from now on; None: none does."""
        self._capture = capture

    def loop_started(self) -> None:
        """A pass over the located loop began (loops_started counts them)."""
        self._loops_started += 1

    def loop_on_gpu(self, device: int) -> None:
        """The loop runs on CUDA device `device`: its steps are timed with CUDA events too."""
        self.cuda_device, self._gpu_used = device, True

    # -- observers (the live view) ---------------------------------------------------------
    def observe(self, observer: Observer) -> None:
        """Call `observer` with the run at its ticks from the next step on, and once when the
        run finishes (a raise removes it, with a note)."""
        self._observers.append(observer)
        self.next_tick = 0
        if self._capture is not None:
            self._capture.listen()

    def observe_only(self, observer: Observer) -> None:
        """`observer` alone from now on (a forked rank or a child process sends its steps to
        the kernel: the live chart is the kernel's)."""
        self._observers[:] = []
        self.observe(observer)

    def stop_observing(self, observer: Observer) -> None:
        """`observer` is called no more (nothing happens if it was not observing)."""
        if observer in self._observers:
            self._observers.remove(observer)

    def tick_due(self, now: int) -> bool:
        """The observers are due at `now` (perf_counter_ns): at most 4 ticks a second."""
        return now >= self.next_tick

    def tick(self, now: int) -> None:
        """Call the observers now; the next tick is due REFRESH_NS later."""
        self.next_tick = now + REFRESH_NS
        for observer in list(self._observers):
            guard = never_raise(self.notes, "The live view stopped")  # never stop the training
            with guard:
                observer(self)
            if guard.error is not None:
                self._observers.remove(observer)

    # -- the end ---------------------------------------------------------------------------
    def read_capture(self, capture: Any, wall_ns: int) -> None:
        """What the capture saw, once it closed: where batches came from, which of them fed the
        steps (the training loader), the phases kept out, and what a step was."""
        from .capture.data.sources import describe_run_sources

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
        self._keep_loader_copy(self._loader_copies.get(key) if key is not None else None)
        self._loader_copies.clear()
        if isinstance(key, int) and key in capture.loader_sites:  # built while the run recorded
            from .capture.data.dataloaders import split_site

            self.loader_site, self.dataset_site = split_site(capture.loader_sites[key])

    def _keep_loader_copy(self, copy: Any) -> None:
        """After the capture: the copy of the training loader is kept for tune if the loader
        itself is gone (built inside a function of a script run with `%run`)."""
        kernel_state.forget_loader_copy()
        ref = self.loader_ref
        if copy is not None and ref is not None and ref() is None:
            self.loader_ref = kernel_state.keep_loader_copy(self, copy)

    def finish(self, error: BaseException | None = None) -> Run:
        """Close the run (after its capture): its result is frozen (`result`), then the views
        draw their final state from it."""
        if self.finished:
            return self
        if error is not None:
            self.error = failure_text(error).rstrip(": ")
            self.error_before_first_step = self.recorder.n_steps == 0
        self.finished = True
        self.ended_at = time.time()
        self._result = self._freeze()
        for observer in list(self._observers):
            with never_raise():
                observer(self)
        self._observers.clear()
        return self

    # -- the result --------------------------------------------------------------------------
    @property
    def result(self) -> RunResult:
        """What the run measured and concluded (a RunResult), frozen when the run finished;
        before, what the recording holds so far (computed again at each read)."""
        if self._result is not None:
            return self._result
        if not self.finished:
            return self._freeze()
        self._result = self._freeze()
        return self._result

    def _freeze(self) -> RunResult:
        cols = self._read_columns()
        summary, verdict = analyse(self, cols)
        samples = self.gpu_samples
        return RunResult(
            name=self.name, started_at=self.started_at, ended_at=self.ended_at,
            summary=frozen_summary(summary), verdict=verdict,
            steps=Steps(
                columns=read_only(cols), n_steps=self.n_steps, stride=self.recorder.stride,
                kind=self.step_kind, definition=self.step_definition, warmup=self.warmup,
                expected=self.expected_steps, batch_size=self.batch_size, batch_kind=self.batch_kind,
                batches_per_step=self.batches_per_step,
            ),
            loop=Loop(
                line=self.loop_line, where=self.loop_where, cell_source=self.cell_source,
                cell_filename=self.cell_filename, loop_cell_source=self.loop_cell_source,
                wall_ms=self.wall_ms, process_cpu_ms=self.process_cpu_ms,
                thread_cpu_ms=self.thread_cpu_ms, thread_wait_ms=self.thread_wait_ms,
            ),
            data=DataFeed(
                loader=frozen_facts(self.loader_info), sources=frozen_rows(self.sources) or (),
                phases=frozen_rows(self.phases) or (), loader_site=frozen_facts(self.loader_site),
                dataset_site=frozen_facts(self.dataset_site),
            ),
            gpu=Gpu(
                used=self.gpu_used, cuda_device=self.cuda_device, device=self.gpu_device,
                note=self.gpu_note, samples=read_only(samples) if samples is not None else None,
                h2d=frozen_as(Copies, self.h2d), sync_stalls=frozen_as(SyncStalls, self.sync_stalls),
                cuda_graphs=frozen_facts(self.cuda_graphs),
            ),
            resources=Resources(
                host=frozen_facts(self.host), gpu_memory=frozen_facts(self.gpu_memory),
                held_before=frozen_facts(self.held_before), oom=frozen_facts(self.oom),
            ),
            line_costs=frozen_as(LineCosts, self.line_costs), ranks=frozen_rows(self.ranks),
            processes=frozen_rows(self.processes), machine=frozen_facts(self._describe_machine()),
            notes=tuple(self.notes), error=self.error,
        )

    def _describe_machine(self) -> dict[str, Any] | None:
        """What the run ran on (capture/resources/machine.py), once it has finished; None before."""
        if self._machine is None and self.finished:
            self._machine = {}  # what is kept if it fails: never cost the run its result
            with never_raise(self.notes, "The machine could not be described"):
                self._machine = dict(describe_machine(usable_cpus(), self.cuda_device, self.gpu_device))
        return self._machine

    def _read_columns(self) -> dict[str, np.ndarray]:
        cols = self.recorder.columns()
        for name, column in self.extra_columns.items():
            cols[name] = column(cols["step"])
        if self.step_parts is not None:
            cols.update(self.step_parts.columns(cols))
        samples = self.gpu_samples
        if samples is not None and len(samples.get("time_s", ())):
            from .capture.resources.nvml import at_steps

            cols.update(at_steps(samples, cols["time_s"], cols.get("gpu_backlog_ms")))
        return cols

    def keep_reading(self, checklist: Sequence[ItemRow] | None, quoted_cells: dict[str, str] | None) -> None:
        """What the kernel read once the run finished (kernel/code_facts.read_kernel_at_end): the
        checklist as evaluated and the cells the report quotes. The result becomes a new value
        that holds them (the one before is left as it was)."""
        self._result = self.result.with_reading(checklist, quoted_cells)

    # -- the result API: what `result` holds ------------------------------------------------
    @property
    def summary(self) -> Summary:
        """The medians, shares and counts the verdict read (every key: docs/api.md): a plain
        dict, copied from the result (changing it changes nothing of the run)."""
        return self.result.summary.copy()

    @property
    def verdict_detail(self) -> Verdict:
        """The verdict with its severity, why, what to try next and the evidence."""
        return self.result.verdict

    @property
    def verdict(self) -> str:
        """The verdict's label: INPUT-BOUND, COMPUTE-BOUND, ..."""
        return self.verdict_detail.label

    @property
    def severity(self) -> str:
        """The verdict's severity: "info", "warn" or "critical"."""
        return self.verdict_detail.severity

    @property
    def clock(self) -> str:
        """The clock the verdict read: "gpu" (CUDA events) or "cpu" (the wall clock)."""
        return str(self.summary["clock"])

    @property
    def n_steps(self) -> int:
        """The steps recorded."""
        return self._result.n_steps if self._result is not None else self.recorder.n_steps

    @property
    def gpu_used(self) -> bool:
        """The loop ran on a CUDA device: its steps are timed with CUDA events too."""
        return self._result.gpu.used if self._result is not None else bool(self._gpu_used)

    @property
    def loops_started(self) -> int:
        """Passes begun over the located loop so far (0 before the first)."""
        return int(self._loops_started)

    @property
    def machine(self) -> dict[str, Any] | None:
        """What the run ran on (python, torch, cuda, platform, cpu, cpus, gpu), read once the
        run has finished; None before (a plain dict, copied from the result)."""
        machine = self.result.machine
        return dict(machine) if machine is not None else None

    @property
    def straggler(self) -> Straggler | None:
        """Several ranks: {"rank", "cause": input|h2d|compute|unknown, "score"} of the rank that
        holds the others back (RANK STRAGGLER), else None (a plain dict)."""
        found = self.result.straggler
        return found.copy() if found is not None else None

    @property
    def steps(self) -> dict[str, np.ndarray]:
        """Per-step columns (numpy arrays): step, time_s, data_wait_ms, compute_ms, step_ms,
        and the GPU columns (NaN where not measured)."""
        return self.columns()

    def columns(self) -> dict[str, np.ndarray]:
        """The recorder's kept steps, with the columns of the optional watches and the NVML
        samples (gpu_util_pct, gpu_mem_used_mib) placed on the same steps: a plain dict of the
        result's read-only arrays (once finished), for pandas or numpy as they are."""
        return dict(self.result.columns) if self.finished else self._read_columns()

    @property
    def unsaved(self) -> frozenset[str]:
        """Read back from a file: the result's fields its file did not hold (an older version
        wrote fewer keys); empty for a run of this kernel."""
        return self.result.unsaved

    @property
    def schema_version(self) -> int | None:
        """Read back from a file: the file's schema version; None for a run of this kernel."""
        return self.result.schema_version

    def box(self) -> str:
        """The verdict box alone."""
        return render.box(self.result)

    def lines_after_verdict(self) -> list[tuple[str, str]]:
        """(severity, text) of the lines after the verdict (result.lines_after_verdict)."""
        return render.lines_after_verdict(self.result)

    def text(self) -> str:
        """The text box (what a terminal prints; result.text)."""
        return render.text(self.result)

    def __repr__(self) -> str:
        where = f" from {self.path}" if self.path else ""
        return f"<traceml run {self.name!r}{where}: {self.verdict}, {self.n_steps} steps>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        """Read back from its file, in a notebook: the report as the cell showed it; else the
        text box."""
        if not self.read_back or not kernel_state.REPORT_BUNDLES:
            return {"text/plain": self.text()}
        return kernel_state.REPORT_BUNDLES[0](self, include, exclude)

    def to_dict(self) -> dict[str, Any]:
        """What --save writes: JSON-ready, unmeasured values as null (result.to_dict); a run read
        back writes what it read (keys of a later version included)."""
        return render.to_dict(self.result)

    def resources_dict(self) -> render.ResourcesRow:
        """What --save writes of the resources (result.resources_dict)."""
        return render.resources_dict(self.result)

    def save(self, path: str) -> str:
        """Write the run to `path`: the report as one standalone HTML page for `.html` (no
        script, no network: it opens in any browser), else JSON (what `traceml_jupyter.load`
        reads back)."""
        writer = kernel_state.FILE_WRITERS.get(os.path.splitext(path)[1].lower())
        if writer is not None:
            writer(self, path)
            return path
        if path.lower().endswith((".html", ".htm")):
            raise ValueError(f"{path}: no HTML writer (traceml_jupyter.views.display.register_views())")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1, allow_nan=False)
        return path
