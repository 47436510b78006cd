"""The parts of the step on the GPU clock, on the stand-in GPU (tests/fake_gpu.py), through a real
shell: forward, backward and the optimizer queue known GPU work while the host runs ahead, so on
the host's clock the parts are nearly nothing and on the GPU's they are the work queued; CUDA
events at the parts' boundaries on the loop's stream, never waited for before the cell ends."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest
from fake_gpu import FakeGpu
from IPython.utils.capture import capture_output
from test_gpu_capture import gpu as stand_in_gpu  # noqa: F401  (a fixture: the stand-in GPU)

import traceml_jupyter

FWD, BWD, OPT = 4.0, 7.0, 2.0  # GPU ms queued by the forward, the backward, the optimizer step

SETUP = """
import time, torch
from torch.utils.data import DataLoader, Dataset
class Batches(Dataset):
    def __len__(self):
        return 24
    def __getitem__(self, i):
        time.sleep(0.0005)
        return FakeTensor(1_000_000, pinned=True)
class GpuNet(torch.nn.Module):
    '''A model whose forward queues FWD ms of kernels on the GPU (the host does not wait).'''
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)
    def forward(self, x):
        gpu.launch(FWD)
        return self.fc(torch.ones(1, 2))
class GpuGrad(torch.autograd.Function):
    '''Identity whose backward queues BWD ms of kernels.'''
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, grad):
        gpu.launch(BWD)
        return grad
class GpuSGD(torch.optim.Optimizer):
    '''Plain SGD whose step queues OPT ms of kernels.'''
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
    @torch.no_grad()
    def step(self, closure=None):
        gpu.launch(OPT)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
net = GpuNet()
opt = GpuSGD(net.parameters(), lr=0.1)
"""

CELL = """\
for batch in DataLoader(Batches(), batch_size=None):
    x = batch.to("cuda", non_blocking=True)
    opt.zero_grad()
    GpuGrad.apply(net(x)).sum().backward()
    opt.step()
"""


@pytest.fixture()
def parts_gpu(ip: Any, request: pytest.FixtureRequest) -> FakeGpu:
    """test_gpu_capture.py's stand-in GPU (`gpu` in the notebook), with this file's model."""
    machine: FakeGpu = request.getfixturevalue("stand_in_gpu")
    ip.user_ns.update(FWD=FWD, BWD=BWD, OPT=OPT)
    with capture_output():
        assert ip.run_cell(textwrap.dedent(SETUP)).error_in_exec is None
    return machine


def test_the_parts_are_on_the_gpu_clock_where_the_host_runs_ahead(ip: Any, parts_gpu: FakeGpu) -> None:
    with capture_output() as out:
        result = ip.run_cell("%%traceml --no-live --lines off\n" + textwrap.dedent(CELL))
    assert result.error_in_exec is None, out.stdout + out.stderr
    run = traceml_jupyter.last()
    assert run is not None and run.clock == "gpu" and run.n_steps == 24
    s = run.summary
    assert s["parts_clock"] == "gpu"
    assert s["forward_ms"] == pytest.approx(FWD, rel=0.2)
    assert s["backward_ms"] == pytest.approx(BWD, rel=0.2)
    assert s["optimizer_ms"] == pytest.approx(OPT, rel=0.3)
    assert s["rest_ms"] < 1.0
    cols = run.steps
    cpu = np.nanmedian(cols["forward_ms"][3:]) + np.nanmedian(cols["backward_ms"][3:])
    assert cpu < 0.5 * (FWD + BWD)  # on the host's clock the kernels cost next to nothing
    assert np.isfinite(cols["forward_gpu_ms"][3:]).all()
    assert "Parts: forward 4." in run.text()


def test_a_gpu_clock_that_fails_leaves_the_cpu_parts_and_a_note(
    ip: Any, parts_gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    from traceml_jupyter.capture.inside import step_parts

    def broken(self: Any) -> None:
        raise RuntimeError("event pool gone")

    monkeypatch.setattr(step_parts.CudaParts, "enter", broken)
    with capture_output() as out:
        result = ip.run_cell("%%traceml --no-live --lines off\n" + textwrap.dedent(CELL))
    assert result.error_in_exec is None, out.stdout + out.stderr
    run = traceml_jupyter.last()
    assert run is not None and run.n_steps == 24
    assert any("GPU time of the step's parts turned off" in n for n in run.notes)
    assert np.isfinite(run.steps["backward_ms"][3:]).all()
