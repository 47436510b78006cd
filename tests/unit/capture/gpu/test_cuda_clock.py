"""The GPU clock's events (cuda_clock.CudaStepClock) on the stand-in GPU: steps resolve in order
without blocking, on the loop's device and stream (not the current device's), every event of a
step queried before it is read, and one wait at the end."""

from __future__ import annotations

import numpy as np
import pytest
from fake_gpu import FakeGpu, HostClock

from traceml_jupyter.capture.steps.recorder import Recorder

cuda_clock = pytest.importorskip("traceml_jupyter.capture.gpu.cuda_clock")
if not hasattr(cuda_clock, "CudaStepClock"):  # the capture core's API is being rewritten
    pytest.skip("cuda_clock.CudaStepClock not there", allow_module_level=True)


def marks_on(gpu: FakeGpu, device: int) -> object:
    """What torch_marks(device) gives, on the stand-in machine."""
    return cuda_clock.Marks(gpu.event, lambda: gpu.current_stream(device), lambda ev, on: ev.record(on))


def run_steps(gpu: FakeGpu, steps: object, rec: Recorder, n: int, fetch_ms: float, body_ms: float) -> None:
    clock = gpu.clock
    for k in range(n):
        t0 = clock()
        steps.before_fetch(k)  # type: ignore[attr-defined]
        clock.sleep(fetch_ms * 1e6)  # the host fetches; the GPU has nothing queued
        steps.after_fetch(k)  # type: ignore[attr-defined]
        t1 = clock()
        gpu.launch(body_ms)
        rec.add(t0, t1, clock())
        steps.step_closed(k, k + 1)  # type: ignore[attr-defined]


def test_steps_resolve_in_order_without_blocking_and_all_at_the_end() -> None:
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock)
    rec = Recorder()
    rec.origin_ns = 0
    steps = cuda_clock.CudaStepClock(rec, 0, marks_on(gpu, 0))
    run_steps(gpu, steps, rec, 5, fetch_ms=1.0, body_ms=4.0)
    # The host ran ahead: the GPU is still on an early step; nothing was waited for.
    assert clock() == 5_000_000
    cols = rec.columns()
    assert np.isfinite(cols["step_gpu_ms"]).sum() < 5
    steps.close()
    cols = rec.columns()
    assert np.isfinite(cols["step_gpu_ms"]).all()
    # Queued work hid the later fetches: only the first one starved the GPU.
    assert cols["data_wait_gpu_ms"][0] == pytest.approx(1.0)
    assert np.allclose(cols["data_wait_gpu_ms"][1:], 0.0)
    assert np.allclose(cols["compute_gpu_ms"], 4.0)


def test_a_loop_on_another_device_than_the_current_one_is_timed_there() -> None:
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock, devices=2)
    rec = Recorder()
    rec.origin_ns = 0
    steps = cuda_clock.CudaStepClock(rec, 1, marks_on(gpu, 1))
    assert gpu.current_device == 0  # training on cuda:1 without set_device
    for k in range(4):
        t0 = clock()
        steps.before_fetch(k)
        steps.after_fetch(k)
        gpu.launch(3.0, gpu.current_stream(1))
        gpu.launch(50.0, gpu.current_stream(0))  # someone else's work on device 0
        rec.add(t0, t0, clock())
        steps.step_closed(k, k + 1)
    steps.close()
    assert np.allclose(rec.columns()["compute_gpu_ms"], 3.0)  # device 1's, not device 0's


def test_a_stream_switched_inside_a_step_is_read_only_once_every_event_is_done() -> None:
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock)
    rec = Recorder()
    rec.origin_ns = 0
    steps = cuda_clock.CudaStepClock(rec, 0, marks_on(gpu, 0))
    side = gpu.new_stream(0)
    t0 = clock()
    gpu.launch(10.0)  # the default stream is busy for 10 ms: the fetch's marks wait behind it
    steps.before_fetch(0)
    steps.after_fetch(0)
    gpu.set_stream(side)  # the body's end is marked on an idle side stream
    rec.add(t0, t0, clock())
    steps.step_closed(0, 1)  # polls: the end is done, the start of the fetch is not yet
    clock.sleep(1e6)
    steps.poll()  # would raise "Both events must be completed" if only the end were queried
    assert not np.isfinite(rec.columns()["step_gpu_ms"]).any()
    gpu.set_stream(gpu.devices[0].default_stream)
    steps.close()


def test_every_step_reads_its_own_events_when_the_first_fetch_opens_the_run() -> None:
    """The first step's start is its first fetch's "before" event: one event, which must go
    back to the pool once. Freed twice, it is handed out twice, and later steps read each
    other's times (every other step then shows its whole body as GPU data wait)."""
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock)
    rec = Recorder()
    rec.origin_ns = 0
    steps = cuda_clock.CudaStepClock(rec, 0, marks_on(gpu, 0))
    for k in range(8):  # a fetch of 1 ms on an idle GPU, then 3 ms of body with a short kernel
        t0 = clock()
        steps.before_fetch(k)
        clock.sleep(1e6)
        steps.after_fetch(k)
        t1 = clock()
        gpu.launch(0.5)
        clock.sleep(3e6)
        rec.add(t0, t1, clock())
        steps.step_closed(k, k + 1)
    steps.close()
    cols = rec.columns()
    assert np.allclose(cols["data_wait_gpu_ms"], 1.0) and np.allclose(cols["compute_gpu_ms"], 3.0)
