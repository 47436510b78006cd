"""The capture core on the stand-in GPU (tests/fake_gpu.py), through a real shell: a trainer-owned
loop is judged on the GPU clock, the step's events stay on the stream it started on, a loop that
launches kernels without allocating is still on the GPU, a CPU loop next to a GPU tensor is not."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from fake_gpu import FakeGpu, FakeTensor
from helpers import gpu_fixture
from helpers import traced as traced_with

SETUP = """
import time, torch
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    '''A batch costs the host `ms` (decoding), on a loader without workers.'''
    def __init__(self, n, ms):
        self.n, self.ms = n, ms
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        time.sleep(self.ms / 1000)
        return FakeTensor(4_000_000, pinned=True)
tiny = torch.nn.Linear(2, 1)
tiny_opt = torch.optim.SGD(tiny.parameters(), lr=0.1)
def library_fit(loader, gpu_ms):
    '''A trainer that owns its loop: the notebook cannot see it, only its training events.'''
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        x = batch.to("cuda", non_blocking=True)
        x.work(gpu_ms)  # forward and backward, queued on the GPU: the host runs ahead
        tiny_opt.zero_grad()
        tiny(torch.ones(1, 2)).sum().backward()
        tiny_opt.step()
"""


gpu = gpu_fixture(SETUP, devices=2)


traced = partial(traced_with, options="--no-live --lines off")


def test_a_trainer_owned_loop_whose_gpu_is_busy_is_compute_bound_on_the_gpu_clock(ip: Any, gpu: FakeGpu) -> None:
    run = traced(ip, "library_fit(DataLoader(Slow(24, 8.0), batch_size=None), 14.0)\n")
    assert run.result.steps.kind == "optimizer" and run.result.loop.line is None and run.n_steps == 24
    assert run.result.gpu.cuda_device == 0 and run.clock == "gpu"
    # The host waited 8 ms a step in next(), but the GPU had 14 ms of queued work to hide it.
    cols = run.steps
    assert float(cols["data_wait_ms"][5:].mean()) > 7.0
    assert run.summary["data_wait_ms"] < 2.0 and run.verdict != "INPUT-BOUND"


def test_a_trainer_owned_loop_that_starves_the_gpu_is_input_bound_on_the_gpu_clock(ip: Any, gpu: FakeGpu) -> None:
    run = traced(ip, "library_fit(DataLoader(Slow(24, 12.0), batch_size=None), 3.0)\n")
    assert run.clock == "gpu" and run.verdict == "INPUT-BOUND"
    assert run.summary["data_wait_ms"] == pytest.approx(9.0, abs=3.0)  # 12 ms of loading, 3 ms of work hid part


@pytest.mark.slow
def test_a_body_on_a_side_stream_is_timed_on_the_stream_its_step_started_on(ip: Any, gpu: FakeGpu) -> None:
    ip.user_ns["side"] = gpu.new_stream(0)
    run = traced(
        ip,
        """\
        for batch in DataLoader(Slow(16, 1.0), batch_size=None):
            x = batch.to("cuda", non_blocking=True)
            with cuda.stream(side):
                x.work(10.0)
            cuda.current_stream().wait_stream(side)
            tiny_opt.step()
        """,
    )
    assert run.clock == "gpu"
    assert run.summary["compute_ms"] == pytest.approx(10.0, rel=0.2)


def test_a_loop_that_allocates_nothing_but_keeps_the_gpu_busy_is_on_the_gpu(ip: Any, gpu: FakeGpu) -> None:
    ip.user_ns["graph_input"] = FakeTensor(1_000, device="cuda:0")
    run = traced(
        ip,
        """\
        for step in range(20):  # traceml: loop
            gpu.launch(6.0)  # a CUDA graph replayed: kernels, no allocation
        """,
    )
    assert run.result.gpu.cuda_device == 0 and run.clock == "gpu"
    assert run.summary["step_ms"] == pytest.approx(6.0, rel=0.2)


def test_a_cpu_loop_next_to_a_gpu_tensor_stays_on_the_cpu_clock(ip: Any, gpu: FakeGpu) -> None:
    gpu.devices[0].allocations = 50  # a model from an earlier cell sits on the GPU
    run = traced(ip, "for batch in DataLoader(Slow(16, 2.0), batch_size=None):\n    time.sleep(0.003)\n")
    assert run.result.gpu.cuda_device is None and run.clock == "cpu" and run.verdict != "HOST-BOUND"
