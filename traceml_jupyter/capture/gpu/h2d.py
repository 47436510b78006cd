"""Host-to-device copies in the step loop: `Tensor.to` and `Tensor.cuda` timed with CUDA events
while a traced cell runs on a GPU, summed per step and per cell line.

Only copies made on the thread that runs the steps are timed (DataParallel's replica threads,
a pin-memory thread pass straight through). Each copy's events sit on the destination device's
current stream, from a pool kept per device (an event is bound to the device of its first
record, and CUDA refuses to record it on another's). Any error of ours turns the watch off for
the run, with a note; the user's own call always runs and its errors propagate unchanged. The
edge: every hook (a copy's start and end, a stream's or an event's wait, an event's record)
calls our code through `CopyWatch.guarded`, its one guard.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter_ns
from types import FrameType
from typing import Any, TypeVar

from ...facts import gpu as gpu_facts
from ...failures import failure_text
from ..instrument.patches import patched
from ..steps.step_tally import StepTally
from .copy_calls import (
    CURRENT,
    NOT_A_DEVICE,
    cell_line,
    cuda_index,
    device_arg,
    is_pinned,
    nbytes_of,
    non_blocking_of,
    target_is_cpu,
)
from .cuda_graphs import capturing

# Per-step columns this module adds to a run (see Run.extra_columns). h2d_async_bytes: bytes
# copied asynchronously, i.e. non_blocking=True *and* from pinned memory (from pageable memory
# CUDA makes the host wait, whatever non_blocking says).
COPY_COLUMNS = ("h2d_ms", "h2d_bytes", "h2d_pinned_bytes", "h2d_async_bytes")

T = TypeVar("T")


class EventPool:
    """Timing events kept per device: an event is bound to the device of its first record and
    may only be recorded there again, so each device reuses its own."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._free: dict[int, list[Any]] = {}
        self.made = 0

    def record(self, device: int, stream: Any = None) -> Any:
        """An event recorded now on `stream` (a stream of `device`; None: the current one)."""
        free = self._free.get(device)
        if free:
            ev = free.pop()
        else:
            ev = self._make()
            self.made += 1
        if stream is None:
            ev.record()
        else:
            ev.record(stream)
        return ev

    def give(self, device: int, *events: Any) -> None:
        """Events that were read: reusable on `device`."""
        self._free.setdefault(device, []).extend(events)

    def clear(self) -> None:
        """Drop every free CUDA event."""
        self._free.clear()


@dataclass
class CopySite:
    """The copies made by one line of code."""

    filename: str
    line: int
    copies: int = 0
    nbytes: int = 0
    ms: float = 0.0  # GPU time of the copies resolved so far
    timed: int = 0  # copies whose GPU time is in `ms`
    pinned: int = 0  # copies from pinned (page-locked) memory
    non_blocking: int = 0  # copies written with non_blocking=True
    pageable_non_blocking: int = 0  # ... of which from pageable memory: the host waited anyway
    side_stream: int = 0  # copies on another stream than the loop's: they can overlap compute
    waited: int = 0  # ... of which the loop's stream waited for (wait_stream) before they were done
    waited_ms: float = 0.0  # how long the loop's stream waited for them (GPU time): step time


@dataclass(slots=True)
class _Copy:
    """A copy in flight: its two events, and where the loop's stream waited for it, if it did."""

    step: int
    device: int
    stream: Any
    start: Any
    end: Any
    side: bool
    site: CopySite
    waited_at: Any = None  # an event on the loop's stream, just before it waited for `stream`
    waited_step: int = 0  # the step that waited
    read: bool = False  # its events were read (it is no longer pending)


class CopyWatch:
    """Times host-to-device copies with a pair of CUDA events each, read back once done.

    `current_step()` gives the index of the step being run, or None outside the steps (copies
    there are not counted). `events` is an EventPool (or a factory of objects with record(),
    query(), elapsed_time(other) and synchronize()). `stream_of(d)` is device d's current
    stream, `current_device()` the current device; `loop_device` the loop's. `loop_stream`
    (set by the GPU watch) is the stream the loop's steps run on: a copy on another stream can
    overlap compute and is not step time, except for the part of it the loop's stream waits for
    (`stream_waits`, called by a patched `Stream.wait_stream`, and `event_waits`, by a patched
    `Event.wait`, which `Stream.wait_event` calls): a copy made on a side stream and waited for
    at once runs between the kernels as one on the loop's stream does.
    """

    def __init__(
        self,
        current_step: Callable[[], int | None],
        events: EventPool | Callable[[], Any],
        cell_filename: str | None,
        stream_of: Callable[[int], Any] | None = None,
        current_device: Callable[[], int] | None = None,
        loop_device: int = 0,
    ) -> None:
        self.current_step = current_step
        self.pool = events if isinstance(events, EventPool) else EventPool(events)
        self.cell_filename = cell_filename
        self.stream_of = stream_of
        self.current_device = current_device or (lambda: loop_device)
        self.loop_device = loop_device
        self.loop_stream: Any = None
        self.thread = threading.get_ident()  # the thread that runs the steps
        self.off: str | None = None  # why the watch turned itself off
        self.tallies = {name: StepTally() for name in COPY_COLUMNS}
        self.sites: dict[tuple[str, int], CopySite] = {}
        self._pending: deque[_Copy] = deque()
        self.side_pending = 0  # side-stream copies not read yet: events recorded then may mark them
        self._marked: dict[int, tuple[Any, _Copy]] = {}  # id(event) -> (event, copy it follows)

    def guarded(self, do: Callable[..., T], *args: Any) -> T | None:
        """`do(*args)`, the edge of every hook of the watch: an error of ours turns the watch
        off (None) and never reaches the user's call."""
        try:
            return do(*args)
        except Exception as exc:
            self.turn_off(exc)
            return None

    def turn_off(self, exc: BaseException) -> None:
        """Stop timing copies after an error of ours (`off` says which); the copies themselves still
        run."""
        if self.off is None:
            self.off = f"Copies to the GPU were not timed after an error: {failure_text(exc)}"
        self._pending.clear()
        self._marked.clear()
        self.side_pending = 0

    def begin(self, device: int) -> tuple[Any, Any]:
        """(stream, event): an event recorded just before a copy to `device` is issued, on the
        stream the copy will run on (the destination's current stream)."""
        stream = self.stream_of(device) if self.stream_of is not None else None
        return stream, self.pool.record(device, stream)

    def copied(
        self,
        step: int,
        device: int,
        stream: Any,
        start: Any,
        src: Any,
        non_blocking: bool,
        pinned: bool,
        frame: FrameType | None,
    ) -> None:
        """Record the end of a copy of `src` that began at `start`; resolve the finished ones."""
        end = self.pool.record(device, stream)
        nbytes = nbytes_of(src)
        side = device != self.loop_device or (
            stream is not None and self.loop_stream is not None and stream != self.loop_stream
        )
        where = cell_line(frame, self.cell_filename)
        site = self.sites.get(where)
        if site is None:
            site = self.sites[where] = CopySite(*where)
        site.copies += 1
        site.nbytes += nbytes
        site.pinned += pinned
        site.non_blocking += non_blocking
        site.pageable_non_blocking += non_blocking and not pinned
        site.side_stream += side
        tallies = self.tallies
        tallies["h2d_bytes"].add(step, nbytes)
        tallies["h2d_pinned_bytes"].add(step, nbytes if pinned else 0)
        tallies["h2d_async_bytes"].add(step, nbytes if non_blocking and pinned else 0)
        self._pending.append(_Copy(step, device, stream, start, end, side, site))
        self.side_pending += side
        self.poll()

    def stream_waits(self, waiter: Any, other: Any) -> None:
        """`waiter.wait_stream(other)` is about to be queued. When the loop's stream waits for a
        side stream whose newest copy is not read yet, an event on the loop's stream marks the
        wait: the copy's end past that event is time the loop's stream spent waiting for it.
        (A copy already done when the wait is queued ends before the event: nothing waited.)"""
        if other == waiter or waiter != self.loop_stream:
            return
        step = self.current_step()
        if step is None:
            return
        for copy in reversed(self._pending):
            if copy.stream == other:  # copies on one stream run in order: the newest ends last
                self._waits_for(copy, waiter, step)
                return

    def _waits_for(self, copy: _Copy, waiter: Any, step: int) -> None:
        """The loop's stream `waiter` waits for side-stream `copy` from now on (not read yet)."""
        if copy.waited_at is None and copy.side and not copy.read and copy.device == self.loop_device:
            copy.waited_at = self.pool.record(copy.device, waiter)
            copy.waited_step = step

    def event_recorded(self, event: Any, stream: Any) -> None:
        """`event.record(stream)` (None: the current stream) while side-stream copies are
        pending: the event marks the newest copy on that stream (a later `wait_event` on it
        waits for that copy: the prefetcher's `record_event` then `wait_event`)."""
        if stream is None and self.stream_of is not None:
            stream = self.stream_of(int(self.current_device()))
        for copy in reversed(self._pending):
            if copy.stream == stream:
                if copy.side:
                    if len(self._marked) > 64:  # events of copies long read
                        self._marked = {k: v for k, v in self._marked.items() if not v[1].read}
                    self._marked[id(event)] = (event, copy)
                return

    def event_waits(self, waiter: Any, event: Any) -> None:
        """`waiter.wait_event(event)` / `event.wait(waiter)` is about to be queued: as
        `stream_waits`, for the copy the event marks."""
        if waiter != self.loop_stream:
            return
        marked = self._marked.pop(id(event), None)
        step = self.current_step()
        if marked is None or marked[0] is not event or step is None:
            return
        self._waits_for(marked[1], waiter, step)

    def _read(self, copy: _Copy) -> None:
        ms = float(copy.start.elapsed_time(copy.end))
        copy.read = True
        self.side_pending -= copy.side
        site = copy.site
        site.ms += ms
        site.timed += 1
        if not copy.side:
            self.tallies["h2d_ms"].add(copy.step, ms)
        elif copy.waited_at is not None:  # a side copy overlaps compute but for the waited part
            waited = max(0.0, float(copy.waited_at.elapsed_time(copy.end)))
            site.waited += 1
            site.waited_ms += waited
            self.tallies["h2d_ms"].add(copy.waited_step, waited)
            self.pool.give(copy.device, copy.waited_at)
        self.pool.give(copy.device, copy.start, copy.end)

    @staticmethod
    def _done(copy: _Copy) -> bool:
        return bool(
            copy.end.query() and copy.start.query() and (copy.waited_at is None or copy.waited_at.query())
        )

    def poll(self) -> None:
        """Read the copies that are done, oldest first (their events queried)."""
        pending, done = self._pending, self._done
        while pending and done(pending[0]):
            self._read(pending.popleft())

    def poll_all(self) -> None:
        """Read every copy that is done, whatever its stream (at the end, after the GPU was
        waited for: all of them)."""
        left: deque[_Copy] = deque()
        for copy in self._pending:
            if self._done(copy):
                self._read(copy)
            else:
                left.append(copy)
        self._pending = left

    def synchronize(self) -> None:
        """Wait for every pending copy and read them all."""
        for copy in self._pending:
            for event in (copy.end, copy.waited_at):
                if hasattr(event, "synchronize"):
                    event.synchronize()
        self.poll_all()

    def release(self) -> None:
        """Drop every event (the run outlives the cell)."""
        self._pending.clear()
        self._marked.clear()
        self.side_pending = 0
        self.pool.clear()

    def watch_from(self, step: int) -> None:
        """Steps from `step` on are watched: a step without a copy counts as 0, not unmeasured."""
        for tally in self.tallies.values():
            tally.watch_from(step)

    def result(self, n_steps: int) -> gpu_facts.Copies:
        """What the report and the checklist read: totals and the copying lines, costliest first.
        Per step means per watched step (the watch starts once the loop is seen on the GPU)."""
        per = max(1, n_steps - (self.tallies["h2d_bytes"].first_step or 0))
        sites = sorted(self.sites.values(), key=lambda s: (-s.ms, -s.nbytes, s.line))
        return {
            "copies": sum(s.copies for s in sites),
            "bytes": sum(s.nbytes for s in sites),
            "ms": sum(s.ms for s in sites),
            "steps": per,
            "sites": [
                {
                    "filename": s.filename,
                    "line": s.line,
                    "in_cell": s.filename == self.cell_filename,
                    "copies": s.copies,
                    "timed": s.timed,
                    "copies_per_step": s.copies / per,
                    "bytes_per_step": s.nbytes / per,
                    "ms_per_step": s.ms / per if s.timed else None,
                    "gb_per_s": s.nbytes * s.timed / s.copies / s.ms / 1e6 if s.ms > 0 else None,
                    "pinned": s.pinned,
                    "non_blocking": s.non_blocking,
                    "pageable_non_blocking": s.pageable_non_blocking,
                    "side_stream": s.side_stream,
                    "waited": s.waited,
                    "waited_ms_per_step": s.waited_ms / per,
                }
                for s in sites
            ],
        }


Synced = Callable[[int, str, "int | None", "FrameType | None"], None]


@contextmanager
def copies_timed(
    watch: CopyWatch,
    tensor_type: Any,
    synced: Synced | None = None,
    inside: list[int] | None = None,
    clock: Callable[[], int] = perf_counter_ns,
    compiling: Callable[[], bool] = lambda: False,
    stream_type: Any = None,
    event_type: Any = None,
    own: Callable[[int, int], None] | None = None,
) -> Iterator[None]:
    """`tensor_type.to` and `tensor_type.cuda` time host-to-device copies for the duration, and
    `stream_type.wait_stream` (torch.cuda.Stream's) and `event_type.wait` (torch.cuda.Event's,
    which `Stream.wait_event` calls; `event_type.record` tells which copy an event follows) tell
    the watch when the loop's stream waits for a side stream's copies. `own(step, ns)` gets
    the hooks' own host time around each timed copy.

    A copy that makes the host wait for the GPU (a blocking one, or a `non_blocking` one from
    pageable memory, which CUDA runs synchronously) and a blocking `.to("cpu")` of a CUDA
    tensor go to `synced(step, kind, host ns, frame)`. `inside[0]` counts calls in progress, so
    the sync watch does not count their sync warning a second time. While `compiling()`
    (torch.compile tracing) the originals run untimed. Both attributes are restored on exit.
    """
    to, cuda = tensor_type.to, tensor_type.cuda
    busy = inside if inside is not None else [0]
    get_ident = threading.get_ident
    timed, waited = _copy_hooks(watch, to, busy, synced, clock, own)

    not_a_device = NOT_A_DEVICE
    torch = sys.modules.get("torch")
    if torch is not None:  # dtypes and memory formats never name a device
        not_a_device.update({type(torch.float32), type(torch.contiguous_format)})

    def timed_to(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args and type(args[0]) in not_a_device and not kwargs:  # `.to(dtype)`: the commonest
            return to(self, *args)
        if compiling() or watch.off is not None or get_ident() != watch.thread:  # (instrument/dynamo.py)
            return to(self, *args, **kwargs)
        if self.is_cuda:
            if synced is None or not target_is_cpu(args, kwargs) or non_blocking_of(args, kwargs):
                return to(self, *args, **kwargs)
            step = watch.current_step()
            if step is None or compiling():
                return to(self, *args, **kwargs)
            return waited(self, args, kwargs, step)
        device = cuda_index(device_arg(args, kwargs))
        if device is None:
            return to(self, *args, **kwargs)
        step = watch.current_step()
        if step is None or compiling() or capturing(True):  # a copy into a CUDA graph runs at replay
            return to(self, *args, **kwargs)
        return timed(to, self, args, kwargs, step, device)

    def timed_cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
        if compiling() or watch.off is not None or get_ident() != watch.thread or self.is_cuda:
            return cuda(self, *args, **kwargs)
        step = watch.current_step()
        if step is None or compiling() or capturing(True):
            return cuda(self, *args, **kwargs)
        target = device_arg(args, kwargs)
        device = CURRENT if target is None or isinstance(target, bool) else cuda_index(target)
        if device is None and isinstance(target, str):  # `.cuda("0")` is not a device
            return cuda(self, *args, **kwargs)
        return timed(cuda, self, args, kwargs, step, CURRENT if device is None else device)

    timed_to.__doc__, timed_cuda.__doc__ = to.__doc__, cuda.__doc__
    waits, events = _stream_wait_hooks(watch, stream_type, event_type)
    with patched(tensor_type, {"to": timed_to, "cuda": timed_cuda}), patched(stream_type, waits), patched(event_type, events):
        yield


def _copy_hooks(
    watch: CopyWatch,
    to: Callable[..., Any],
    busy: list[int],
    synced: Synced | None,
    clock: Callable[[], int],
    own: Callable[[int, int], None] | None,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """copies_timed's two timings: `timed` (a host-to-device copy, onto the watch) and `waited`
    (`.to("cpu")` of a CUDA tensor, a sync)."""

    def begin(device: int) -> tuple[int, Any, Any]:
        if device == CURRENT:
            device = int(watch.current_device())
        stream, start = watch.begin(device)
        return device, stream, start

    def copied(tensor: Any, args: Any, kwargs: Any, step: int, begun: tuple[int, Any, Any], ns: int, t_in: int, frame: FrameType) -> None:
        device, stream, start = begun
        nb = non_blocking_of(args, kwargs)
        pinned = is_pinned(tensor)
        watch.copied(step, device, stream, start, tensor, nb, pinned, frame)
        if synced is not None and not (nb and pinned):
            synced(step, "blocking copy" if not nb else "pageable non_blocking copy", ns, frame)
        if own is not None:
            own(step, clock() - t_in - ns)

    def timed(method: Callable[..., Any], self: Any, args: Any, kwargs: Any, step: int, device: int) -> Any:
        t_in = clock()
        begun = watch.guarded(begin, device)
        if begun is None:  # the watch turned off: the copy itself still runs, untimed
            return method(self, *args, **kwargs)
        busy[0] += 1
        t0 = clock()
        try:
            out = method(self, *args, **kwargs)
        finally:
            busy[0] -= 1
        ns = clock() - t0
        watch.guarded(copied, self, args, kwargs, step, begun, ns, t_in, sys._getframe(2))
        return out

    def waited(self: Any, args: Any, kwargs: Any, step: int) -> Any:
        """`.to("cpu")` of a CUDA tensor: the host waits for the GPU, then the copy."""
        assert synced is not None
        busy[0] += 1
        t0 = clock()
        try:
            return to(self, *args, **kwargs)
        finally:
            ns = clock() - t0
            busy[0] -= 1
            synced(step, "to(cpu)", ns, sys._getframe(2))

    return timed, waited


def _stream_wait_hooks(
    watch: CopyWatch, stream_type: Any, event_type: Any
) -> tuple[dict[str, Callable[..., Any]], dict[str, Callable[..., Any]]]:
    """copies_timed's patches of `stream_type.wait_stream` and of `event_type.record`/`wait`:
    they tell the watch when the loop's stream waits for a side stream's copies."""
    get_ident = threading.get_ident
    wait_stream: Any = getattr(stream_type, "wait_stream", None)
    in_wait_stream = [False]  # torch's wait_stream is wait_event(stream.record_event()): seen once

    def watched_wait_stream(self: Any, stream: Any) -> Any:
        if watch.off is None and get_ident() == watch.thread and not capturing(True):
            watch.guarded(watch.stream_waits, self, stream)  # the wait itself always runs
        in_wait_stream[0] = True
        try:
            return wait_stream(self, stream)
        finally:
            in_wait_stream[0] = False

    def event_waits(event: Any, stream: Any) -> None:
        waiter = stream
        if waiter is None and watch.stream_of is not None:
            waiter = watch.stream_of(int(watch.current_device()))
        watch.event_waits(waiter, event)

    record: Any = getattr(event_type, "record", None)
    event_wait: Any = getattr(event_type, "wait", None)

    def watched_record(self: Any, stream: Any = None) -> Any:
        if watch.side_pending and watch.off is None and get_ident() == watch.thread and not capturing(True):
            watch.guarded(watch.event_recorded, self, stream)
        return record(self, stream)

    def watched_wait(self: Any, stream: Any = None) -> Any:
        if (
            watch.side_pending
            and not in_wait_stream[0]
            and watch.off is None
            and get_ident() == watch.thread
            and not capturing(True)
        ):
            watch.guarded(event_waits, self, stream)
        return event_wait(self, stream)

    watched_wait_stream.__doc__ = getattr(wait_stream, "__doc__", None)
    watched_record.__doc__ = getattr(record, "__doc__", None)
    watched_wait.__doc__ = getattr(event_wait, "__doc__", None)
    waits: dict[str, Callable[..., Any]] = {"wait_stream": watched_wait_stream} if callable(wait_stream) else {}
    events: dict[str, Callable[..., Any]] = {"record": watched_record, "wait": watched_wait} if callable(record) and callable(event_wait) else {}
    return waits, events
