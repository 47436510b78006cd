"""Traced cells on the stand-in GPU (tests/fake_gpu.py) through a real IPython shell: a machine
installed in place of torch.cuda and a setup cell that defines a slow dataset (the `gpu` fixture:
helpers.gpu_fixture; the run a traced cell made: helpers.traced)."""

from __future__ import annotations

import textwrap
from typing import Any

from fake_gpu import FakeGpu, FakeTensor, HostClock, install_fake_cuda
from IPython.utils.capture import capture_output

# A map-style dataset whose items cost the host `ms` (decoding), made of pinned FakeTensors.
SLOW_DATASET = """
import time, torch
from torch.utils.data import DataLoader, Dataset
from fake_gpu import FakeTensor, hidden_sync, implicit_sync
class Slow(Dataset):
    def __init__(self, n, ms, nbytes=4_000):
        self.n, self.ms, self.nbytes = n, ms, nbytes
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        time.sleep(self.ms / 1000)
        return FakeTensor(self.nbytes, pinned=True)
"""


def machine(**kw: Any) -> FakeGpu:
    """A stand-in machine on a fake host clock (the test moves time), its tensors' machine."""
    gpu = FakeGpu(HostClock(fake=True), **kw)
    FakeTensor.gpu = gpu
    return gpu


def stand_in_shell(ip: Any, monkeypatch: Any, setup: str = "", **machine: Any) -> FakeGpu:
    """A stand-in machine as torch.cuda for traced cells, with `gpu`, `cuda` and `FakeTensor`
    in the namespace and SLOW_DATASET then `setup` run. The caller resets FakeTensor.gpu."""
    gpu = FakeGpu(HostClock(), **machine)
    install_fake_cuda(monkeypatch, gpu)
    ip.user_ns.update(FakeTensor=FakeTensor, gpu=gpu, cuda=gpu.module)
    with capture_output():
        assert ip.run_cell(SLOW_DATASET + textwrap.dedent(setup)).error_in_exec is None
    return gpu
