"""CUDA events around fetch and body, recorded on the current stream and resolved without blocking."""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

from .recorder import Recorder


def cuda_in_use() -> bool:
    """True when torch is imported and has initialised CUDA (the loop can run on the GPU)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:
        return False


def gpu_memory_in_use() -> bool:
    """True when tensors live on the current CUDA device (the work really runs there)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.memory_allocated() > 0)
    except Exception:
        return False


class CudaClock:
    """A pool of timing events; a step's events are read once its end event has completed.

    `event_factory` makes an object with `record()`, `query()` and `elapsed_time(other)`
    (torch.cuda.Event(enable_timing=True) on a GPU; a fake in tests).
    """

    def __init__(self, recorder: Recorder, event_factory: Any = None) -> None:
        if event_factory is None:
            import torch

            def event_factory() -> Any:
                return torch.cuda.Event(enable_timing=True)

        self._make = event_factory
        self._free: list[Any] = []
        self._pending: deque[tuple[Any, Any, Any]] = deque()
        self._recorder = recorder
        recorder.before_fold = self.synchronize
        self.used = False

    def mark(self) -> Any:
        ev = self._free.pop() if self._free else self._make()
        ev.record()
        return ev

    def step(self, before_fetch: Any, after_fetch: Any, end: Any) -> None:
        """Queue one step's events and resolve those that are done (oldest first)."""
        self._pending.append((before_fetch, after_fetch, end))
        self.used = True
        self.poll()

    def poll(self) -> None:
        pending, add, free = self._pending, self._recorder.add_gpu, self._free
        while pending and pending[0][2].query():
            a, b, c = pending.popleft()
            add(a.elapsed_time(b), b.elapsed_time(c))
            free.append(a)  # `c` is the next step's `a` and is freed with it
            free.append(b)

    def synchronize(self) -> None:
        """Wait for the GPU once and read every pending step (end of the cell, or a fold)."""
        if self._pending:
            last = self._pending[-1][2]
            if hasattr(last, "synchronize"):
                last.synchronize()
            self.poll()
