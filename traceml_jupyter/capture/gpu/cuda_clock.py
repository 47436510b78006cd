"""The GPU clock: CUDA events on the step model's boundaries and fetches, recorded on the loop's
device and stream, read once done (never waited for on the per-step path).

Which device the loop uses is decided from what the loop did (allocations made during its first
steps), never by asking CUDA anything that would initialise it: a CPU loop in a kernel where a
tensor from an earlier cell sits on the GPU stays on the CPU clock.

CUDA's state (the allocator's counters, the current device, a stream's queue) is asked only once
CUDA is initialised, through `cuda_state.cuda_or`: CUDA's own (sticky) error gives the fallback.
The clock's own errors raise to the capture's per-step edge, which turns the GPU clock off.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..steps.recorder import Recorder
from .cuda_state import cuda_initialized, cuda_or


def allocation_counts() -> dict[int, int]:
    """Allocations made so far on each CUDA device (host-side counters of torch's caching
    allocator); {} while CUDA is not initialised."""
    if not cuda_initialized():
        return {}
    return cuda_or({}, _allocation_counts, sys.modules["torch"].cuda)


def _allocation_counts(cuda: Any) -> dict[int, int]:
    return {d: int(cuda.memory_stats(d).get("allocation.all.allocated", 0)) for d in range(int(cuda.device_count()))}


def busiest_device(before: Mapping[int, int], after: Mapping[int, int]) -> int | None:
    """The device with the most allocations between two counts, None when none allocated."""
    grown = {d: n - before.get(d, 0) for d, n in after.items()}
    best = max(grown, key=lambda d: (grown[d], -d), default=None)
    return best if best is not None and grown[best] > 0 else None


def current_device() -> int | None:
    """torch's current CUDA device, only when CUDA is already initialised."""
    if not cuda_initialized():
        return None
    device = cuda_or(None, sys.modules["torch"].cuda.current_device)
    return None if device is None else int(device)


def busy_devices(devices: Iterable[int]) -> set[int]:
    """Of `devices`, those whose current stream still has queued work (a host-side query: no
    wait): a loop that launches kernels without allocating (in-place ops, CUDA graph replay)."""
    torch = sys.modules.get("torch")
    busy: set[int] = set()
    if torch is None or not cuda_initialized():
        return busy
    for d in devices:
        if not cuda_or(True, _queue_empty, torch.cuda, d):  # CUDA's error: that device's work unknown
            busy.add(d)
    return busy


def _queue_empty(cuda: Any, device: int) -> bool:
    return bool(cuda.current_stream(device).query())


@dataclass
class Marks:
    """How events are made and recorded (torch's on a GPU, a test double on the CPU)."""

    new_event: Callable[[], Any]
    stream: Callable[[], Any]  # the stream current on the loop's device now
    record: Callable[[Any, Any], None]  # record an event on a stream


def torch_marks(device: int) -> Marks:
    """Timing events of `device` (the loop's device, which may not be the current device),
    recorded on the stream a step started on."""
    torch = sys.modules["torch"]
    cuda = torch.cuda

    def new_event() -> Any:
        return cuda.Event(enable_timing=True)

    def stream() -> Any:
        return cuda.current_stream(device)

    def record(event: Any, on: Any) -> None:
        event.record(on)

    return Marks(new_event, stream, record)


@dataclass
class StepEvents:
    """The events of one step: its start and end, a pair around each of its outermost fetches
    (by fetch serial number), and a pair around each phase kept out of it."""

    index: int
    start: Any
    end: Any = None
    fetches: list[tuple[int, Any, Any]] = field(default_factory=list)
    phases: list[tuple[Any, Any]] = field(default_factory=list)
    valid: bool = True


class CudaStepClock:
    """Events per step, resolved in step order once every event of the step has completed.

    GPU data wait = the summed GPU time between the events around each fetch (the part of the
    fetch that queued work did not hide); GPU step = start to end minus the phases kept out;
    GPU compute = step - data wait. `poll()` never blocks; `close()` waits once.
    """

    def __init__(self, recorder: Recorder, device: int, marks: Marks) -> None:
        self.recorder = recorder
        self.device = device
        self.marks = marks
        self.current: StepEvents | None = None
        self.pending: deque[StepEvents] = deque()
        self._before: Any = None
        self._free: list[Any] = []
        self._stream = marks.stream()  # the stream the open step started on
        recorder.enable_gpu()

    def _mark(self) -> Any:
        """An event on the open step's stream: a body that switches streams (`with
        torch.cuda.stream(s):`) is still timed on the stream its step started on."""
        ev = self._free.pop() if self._free else self.marks.new_event()
        self.marks.record(ev, self._stream)
        return ev

    # -- per step ---------------------------------------------------------------------------
    def open(self, index: int) -> None:
        """A step starts now (the first one, or the one after the live view's refresh)."""
        self._stream = self.marks.stream()
        if self.current is None or self.current.index != index:
            self.current = StepEvents(index, self._mark())
        else:
            self.current.start = self._mark()

    def before_fetch(self, index: int) -> None:
        """A batch is about to be fetched: an event marks the step's data wait beginning (the first
        fetch of a run also opens its first step)."""
        opening = self.current is None or self.current.start is None
        if opening:  # the run's first step (or one begun inside a CUDA graph capture) opens here
            self._stream = self.marks.stream()
        self._before = ev = self._mark()
        if self.current is None:
            self.current = StepEvents(index, ev)
        elif opening:
            self.current.start = ev

    def after_fetch(self, serial: int) -> None:
        """The fetch returned: an event marks the end of its data wait."""
        before, self._before = self._before, None
        if before is not None and self.current is not None:
            self.current.fetches.append((serial, before, self._mark()))

    def exclude(self, first_serial: int, last_serial: int) -> None:
        """A phase (its fetches first..last) is kept out of the open step."""
        cur = self.current
        if cur is None:
            return
        inside = [f for f in cur.fetches if first_serial <= f[0] <= last_serial]
        if not inside:
            cur.valid = False
            return
        cur.fetches = [f for f in cur.fetches if not first_serial <= f[0] <= last_serial]
        cur.phases.append((inside[0][1], inside[-1][2]))

    def step_closed(self, index: int, next_serial: int) -> None:
        """Step `index` ended now; fetches from `next_serial` on belong to the next step."""
        self._close(index, next_serial, self._mark())
        self._stream = self.marks.stream()
        self.poll()

    def step_captured(self, index: int, next_serial: int) -> None:
        """Step `index` ended while a CUDA graph capture was under way, when no event may be
        recorded (cuda_graphs.py): its GPU timings are unknown, and the next step starts at its
        first fetch."""
        self._close(index, next_serial, None)

    def _close(self, index: int, next_serial: int, end: Any) -> None:
        """The open step `index` ends at event `end` (None: unknown) and goes to the pending."""
        cur = self.current
        later: list[tuple[int, Any, Any]] = []
        if cur is not None and cur.index == index:
            later = [f for f in cur.fetches if f[0] >= next_serial]
            cur.fetches = [f for f in cur.fetches if f[0] < next_serial]
            cur.end = end
            cur.valid = cur.valid and end is not None
            self.pending.append(cur)
        self.current = StepEvents(index + 1, end, fetches=later)

    def step_stream(self) -> Any:
        """The stream the open step started on: where events of its insides go too."""
        return self._stream

    def merged(self, n: int) -> None:
        """The last n closed steps were merged into the open one: its GPU timings are unknown."""
        last = self.recorder.n_steps  # the open step's index after the merge
        self.pending = deque(p for p in self.pending if p.index < last)
        if self.current is not None:
            self.current.index = last
            self.current.valid = False

    # -- resolving ----------------------------------------------------------------------------
    def poll(self) -> None:
        """Read every step whose events have all completed, oldest first."""
        pending, add = self.pending, self.recorder.add_gpu
        while pending:
            step = pending[0]
            events = [step.start, step.end]
            for _, a, b in step.fetches:
                events += (a, b)
            for a, b in step.phases:
                events += (a, b)
            if not all(ev.query() for ev in events if ev is not None):
                return
            pending.popleft()
            if step.valid and step.start is not None and step.end is not None:
                wait = sum(float(a.elapsed_time(b)) for _, a, b in step.fetches)
                kept_out = sum(float(a.elapsed_time(b)) for a, b in step.phases)
                total = float(step.start.elapsed_time(step.end)) - kept_out
                add(step.index, wait, total - wait)
            # The step's end is the next step's start: it stays in use until that one is read.
            # The first step's start is its first fetch's own event: free each event once.
            done = {id(ev): ev for ev in [step.start, *events[2:]] if ev is not None}
            self._free += done.values()

    def close(self) -> None:
        """Wait for the GPU once and read every closed step."""
        if self.pending:
            last = self.pending[-1].end
            if hasattr(last, "synchronize"):
                last.synchronize()
        self.poll()
        self.current = None
        self._free.clear()
