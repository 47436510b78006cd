"""The GPU watch of a traced cell: where host and GPU wait for each other. Synchronising calls
(syncs.py: per step and per cell line, with the host's wait where it can be timed), copies to
the GPU (h2d.py), and the GPU's backlog when each step ends.

Nothing touches CUDA until the capture says the loop runs on a CUDA device (`loop_started`),
and CUDA is then already initialised by the user's code: entering the watch, or a CPU loop,
never initialises CUDA (a later fork-started DDP launch must still work). Everything is undone
when the cell ends.

How the pieces are measured:

- Syncs: `Tensor.item`, `.tolist`, `.cpu`, `bool()`, `float()` and `int()` of a CUDA tensor,
  `.to("cpu")`, `torch.cuda.synchronize()`, `Event.synchronize()`, `Stream.synchronize()`,
  blocking host-to-device copies and pageable `non_blocking` ones (CUDA makes the host wait for
  those) are timed on the host: their wait for the GPU. Every other synchronising call torch
  knows of is counted through `torch.cuda.set_sync_debug_mode("warn")`, untimed: its warning
  names no time, only the place. A step with an untimed sync has an unknown host issue time.
- Backlog: every BACKLOG_EVERY-th step end, an event is recorded on the loop's stream; the GPU
  reaches it later by as much work as was queued. The GPU times of the probes are chained
  (each one from the previous, summed in float64: an event's own `elapsed_time` is a float32).
  GPU and host clocks are tied by one synchronize when the loop starts on the GPU and one when
  the cell ends (their drift is corrected linearly between the two).
- Only the thread that runs the steps is timed (DataParallel's replica threads pass through),
  events are kept per device, and any error of ours turns that watch off with a note: nothing
  of ours is raised into the user's code.

Edges (the one guard of each; the code under them raises): `loop_started` (nothing stays
patched; the backlog alone is off when only tying the clocks failed), `step_ended` (the backlog
turns itself off), `merged` (the step model's merges), `close` at the cell's end (the final wait and reads, and the report of what
was measured, each noted apart); each copy and sync hook has its own (h2d.py `CopyWatch.guarded`,
syncs.py `SyncWatch.synced`). Torch's CUDA is asked only once it is initialised; a query of
its state that CUDA answers with its own error gives a fallback (`cuda_state.cuda_or`).
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, TypedDict

import numpy as np

from ...facts.gpu import Copies, SyncStalls, SyncTop
from ...failures import failure_text, never_raise
from ..instrument.dynamo import compile_check
from ..steps.step_tally import StepTally
from . import hidden_waits
from .cuda_graphs import capturing
from .cuda_state import cuda_initialized, cuda_or, torch_cuda
from .h2d import COPY_COLUMNS, CopyWatch, EventPool, copies_timed
from .syncs import (
    EMPTY_CACHE,
    SYNC_COLUMNS,
    SyncWatch,
    sync_warnings_counted,
    syncs_timed,
)


class HostLine(TypedDict):
    """The body line that takes the host most time per step (from line_costs' statements)."""

    line: Any
    text: Any
    ms_per_step: Any
    share: Any
    gpu_ms_per_step: Any


class WatchSummary(TypedDict, total=False):
    """The few facts of the copy and sync watches that the verdict quotes (the run's
    `watch_summary`)."""

    h2d_lines: list[int]
    h2d_pageable_non_blocking: list[int]
    h2d_side_stream_waited: list[int]
    sync_top: SyncTop | None
    syncs_all_seen: bool
    syncs_hidden: list[str]
    host_top_line: HostLine | None


BACKLOG_EVERY = 4  # a backlog probe every 4th step: one event record, read when done
OWN_COLUMN = "own_host_ms"  # traceml's own host time inside each step on the GPU path


@dataclass
class CudaApi:
    """The parts of torch.cuda the watches use, for the loop's device (a stand-in in CPU tests).
    Made only once CUDA is initialised (see `cuda_api`)."""

    device: int  # the loop's CUDA device
    event_factory: Callable[[], Any]  # a timing event (bound to a device at its first record)
    current_stream: Callable[[int], Any]  # the current stream of a device
    current_device: Callable[[], int]
    synchronize: Callable[[int], None]  # wait for everything queued on a device
    get_sync_debug_mode: Callable[[], int]
    set_sync_debug_mode: Callable[[int], None]
    tensor_type: Any
    # (owner, attribute, kind): calls that wait for the GPU without a sync warning, or whose
    # wait is worth a time: torch.cuda.synchronize, Event.synchronize, Stream.synchronize.
    sync_points: tuple[tuple[Any, str, str], ...] = ()
    compiling: Callable[[], bool] = lambda: False  # torch.compile is tracing: stay out of it
    stream_type: Any = None  # torch.cuda.Stream: its wait_stream tells when the loop waits for a copy
    event_type: Any = None  # torch.cuda.Event: record and wait tell when the loop waits for a copy (wait_event)


# The CUDA module the copy and sync watches read (a seam: tests put a fake GPU here).
cuda_module = torch_cuda


def cuda_api(
    cuda: Any, tensor_type: Any, device: int | None = None, compiling: Callable[[], bool] | None = None
) -> CudaApi | None:
    """The watches' CudaApi from a torch.cuda-like module, for `device` (the current device if
    None); None while CUDA is not initialised."""
    if not cuda_initialized(cuda):
        return None
    if device is None:
        device = cuda_or(None, cuda.current_device)  # CUDA's own error: nothing to watch
        if device is None:
            return None
    index = int(device)

    def event() -> Any:
        return cuda.Event(enable_timing=True)

    points = tuple(
        (owner, "synchronize", kind)
        for owner, kind in (
            (cuda, "torch.cuda.synchronize"),
            (getattr(cuda, "Event", None), "Event.synchronize"),
            (getattr(cuda, "Stream", None), "Stream.synchronize"),
        )
        if owner is not None and callable(getattr(owner, "synchronize", None))
    )
    if callable(getattr(cuda, "empty_cache", None)):  # it waits for the device, without a warning
        points += ((cuda, "empty_cache", EMPTY_CACHE),)
    return CudaApi(
        index,
        event,
        cuda.current_stream,
        cuda.current_device,
        cuda.synchronize,
        cuda.get_sync_debug_mode,
        cuda.set_sync_debug_mode,
        tensor_type,
        points,
        compiling or (lambda: False),
        getattr(cuda, "Stream", None),
        getattr(cuda, "Event", None),
    )


def torch_cuda_api(device: int | None = None) -> CudaApi | None:
    """torch's CUDA for `device`, only when torch is imported and CUDA already initialised."""
    cuda = cuda_module()
    if cuda is None:
        return None
    torch = sys.modules["torch"]
    return cuda_api(cuda, torch.Tensor, device, compile_check(torch))


class GpuWatch:
    """Copies, syncs and backlog of one traced cell's step loop on a GPU.

    The capture calls `loop_started(device)` once, on the thread that runs the steps, when it
    has decided the loop runs on CUDA device `device` (CUDA is initialised then), and
    `step_ended(t_ns)` after each step; `close()` (the cell's end) undoes every patch, reads what
    is pending and leaves the results on the run. Before `loop_started` nothing is touched.
    """

    def __init__(
        self, run: Any, api: CudaApi | None = None, clock: Callable[[], int] = perf_counter_ns
    ) -> None:
        self.run = run
        self.api = api  # None: torch's, made in loop_started
        self.clock = clock
        self.current_step: Callable[[], int | None] = run.current_step  # the step running now
        self.device: int | None = None
        self.thread: int | None = None
        self.copies: CopyWatch | None = None
        self.syncs: SyncWatch | None = None
        self.backlog_raw = StepTally(dense=False)  # GPU minus host time of each probe, ms
        self.backlog_at = StepTally(dense=False)  # host ms since the anchor, per probe
        self.drift = 0.0  # GPU clock ms gained per host ms (from the two anchors)
        self.backlog_off: str | None = None
        self.backlog_on = False  # the clocks were tied: probes are read
        self.started = False
        self.counting_sync_warnings = False
        self.notes: list[str] = []
        # Waits nobody reports (hidden_waits.py), and traceml's own host time per step.
        self.hidden: list[str] = []
        self._frees_before: dict[str, int] = {}
        self.own_tally = StepTally()
        self._patches = ExitStack()
        self._pool: EventPool | None = None
        self._stream: Any = None  # the loop's stream, read every BACKLOG_EVERY steps
        self._h0 = 0  # host ns of the anchor
        self._last: tuple[Any, float] | None = None  # newest resolved probe: event, GPU ms since h0
        self._probes: deque[tuple[int, int, Any]] = deque()
        self._steps_seen = 0

    # -- called by the capture -----------------------------------------------------------
    def loop_started(self, device: int | None = None) -> None:
        """The loop runs on CUDA `device`: patch, and tie the GPU clock to the host's. Never
        raises: on an error nothing stays patched and a note says why."""
        if self.started:
            return
        self.started = True
        run = self.run
        tying = False  # past the patches: only the backlog's clocks are left to tie
        try:
            if device is None:
                device = getattr(run, "cuda_device", None)
            api = self.api if self.api is not None else torch_cuda_api(device)
            if api is None:
                self.notes.append("Copies and syncs were not watched: CUDA is not initialised.")
                return
            self.api = api
            self.device = api.device if device is None else int(device)
            self.thread = getattr(run, "capture_thread", None) or threading.get_ident()
            first = self.current_step()
            if first is None:
                first = int(run.recorder.n_steps)
            self._pool = pool = EventPool(api.event_factory)
            copies = CopyWatch(
                self.current_step,
                pool,
                getattr(run, "cell_filename", None),
                api.current_stream,
                api.current_device,
                self.device,
            )
            syncs = SyncWatch(self.current_step, getattr(run, "cell_filename", None), self.clock)
            copies.thread = syncs.thread = self.thread
            syncs.compiling = api.compiling
            copies.watch_from(first)
            syncs.watch_from(first)
            self._watch_hidden_and_own(syncs, first)
            self.copies, self.syncs = copies, syncs
            patches = self._patches
            patches.enter_context(
                copies_timed(
                    copies,
                    api.tensor_type,
                    syncs.synced,
                    syncs.inside,
                    self.clock,
                    api.compiling,
                    api.stream_type,
                    api.event_type,
                    syncs.own,
                )
            )
            patches.enter_context(syncs_timed(syncs, api.tensor_type, api.sync_points))
            self.counting_sync_warnings = patches.enter_context(sync_warnings_counted(syncs, api))
            syncs.all_counted = self.counting_sync_warnings
            tying = True
            self._tie_clocks()
        except Exception as exc:  # the edge: never stop the user's loop for a measurement
            if tying:
                self._backlog_failed(exc)
            else:
                self._patches.close()
                self.copies = self.syncs = None
                self.notes.append(f"Copies and syncs were not watched: {failure_text(exc)}")
                return
        run.extra_columns.update(self.columns())

    def step_ended(self, t_ns: int | None = None, step: int | None = None) -> None:
        """Step `step` (the one that just closed) ended at host time `t_ns`. Never raises."""
        if self._last is None or self.backlog_off is not None:
            return
        self._steps_seen += 1
        if self._steps_seen % BACKLOG_EVERY or capturing(True):
            return
        try:
            if step is None:
                step = int(self.run.recorder.n_steps) - 1
            self._probe(step)
        except Exception as exc:
            self._backlog_failed(exc)

    # -- waits nobody reports, and our own host time ---------------------------------------
    def _watch_hidden_and_own(self, syncs: SyncWatch, first: int) -> None:
        self.hidden = hidden_waits.at_loop_start()
        self._frees_before = self._allocator_frees()
        self.own_tally.watch_from(first)
        syncs.own = self.own_at

    def _allocator_frees(self) -> dict[str, int]:
        from .gpu_activity import memory_stats

        return hidden_waits.allocator_frees(memory_stats().get(self.device or 0))

    def own_at(self, step: int, ns: int) -> None:
        """`ns` of traceml's own host time inside step `step` (a hook on the GPU path)."""
        if ns > 0:
            self.own_tally.add(step, ns / 1e6)

    def own_time(self, ns: int) -> None:
        """`ns` of traceml's own host time in the step running now."""
        step = self.current_step()
        if step is not None:
            self.own_at(step, ns)

    def merged(self, n: int) -> None:
        """The capture merged its last `n` closed steps into the open one (now step
        `recorder.n_steps`): what the watch summed for them moves there. Called through the
        loop's GPU edge (loop_gpu.LoopGpu._watched): an error stops the watch, with a note."""
        first = int(self.run.recorder.n_steps)
        for part in (self.copies, self.syncs):
            if part is not None:
                for tally in part.tallies.values():
                    tally.merge_from(first)
        self.own_tally.merge_from(first)
        self.backlog_raw.merge_from(first)
        self.backlog_at.merge_from(first)

    # -- backlog ---------------------------------------------------------------------------
    def _tie_clocks(self) -> None:
        """The one wait when the loop starts: an event the GPU reaches at once (it has just
        finished everything), with its host time. Probes are measured from it."""
        api, pool = self.api, self._pool
        assert api is not None and pool is not None and self.device is not None
        api.synchronize(self.device)
        self._stream = stream = api.current_stream(self.device)
        if self.copies is not None:
            self.copies.loop_stream = stream
        t = self.clock()
        ev = pool.record(self.device, stream)
        self._h0 = t
        self._last = (ev, 0.0)
        self.backlog_on = True

    def _probe(self, step: int) -> None:
        api, pool = self.api, self._pool
        assert api is not None and pool is not None and self.device is not None
        # The loop's stream, read once every BACKLOG_EVERY steps (a `set_stream` in the loop is
        # followed): probes and the copies' "same stream as the loop" test use it.
        self._stream = stream = api.current_stream(self.device)
        if self.copies is not None:
            self.copies.loop_stream = stream
        t = self.clock()
        ev = pool.record(self.device, stream)
        self._probes.append((step, t, ev))
        self._poll_backlog()

    def _poll_backlog(self) -> None:
        """Read the probes that are done, oldest first; each GPU time is the previous probe's
        plus the elapsed time between the two (float64 sums of short float32 spans)."""
        if self._last is None or self._pool is None or self.device is None:
            return
        last_ev, last_gpu = self._last
        probes, raw, at, h0 = self._probes, self.backlog_raw, self.backlog_at, self._h0
        while probes:
            step, t, ev = probes[0]
            if not (ev.query() and last_ev.query()):
                break
            gpu = last_gpu + float(last_ev.elapsed_time(ev))
            probes.popleft()
            since = (t - h0) / 1e6
            raw.add(step, gpu - since)
            at.add(step, since)
            self._pool.give(self.device, last_ev)
            last_ev, last_gpu = ev, gpu
            self._last = (last_ev, last_gpu)

    def _backlog_failed(self, exc: BaseException) -> None:
        if self.backlog_off is None:
            self.backlog_off = f"The GPU backlog was not measured after an error: {failure_text(exc)}"
        self._probes.clear()
        self._last = None
        self.run.extra_columns.pop("gpu_backlog_ms", None)

    def backlog_column(self, steps: np.ndarray) -> np.ndarray:
        """How far behind the host the GPU was when each probed step ended (ms); NaN elsewhere."""
        lag = self.backlog_raw.column(steps) - self.drift * self.backlog_at.column(steps)
        return np.maximum(lag, 0.0)

    def columns(self) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
        """The per-step columns of the copies, the syncs and the GPU backlog that are measured, by
        name."""
        cols: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
        if self.copies is not None and self.copies.off is None:
            cols.update({name: tally.column for name, tally in self.copies.tallies.items()})
        if self.syncs is not None and self.syncs.off is None:
            cols.update({name: tally.column for name, tally in self.syncs.tallies.items()})
        if self.backlog_on and self.backlog_off is None:
            cols["gpu_backlog_ms"] = self.backlog_column
        if self.syncs is not None:
            cols[OWN_COLUMN] = self.own_tally.column
        return cols

    # -- the end ---------------------------------------------------------------------------
    def close(self) -> None:
        """Undo every patch, wait once for the GPU, read every pending copy and probe, tie the
        clocks again, and leave the results on the run. Never raises. No CUDA event stays
        referenced afterwards (the run outlives the cell, in `kernel_state.RUNS`). The edge at
        the cell's end: it runs while the user's error (if any) goes up, and never masks it."""
        with never_raise(self.run.notes, "The GPU watch failed at the cell's end"):
            try:
                self._patches.close()  # every patch is undone, even when one fails (ExitStack)
            finally:
                self._read_and_publish()

    def _read_and_publish(self) -> None:
        if not self.started or self.api is None or self.device is None:
            self._release()
            self.run.notes.extend(self.notes)
            return
        try:
            if capturing():  # a capture left open: a wait now would invalidate it
                self.notes.append(
                    "GPU timings of copies and syncs incomplete: a CUDA graph capture was still "
                    "under way when the cell ended"
                )
            else:  # CUDA's own error (a sticky one) leaves what was read so far, and a note
                with never_raise(self.notes, "GPU timings of copies and syncs incomplete"):
                    self._read_at_end(self.api, self.device)
        finally:
            self._release()
        self._publish()

    def _read_at_end(self, api: CudaApi, device: int) -> None:
        api.synchronize(device)  # the one wait at the end: every copy and probe is done
        if self.copies is not None and self.copies.off is None:
            self.copies.poll_all()
        if self._last is None or self._pool is None:
            return
        self._poll_backlog()
        last_ev, last_gpu = self._last
        t_end = self.clock()
        end = self._pool.record(device, api.current_stream(device))
        end.synchronize()  # an idle GPU: it completes at once
        since = (t_end - self._h0) / 1e6
        if since > 0:
            gpu_end = last_gpu + float(last_ev.elapsed_time(end))
            self.drift = (gpu_end - since) / since

    def _release(self) -> None:
        """Drop every CUDA event (pools, probes, pending copies) and the CUDA API."""
        if self._pool is not None:
            self._pool.clear()
        self._probes.clear()
        self._last = None
        self._stream = None
        if self.copies is not None:
            self.copies.release()
        self.api = None

    def _publish(self) -> None:
        run = self.run
        n = int(run.recorder.n_steps)
        total = float(run.recorder.totals().get("step_ms", 0.0))
        copies, syncs = self.copies, self.syncs
        notes = list(self.notes)
        for part in (copies, syncs):
            if part is not None and part.off is not None:
                notes.append(part.off)
        if self.backlog_off is not None:
            notes.append(self.backlog_off)
        # A part that turned itself off measured nothing reliable: its columns go.
        dropped = (
            (COPY_COLUMNS if copies is not None and copies.off is not None else ())
            + (SYNC_COLUMNS if syncs is not None and syncs.off is not None else ())
            + (("gpu_backlog_ms",) if self.backlog_off is not None else ())
        )
        for name in dropped:
            run.extra_columns.pop(name, None)
        h2d = copies.result(n) if copies is not None and copies.off is None else None
        stalls: SyncStalls | None = None
        if syncs is not None and syncs.off is None:
            stalls = syncs.result(n, total, run.cell_source)
            stalls["counted_implicit"] = self.counting_sync_warnings
            stalls["all_counted"] = syncs.all_counted
            stalls["hidden"] = self.hidden_reasons(syncs)
            stalls["warning_us"] = syncs.warning_ns / 1e3 if self.counting_sync_warnings else None
            notes.extend(syncs.notes)
        run.h2d, run.sync_stalls = h2d, stalls
        summary = watch_summary(h2d, stalls)
        summary["host_top_line"] = costliest_host_line(getattr(run, "line_costs", None))
        run.watch_summary.update(summary)
        run.notes.extend(notes)


    def hidden_reasons(self, syncs: SyncWatch) -> list[str]:
        """Why some waits for the GPU may have gone unseen (empty: none known)."""
        emptied = sum(s.calls for s in syncs.sites.values() if EMPTY_CACHE in s.kinds)
        after = self._allocator_frees()
        return self.hidden + hidden_waits.at_loop_end(self._frees_before, after, emptied)


def costliest_host_line(costs: Mapping[str, Any] | None) -> HostLine | None:
    """The body line that takes the host most time per step (line_costs), for HOST-BOUND's why:
    often a fetch or Python work in the body, not the kernels' launches."""
    rows = [r for r in (costs or {}).get("statements") or [] if r.get("ms_per_step") is not None]
    if not rows:
        return None
    top = max(rows, key=lambda r: float(r["ms_per_step"]))
    return HostLine(
        line=top.get("line"),
        text=top.get("text"),
        ms_per_step=top.get("ms_per_step"),
        share=top.get("share"),
        gpu_ms_per_step=top.get("gpu_ms_per_step"),
    )


def watch_summary(h2d: Copies | None, syncs: SyncStalls | None) -> WatchSummary:
    """The few facts of the copy and sync watches that the verdict quotes: the cell lines that
    copy to the GPU, the line whose syncs cost the host most, and whether every synchronising
    call was seen (else the host's issue time is not known)."""
    out: WatchSummary = {"h2d_lines": [], "sync_top": None, "syncs_all_seen": False}
    if h2d:
        out["h2d_lines"] = sorted({s["line"] for s in h2d["sites"] if s["in_cell"]})
        out["h2d_pageable_non_blocking"] = sorted(
            {s["line"] for s in h2d["sites"] if s["in_cell"] and s.get("pageable_non_blocking")}
        )
        # side-stream copies the loop's stream waited for most of (a prefetch that hides little)
        out["h2d_side_stream_waited"] = sorted(
            {
                s["line"]
                for s in h2d["sites"]
                if s["in_cell"] and s.get("waited") and (s.get("waited_ms_per_step") or 0.0) * 2 >= (s["ms_per_step"] or 0.0)
            }
        )
    if syncs:
        out["syncs_hidden"] = list(syncs.get("hidden") or [])
        out["syncs_all_seen"] = bool(
            syncs.get("counted_implicit") and syncs.get("all_counted", True) and not out["syncs_hidden"]
        )
        if syncs.get("sites"):
            top = syncs["sites"][0]
            out["sync_top"] = SyncTop(
                line=top["line"],
                in_cell=top["in_cell"],
                call=top["call"],
                calls_per_step=top["calls_per_step"],
                every_step=top["every_step"],
                wait_ms_per_step=top["wait_ms_per_step"],
                share=top["share"],
            )
    return out


@contextmanager
def gpu_watched(
    run: Any, api: CudaApi | None = None, clock: Callable[[], int] = perf_counter_ns
) -> Iterator[GpuWatch]:
    """Watch copies, syncs and backlog for the duration of a traced cell.

    Sets `run.gpu_watch` (the capture starts it when its loop runs on CUDA) and closes it on
    exit. Entering touches nothing of CUDA (a CPU loop never initialises it)."""
    watch = GpuWatch(run, api, clock)
    run.gpu_watch = watch
    try:
        yield watch
    finally:
        run.gpu_watch = None
        watch.close()
