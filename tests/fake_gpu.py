"""A stand-in GPU for CPU tests: one stream that runs queued work in order on the host's clock
(real, or a fake one the test advances), CUDA-like events on it, tensors that "live" on it,
and the CudaApi the watches take.

Work launched with `launch(ms)` starts when the stream is free and the host has issued it; an
event completes when the stream has done everything queued before it. Like a real launch
queue, `launch` blocks the host while more than `queue_ms` of work is queued.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from traceml_jupyter.sync_stalls import SYNC_MESSAGE, CudaApi


class HostClock:
    """The host clock in ns: real (perf_counter_ns), or fake and moved by `sleep`."""

    def __init__(self, fake: bool = False) -> None:
        self.fake = fake
        self.ns = 0

    def __call__(self) -> int:
        return self.ns if self.fake else time.perf_counter_ns()

    def sleep(self, ns: float) -> None:
        if ns <= 0:
            return
        if self.fake:
            self.ns += int(ns)
            return
        end = time.perf_counter_ns() + ns
        if ns > 300_000:
            time.sleep((ns - 200_000) / 1e9)
        while time.perf_counter_ns() < end:  # the last 0.2 ms spun: a sleep oversleeps
            pass


class FakeGpu:
    def __init__(
        self, clock: HostClock | None = None, drift: float = 0.0, queue_ms: float = 50.0
    ) -> None:
        self.clock = clock or HostClock()
        self.drift = drift  # GPU timer runs (1 + drift) times as fast as the host's
        self.queue_ns = queue_ms * 1e6
        self.free_at = 0  # host ns when the queued work is done
        self.sync_mode = 0

    def launch(self, ms: float) -> None:
        now = self.clock()
        self.clock.sleep(self.free_at - now - self.queue_ns)  # a full launch queue blocks
        now = self.clock()
        self.free_at = max(self.free_at, now) + int(ms * 1e6)

    def wait(self) -> None:
        """The host waits until the stream has done all its work (a synchronising call)."""
        self.clock.sleep(self.free_at - self.clock())

    def synchronize(self) -> None:
        self.wait()

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def api(self, tensor_type: Any = None) -> CudaApi:
        def set_mode(mode: int) -> None:
            self.sync_mode = mode

        return CudaApi(
            self.event,
            self.synchronize,
            lambda: self.sync_mode,
            set_mode,
            tensor_type if tensor_type is not None else FakeTensor,
            lambda: False,
        )

    def warn_sync(self) -> None:
        """What torch does after a synchronising call in sync debug mode "warn"."""
        if self.sync_mode == 1:
            warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=3)


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.t = 0

    def record(self) -> None:
        self.t = max(self.gpu.clock(), self.gpu.free_at)

    def query(self) -> bool:
        return self.gpu.clock() >= self.t

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.t - self.t) / 1e6 * (1.0 + self.gpu.drift)

    def synchronize(self) -> None:
        self.gpu.clock.sleep(self.t - self.gpu.clock())


class FakeTensor:
    """A tensor of `nbytes` on the host ("cpu") or on the fake GPU ("cuda")."""

    gpu: FakeGpu | None = None  # the GPU the tensors of a test use
    gbps = 10.0  # copy bandwidth from pinned memory; pageable copies run at half of it

    def __init__(self, nbytes: int = 4_000_000, device: str = "cpu", pinned: bool = False) -> None:
        self.nbytes = nbytes
        self.device = device
        self.pinned = pinned

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def nelement(self) -> int:
        return self.nbytes // 4

    def element_size(self) -> int:
        return 4

    def is_pinned(self) -> bool:
        return self.pinned

    def _copy_to_gpu(self, non_blocking: bool) -> FakeTensor:
        gpu = self.gpu
        assert gpu is not None
        rate = self.gbps if self.pinned else self.gbps / 2
        gpu.launch(self.nbytes / rate / 1e6)
        if not non_blocking:
            gpu.wait()  # a blocking copy waits for the stream, then returns
            gpu.warn_sync()
        return FakeTensor(self.nbytes, "cuda")

    def to(self, *args: Any, **kwargs: Any) -> FakeTensor:
        device = kwargs.get("device", args[0] if args else None)
        nb = bool(kwargs.get("non_blocking", False))
        if isinstance(device, str) and device.startswith("cuda") and not self.is_cuda:
            return self._copy_to_gpu(nb)
        return self

    def cuda(self, *args: Any, **kwargs: Any) -> FakeTensor:
        if self.is_cuda:
            return self
        return self._copy_to_gpu(bool(kwargs.get("non_blocking", False)))

    def work(self, ms: float) -> FakeTensor:
        """A kernel of `ms` on the GPU (a model's forward and backward, say)."""
        assert self.gpu is not None
        self.gpu.launch(ms)
        return self

    def item(self) -> float:
        if self.is_cuda:
            assert self.gpu is not None
            self.gpu.wait()
            self.gpu.warn_sync()
        return 0.5

    def tolist(self) -> list[float]:
        return [self.item()]

    def cpu(self) -> FakeTensor:
        if self.is_cuda:
            assert self.gpu is not None
            self.gpu.wait()
            self.gpu.warn_sync()
        return FakeTensor(self.nbytes)


def implicit_sync(t: FakeTensor) -> FakeTensor:
    """A library call that synchronises inside (like torch.nonzero): only the warning shows it."""
    assert t.gpu is not None
    t.gpu.wait()
    t.gpu.warn_sync()
    return t


def install_fake_cuda(monkeypatch: Any, gpu: FakeGpu) -> None:
    """Make traced cells take the CUDA path with `gpu` in place of torch.cuda: the step clock's
    events, the copy and sync watches, and the per-line clock."""
    from traceml_jupyter import run as run_module
    from traceml_jupyter import sync_stalls
    from traceml_jupyter.cuda_clock import CudaClock

    FakeTensor.gpu = gpu
    monkeypatch.setattr(run_module, "cuda_in_use", lambda: True)
    monkeypatch.setattr(run_module, "gpu_memory_in_use", lambda: True)
    monkeypatch.setattr(run_module, "CudaClock", lambda recorder: CudaClock(recorder, gpu.event))
    monkeypatch.setattr(sync_stalls, "torch_cuda_api", lambda: gpu.api())
