"""CUDA event bookkeeping, with fake events: steps resolve in order, without blocking."""

from __future__ import annotations

import numpy as np

from traceml_jupyter.cuda_clock import CudaClock
from traceml_jupyter.recorder import Recorder


class FakeEvent:
    clock = 0.0
    done_before = 0.0  # events recorded before this time have completed

    def __init__(self) -> None:
        self.t = 0.0
        self.synced = False

    def record(self) -> None:
        FakeEvent.clock += 1.0
        self.t = FakeEvent.clock

    def query(self) -> bool:
        return self.t <= FakeEvent.done_before

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.t - self.t

    def synchronize(self) -> None:
        FakeEvent.done_before = FakeEvent.clock


def test_steps_resolve_only_when_done_and_all_at_the_end() -> None:
    FakeEvent.clock, FakeEvent.done_before = 0.0, 0.0
    made: list[FakeEvent] = []

    def factory() -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    rec = Recorder()
    rec.origin_ns = 0
    cuda = CudaClock(rec, factory)
    a = cuda.mark()
    for k in range(5):
        b = cuda.mark()
        c = cuda.mark()
        rec.add(k * 10, k * 10 + 1, k * 10 + 10)
        cuda.step(a, b, c)
        a = c
    assert not rec.has_gpu  # nothing completed yet: nothing was read, nothing blocked
    FakeEvent.done_before = 5.0  # the GPU has reached the 5th event
    cuda.poll()
    assert np.isfinite(rec.columns()["step_gpu_ms"]).sum() == 2
    cuda.synchronize()
    cols = rec.columns()
    assert np.isfinite(cols["step_gpu_ms"]).all()
    assert np.allclose(cols["data_wait_gpu_ms"], 1.0) and np.allclose(cols["compute_gpu_ms"], 1.0)
    before = len(made)
    for _ in range(4):
        cuda.mark()
    assert len(made) == before  # finished events are reused from the pool
