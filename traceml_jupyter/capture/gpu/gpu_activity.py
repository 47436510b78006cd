"""Which CUDA device a loop works on when the allocator's counts do not say.

The capture decides the loop's device from the allocations its first steps make (cuda_clock.py).
Two kinds of GPU loop make none that count: a loop that allocates nothing (a CUDA graph
replayed, in-place kernels), and any loop under `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`,
whose `memory_stats()` keeps every count at 0 and reports only the bytes in use and reserved
(c10/cuda/CUDAMallocAsyncAllocator.cpp, getDeviceStats). Other evidence, gathered during the
deciding steps only:

- the bytes in use (or their peak) moved on a device (the one stat both allocators report);
- the loop replayed a CUDA graph (cuda_graphs.py tells);
- the loop's device still had work queued when a training event (backward, optimizer step)
  ended, or when the loop called something that waits for the GPU (`.item()`, `.tolist()`,
  `.cpu()`, `bool()`/`float()`/`int()` of a CUDA tensor, a synchronize): it launched work
  there that the host then waited for.

Nothing here initialises CUDA, and nothing touches it while a graph capture is under way.
The allocator's figures are asked only once CUDA is initialised (`cuda_state.cuda_or`); `look` is the
edge of the waits probed in the user's code (a failure there counts nothing, raises nothing);
the probes' patches are undone in `finally` when setting one fails, and the error goes to the
capture, which notes it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from typing import Any

from ..instrument.patches import patched
from .cuda_graphs import capturing
from .cuda_state import cuda_initialized, cuda_or, torch_cuda

BYTES_KEYS = ("allocated_bytes.all.current", "allocated_bytes.all.peak")


def cuda_module() -> Any:
    """torch.cuda, only once CUDA is initialised by the user's code; else None."""
    cuda = torch_cuda()
    return cuda if cuda is not None and cuda_initialized(cuda) else None


def memory_stats() -> dict[int, dict[str, int]]:
    """`torch.cuda.memory_stats(d)` of every device (host-side counters; for a device nothing
    used yet, zeros without a context); {} while CUDA is not initialised."""
    cuda = cuda_module()
    if cuda is None:
        return {}
    return cuda_or({}, _memory_stats, cuda)


def _memory_stats(cuda: Any) -> dict[int, dict[str, int]]:
    return {d: dict(cuda.memory_stats(d)) for d in range(int(cuda.device_count()))}


def allocator_backend() -> str | None:
    """"native" or "cudaMallocAsync" (PYTORCH_CUDA_ALLOC_CONF's backend), once CUDA is
    initialised; None before, or when torch does not say."""
    backend = getattr(cuda_module(), "get_allocator_backend", None)  # torch >= 2.0
    return str(backend()) if callable(backend) else None


def bytes_in_use() -> dict[int, tuple[int, int]]:
    """Per device: (bytes in use, their peak), as both allocator backends report them."""
    return {d: tuple(int(s.get(k, 0)) for k in BYTES_KEYS) for d, s in memory_stats().items()}  # type: ignore[misc]


def bytes_moved(before: Mapping[int, tuple[int, int]], after: Mapping[int, tuple[int, int]]) -> set[int]:
    """Devices whose bytes in use or peak changed between two readings."""
    return {d for d, now in after.items() if now != before.get(d, (0, 0)) and any(now)}


class QueuedWork:
    """Work the loop launched on each device, seen while its device is decided: graph
    replays, and work still queued when the loop ended a training event or waited for the GPU.

    `busy(devices)` gives those of `devices` whose current stream has work queued (a host-side
    stream query: cuda_clock.busy_devices); `current()` the current device."""

    def __init__(
        self,
        busy: Callable[[Iterable[int]], set[int]],
        current: Callable[[], int | None],
        thread: int | None = None,
    ) -> None:
        self.busy = busy
        self.current = current
        self.thread = threading.get_ident() if thread is None else thread
        self.seen: Counter[int] = Counter()
        self.kinds: Counter[str] = Counter()
        self._probes: ExitStack | None = None

    def saw(self, device: int | None, kind: str) -> None:
        """Count work seen queued on `device`, of kind `kind` (a sync, a copy, ...)."""
        if device is not None:
            self.seen[device] += 1
            self.kinds[kind] += 1

    def look(self, kind: str, devices: Iterable[int] | None = None) -> None:
        """Queued work now on `devices` (the current device if None) counts for each."""
        if capturing(True):
            return
        try:  # the edge of a probed wait in the user's code: a failure counts nothing
            if devices is None:
                current = self.current()
                devices = () if current is None else (current,)
            for d in self.busy(devices):
                self.saw(d, kind)
        except Exception:
            return

    def device(self) -> int | None:
        """The device with the most work seen, None when none was."""
        if not self.seen:
            return None
        return max(self.seen, key=lambda d: (self.seen[d], -d))

    # -- waits for the GPU while deciding --------------------------------------------------
    def probe_waits(self, tensor_type: Any, methods: Iterable[str], sync_points: Iterable[tuple[Any, str, str]]) -> None:
        """Until `stop_probing()`: each of `methods` of a CUDA tensor, and each sync point
        (owner, name, kind), first looks whether the current device has work queued."""
        if self._probes is not None:
            return
        stack = ExitStack()
        look, thread, get_ident = self.look, self.thread, threading.get_ident

        def probed_method(method: Callable[..., Any]) -> Callable[..., Any]:
            def probed(self: Any, *args: Any, **kwargs: Any) -> Any:
                if get_ident() == thread and getattr(self, "is_cuda", False):
                    look("a wait for the GPU")
                return method(self, *args, **kwargs)

            probed.__doc__ = method.__doc__
            return probed

        def probed_call(function: Callable[..., Any]) -> Callable[..., Any]:
            def probed(*args: Any, **kwargs: Any) -> Any:
                if get_ident() == thread:
                    look("a wait for the GPU")
                return function(*args, **kwargs)

            probed.__doc__ = function.__doc__
            probed.__wrapped__ = function  # type: ignore[attr-defined]
            return probed

        set_all = False
        try:
            names = [n for n in methods if callable(getattr(tensor_type, n, None))]
            stack.enter_context(patched(tensor_type, {n: probed_method(getattr(tensor_type, n)) for n in names}))
            for owner, name, _ in sync_points:
                stack.enter_context(patched(owner, {name: probed_call(getattr(owner, name))}))
            set_all = True
        finally:
            if not set_all:  # nothing stays patched; the error goes to the capture
                stack.close()
        self._probes = stack

    def stop_probing(self) -> None:
        """Undo the probes' patches (if any); what they saw stays."""
        probes, self._probes = self._probes, None
        if probes is not None:
            probes.close()

