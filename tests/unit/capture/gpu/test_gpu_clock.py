"""The GPU clock on stand-in events: steps resolve once every event of theirs has completed, in
order, never blocking; the device is the one the loop allocated on; any error turns it off."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from traceml_jupyter import kernel_state
from traceml_jupyter.capture import loop_gpu, session
from traceml_jupyter.capture.gpu.cuda_clock import CudaStepClock, Marks, busiest_device
from traceml_jupyter.capture.session import Capture, capture_session
from traceml_jupyter.capture.steps.recorder import Recorder
from traceml_jupyter.run import Recording, Run


class Stream:
    """One in-order stream on a fake GPU: `clock` advances as the host records; events complete
    when the GPU reaches them (`done_before`)."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.t = 0.0
        self.done_before = 0.0
        self.made: list[Event] = []

    def marks(self) -> Marks:
        def new_event() -> Event:
            self.made.append(Event(self))
            return self.made[-1]

        return Marks(new_event, lambda: self, lambda ev, on: ev.record())


class Event:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.t: float | None = None

    def record(self) -> None:
        self.t = self.stream.t

    def query(self) -> bool:
        return self.t is not None and self.t <= self.stream.done_before

    def elapsed_time(self, other: Event) -> float:
        if not (self.query() and other.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        assert self.t is not None and other.t is not None
        return other.t - self.t

    def synchronize(self) -> None:
        self.stream.done_before = max(self.stream.done_before, self.stream.t)


def test_steps_resolve_in_order_only_when_all_their_events_are_done() -> None:
    s = Stream()
    rec = Recorder()
    cuda = CudaStepClock(rec, 0, s.marks())
    for k in range(4):
        rec.add(k * 10, k * 10 + 1, k * 10 + 10)
        cuda.before_fetch(k)
        s.t += 2.0  # the fetch: 2 ms on the GPU timeline
        cuda.after_fetch(k)
        s.t += 6.0  # the body
        cuda.step_closed(k, k + 1)
    assert np.isnan(rec.columns()["step_gpu_ms"]).all()  # nothing done yet, nothing waited for
    s.done_before = 17.0  # the GPU is inside step 2
    cuda.poll()
    cols = rec.columns()
    assert np.isfinite(cols["step_gpu_ms"][:2]).all() and np.isnan(cols["step_gpu_ms"][2:]).all()
    cuda.close()  # one wait for the GPU at the end
    cols = rec.columns()
    assert np.allclose(cols["data_wait_gpu_ms"], 2.0) and np.allclose(cols["compute_gpu_ms"], 6.0)


def test_a_phase_kept_out_of_a_step_is_kept_out_of_its_gpu_time() -> None:
    s = Stream()
    rec = Recorder()
    cuda = CudaStepClock(rec, 0, s.marks())
    rec.add(0, 1, 10)
    cuda.before_fetch(0)
    s.t += 1.0
    cuda.after_fetch(0)
    s.t += 4.0
    for serial in (1, 2):  # a validation pass: two fetches and its forward passes
        cuda.before_fetch(0)
        s.t += 5.0
        cuda.after_fetch(serial)
        s.t += 3.0
    cuda.exclude(1, 2)
    cuda.step_closed(0, 3)
    cuda.close()
    cols = rec.columns()
    assert cols["step_gpu_ms"][0] == pytest.approx(1.0 + 4.0 + 3.0)  # the last forward is still the step's
    assert cols["data_wait_gpu_ms"][0] == pytest.approx(1.0)


def test_the_busiest_device_is_the_loops() -> None:
    assert busiest_device({0: 100, 1: 5}, {0: 100, 1: 90}) == 1
    assert busiest_device({0: 100}, {0: 100}) is None  # a tensor sits on the GPU; the loop is on the CPU
    assert busiest_device({}, {0: 3}) == 0  # CUDA initialised during the loop


@pytest.fixture()
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """CUDA initialised with two devices whose allocation counters the test moves."""
    state: dict[str, Any] = {"counts": {0: 10, 1: 10}, "streams": {}, "current": 0}

    def marks(device: int) -> Marks:
        return state["streams"].setdefault(device, Stream(device)).marks()

    monkeypatch.setattr(session, "cuda_initialized", lambda: True)
    monkeypatch.setattr(loop_gpu, "allocation_counts", lambda: dict(state["counts"]))
    monkeypatch.setattr(loop_gpu, "current_device", lambda: state["current"])
    state["marks"] = marks
    return state


def loop_steps(run: Recording, cap: Capture, state: dict[str, Any], n: int, device: int | None) -> None:
    for _ in cap.loop(range(n)):
        if device is not None:
            state["counts"][device] += 3  # the step allocates there
            stream = state["streams"].get(device)
            if stream is not None:
                stream.t += 5.0


def test_a_cpu_loop_next_to_a_stale_gpu_tensor_stays_on_the_cpu_clock(fake_cuda: dict[str, Any]) -> None:
    run = Run("cpu loop")
    rec = run.recording
    try:
        with capture_session(rec, Capture(rec, marks=fake_cuda["marks"])) as cap:
            loop_steps(rec, cap, fake_cuda, 8, None)
        run.finish()
        assert run.result.gpu.cuda_device is None and not run.gpu_used and run.clock == "cpu"
    finally:
        kernel_state.RUNS.remove(run)


def test_a_loop_on_another_device_is_timed_there(fake_cuda: dict[str, Any]) -> None:
    run = Run("cuda:1 loop")
    rec = run.recording
    try:
        with capture_session(rec, Capture(rec, marks=fake_cuda["marks"])) as cap:
            loop_steps(rec, cap, fake_cuda, 12, 1)
        run.finish()
        assert run.result.gpu.cuda_device == 1 and run.gpu_used
        gpu = run.steps["step_gpu_ms"]
        assert np.isfinite(gpu[2:]).all()  # from the step after the decision on
        assert 1 in fake_cuda["streams"]
    finally:
        kernel_state.RUNS.remove(run)


def test_an_error_in_the_gpu_bookkeeping_turns_the_gpu_clock_off_with_a_note(fake_cuda: dict[str, Any]) -> None:
    def broken(device: int) -> Marks:
        def record(ev: Any) -> None:
            raise RuntimeError("Event device 0 does not match recording stream's device 1")

        return Marks(lambda: object(), lambda: None, lambda ev, on: record(ev))

    run = Run("broken")
    try:
        with capture_session(run.recording, Capture(run.recording, marks=broken)) as cap:
            done = [i for i in cap.loop(range(6))]
        run.finish()
        assert done == list(range(6)) and run.n_steps == 6 and run.clock == "cpu"
        assert any("GPU timings turned off" in note for note in run.notes)
    finally:
        kernel_state.RUNS.remove(run)


class StepClock:
    """A GPU clock that records the steps it closed, or fails at the first."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.closed: list[int] = []

    def step_closed(self, index: int, next_serial: int) -> None:
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.closed.append(index)


class BrokenWatch:
    """A GPU watch whose step bookkeeping fails."""

    syncs = None

    def step_ended(self, t: int) -> None:
        raise RuntimeError("the watch's own bug")


def a_loop_on_the_gpu(clock: StepClock, heard: list[str]) -> tuple[Run, loop_gpu.LoopGpu]:
    run = Run("gpu parts")
    gpu = loop_gpu.LoopGpu(run.recording, 0, lambda: heard.append("changed"))
    gpu.deciding = False  # the loop's device is known
    gpu.cuda = clock  # type: ignore[assignment]
    return run, gpu


def test_an_error_of_the_gpu_watch_stops_the_watch_and_the_gpu_clock_goes_on() -> None:
    clock, heard = StepClock(), []
    run, gpu = a_loop_on_the_gpu(clock, heard)
    try:
        run.recording.gpu_watch = BrokenWatch()  # type: ignore[assignment]
        gpu.step_closed(0, 1_000, 1)
        gpu.step_closed(1, 2_000, 2)
        assert clock.closed == [0, 1] and gpu.cuda is clock and gpu.note is None and not heard
        assert run.recording.gpu_watch is None
        assert [n for n in run.recording.notes if n.startswith("GPU watch stopped")] == ["GPU watch stopped: RuntimeError: the watch's own bug"]
    finally:
        kernel_state.RUNS.remove(run)


def test_an_error_of_the_gpu_clock_turns_it_off_once_with_a_note_and_the_hooks_look_again() -> None:
    clock, heard = StepClock(fails=True), []
    run, gpu = a_loop_on_the_gpu(clock, heard)
    try:
        gpu.step_closed(0, 1_000, 1)
        gpu.step_closed(1, 2_000, 2)  # on the CPU clock now: nothing of the GPU's
        assert gpu.cuda is None and heard == ["changed"]
        assert gpu.note is not None and gpu.note.startswith("GPU timings turned off: RuntimeError: CUDA error")
    finally:
        kernel_state.RUNS.remove(run)
