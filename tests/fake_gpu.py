"""A stand-in GPU for CPU tests: a machine of CUDA devices whose streams run queued work in
order on the host's clock (real, or a fake one the test advances), CUDA-like events and streams,
tensors that "live" on a device, a `torch.cuda`-like module, and an NVML-like module.

What it models, because the GPU review (../shared/reviews/gpu-review.md) found the watches
wrong exactly there:

- Several devices, each with a default stream and any number of user streams. Streams are
  independent (PyTorch creates them non-blocking): the default stream does not wait for the
  others unless told (`wait_stream`, `wait_event`). The current device and the current stream
  of each device are per thread, as in CUDA (DataParallel's replica threads set their own).
- Events are bound to the device of their first record; recording one on another device's
  stream raises, as CUDA's `TORCH_CHECK(device_index_ == stream.device_index())` does.
  `elapsed_time` raises unless both events have completed; it returns a float32 when the
  machine is made with `float32=True` (real `cudaEventElapsedTime` does).
- Launch latency: a command issued at host time h starts on the GPU no earlier than
  h + `launch_us`. A bounded launch queue by count of commands (our event records included):
  the host blocks while `queue_depth` commands are pending on a device.
- Sticky errors: after `fail()`, every CUDA call raises (an illegal address, say).
- Host waits: `.item()`, a blocking copy, `.to("cpu")` wait for their stream and warn in sync
  debug mode "warn"; `torch.cuda.synchronize()` and `Event.synchronize()` wait and never warn;
  `Stream.synchronize()` warns. A pageable `non_blocking=True` copy makes the host wait (CUDA
  synchronises the stream before a copy from pageable memory) and does not warn.
- NVML (`FakeNvml`): utilisation averaged over a window that ends when it is read, device-wide
  memory, MIG mode (utilisation NOT_SUPPORTED), other processes on the device.
- `initialized`: False until something uses CUDA; the watches must never be the first.

What CUDA does around graphs, hidden waits and the allocator (../shared/reviews/gpu-double-review.md),
each rule with the documentation it follows next to its code (the section "CUDA graphs, hidden
waits, allocator backends" at the end):

- CUDA graph capture (`CUDAGraph`, `graph(...)`, `is_current_stream_capturing()`): work issued
  on the capturing stream is recorded into the graph, not run; `replay()` runs it on the
  current stream. What CUDA forbids during a capture raises and invalidates it.
- `launch_blocking` (CUDA_LAUNCH_BLOCKING=1), waits that warn nobody (`hidden_sync`,
  `empty_cache`), allocator statistics per backend (`backend`: "native", "cudaMallocAsync"),
  host-to-device copies that share one copy engine per device, pageable `non_blocking` copies
  small enough to be staged without waiting, and a host cost per CUDA call (`call_us`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import threading
import time
import types
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from traceml_jupyter.capture.gpu.gpu_watch import CudaApi, cuda_api
from traceml_jupyter.capture.gpu.syncs import SYNC_MESSAGE

# What torch appends to a warning raised in C++ (the watches must match on the start only).
TRIGGERED = " (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:158.)"


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


class CudaError(RuntimeError):
    pass


class FakeStream:
    """A CUDA stream of one device: the host ns at which the work queued on it is done."""

    def __init__(self, gpu: FakeGpu, device: int, stream_id: int) -> None:
        self.gpu = gpu
        self.device_index = device
        self.stream_id = stream_id
        self.free_at = 0

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, FakeStream)
            and other.device_index == self.device_index
            and other.stream_id == self.stream_id
        )

    def __hash__(self) -> int:
        return hash((self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return f"<FakeStream cuda:{self.device_index} #{self.stream_id}>"

    @property
    def device(self) -> str:
        return f"cuda:{self.device_index}"

    def query(self) -> bool:
        self.gpu.check()
        self.gpu.forbid_in_capture("cudaStreamQuery")
        return self.gpu.clock() >= self.free_at

    def wait_stream(self, other: FakeStream) -> None:
        """Work queued here from now on starts after what `other` has queued so far."""
        self.gpu.check()
        self.free_at = max(self.free_at, other.free_at)

    def wait_event(self, event: FakeEvent) -> None:
        """torch.cuda.Stream.wait_event is `event.wait(self)` (torch/cuda/streams.py)."""
        event.wait(self)

    def synchronize(self) -> None:
        """cudaStreamSynchronize: the host waits; sync debug mode warns."""
        self.gpu.check()
        self.gpu.forbid_in_capture("cudaStreamSynchronize")
        self.gpu.clock.sleep(self.free_at - self.gpu.clock())
        self.gpu.warn_sync()

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or self.gpu.event()
        event.record(self)
        return event


class FakeDevice:
    def __init__(self, gpu: FakeGpu, index: int) -> None:
        self.index = index
        default = object.__new__(gpu.Stream)
        FakeStream.__init__(default, gpu, index, 0)
        self.streams: list[FakeStream] = [default]  # the default stream first
        self.pending: list[int] = []  # heap: GPU end times of commands not yet done
        self.busy: list[tuple[int, int]] = []  # (start, end) of kernels and copies, for NVML
        self.allocations = 0  # tensors made on the device (torch.cuda.memory_stats counter)

    copy_engine_free_at = 0  # when the device's host-to-device copy engine is free
    device_frees = 0  # cudaFree calls of the allocator (empty_cache, retries)

    @property
    def default_stream(self) -> FakeStream:
        return self.streams[0]


class _PerThread(threading.local):
    device = 0
    streams: dict[int, FakeStream] | None = None  # the current stream of each device


class FakeGpu:
    """A machine with `devices` CUDA devices (1 by default).

    `launch_us` and `event_us`: launch latency of a command and of an event record; 0 keeps
    the timings exact (most tests). `queue_depth`: commands that may be pending on a device
    before a launch blocks the host. `queue_ms` (optional): also block while more than this
    much work is queued on the stream (a queue bounded by time rather than count; None: off).
    """

    def __init__(
        self,
        clock: HostClock | None = None,
        drift: float = 0.0,
        queue_ms: float | None = None,
        devices: int = 1,
        launch_us: float = 0.0,
        queue_depth: int = 1024,
        float32: bool = False,
        initialized: bool = True,
    ) -> None:
        self.clock = clock or HostClock()
        self.drift = drift  # GPU timer runs (1 + drift) times as fast as the host's
        self.queue_ns = None if queue_ms is None else queue_ms * 1e6
        self.launch_ns = int(launch_us * 1000)
        self.queue_depth = queue_depth
        self.float32 = float32
        self.sync_mode = 0
        self.initialized = initialized
        self.error: str | None = None
        self.commands = 0  # every command issued (kernels, copies, event records)
        self.host_blocked_ns = 0  # host time spent blocked on a full launch queue
        self._tls = _PerThread()
        self._next_stream_id = 1
        gpu = self

        class Event(FakeEvent):
            """torch.cuda.Event of this machine (patches of the class apply to every event)."""

            def __init__(self, enable_timing: bool = False, **_: Any) -> None:
                FakeEvent.__init__(self, gpu, enable_timing)

        class Stream(FakeStream):
            """torch.cuda.Stream of this machine: a new user stream of a device."""

            def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
                d = _index(gpu, device)
                FakeStream.__init__(self, gpu, d, gpu._next_stream_id)
                gpu._next_stream_id += 1
                gpu.devices[d].streams.append(self)

        self.Event = Event
        self.Stream = Stream
        self.devices = [FakeDevice(self, i) for i in range(devices)]
        self.module = FakeCudaModule(self)

    # -- per-thread current device and stream ------------------------------------------------
    @property
    def current_device(self) -> int:
        return self._tls.device

    def set_device(self, index: int) -> None:
        self.initialized = True
        self._tls.device = int(index)

    def current_stream(self, device: int | None = None) -> FakeStream:
        d = self.current_device if device is None else int(device)
        streams = self._tls.streams
        if streams is None:
            streams = self._tls.streams = {}
        return streams.get(d) or self.devices[d].default_stream

    def set_stream(self, stream: FakeStream) -> None:
        if self._tls.streams is None:
            self._tls.streams = {}
        self._tls.streams[stream.device_index] = stream

    def new_stream(self, device: int | None = None) -> FakeStream:
        return self.Stream(device)

    # -- work ---------------------------------------------------------------------------------
    def check(self) -> None:
        """A sticky CUDA error makes every later call raise. Every CUDA call passes here: it
        costs the host `call_ns` (see `call_us` in STAND_IN_DEFAULTS)."""
        if self.call_ns:
            self.clock.sleep(self.call_ns)
        if self.error is not None:
            raise CudaError(f"CUDA error: {self.error}")

    def fail(self, what: str = "an illegal memory access was encountered") -> None:
        self.error = what

    def issue(self, stream: FakeStream, ms: float) -> int:
        """The host issues a command of `ms` GPU time on `stream`; the GPU time it ends."""
        self.check()
        self.initialized = True
        if self.capture is not None and stream == self.capture.stream:
            return self._captured(stream, ms)
        dev = self.devices[stream.device_index]
        clock = self.clock
        pending = dev.pending
        now = clock()
        while pending and pending[0] <= now:
            heapq.heappop(pending)
        if len(pending) >= self.queue_depth:  # a full launch queue blocks the host
            before = clock()
            clock.sleep(pending[0] - now)
            self.host_blocked_ns += clock() - before
            now = clock()
            while pending and pending[0] <= now:
                heapq.heappop(pending)
        if self.queue_ns is not None:
            clock.sleep(stream.free_at - now - self.queue_ns)
            now = clock()
        start = max(now + self.launch_ns, stream.free_at)
        end = start + int(ms * 1e6)
        stream.free_at = end
        heapq.heappush(pending, end)
        if end > start:
            dev.busy.append((start, end))
        self.commands += 1
        if self.launch_blocking:  # CUDA_LAUNCH_BLOCKING=1: the call returns once it ran
            clock.sleep(end - clock())
        return end

    def launch(self, ms: float, stream: FakeStream | None = None) -> None:
        """A kernel of `ms` on `stream` (the current stream of the current device)."""
        self.issue(stream or self.current_stream(), ms)

    def wait(self, stream: FakeStream | None = None) -> None:
        """The host waits until the stream has done all its work (a synchronising call)."""
        self.check()
        self.forbid_in_capture("a synchronising call")
        stream = stream or self.current_stream()
        self.clock.sleep(stream.free_at - self.clock())

    def synchronize(self, device: int | None = None) -> None:
        """torch.cuda.synchronize(): every stream of the device; never warns."""
        self.check()
        self.forbid_in_capture("cudaDeviceSynchronize")
        self.initialized = True
        d = self.current_device if device is None else int(device)
        done = max(s.free_at for s in self.devices[d].streams)
        self.clock.sleep(done - self.clock())

    @property
    def free_at(self) -> int:
        """When the current stream's queued work is done (host ns)."""
        return self.current_stream().free_at

    def event(self) -> FakeEvent:
        return self.Event(enable_timing=True)

    def api(self, tensor_type: Any = None, device: int | None = None) -> CudaApi:
        """The watches' view of this machine, built by the same code as torch's."""
        api = cuda_api(self.module, tensor_type if tensor_type is not None else FakeTensor, device)
        assert api is not None
        return api

    def warn_sync(self) -> None:
        """What torch does after a synchronising call in sync debug mode "warn"."""
        if self.sync_mode == 1:
            warnings.warn(SYNC_MESSAGE + TRIGGERED, UserWarning, stacklevel=3)
        elif self.sync_mode == 2:
            raise RuntimeError(SYNC_MESSAGE)

    def utilisation(self, device: int, t_end: int, window_ns: int) -> float:
        """Percent of [t_end - window, t_end] during which the device ran something."""
        t0 = t_end - window_ns
        spans = sorted((max(s, t0), min(e, t_end)) for s, e in self.devices[device].busy if e > t0 and s < t_end)
        busy, reach = 0, t0
        for s, e in spans:
            s = max(s, reach)
            if e > s:
                busy += e - s
                reach = e
        return 100.0 * busy / window_ns if window_ns > 0 else 0.0


    # -- graph capture, hidden waits, allocator backends, copy engine, call cost -------------
    # Knobs (class defaults; a test sets them on its machine): see STAND_IN_DEFAULTS.
    capture: FakeCapture | None = None  # the stream capture under way, if any
    launch_blocking = False  # CUDA_LAUNCH_BLOCKING=1
    backend = "native"  # PYTORCH_CUDA_ALLOC_CONF=backend:...
    pageable_staged_bytes = 64 * 1024  # pageable non_blocking copies up to this size do not wait
    call_ns = 0  # host cost of each CUDA call

    @property
    def call_us(self) -> float:
        return self.call_ns / 1000

    @call_us.setter
    def call_us(self, us: float) -> None:
        self.call_ns = int(us * 1000)

    def forbid_in_capture(self, what: str) -> None:
        """A call CUDA refuses while a stream captures (a query or a wait): it fails with
        cudaErrorStreamCaptureUnsupported and invalidates the capture. In the "global" mode
        (torch.cuda.graph's default) from any thread, in "thread_local" (torch.compile's CUDA
        graph trees) from the capturing thread only, never in "relaxed" (cudaStreamBeginCapture,
        cudaThreadExchangeStreamCaptureMode; torch/cuda/graphs.py `capture_error_mode`)."""
        cap = self.capture
        if cap is None or cap.mode == "relaxed":
            return
        if cap.mode == "thread_local" and threading.get_ident() != cap.thread:
            return
        cap.invalidated = cap.invalidated or what
        raise CudaError(f"CUDA error: operation not permitted when stream is capturing ({what})")

    def event_usable(self, event: FakeEvent, what: str) -> None:
        """A query, wait or elapsed time on an event last recorded in a capture fails with
        cudaErrorCapturedEvent (and, during the capture, invalidates it), even after the capture
        ended, until the event is recorded again outside one."""
        if event.captured:
            if self.capture is not None:
                self.capture.invalidated = self.capture.invalidated or what
            raise CudaError(
                "CUDA error: operation not permitted on an event last recorded in a capturing stream"
            )
        self.forbid_in_capture(what)

    def _captured(self, stream: FakeStream, ms: float) -> int:
        """Work issued on the capturing stream is recorded into the graph, not run."""
        assert self.capture is not None
        self.capture.graph.work_ms += ms
        return stream.free_at

    def begin_capture(self, graph: FakeGraph, mode: str) -> None:
        """cudaStreamBeginCapture on the current stream, which may not be the legacy default
        stream (torch.cuda.graph captures on a side stream of its own)."""
        self.check()
        stream = self.current_stream()
        if stream.stream_id == 0:
            raise CudaError("CUDA error: operation not permitted when stream is capturing (legacy stream)")
        if self.capture is not None:
            raise RuntimeError("Only one capture at a time is allowed in a process.")
        if mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(f"Unknown capture_error_mode {mode!r}")
        graph.work_ms = 0.0
        self.capture = FakeCapture(graph, stream, mode, threading.get_ident())

    def end_capture(self, graph: FakeGraph) -> None:
        """cudaStreamEndCapture: the capture ends either way; an invalidated one raises
        cudaErrorStreamCaptureInvalidated and leaves no graph to replay."""
        cap = self.capture
        if cap is None or cap.graph is not graph:
            raise RuntimeError("capture_end() without capture_begin() on this graph")
        self.capture = None
        if cap.invalidated is not None:
            graph.ready = False
            raise CudaError(
                "CUDA error: operation failed due to a previous error during capture "
                f"(cudaErrorStreamCaptureInvalidated: {cap.invalidated})"
            )
        graph.ready = True
        self.graphs_captured += 1

    graphs_captured = 0  # captures that ended well

    def copy_h2d(self, ms: float, stream: FakeStream) -> None:
        """A host-to-device copy: a device has one copy engine per direction, shared by its
        streams, so copies on two streams run one after the other (CUDA C++ Programming Guide,
        "Asynchronous Concurrent Execution": concurrent transfers need `asyncEngineCount`
        engines; transfers in one direction share one)."""
        dev = self.devices[stream.device_index]
        if self.capture is None or stream != self.capture.stream:
            stream.free_at = max(stream.free_at, dev.copy_engine_free_at)
        end = self.issue(stream, ms)
        if self.capture is None or stream != self.capture.stream:
            dev.copy_engine_free_at = end

    def hidden_wait(self, device: int | None = None) -> None:
        """A wait for the whole device that no sync debug warning reports: cudaFree (the
        caching allocator's retry or `empty_cache()`), an NCCL collective, a third-party
        extension's cudaDeviceSynchronize."""
        self.check()
        self.forbid_in_capture("cudaDeviceSynchronize")
        d = self.current_device if device is None else int(device)
        done = max(s.free_at for s in self.devices[d].streams)
        self.clock.sleep(done - self.clock())

class FakeEvent:
    """torch.cuda.Event(enable_timing=True) on the stand-in machine."""

    def __init__(self, gpu: FakeGpu, enable_timing: bool = True) -> None:
        self.gpu = gpu
        self.enable_timing = enable_timing
        self.device: int | None = None  # bound at the first record
        self.t: int | None = None  # GPU time it completes at (host ns)

    captured = False  # last recorded on a capturing stream (see the section "CUDA graphs, ...")

    def record(self, stream: FakeStream | None = None) -> None:
        gpu = self.gpu
        stream = stream or gpu.current_stream()
        if self.device is None:
            self.device = stream.device_index
        elif self.device != stream.device_index:
            raise RuntimeError(
                f"Event device index {self.device} does not match recording stream's device "
                f"index {stream.device_index}."
            )
        self.captured = gpu.capture is not None and stream == gpu.capture.stream
        self.t = gpu.issue(stream, 0.0)

    def query(self) -> bool:
        self.gpu.check()
        self.gpu.event_usable(self, "cudaEventQuery")
        return self.t is None or self.gpu.clock() >= self.t

    def elapsed_time(self, other: FakeEvent) -> float:
        self.gpu.check()
        self.gpu.event_usable(self, "cudaEventElapsedTime")
        self.gpu.event_usable(other, "cudaEventElapsedTime")
        if not (self.enable_timing and other.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.t is None or other.t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if self.device != other.device:
            raise RuntimeError("Both events must be recorded on the same device.")
        if not (self.query() and other.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        ms = (other.t - self.t) / 1e6 * (1.0 + self.gpu.drift)
        return float(np.float32(ms)) if self.gpu.float32 else ms

    def synchronize(self) -> None:
        """cudaEventSynchronize: the host waits; sync debug mode does not warn."""
        self.gpu.check()
        self.gpu.event_usable(self, "cudaEventSynchronize")
        if self.t is not None:
            self.gpu.clock.sleep(self.t - self.gpu.clock())

    def wait(self, stream: FakeStream | None = None) -> None:
        """cudaStreamWaitEvent: work queued on `stream` from now on starts after this event."""
        stream = stream or self.gpu.current_stream()
        self.gpu.check()
        if self.t is not None:
            stream.free_at = max(stream.free_at, self.t)


class FakeCudaModule:
    """What the watches read of `torch.cuda`, for the stand-in machine. Module functions are
    instance attributes and Event/Stream are classes, so patches apply to them as to torch's."""

    def __init__(self, gpu: FakeGpu) -> None:
        self._gpu = gpu
        self.Event = gpu.Event
        self.Stream = gpu.Stream
        self.is_initialized = lambda: gpu.initialized
        self.is_available = lambda: True
        self.device_count = lambda: len(gpu.devices)
        self.current_device = lambda: gpu.current_device
        self.set_device = gpu.set_device
        self.current_stream = gpu.current_stream
        self.default_stream = lambda device=None: gpu.devices[
            gpu.current_device if device is None else int(device)
        ].default_stream
        self.set_stream = gpu.set_stream
        self.synchronize = gpu.synchronize
        self.get_sync_debug_mode = lambda: gpu.sync_mode
        self.set_sync_debug_mode = self._set_mode
        self.memory_allocated = lambda device=None: 1 if gpu.devices[_index(gpu, device)].allocations else 0
        self.memory_stats = lambda device=None: allocator_stats(gpu, _index(gpu, device))
        self.get_device_properties = lambda device=None: types.SimpleNamespace(
            name="Fake GPU",
            pci_domain_id=0,
            pci_bus_id=0x17 + _index(gpu, device),
            pci_device_id=0,
            uuid=f"fake-uuid-{_index(gpu, device)}",
            total_memory=80 * 2**30,
        )
        _graphs_and_allocator_api(self, gpu)

    def _set_mode(self, mode: int | str) -> None:
        self._gpu.sync_mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)  # type: ignore[call-overload]

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        previous = self._gpu.current_device
        self._gpu.set_device(index)
        try:
            yield
        finally:
            self._gpu.set_device(previous)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        previous = self._gpu.current_stream(stream.device_index)
        self._gpu.set_stream(stream)
        try:
            yield
        finally:
            self._gpu.set_stream(previous)


def _index(gpu: FakeGpu, device: Any) -> int:
    if device is None:
        return gpu.current_device
    if isinstance(device, str):
        return int(device.split(":")[1]) if ":" in device else gpu.current_device
    return int(getattr(device, "index", device) or 0)


def _device_of(target: Any, gpu: FakeGpu | None) -> int | None:
    """The CUDA device index `target` names, or None for the CPU (or a dtype)."""
    if isinstance(target, str):
        if target.startswith("cuda"):
            return int(target.split(":")[1]) if ":" in target else (gpu.current_device if gpu else 0)
        return None
    if isinstance(target, bool) or target is None:
        return None
    if isinstance(target, int):
        return target
    if isinstance(target, FakeTensor):
        return target.device_index
    kind = getattr(target, "type", None)
    if kind == "cuda":
        index = getattr(target, "index", None)
        return (gpu.current_device if gpu else 0) if index is None else int(index)
    return None


def _is_cpu(target: Any) -> bool:
    return target == "cpu" or getattr(target, "type", None) == "cpu"


class FakeTensor:
    """A tensor of `nbytes` on the host ("cpu") or on a device of the stand-in machine
    ("cuda", "cuda:1")."""

    gpu: FakeGpu | None = None  # the machine the tensors of a test use
    gbps = 10.0  # copy bandwidth from pinned memory; pageable copies run at half of it

    def __init__(self, nbytes: int = 4_000_000, device: str = "cpu", pinned: bool = False) -> None:
        self.nbytes = nbytes
        self.device_index: int | None = _device_of(device, self.gpu)
        self.pinned = pinned
        if self.device_index is not None and self.gpu is not None:
            self.gpu.initialized = True
            self.gpu.devices[self.device_index].allocations += 1

    @property
    def device(self) -> str:
        return "cpu" if self.device_index is None else f"cuda:{self.device_index}"

    @property
    def is_cuda(self) -> bool:
        return self.device_index is not None

    def nelement(self) -> int:
        return self.nbytes // 4

    def element_size(self) -> int:
        return 4

    def is_pinned(self) -> bool:
        return self.pinned

    def _machine(self) -> FakeGpu:
        assert self.gpu is not None, "FakeTensor.gpu is not set"
        return self.gpu

    def _stream(self) -> FakeStream:
        assert self.device_index is not None
        return self._machine().current_stream(self.device_index)

    def _copy_to_gpu(self, device: int, non_blocking: bool) -> FakeTensor:
        gpu = self._machine()
        stream = gpu.current_stream(device)  # a copy runs on the destination's current stream
        rate = self.gbps if self.pinned else self.gbps / 2
        waits = not self.pinned and not (non_blocking and self.nbytes <= gpu.pageable_staged_bytes)
        if waits:
            gpu.wait(stream)  # CUDA syncs the stream before a copy from pageable memory
        gpu.copy_h2d(self.nbytes / rate / 1e6, stream)
        if waits:
            gpu.wait(stream)  # ... and the host returns when the staged copy is done
        if not non_blocking:
            gpu.wait(stream)  # a blocking copy waits for the stream, then returns
            gpu.warn_sync()
        return FakeTensor(self.nbytes, f"cuda:{device}")

    def _copy_to_host(self, non_blocking: bool) -> FakeTensor:
        gpu = self._machine()
        stream = self._stream()
        gpu.launch(self.nbytes / self.gbps / 1e6, stream)
        if not non_blocking:
            gpu.wait(stream)
            gpu.warn_sync()
        return FakeTensor(self.nbytes, "cpu", pinned=non_blocking)

    def to(self, *args: Any, **kwargs: Any) -> FakeTensor:
        target = kwargs.get("device", args[0] if args else None)
        nb = bool(kwargs.get("non_blocking", next((a for a in args if isinstance(a, bool)), False)))
        device = _device_of(target, self.gpu)
        if device is not None and device != self.device_index:
            if self.is_cuda:
                self._machine().launch(self.nbytes / self.gbps / 1e6, self._stream())
                return FakeTensor(self.nbytes, f"cuda:{device}")
            return self._copy_to_gpu(device, nb)
        if self.is_cuda and _is_cpu(target):
            return self._copy_to_host(nb)
        return self

    def cuda(self, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> FakeTensor:
        if self.is_cuda:
            return self
        index = self._machine().current_device if device is None else _device_of(device, self.gpu) or 0
        return self._copy_to_gpu(index, bool(kwargs.get("non_blocking", non_blocking)))

    def work(self, ms: float) -> FakeTensor:
        """A kernel of `ms` on the GPU (a model's forward and backward, say), on the current
        stream of the tensor's device; its output is allocated there, as activations are."""
        gpu = self._machine()
        device = gpu.current_device if self.device_index is None else self.device_index
        gpu.launch(ms, gpu.current_stream(device))
        gpu.devices[device].allocations += 1
        return self

    def item(self) -> float:
        if self.is_cuda:
            gpu = self._machine()
            gpu.wait(self._stream())
            gpu.warn_sync()
        return 0.5

    def __bool__(self) -> bool:
        self.item()
        return True

    def __float__(self) -> float:
        return self.item()

    def tolist(self) -> list[float]:
        return [self.item()]

    def cpu(self) -> FakeTensor:
        return self._copy_to_host(False) if self.is_cuda else self


def implicit_sync(t: FakeTensor) -> FakeTensor:
    """A library call that synchronises inside (like torch.nonzero): only the warning shows it."""
    gpu = t._machine()
    gpu.wait(t._stream())
    gpu.warn_sync()
    return t


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801  (pynvml's name)
    pass


class FakeNvml(types.ModuleType):
    """pynvml on the stand-in machine: utilisation is the busy share of the last `window_s`
    before each read (NVML averages over 1/6 s to 1 s, by product), memory is device-wide."""

    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(
        self, gpu: FakeGpu, window_s: float = 1 / 6, mig: bool = False, others: int = 0
    ) -> None:
        super().__init__("pynvml")
        self.gpu = gpu
        self.window_ns = int(window_s * 1e9)
        self.mig = mig
        self.others = others  # processes of other users on the device
        self.calls: list[Any] = []
        self.NVMLError = NVMLError
        self.NVMLError_NotSupported = NVMLError_NotSupported

    def nvmlInit(self) -> None:  # noqa: N802  (pynvml's names)
        self.calls.append("init")

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByPciBusId(self, bus: bytes) -> int:  # noqa: N802
        self.calls.append(("bus", bus))
        return int(bus.decode().split(":")[1], 16) - 0x17

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return int(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> int:  # noqa: N802
        self.calls.append(("uuid", uuid))
        return int(uuid.decode().rsplit("-", 1)[1])

    def nvmlDeviceGetName(self, handle: int) -> bytes:  # noqa: N802
        return b"NVIDIA Fake"

    def nvmlDeviceGetMigMode(self, handle: int) -> tuple[int, int]:  # noqa: N802
        return (1, 1) if self.mig else (0, 0)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802
        if self.mig:
            raise NVMLError_NotSupported("Not Supported")
        util = self.gpu.utilisation(handle, self.gpu.clock(), self.window_ns)
        return types.SimpleNamespace(gpu=int(round(util)), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        return types.SimpleNamespace(used=2 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:  # noqa: N802
        import os

        mine = [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=2**30)]
        return mine + [types.SimpleNamespace(pid=10_000 + i, usedGpuMemory=2**30) for i in range(self.others)]


def install_fake_cuda(monkeypatch: Any, gpu: FakeGpu) -> None:
    """Make traced cells take the CUDA path with `gpu` in place of torch.cuda: the step clock's
    events, the copy and sync watches, and the per-line clock.

    The watches get `gpu.module` through the same `cuda_api` as torch's; the capture core's
    own CUDA decisions are replaced where it has them (CUDA initialised, the allocations each
    device saw, events on a device)."""
    from traceml_jupyter import run as run_module
    from traceml_jupyter.capture.gpu import cuda_clock, gpu_watch

    FakeTensor.gpu = gpu
    gpu.initialized = True

    def fake_api(device: int | None = None) -> CudaApi | None:
        return cuda_api(gpu.module, FakeTensor, device)

    monkeypatch.setattr(gpu_watch, "torch_cuda_api", fake_api)
    monkeypatch.setattr(gpu_watch, "cuda_module", lambda: gpu.module)
    # The capture core's seams (whichever of them this core has): CUDA initialised, the
    # allocations each device saw (how the loop's device is decided), events on a device.
    try:
        from traceml_jupyter.capture import session as capture_module
    except ImportError:
        capture_module = None
    try:  # where the loop's device is decided, in a core that has it apart
        from traceml_jupyter.capture import loop_gpu
    except ImportError:
        loop_gpu = capture_module
    if capture_module is not None and hasattr(cuda_clock, "Marks"):

        def marks(device: int) -> Any:
            return cuda_clock.Marks(
                gpu.event, lambda: gpu.current_stream(device), lambda ev, on: ev.record(on)
            )

        def busy(devices: Any) -> set[int]:
            return {d for d in devices if not gpu.current_stream(d).query()}

        seams = {
            "cuda_initialized": lambda: gpu.initialized,
            "allocation_counts": lambda: {
                d.index: int(allocator_stats(gpu, d.index)["allocation.all.allocated"]) for d in gpu.devices
            },
            "current_device": lambda: gpu.current_device,
            "torch_marks": marks,
            "busy_devices": busy,
        }
        for name, value in seams.items():
            monkeypatch.setattr(capture_module, name, value, raising=False)
            monkeypatch.setattr(loop_gpu, name, value, raising=False)
            monkeypatch.setattr(cuda_clock, name, value, raising=False)
    monkeypatch.setattr(run_module, "cuda_in_use", lambda: True, raising=False)
    monkeypatch.setattr(run_module, "gpu_memory_in_use", lambda: True, raising=False)
    _install_graphs_and_allocator(monkeypatch, gpu)
    if hasattr(run_module, "CudaClock"):
        real = cuda_clock.CudaClock
        monkeypatch.setattr(run_module, "CudaClock", lambda recorder: real(recorder, gpu.event))


# -- the caching allocator's statistics and the device's capacity (GPU memory per step) -----------
# What the resource watch reads of torch's CUDA caching allocator, kept in this block of its own.
# Each behaviour follows PyTorch's documentation ("CUDA semantics: memory management",
# https://pytorch.org/docs/stable/notes/cuda.html#memory-management, and the torch.cuda memory
# functions' docstrings) and c10/cuda/CUDACachingAllocator.cpp where the docs are silent:
# - memory_allocated(): bytes occupied by tensors, each allocation rounded up to 512 bytes
#   (kMinBlockSize); max_memory_allocated(): its peak since the start or the last
#   reset_peak_memory_stats(), which sets every peak to the current value;
# - memory_reserved(): bytes the allocator holds from the driver, in segments: allocations of
#   1 MiB or less come from 2 MiB segments (kSmallBuffer), up to 10 MiB from 20 MiB segments
#   (kLargeBuffer), larger ones are rounded up to 2 MiB (kRoundLarge). Freed blocks stay cached
#   (reserved does not fall) and are reused; empty_cache() releases cached segments;
# - on a failed allocation the allocator frees its cached segments and retries, then raises
#   torch.cuda.OutOfMemoryError with the message format of CUDACachingAllocator.cpp;
# - memory_stats_as_nested_dict(): {"allocated_bytes": {"all": {"current", "peak", "allocated",
#   "freed"}}, "reserved_bytes": {...}, ...}; memory_stats() is its flattened form;
# - get_device_properties(d).total_memory: the device's memory; mem_get_info(d): (free, total).
# The stand-in ignores fragmentation inside a segment (a segment of the right pool with enough
# free bytes takes the block) and the CUDA context's own memory.

MIB = 2**20
SMALL_SIZE, SMALL_SEGMENT = MIB, 2 * MIB
LARGE_SEGMENT, MIN_LARGE_ALLOC, ROUND_LARGE = 20 * MIB, 10 * MIB, 2 * MIB
MIN_BLOCK = 512


def _format_size(nbytes: float) -> str:
    """c10's format_size: "512 bytes", "1.50 KiB", "20.00 MiB", "79.15 GiB"."""
    if nbytes <= 1024:
        return f"{int(nbytes)} bytes"
    if nbytes <= MIB:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1024 * MIB:
        return f"{nbytes / MIB:.2f} MiB"
    return f"{nbytes / 1024**3:.2f} GiB"


class _Segment:
    def __init__(self, pool: str, size: int) -> None:
        self.pool, self.size, self.used = pool, size, 0


class _DeviceMemory:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.allocated = self.peak = self.reserved = self.reserved_peak = 0
        self.total_allocated = self.total_freed = 0
        self.segments: list[_Segment] = []

    def stat(self, current: int, peak: int, allocated: int = 0, freed: int = 0) -> dict[str, dict[str, int]]:
        return {"all": {"current": current, "peak": peak, "allocated": allocated, "freed": freed}}


class FakeAllocator:
    """torch's caching allocator as its statistics show it (see the block's comment), for the
    devices of a FakeGpu. `install()` puts its functions on `gpu.module`."""

    def __init__(self, gpu: FakeGpu, capacity_gib: float = 80.0) -> None:
        self.gpu = gpu
        self.memory = [_DeviceMemory(int(capacity_gib * 1024**3)) for _ in gpu.devices]
        self.calls = {"stats": 0, "reset": 0}

    # -- allocating -----------------------------------------------------------------------------
    @staticmethod
    def _pool(size: int) -> tuple[str, int]:
        """The pool of an allocation and the segment a miss reserves."""
        if size <= SMALL_SIZE:
            return "small", SMALL_SEGMENT
        if size < MIN_LARGE_ALLOC:
            return "large", LARGE_SEGMENT
        return "large", -(-size // ROUND_LARGE) * ROUND_LARGE

    def malloc(self, device: int, nbytes: int) -> tuple[int, _Segment]:
        """Allocate `nbytes` on `device`: the rounded size and its segment. Raises
        torch.cuda.OutOfMemoryError."""
        self.gpu.check()
        m = self.memory[device]
        size = max(MIN_BLOCK, -(-int(nbytes) // MIN_BLOCK) * MIN_BLOCK)
        pool, segment_size = self._pool(size)
        segment = next((g for g in m.segments if g.pool == pool and g.size - g.used >= size), None)
        if segment is None:
            if m.reserved + segment_size > m.capacity:
                self.empty_cache(device)  # the allocator frees its cached segments and retries
            if m.reserved + segment_size > m.capacity:
                raise self._oom(device, size)
            segment = _Segment(pool, segment_size)
            m.segments.append(segment)
            m.reserved += segment_size
            m.reserved_peak = max(m.reserved_peak, m.reserved)
        segment.used += size
        m.allocated += size
        m.total_allocated += size
        m.peak = max(m.peak, m.allocated)
        return size, segment

    def free(self, device: int, size: int, segment: _Segment) -> None:
        m = self.memory[device]
        m.allocated -= size
        m.total_freed += size
        segment.used -= size  # the block stays cached in its segment

    def empty_cache(self, device: int | None = None) -> None:
        """Release the segments with no allocation left (empty_cache())."""
        for d in range(len(self.memory)) if device is None else [device]:
            m = self.memory[d]
            free = [g for g in m.segments if g.used == 0]
            m.segments = [g for g in m.segments if g.used > 0]
            m.reserved -= sum(g.size for g in free)

    def _oom(self, device: int, size: int) -> BaseException:
        import torch

        m = self.memory[device]
        free = m.capacity - m.reserved
        text = (
            f"CUDA out of memory. Tried to allocate {_format_size(size)}. GPU {device} has a total "
            f"capacity of {_format_size(m.capacity)} of which {_format_size(free)} is free. Including "
            f"non-PyTorch memory, this process has {_format_size(m.reserved)} memory in use. Of the "
            f"allocated memory {_format_size(m.allocated)} is allocated by PyTorch, and "
            f"{_format_size(m.reserved - m.allocated)} is reserved by PyTorch but unallocated."
        )
        return torch.cuda.OutOfMemoryError(text)

    # -- torch.cuda's functions ---------------------------------------------------------------------
    def stats(self, device: Any = None) -> dict[str, Any]:
        self.calls["stats"] += 1
        m = self.memory[_index(self.gpu, device)]
        return {
            "allocated_bytes": m.stat(m.allocated, m.peak, m.total_allocated, m.total_freed),
            "reserved_bytes": m.stat(m.reserved, m.reserved_peak),
        }

    def flat_stats(self, device: Any = None) -> dict[str, int]:
        out = {}
        for name, groups in self.stats(device).items():
            for group, values in groups.items():
                for key, value in values.items():
                    out[f"{name}.{group}.{key}"] = value
        return out

    def reset_peak(self, device: Any = None) -> None:
        self.calls["reset"] += 1
        m = self.memory[_index(self.gpu, device)]
        m.peak, m.reserved_peak = m.allocated, m.reserved

    def install(self) -> FakeAllocator:
        module, gpu = self.gpu.module, self.gpu
        module.memory_stats_as_nested_dict = self.stats
        module.memory_stats = self.flat_stats
        module.memory_allocated = lambda device=None: self.memory[_index(gpu, device)].allocated
        module.max_memory_allocated = lambda device=None: self.memory[_index(gpu, device)].peak
        module.memory_reserved = lambda device=None: self.memory[_index(gpu, device)].reserved
        module.max_memory_reserved = lambda device=None: self.memory[_index(gpu, device)].reserved_peak
        module.reset_peak_memory_stats = self.reset_peak
        module.empty_cache = lambda: self.empty_cache()
        module.mem_get_info = lambda device=None: (
            self.memory[_index(gpu, device)].capacity - self.memory[_index(gpu, device)].reserved,
            self.memory[_index(gpu, device)].capacity,
        )
        previous = module.get_device_properties

        def properties(device: Any = None) -> Any:
            props = previous(device)
            props.total_memory = self.memory[_index(gpu, device)].capacity
            return props

        module.get_device_properties = properties
        import torch

        module.OutOfMemoryError = torch.cuda.OutOfMemoryError
        MemTensor.allocator = self
        return self


class _Storage:
    """A tensor's memory: freed (by the allocator) when the last tensor on it is collected."""

    _next_ptr = 0x7F0000000000

    def __init__(self, allocator: FakeAllocator, device: int, nbytes: int) -> None:
        self.size, segment = allocator.malloc(device, nbytes)
        self._nbytes = int(nbytes)
        self.device = device
        _Storage._next_ptr += self.size
        self.ptr = _Storage._next_ptr
        weakref.finalize(self, allocator.free, device, self.size, segment)

    def data_ptr(self) -> int:
        return self.ptr

    def nbytes(self) -> int:
        return self._nbytes


class MemTensor(FakeTensor):
    """A tensor on a device of the stand-in whose memory the allocator counts. `graph`: the
    tensors its autograd history keeps alive; `saved`: what backward() frees (activations)."""

    allocator: FakeAllocator | None = None

    def __init__(
        self, nbytes: int, device: str = "cuda", graph: list[Any] | None = None, storage: _Storage | None = None
    ) -> None:
        super().__init__(nbytes, device)
        assert self.device_index is not None and self.allocator is not None
        self.storage = storage or _Storage(self.allocator, self.device_index, nbytes)
        self.graph: list[Any] = list(graph or [])
        self.saved: list[Any] = []
        self.grad: MemTensor | None = None

    def untyped_storage(self) -> _Storage:
        return self.storage

    @property
    def is_leaf(self) -> bool:
        """A tensor with no history is a leaf (torch: only a leaf's .grad is populated)."""
        return not self.graph

    def detach(self) -> MemTensor:
        return MemTensor(self.nbytes, self.device, storage=self.storage)

    def _scalar(self, *parents: Any) -> MemTensor:
        return MemTensor(4, self.device, graph=[p for p in parents if isinstance(p, MemTensor)])

    def mean(self) -> MemTensor:
        return self._scalar(self)

    def sum(self) -> MemTensor:
        return self._scalar(self)

    def __add__(self, other: Any) -> MemTensor:
        return self._scalar(self, other)

    __radd__ = __add__

    def backward(self) -> None:
        """Frees the saved tensors of the graph behind it (torch frees a graph's buffers after
        backward unless retain_graph=True); the graph's nodes stay referenced."""
        stack, seen = [self], set()
        while stack:
            t = stack.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            t.saved.clear()
            stack.extend(t.graph)


class FakeModel:
    """A model on the stand-in: parameters of `params_mib`, a forward that runs `ms` of GPU
    work and saves `activations_mib` for backward, an output of `out_mib`."""

    def __init__(self, params_mib: float, activations_mib: float = 0.0, out_mib: float = 0.01, ms: float = 1.0, device: str = "cuda") -> None:
        self.device = device
        self.params = [MemTensor(int(params_mib * MIB), device)]
        self.activations = int(activations_mib * MIB)
        self.out = int(out_mib * MIB)
        self.ms = ms

    def parameters(self) -> list[MemTensor]:
        return list(self.params)

    def buffers(self) -> list[MemTensor]:
        return []

    def __call__(self, x: Any) -> MemTensor:
        x.work(self.ms) if isinstance(x, FakeTensor) and x.is_cuda else None
        out = MemTensor(self.out, self.device, graph=[x, *self.params] if isinstance(x, MemTensor) else list(self.params))
        if self.activations:
            out.saved.append(MemTensor(self.activations, self.device))
        return out


class FakeOptimizer:
    """Adam-like: two state tensors per parameter, made at the first step."""

    def __init__(self, params: list[MemTensor]) -> None:
        self.params = params
        self.state: dict[int, dict[str, MemTensor]] = {}

    def step(self) -> None:
        for p in self.params:
            if id(p) not in self.state:
                self.state[id(p)] = {"exp_avg": MemTensor(p.nbytes, p.device), "exp_avg_sq": MemTensor(p.nbytes, p.device)}

    def zero_grad(self) -> None:
        pass


def install_fake_allocator(monkeypatch: Any, gpu: FakeGpu, capacity_gib: float = 80.0) -> FakeAllocator:
    """The stand-in's allocator statistics and capacity for the resource watch (after
    install_fake_cuda): torch.cuda's memory functions on `gpu.module`, and the namespace scan
    recognising MemTensor, FakeModel and FakeOptimizer."""
    import torch

    from traceml_jupyter.capture.resources import gpu_memory

    allocator = FakeAllocator(gpu, capacity_gib).install()
    monkeypatch.setattr(gpu_memory, "cuda_module", lambda: gpu.module)
    kinds = gpu_memory.Kinds((MemTensor, torch.Tensor), (FakeModel, torch.nn.Module), (FakeOptimizer, torch.optim.Optimizer))
    monkeypatch.setattr(gpu_memory, "torch_kinds", lambda: kinds)
    return allocator
# -- CUDA graphs, hidden waits, allocator backends ------------------------------------------------

# What the stand-in assumes where CUDA or NVML does not say (or the docs say "may"); the first
# real run measures each (scripts/gpu_check.py, group "calibration") and writes it next to
# these in its JSON, so that one run corrects the stand-in.
STAND_IN_DEFAULTS: dict[str, Any] = {
    "launch_queue_depth": 1024,  # FakeGpu(queue_depth=): commands pending before a launch blocks
    "idle_event_latency_us": 0.0,  # FakeGpu(launch_us=): an event on an idle GPU completes this late
    "elapsed_time_type": "float",  # float64 unless FakeGpu(float32=True); CUDA: float32 ms, ~0.5 µs
    "elapsed_time_incomplete_raises": True,
    "nvml_update_period_s": 1 / 6,  # FakeNvml(window_s=): one averaging window per read
    "pageable_staged_bytes": FakeGpu.pageable_staged_bytes,
    "cuda_call_us": 0.0,  # host cost of a CUDA call (call_us)
}

BLOCK_BYTES = 512  # CUDACachingAllocator's kMinBlockSize: every allocation is at least this
SEGMENT_BYTES = 2 * 2**20  # ... and reserved memory grows by segments (kLargeBuffer)
MEMORY_STAT_KEYS = (
    "allocation.all.allocated",
    "allocation.all.current",
    "allocated_bytes.all.allocated",
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "active_bytes.all.current",
    "active_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "num_alloc_retries",
    "num_device_free",
)


def allocator_stats(gpu: FakeGpu, device: int) -> dict[str, int]:
    """`torch.cuda.memory_stats(device)` as the machine's allocator backend reports it.

    native (CUDACachingAllocator): allocation counts and bytes. cudaMallocAsync: only the bytes
    in use and reserved (current and peak) come from the driver's pool; every count, and every
    other stat, is 0 ("Many stat types are specific to the native allocator ... zeroed values",
    c10/cuda/CUDAMallocAsyncAllocator.cpp, getDeviceStats). The stand-in's tensors are never
    freed: the bytes in use are the allocations in minimum blocks (BLOCK_BYTES)."""
    dev = gpu.devices[device]
    n = dev.allocations
    used = n * BLOCK_BYTES
    reserved = -(-used // SEGMENT_BYTES) * SEGMENT_BYTES
    stats = dict.fromkeys(MEMORY_STAT_KEYS, 0)
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "active_bytes.all.current", "active_bytes.all.peak"):
        stats[key] = used
    stats["reserved_bytes.all.current"] = stats["reserved_bytes.all.peak"] = reserved
    if gpu.backend == "native":
        stats.update(
            {
                "allocation.all.allocated": n,
                "allocation.all.current": n,
                "allocated_bytes.all.allocated": used,
                "num_device_free": dev.device_frees,
            }
        )
    return stats


@dataclasses.dataclass
class FakeCapture:
    """One stream capture under way (cudaStreamBeginCapture ... cudaStreamEndCapture)."""

    graph: FakeGraph
    stream: FakeStream
    mode: str  # "global", "thread_local" or "relaxed"
    thread: int
    invalidated: str | None = None  # the forbidden call that invalidated it


class FakeGraph:
    """torch.cuda.CUDAGraph on the stand-in machine (torch/cuda/graphs.py): what is issued on
    the capturing stream between capture_begin and capture_end is the graph's work."""

    def __init__(self, gpu: FakeGpu, keep_graph: bool = False) -> None:
        self.gpu = gpu
        self.work_ms = 0.0
        self.ready = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.gpu.begin_capture(self, capture_error_mode)

    def capture_end(self) -> None:
        self.gpu.end_capture(self)

    def replay(self) -> None:
        """CUDAGraph::replay is one cudaGraphLaunch of the whole graph on the current stream
        (aten/src/ATen/cuda/CUDAGraph.cpp): one command that runs the captured work."""
        gpu = self.gpu
        gpu.check()
        if not self.ready:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        gpu.issue(gpu.current_stream(), self.work_ms)

    def reset(self) -> None:
        self.ready, self.work_ms = False, 0.0


def _graphs_and_allocator_api(module: FakeCudaModule, gpu: FakeGpu) -> None:
    """torch.cuda's graph and allocator functions on the stand-in machine."""

    class CUDAGraph(FakeGraph):
        """torch.cuda.CUDAGraph of this machine (patches of the class apply to every graph)."""

        def __init__(self, keep_graph: bool = False) -> None:
            FakeGraph.__init__(self, gpu, keep_graph)

    capture_stream: list[FakeStream] = []

    @contextlib.contextmanager
    def graph(
        cuda_graph: FakeGraph, pool: Any = None, stream: FakeStream | None = None, capture_error_mode: str = "global"
    ) -> Iterator[None]:
        """torch.cuda.graph: synchronize and empty the cache, make `stream` (else a side stream
        of its own) current, capture; capture_end and the stream restored on exit, also when
        the body raised (torch/cuda/graphs.py, graph.__enter__/__exit__)."""
        gpu.synchronize()
        module.empty_cache()
        if stream is None:
            if not capture_stream:
                capture_stream.append(gpu.new_stream())
            stream = capture_stream[0]
        with module.stream(stream):
            cuda_graph.capture_begin(pool, capture_error_mode=capture_error_mode)
            try:
                yield
            finally:
                cuda_graph.capture_end()

    def is_current_stream_capturing() -> bool:
        """torch.cuda.is_current_stream_capturing: the current stream of this thread captures."""
        cap = gpu.capture
        return cap is not None and gpu.current_stream() == cap.stream

    def empty_cache() -> None:
        """torch.cuda.empty_cache waits for the device and never warns: the native allocator
        frees its cached segments (cudaFree waits for the GPU), the cudaMallocAsync one calls
        cudaDeviceSynchronize before trimming its pool (CUDAMallocAsyncAllocator.cpp, emptyCache)."""
        gpu.hidden_wait()
        if gpu.backend == "native":
            gpu.devices[gpu.current_device].device_frees += 1

    gpu.CUDAGraph = CUDAGraph  # type: ignore[attr-defined]
    module.CUDAGraph = CUDAGraph  # type: ignore[attr-defined]
    module.graph = graph  # type: ignore[attr-defined]
    module.is_current_stream_capturing = is_current_stream_capturing  # type: ignore[attr-defined]
    module.empty_cache = empty_cache  # type: ignore[attr-defined]
    module.get_allocator_backend = lambda: gpu.backend  # type: ignore[attr-defined]


def hidden_sync(t: FakeTensor) -> FakeTensor:
    """A library call that waits for the GPU without any sync warning (an NCCL collective, a
    third-party extension's own cudaStreamSynchronize): nothing shows it but the time."""
    gpu = t._machine()
    gpu.wait(t._stream())
    return t


def reduce_overhead(fn: Any, gpu: FakeGpu) -> Any:
    """What `torch.compile(fn, mode="reduce-overhead")` does at run time with CUDA graph trees
    (torch/_inductor/cudagraph_trees.py): the first call runs eagerly (warm-up), the second
    records fn on a stream of its own in "thread_local" capture mode and replays the graph at
    once (the recording ran nothing), later calls replay it."""
    state: dict[str, Any] = {"calls": 0, "graph": None, "out": None}
    stream = gpu.new_stream()

    def compiled(*args: Any) -> Any:
        state["calls"] += 1
        if state["calls"] == 1:
            return fn(*args)
        if state["graph"] is None:
            g = gpu.module.CUDAGraph()
            with gpu.module.graph(g, stream=stream, capture_error_mode="thread_local"):
                state["out"] = fn(*args)
            state["graph"] = g
        state["graph"].replay()
        return state["out"]

    return compiled


def _install_graphs_and_allocator(monkeypatch: Any, gpu: FakeGpu) -> None:
    """The capture core's seams for CUDA graphs and the allocator, on the stand-in machine."""
    try:
        from traceml_jupyter.capture.gpu import cuda_graphs, gpu_activity
    except ImportError:  # an older core
        return
    monkeypatch.setattr(cuda_graphs, "graph_class", lambda: gpu.module.CUDAGraph)
    monkeypatch.setattr(cuda_graphs, "stream_capturing", gpu.module.is_current_stream_capturing)
    monkeypatch.setattr(
        gpu_activity,
        "memory_stats",
        lambda: {d.index: allocator_stats(gpu, d.index) for d in gpu.devices} if gpu.initialized else {},
    )
    monkeypatch.setattr(gpu_activity, "cuda_module", lambda: gpu.module)
