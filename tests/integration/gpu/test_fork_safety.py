"""A traced cell never initialises CUDA that the user's code did not.

`torch.cuda.is_available()`, `device_count()`, `current_device()`, event creation and the
rest initialise the driver; afterwards every fork-started process that uses CUDA fails
("Cannot re-initialize CUDA in forked subprocess": accelerate.notebook_launcher, fork-started
DDP), and CUDA_VISIBLE_DEVICES set in a later cell is ignored. On a CPU machine CUDA cannot be
initialised at all, so the check is a count: every such function of torch.cuda is replaced by
a counting wrapper while a realistic CPU training cell runs through a real shell, and none may
be called. (scripts/gpu_check.py --fork-check and its test fork a child after a traced cell.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from IPython.utils.capture import capture_output

import traceml_jupyter
from traceml_jupyter.capture.gpu.gpu_watch import gpu_watched, torch_cuda_api
from traceml_jupyter.capture.inside.line_costs import new_clock
from traceml_jupyter.capture.resources.nvml import GpuSampler
from traceml_jupyter.run import Run

# What initialises CUDA (or needs it initialised) in torch.cuda; `_lazy_init` also counts the
# calls torch makes of it internally (they look the name up in the module).
INITIALISING = (
    "is_available",
    "device_count",
    "current_device",
    "init",
    "_lazy_init",
    "Event",
    "Stream",
    "synchronize",
    "current_stream",
    "default_stream",
    "set_device",
    "get_device_properties",
    "get_device_name",
    "get_device_capability",
    "get_sync_debug_mode",
    "set_sync_debug_mode",
    "memory_stats",
    "memory_allocated",
    "memory_reserved",
    "mem_get_info",
    "_get_nvml_device_index",
)
C_ENTRY_POINTS = ("_cuda_getDeviceCount", "_cuda_init", "_cuda_getDevice")


def counting(calls: Counter[str], name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return original(*args, **kwargs)

    return counted


@pytest.fixture()
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    calls: Counter[str] = Counter()
    for name in INITIALISING:
        original = getattr(torch.cuda, name, None)
        if original is not None:
            monkeypatch.setattr(torch.cuda, name, counting(calls, name, original))
    for name in C_ENTRY_POINTS:
        original = getattr(torch._C, name, None)
        if original is not None:
            monkeypatch.setattr(torch._C, name, counting(calls, f"torch._C.{name}", original))
    yield calls


CELL = """%%traceml {options}
for epoch in range(2):
    for x, y in loader:
        x, y = x.to(device), y.to(device, non_blocking=True)
        opt.zero_grad()
        loss = loss_fn(model(x).to(torch.float32), y)
        loss.backward()
        opt.step()
        if loss.item() > 1e9 or bool(loss.isnan()):
            print(loss.to("cpu"))
"""

SETUP = """
import torch
from torch.utils.data import DataLoader, TensorDataset
device = torch.device("cpu")
loader = DataLoader(TensorDataset(torch.randn(96, 16), torch.randint(0, 4, (96,))), batch_size=8)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loss_fn = torch.nn.CrossEntropyLoss()
"""


@pytest.mark.slow
@pytest.mark.parametrize("options", ["--no-live", "--name live-view"])
def test_a_traced_cpu_cell_calls_nothing_that_initialises_cuda(ip: Any, cuda_calls: Counter[str], options: str) -> None:
    initialised_before = torch.cuda.is_initialized()
    ip.run_cell(SETUP)
    cuda_calls.clear()
    with capture_output():
        result = ip.run_cell(CELL.format(options=options))
    assert result.error_in_exec is None, result.error_in_exec
    run = traceml_jupyter.last()
    assert run is not None and run.n_steps == 24 and run.clock == "cpu"
    assert dict(cuda_calls) == {}
    if not initialised_before:  # a GPU test earlier in this process may have initialised it
        assert not torch.cuda.is_initialized()


def test_the_gpu_pieces_touch_nothing_of_cuda_until_it_is_initialised(cuda_calls: Counter[str]) -> None:
    """Each piece a traced cell sets up before its loop: the copy/sync watch, the line clock,
    the NVML sampler, the demo's device choice."""
    from traceml_jupyter.demo import default_device

    run = Run()
    with gpu_watched(run.recording) as watch:
        assert watch.api is None
    assert torch_cuda_api() is None
    clock = new_clock([], run.recording, None)
    clock.start()
    clock.finish()
    sampler = GpuSampler()
    sampler.start_when_ready()
    sampler.stop()
    assert sampler.note is not None
    assert default_device().type == "cpu"
    assert dict(cuda_calls) == {}
