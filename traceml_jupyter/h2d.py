"""Host-to-device copies in the step loop: `Tensor.to` and `Tensor.cuda` timed with CUDA events
while a traced cell runs on a GPU, summed per step and per cell line."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter_ns
from types import FrameType
from typing import Any

from .cell_functions import is_cell_file
from .patches import patched
from .step_tally import StepTally

# Per-step columns this module adds to a run (see Run.extra_columns).
COPY_COLUMNS = ("h2d_ms", "h2d_bytes", "h2d_pinned_bytes", "h2d_async_bytes")
FRAME_DEPTH = 16  # how far up the stack a copy or a sync is looked for in a notebook cell


def cell_line(frame: FrameType | None, cell_filename: str | None) -> tuple[str, int]:
    """Where in the notebook a call came from: the nearest frame of the traced cell, else of
    any notebook cell (a function defined in another cell), else the immediate caller."""
    first: tuple[str, int] | None = None
    other_cell: tuple[str, int] | None = None
    for _ in range(FRAME_DEPTH):
        if frame is None:
            break
        filename = frame.f_code.co_filename
        if first is None:
            first = (filename, frame.f_lineno)
        if filename == cell_filename:
            return filename, frame.f_lineno
        if other_cell is None and is_cell_file(filename):
            other_cell = (filename, frame.f_lineno)
        frame = frame.f_back
    return other_cell or first or ("?", 0)


def target_is_cuda(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` moves to a CUDA device: a device string, a
    torch.device, a device index, or another tensor that lives on CUDA."""
    device = kwargs.get("device")
    if device is None and args:
        device = args[0]
    if device is None or isinstance(device, bool):
        return False
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, int):
        return True  # `x.to(0)`: a CUDA device index
    kind = getattr(device, "type", None)
    if isinstance(kind, str):
        return kind == "cuda"
    return bool(getattr(device, "is_cuda", False))


def non_blocking_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`non_blocking` of a `.to(...)` or `.cuda(...)` call: the keyword, else the first
    positional bool (`.to(device, dtype, non_blocking, copy)`, `.cuda(device, non_blocking)`)."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    for arg in args:
        if isinstance(arg, bool):
            return arg
    return False


def nbytes_of(tensor: Any) -> int:
    try:
        return int(tensor.nelement()) * int(tensor.element_size())
    except Exception:
        return 0


def is_pinned(tensor: Any) -> bool:
    try:
        return bool(tensor.is_pinned())
    except Exception:
        return False


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
    non_blocking: int = 0
    side_stream: int = 0  # copies on a stream other than the default: they can overlap compute


class CopyWatch:
    """Times host-to-device copies with a pair of CUDA events each, read back once done.

    `current_step()` gives the index of the step being run, or None outside the step loop
    (copies there are not counted). `event_factory` makes objects with record(), query(),
    elapsed_time(other) and synchronize() (torch.cuda.Event(enable_timing=True) on a GPU).
    """

    def __init__(
        self,
        current_step: Callable[[], int | None],
        event_factory: Callable[[], Any],
        cell_filename: str | None,
        on_side_stream: Callable[[], bool] | None = None,
    ) -> None:
        self.current_step = current_step
        self._make = event_factory
        self.cell_filename = cell_filename
        self._on_side_stream = on_side_stream or (lambda: False)
        self.tallies = {name: StepTally() for name in COPY_COLUMNS}
        self.sites: dict[tuple[str, int], CopySite] = {}
        self._free: list[Any] = []
        self._pending: deque[tuple[int, Any, Any, bool, CopySite]] = deque()

    def begin(self) -> Any:
        """An event recorded just before a copy is issued."""
        ev = self._free.pop() if self._free else self._make()
        ev.record()
        return ev

    def copied(
        self, step: int, start: Any, src: Any, non_blocking: bool, frame: FrameType | None
    ) -> None:
        """Record the end of a copy of `src` that began at `start`; resolve the finished ones."""
        end = self.begin()
        nbytes = nbytes_of(src)
        pinned = is_pinned(src)
        side = self._on_side_stream()
        where = cell_line(frame, self.cell_filename)
        site = self.sites.get(where)
        if site is None:
            site = self.sites[where] = CopySite(*where)
        site.copies += 1
        site.nbytes += nbytes
        site.pinned += pinned
        site.non_blocking += non_blocking
        site.side_stream += side
        tallies = self.tallies
        tallies["h2d_bytes"].add(step, nbytes)
        tallies["h2d_pinned_bytes"].add(step, nbytes if pinned else 0)
        tallies["h2d_async_bytes"].add(step, nbytes if non_blocking else 0)
        self._pending.append((step, start, end, side, site))
        self.poll()

    def poll(self) -> None:
        pending, free, tally = self._pending, self._free, self.tallies["h2d_ms"]
        while pending and pending[0][2].query():
            step, start, end, side, site = pending.popleft()
            ms = float(start.elapsed_time(end))
            site.ms += ms
            site.timed += 1
            if not side:  # a copy on a side stream overlaps compute: not step time
                tally.add(step, ms)
            free.append(start)
            free.append(end)

    def synchronize(self) -> None:
        """Wait for the last copy and read every pending one (once, at the end of the cell)."""
        if self._pending:
            last = self._pending[-1][2]
            if hasattr(last, "synchronize"):
                last.synchronize()
            self.poll()

    def watch_from(self, step: int) -> None:
        for tally in self.tallies.values():
            tally.watch_from(step)

    def result(self, n_steps: int) -> dict[str, Any]:
        """What the report and the checklist read: totals and the copying lines, costliest first."""
        per = max(1, n_steps)
        sites = sorted(self.sites.values(), key=lambda s: (-s.ms, -s.nbytes, s.line))
        return {
            "copies": sum(s.copies for s in sites),
            "bytes": sum(s.nbytes for s in sites),
            "ms": sum(s.ms for s in sites),
            "steps": n_steps,
            "sites": [
                {
                    "filename": s.filename,
                    "line": s.line,
                    "in_cell": s.filename == self.cell_filename,
                    "copies": s.copies,
                    "copies_per_step": s.copies / per,
                    "bytes_per_step": s.nbytes / per,
                    "ms_per_step": s.ms / per if s.timed else None,
                    "gb_per_s": s.nbytes * s.timed / s.copies / s.ms / 1e6 if s.ms > 0 else None,
                    "pinned": s.pinned,
                    "non_blocking": s.non_blocking,
                    "side_stream": s.side_stream,
                }
                for s in sites
            ],
        }


@contextmanager
def copies_timed(
    watch: CopyWatch,
    tensor_type: Any,
    blocking: Callable[[int, int, FrameType | None], None] | None = None,
    inside: list[int] | None = None,
    clock: Callable[[], int] = perf_counter_ns,
    compiling: Callable[[], bool] = lambda: False,
) -> Iterator[None]:
    """`tensor_type.to` and `tensor_type.cuda` time host-to-device copies for the duration.

    A blocking copy (`non_blocking=False`) also makes the host wait for the GPU; its host time
    goes to `blocking(step, ns, frame)`. `inside[0]` counts calls in progress, so the sync
    watch does not count a blocking copy a second time. While `compiling()` (torch.compile
    tracing) the originals run untimed. Both attributes are restored on exit.
    """
    to, cuda = tensor_type.to, tensor_type.cuda
    busy = inside if inside is not None else [0]

    def timed(method: Callable[..., Any], self: Any, args: Any, kwargs: Any, step: int) -> Any:
        start = watch.begin()
        busy[0] += 1
        t0 = clock()
        try:
            out = method(self, *args, **kwargs)
        finally:
            busy[0] -= 1
        ns = clock() - t0
        frame = sys._getframe(2)
        nb = non_blocking_of(args, kwargs)
        watch.copied(step, start, self, nb, frame)
        if blocking is not None and not nb:
            blocking(step, ns, frame)
        return out

    def timed_to(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.is_cuda or not target_is_cuda(args, kwargs) or compiling():
            return to(self, *args, **kwargs)
        step = watch.current_step()
        if step is None:
            return to(self, *args, **kwargs)
        return timed(to, self, args, kwargs, step)

    def timed_cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = None if self.is_cuda or compiling() else watch.current_step()
        if step is None:
            return cuda(self, *args, **kwargs)
        return timed(cuda, self, args, kwargs, step)

    timed_to.__doc__, timed_cuda.__doc__ = to.__doc__, cuda.__doc__
    with patched(tensor_type, {"to": timed_to, "cuda": timed_cuda}):
        yield
