"""The step parts' GPU time: CUDA events at the part boundaries of sampled steps, on the loop's
stream, read once complete, never waited for on the per-step path (step_parts.py's `_on_gpu`
calls every method here: an error turns the GPU time of the parts off there)."""

from __future__ import annotations

from collections import deque
from typing import Any

from ..gpu.cuda_graphs import capturing


class CudaParts:
    """CUDA events at the part boundaries of sampled steps, on the loop's stream; each stamp's
    own GPU time (its span less its nested stamps' spans) once its events have completed.
    Nothing of it touches CUDA while a CUDA graph capture is under way (cuda_graphs.py): a part
    that runs during one has no GPU time (nor has the part around it)."""

    def __init__(self, cuda: Any, own: dict[int, float]) -> None:
        self.cuda = cuda
        self._free: list[Any] = []
        self._open: list[tuple[Any, list[int]]] = []  # per open part: its start event, nested stamps
        self.pending: deque[tuple[int, Any, Any, list[int]]] = deque()  # stamp, start, end, nested
        self.spans: dict[int, float] = {}  # stamp -> its GPU span (ms), until its parent is read
        self.own = own  # stamp -> own GPU ms, once read (the store's)

    def _event(self) -> Any:
        cuda = self.cuda
        ev = self._free.pop() if self._free else cuda.marks.new_event()
        cuda.marks.record(ev, cuda.step_stream())
        return ev

    def enter(self) -> None:
        """A part begins: its start event (none during a CUDA graph capture)."""
        self._open.append((None if capturing(True) else self._event(), []))

    def exit(self, stamp: int) -> None:
        """The part opened last ends as `stamp`: its end event (poll() reads it once both completed)."""
        start, nested = self._open.pop()
        if start is not None and not capturing(True):
            self.pending.append((stamp, start, self._event(), nested))
        if self._open:
            self._open[-1][1].append(stamp)

    def reset(self) -> None:
        """A sampled step opens: no part is open."""
        self._open.clear()

    def poll(self) -> None:
        """Read every stamp whose events completed, in order (nested stamps come first)."""
        pending = self.pending
        if not pending or capturing():
            return
        while pending:
            stamp, start, end, nested = pending[0]
            if not (start.query() and end.query()):
                return
            pending.popleft()
            span = float(start.elapsed_time(end))
            self.spans[stamp] = span
            # a nested part without GPU time (run during a graph capture): this one's is unknown
            self.own[stamp] = span - sum(self.spans.pop(n, float("nan")) for n in nested)
            self._free += (start, end)

    def close(self) -> None:
        """The last events are done once the step clock's last event is (it waited for it)."""
        if self.pending and not capturing(True):
            end = self.pending[-1][2]
            if hasattr(end, "synchronize"):
                end.synchronize()
        self.poll()
        self.pending.clear()
        self._free.clear()
