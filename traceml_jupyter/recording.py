"""The recording: what the capture, the ranks and the child processes write while a run records
(the per-step recorder, what the loop and its loader were, what the watches measured, the
notes), its observers (the live view, a rank's sender, the resource watch), and `freeze()`,
which builds the run's RunResult once. The `Run` users hold (run.py) points at the recording
while the cell runs, and at the result once it has finished; the recording then goes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Protocol

from . import kernel_state
from .analysis.compile import CompileFacts
from .analysis.loader_inside import LoaderInside, Watched, inside_next
from .analysis.loader_inside import summarise as summarise_inside
from .analysis.phases import step_definition
from .analysis.summary_keys import LineCosts, RankRow
from .capture.data.probes import safe_len
from .capture.resources.host import usable_cpus
from .capture.resources.machine import describe_machine
from .capture.steps.recorder import Recorder
from .facts.gpu import Copies, CudaGraphs, SyncStalls
from .facts.loader import CodeSite, LoaderFacts, PhaseRow, SourceRow
from .facts.machine import MachineFacts
from .facts.processes import ProcessRow
from .facts.resources import GpuMemoryFacts, HeldBefore, HostFacts, OomFacts
from .failures import failure_text, never_raise, read_or
from .result import DataFeed, Gpu, Loop, Resources, RunResult, Steps
from .result.value import (
    frozen_as,
    frozen_rows,
    frozen_summary,
    read_only,
)
from .run_summary import StepFacts, analyse

if TYPE_CHECKING:
    import numpy as np

    from .capture.compiled.compile_record import CompileRecord, CompileWatch
    from .capture.gpu.gpu_watch import GpuWatch
    from .capture.loader.lanes import LiveLanes
    from .capture.resources.watch import ResourceWatch

__all__ = ["COPIES_KEPT", "REFRESH_NS", "Observer", "Recording"]
REFRESH_NS = 250_000_000  # observers (the live view) run at most 4 times a second
COPIES_KEPT = 4  # copies of the run's newest DataLoaders kept while it runs (kernel_state)


class Observer(Protocol):
    """What watches a recording (the live chart's refresh, a rank's sender, the resource watch):
    called with the recording at its ticks, on the capture's thread, at most 4 times a second,
    and once more when the run finishes (then `finished` is True and `result` the frozen value).
    An observer that raises is dropped (a note says so): a view never stops the training."""

    def __call__(self, recording: Recording, /) -> None: ...


class Recording:
    """What a run records while the cell runs; `freeze()` makes its RunResult once.

    What the capture writes (the result's sections copy most of it when the run finishes):
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

    def __init__(self, name: str, warmup: int | None = None) -> None:
        self.name = name
        self.warmup = warmup
        self.started_at = time.time()
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
        self.loader_info: LoaderFacts | None = None
        self.loader_ref: Callable[[], Any] | None = None
        self.loader_name: str | None = None
        self.expected_steps: int | None = None
        self.step_kind = "none"
        self.step_definition = "no step ran"
        self.sources: list[SourceRow] = []
        self.phases: list[PhaseRow] = []
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
        self.gpu_watch: GpuWatch | None = None  # loop_started(device) and step_ended(t); CUDA path only
        self.h2d: Copies | None = None
        self.sync_stalls: SyncStalls | None = None
        self.line_costs: LineCosts | None = None
        self.step_parts: StepFacts | None = None  # columns(cols) and facts() of the sampled steps
        self.pass_starts: list[int] = []
        self.cuda_graphs: CudaGraphs | None = None
        self.gpu_note: str | None = None
        self.gpu_device: str | None = None
        self.resource_watch: ResourceWatch | None = None  # while recording
        self.compile_watch: CompileWatch | None = None  # while recording: is Dynamo compiling now
        self.compiled: CompileRecord | None = None  # what torch.compile did (capture/compiled/)
        self.host: HostFacts | None = None
        self.gpu_memory: GpuMemoryFacts | None = None
        self.held_before: HeldBefore | None = None
        self.oom: OomFacts | None = None
        self.ranks: list[RankRow] | None = None
        # ranks.Collector or ranks.LocalRank, which check what they are given (isinstance): the
        # recording names no type of the ranks above it.
        self.rank_collector: object = None
        self.processes: list[ProcessRow] | None = None
        self.loader_site: CodeSite | None = None
        self.dataset_site: CodeSite | None = None
        # Inside the DataLoader's workers (capture/loader/watch.py, summarised: inside_watched)
        self.loader_inside: LoaderInside | None = None
        self.loader_lanes: LiveLanes | None = None  # its lanes while the cell runs (the live chart's)
        # NVML samples of the run's GPU (time_s, gpu_util_pct, gpu_mem_used_mib), left by the
        # resource watch when it stops, before the run finishes.
        self.gpu_samples: dict[str, np.ndarray] | None = None
        self.gpu_used = False
        self.loops_started = 0  # passes begun over the located loop (0 before the first)
        self.next_tick = 0
        self.finished = False
        self._capture: Any = None  # capture.Capture while recording
        self._observers: list[Observer] = []
        self._loader_infos: dict[Any, LoaderFacts] = {}
        self._loader_copies: dict[Any, Any] = {}  # copies of its DataLoaders (kernel_state.keep_loader_copy)
        self._result: RunResult | None = None

    @property
    def n_steps(self) -> int:
        """The steps recorded so far."""
        return self.recorder.n_steps

    # -- what the capture tells it -----------------------------------------------------------
    def _capturing_here(self) -> Any:
        """The capture (capture.Capture) recording on the calling thread, else None."""
        capture = self._capture
        return capture if capture is not None and capture.thread == threading.get_ident() else None

    def loop(self, iterable: Iterable[Any]) -> Iterable[Any]:
        """`iterable` with each fetch and iteration timed by the capture on this thread (as it
        is elsewhere)."""
        capture = self._capturing_here()
        return iterable if capture is None else capture.loop(iterable)

    def current_step(self) -> int | None:
        """Index of the step being run on the capture's thread; None elsewhere or between runs."""
        capture = self._capturing_here()
        return None if capture is None else capture.current_step()

    def note_loop_iterable(self, iterable: Any) -> None:
        """After the located loop's first batch: how many iterations a pass has, if it says
        (else the length of the DataLoader it iterates: `enumerate(loader)`, `tqdm(loader)`)."""
        from .capture.data.sources import loop_iterable_type

        self.expected_steps = safe_len(iterable)
        self.loop_iterable_type = loop_iterable_type(iterable)
        if self.expected_steps is None and self._loader_infos:
            self.expected_steps = list(self._loader_infos.values())[-1].get("len")

    def note_dataloader(self, source: Any, loader: Any) -> None:
        """A DataLoader's first iter() in the run: keep its settings (the user's object, read
        once: settings that cannot be read are none, {})."""
        from .capture.data.dataloaders import describe_loader, loader_copy

        self._loader_infos[source.key] = read_or(LoaderFacts(), describe_loader, loader)
        while len(self._loader_copies) >= COPIES_KEPT:
            self._loader_copies.pop(next(iter(self._loader_copies)))
        self._loader_copies[source.key] = loader_copy(loader)

    def loader_settings(self, key: Any) -> LoaderFacts:
        """The settings note_dataloader() kept of the DataLoader of that source key ({}: none)."""
        return self._loader_infos.get(key) or {}

    def recorded_by(self, capture: Any) -> None:
        """The capture (capture.Capture) that records the run from now on; None: none does."""
        self._capture = capture

    def loop_started(self) -> None:
        """A pass over the located loop began (loops_started counts them)."""
        self.loops_started += 1

    def loop_on_gpu(self, device: int) -> None:
        """The loop runs on CUDA device `device`: its steps are timed with CUDA events too."""
        self.cuda_device, self.gpu_used = device, True

    # -- observers (the live view) ---------------------------------------------------------
    def observe(self, observer: Observer) -> None:
        """Call `observer` with the recording at its ticks from the next step on, and once when
        the run finishes (a raise removes it, with a note)."""
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
        """Call the observers now; the next tick is due REFRESH_NS later. The edge of the live
        view: an observer that raises is dropped with a note, the training goes on."""
        self.next_tick = now + REFRESH_NS
        for observer in list(self._observers):
            guard = never_raise(self.notes, "The live view stopped")
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
        # A compiled model seen, or a torch.compile'd function the cell calls (the capture stood aside)
        self.model_compiled = facts.model_compiled or capture.compiled
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
            self.loader_ref = kernel_state.keep_loader_copy(copy)

    def finish(self, error: BaseException | None = None) -> RunResult:
        """Close the recording (after its capture): its result is frozen, then the observers
        draw their final state from it (`finished`, `result`). The edge of finish: an observer
        that fails there is dropped silently (the report follows)."""
        if self._result is not None:
            return self._result
        if error is not None:
            self.error = failure_text(error).rstrip(": ")
            self.error_before_first_step = self.recorder.n_steps == 0
        self.ended_at = time.time()
        self.finished = True
        result = self.freeze()
        for observer in list(self._observers):
            with never_raise():
                observer(self)
        self._observers.clear()
        return result

    # -- the result --------------------------------------------------------------------------
    @property
    def result(self) -> RunResult:
        """The frozen result once the run finished; before, what the recording holds so far
        (built again at each read)."""
        return self._result if self._result is not None else self._build()

    def freeze(self) -> RunResult:
        """The run's RunResult, built once (later calls give the same value)."""
        if self._result is None:
            self._result = self._build()
        return self._result

    def inside_watched(self, watched: Watched | None) -> None:
        """What the watch inside the DataLoader's workers gave at the capture's end (records,
        receptions, start, pinned batches, failed next(), workers' exits), summarised; None: no
        worker was watched."""
        self.loader_inside = summarise_inside(*watched) if watched else None

    def _build(self) -> RunResult:
        cols = self.columns()
        summary, verdict = analyse(self, cols)
        inside = self.loader_inside
        verdict = inside_next(verdict, inside)
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
                loader=frozen_as(LoaderFacts, self.loader_info), sources=frozen_rows(SourceRow, self.sources) or (),
                phases=frozen_rows(PhaseRow, self.phases) or (), loader_site=frozen_as(CodeSite, self.loader_site),
                dataset_site=frozen_as(CodeSite, self.dataset_site),
                inside=frozen_as(LoaderInside, inside),
            ),
            gpu=Gpu(
                used=self.gpu_used, cuda_device=self.cuda_device, device=self.gpu_device,
                note=self.gpu_note, samples=read_only(samples) if samples is not None else None,
                h2d=frozen_as(Copies, self.h2d), sync_stalls=frozen_as(SyncStalls, self.sync_stalls),
                cuda_graphs=frozen_as(CudaGraphs, self.cuda_graphs),
            ),
            resources=Resources(
                host=frozen_as(HostFacts, self.host), gpu_memory=frozen_as(GpuMemoryFacts, self.gpu_memory),
                held_before=frozen_as(HeldBefore, self.held_before), oom=frozen_as(OomFacts, self.oom),
            ),
            line_costs=frozen_as(LineCosts, self.line_costs),
            compiled=frozen_as(CompileFacts, self.compiled), ranks=frozen_rows(RankRow, self.ranks),
            processes=frozen_rows(ProcessRow, self.processes), machine=frozen_as(MachineFacts, self._machine()),
            notes=tuple(self.notes), error=self.error,
        )

    def _machine(self) -> MachineFacts | None:
        """What the run ran on (capture/resources/machine.py), once it has finished; None before."""
        return describe_machine(usable_cpus(), self.cuda_device, self.gpu_device) if self.finished else None

    def columns(self) -> dict[str, np.ndarray]:
        """The recorder's kept steps so far, with the columns of the optional watches and the
        NVML samples (gpu_util_pct, gpu_mem_used_mib) placed on the same steps."""
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
