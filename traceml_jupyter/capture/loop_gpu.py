"""The located loop's GPU: which device it runs on, and its GPU clock (cuda_clock.py) fed at each
step's end and around each fetch. Never initialises CUDA: the clock starts only when CUDA already
is, on the current device, until the loop's first steps show where it works.

Any error of the GPU clock turns it off for the run, with a note (`failed`): the run goes on the
CPU clock, and nothing of ours is raised into the user's code. The GPU watch (copies, syncs,
backlog: gpu_watch.py) stops alone on its own errors.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Protocol

from ..failures import failure_text
from .gpu import cuda_graphs, gpu_activity
from .gpu.cuda_clock import (
    CudaStepClock,
    Marks,
    allocation_counts,
    busiest_device,
    busy_devices,
    current_device,
    torch_marks,
)
from .steps.step_model import Span

if TYPE_CHECKING:
    from ..recording import Recording

DECIDE_STEPS = 3  # the loop's device is decided from the allocations of its first steps


class StepMemory(Protocol):
    """The GPU memory per step (resources/gpu_memory.GpuMemory), while the resources are watched."""

    def loop_started(self, device: int) -> None:
        """The loop runs on `device`."""

    def step_ended(self, index: int, t_ns: int | None = None) -> None:
        """Step `index` ended (at `t_ns`): its figures."""

    def merged(self, first: int) -> None:
        """Steps from `first` on were merged into one."""


class LoopGpu:
    """The loop's device and GPU clock (`cuda`: None on the CPU clock). `changed` is called when
    the clock comes or goes: the hooks then look at each step's end again."""

    def __init__(self, run: Recording, thread: int, changed: Callable[[], None], marks: Callable[[int], Marks] | None = None) -> None:
        self.run = run
        self.changed = changed
        self.cuda: CudaStepClock | None = None
        self.deciding = True  # the loop's device is not known yet: each step's end looks
        self.note: str | None = None  # why the GPU clock was turned off
        self.memory: StepMemory | None = None  # set while the run's resources are watched
        self.own_ns = 0  # our GPU bookkeeping's host time in the open step (the GPU watch sums it)
        # The loop's device without the allocator's counts (gpu_activity.py): work queued.
        self.work = gpu_activity.QueuedWork(lambda ds: busy_devices(ds), lambda: current_device(), thread)
        self._marks = marks or torch_marks
        self._first_step = run.recorder.n_steps
        self._alloc_before: dict[int, int] = {}
        self._bytes_before: dict[int, tuple[int, int]] = {}

    def _clock(self, call: Callable[..., Any], *args: Any) -> None:
        """`call(*args)` of the GPU clock: any error turns the clock off (the one guard)."""
        try:
            call(*args)
        except Exception as exc:
            self.failed(exc)

    def failed(self, exc: BaseException) -> None:
        """Any error in the GPU bookkeeping: the run goes on the CPU clock, with a note."""
        self.cuda = None
        self.deciding = False
        self.note = f"GPU timings turned off: {failure_text(exc)}"
        self.changed()

    # -- the start and the device ------------------------------------------------------------
    def start(self) -> None:
        """At the start (CUDA is initialised): time the first steps on the current device until
        the loop shows where it runs."""
        from .gpu.gpu_watch import torch_cuda_api
        from .gpu.syncs import SYNC_METHODS

        self._alloc_before = allocation_counts()
        self._bytes_before = gpu_activity.bytes_in_use()
        api = torch_cuda_api(None)  # while the device is decided, waits for the GPU look for queued work
        if api is not None:
            self.work.probe_waits(api.tensor_type, SYNC_METHODS, api.sync_points)
        device = current_device()
        if device is not None:
            self._use_device(device, confirmed=False)

    def _use_device(self, device: int, confirmed: bool) -> None:
        self._clock(self._make_clock, device)
        if self.cuda is not None and confirmed:
            self._confirmed(device)
        self.changed()

    def _make_clock(self, device: int) -> None:
        self.cuda = CudaStepClock(self.run.recorder, device, self._marks(device))

    def _stop_deciding(self) -> None:
        self.deciding = False
        self.work.stop_probing()

    def _decide_device(self, index: int) -> None:
        """After each of the first steps: the device the loop allocated on is the loop's; else
        one that still has the loop's work queued (in-place kernels, a CUDA graph replayed)."""
        counts = allocation_counts()
        device = busiest_device(self._alloc_before, counts)
        if device is None and counts:
            device = self._device_without_allocations(counts)
        if device is None:
            if index - self._first_step >= DECIDE_STEPS - 1:
                self._stop_deciding()
                self.cuda = None  # a CPU loop: no GPU clock, whatever sits on the GPU
                self.run.recorder.has_gpu = False
                self._cpu_loop_noted(counts)
                self.changed()
            return
        self._stop_deciding()
        if self.cuda is not None and self.cuda.device == device:
            self._confirmed(device)
            return
        self._use_device(device, confirmed=True)
        if self.cuda is not None:
            self._clock(self.cuda.open, index + 1)

    def _device_without_allocations(self, counts: dict[int, int]) -> int | None:
        """No allocation counted: the device whose bytes in use moved (cudaMallocAsync counts
        nothing), else the one the loop was seen working on (gpu_activity.py)."""
        current = current_device()
        moved = gpu_activity.bytes_moved(self._bytes_before, gpu_activity.bytes_in_use())
        if moved:
            return current if current in moved else min(moved)
        candidates = [d for d, n in counts.items() if n > 0 or d == current]
        self.work.look("work queued when a step ended", candidates)
        seen = self.work.seen
        if not seen:
            return None
        return max(seen, key=lambda d: (seen[d], d == current, -d))

    def _cpu_loop_noted(self, counts: dict[int, int]) -> None:
        """A loop taken for a CPU loop while CUDA is initialised says so (never in silence)."""
        if not counts:
            return
        backend = gpu_activity.allocator_backend()
        why = " (the cudaMallocAsync allocator counts no allocations)" if backend == "cudaMallocAsync" else ""
        self.run.notes.append(
            f"CUDA is initialised, but the loop's first {DECIDE_STEPS} steps showed no work on a GPU "
            f"(nothing allocated{why}, no graph replayed, no work queued when a step ended or the "
            "host waited for the GPU): it was timed on the CPU clock."
        )

    def _confirmed(self, device: int) -> None:
        run = self.run
        run.loop_on_gpu(device)
        if self.memory is not None:
            self.memory.loop_started(device)
        if run.gpu_watch is not None:
            self._watched(run.gpu_watch.loop_started, device)

    def _watched(self, call: Callable[..., Any], *args: Any) -> None:
        """`call(*args)` of the GPU watch: an error stops the watch (not the clock), with a note."""
        try:
            call(*args)
        except Exception as exc:
            self.run.notes.append(f"GPU watch stopped: {failure_text(exc)}")
            self.run.gpu_watch = None

    # -- each step ----------------------------------------------------------------------------
    def step_closed(self, index: int, t: int, next_serial: int) -> None:
        """Step `index` ended at `t` (the next fetch will be `next_serial`): the clock's events,
        the allocator's figures, the device decided, the GPU watch."""
        t_in = perf_counter_ns()
        self._bookkeeping(index, t, next_serial)
        # Our host time in the step that closed goes to the GPU watch (it is taken out of the
        # host's issue time); this bookkeeping's own lands in the next step.
        watch = self.run.gpu_watch
        if self.cuda is not None and watch is not None and watch.syncs is not None:
            watch.own_at(index, self.own_ns)
        self.own_ns = perf_counter_ns() - t_in

    def _bookkeeping(self, index: int, t: int, next_serial: int) -> None:
        if cuda_graphs.notice_foreign_capture():  # no CUDA call of ours inside a graph capture
            if self.cuda is not None:
                self.cuda.step_captured(index, next_serial)
            return
        if self.cuda is not None:
            self._clock(self.cuda.step_closed, index, next_serial)
            if self.memory is not None:  # the allocator's figures of the step (never raises)
                self.memory.step_ended(index, t)
        if self.deciding:
            if index - self._first_step < DECIDE_STEPS:
                self._decide_device(index)
            else:
                self._stop_deciding()
        watch = self.run.gpu_watch
        if self.cuda is not None and watch is not None:
            self._watched(watch.step_ended, t)

    def open(self, step: int) -> None:
        """After the views' tick: the clock's step `step` opens again (its time was kept out)."""
        if self.cuda is not None and not cuda_graphs.capturing():
            self._clock(self.cuda.open, step)

    def before_fetch(self, step: int) -> None:
        """A fetch outside any other begins in step `step`: the clock's event before it."""
        t_in = perf_counter_ns()
        if self.cuda is not None:
            self._clock(self.cuda.before_fetch, step)
        self.own_ns += perf_counter_ns() - t_in

    def after_fetch(self, serial: int) -> None:
        """Fetch `serial` gave its batch: the clock's event after it."""
        t_in = perf_counter_ns()
        if self.cuda is not None:
            self._clock(self.cuda.after_fetch, serial)
        self.own_ns += perf_counter_ns() - t_in

    def merged(self, n: int) -> None:
        """The step model merged the last `n` steps into one."""
        if self.memory is not None:
            self.memory.merged(self.run.recorder.n_steps)
        if self.cuda is not None:
            self.cuda.merged(n)
            if self.run.gpu_watch is not None:
                self._watched(self.run.gpu_watch.merged, n)

    def excluded(self, span: Span) -> None:
        """A phase (validation) was kept out of the steps: its fetches too."""
        if self.cuda is not None:
            self._clock(self.cuda.exclude, span.first_serial, span.last_serial)

    def close(self) -> None:
        """Read the pending GPU timings (one wait for the GPU)."""
        self.work.stop_probing()
        if self.cuda is not None and cuda_graphs.capturing():
            self.failed(RuntimeError("a CUDA graph capture was still under way when the cell ended"))
        if self.cuda is not None:
            self._clock(self.cuda.close)
