"""The NVML sampler: the loop's GPU found by PCI bus id, a bounded buffer, a thread that stops,
and a reason whenever there are no GPU figures. NVML is a fake module; CUDA is faked on torch."""

from __future__ import annotations

import sys
import threading
import time
import types
from typing import Any

import numpy as np
import pytest

from traceml_jupyter.capture.resources import nvml
from traceml_jupyter.capture.resources.nvml import GpuSampler, GpuSamples


class FakeNVMLError(Exception):
    pass


def fake_pynvml(init_error: bool = False, fail_after: int | None = None) -> Any:
    """A pynvml stand-in: one GPU on bus 0000:17:00.0 at 70 % utilisation, 2 of 80 GiB used."""
    mod = types.ModuleType("pynvml")
    mod.calls = []  # type: ignore[attr-defined]
    mod.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    reads = {"n": 0}

    def init() -> None:
        mod.calls.append("init")
        if init_error:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def shutdown() -> None:
        mod.calls.append("shutdown")

    def by_bus(bus: bytes) -> str:
        mod.calls.append(("bus", bus))
        return "handle"

    def util(handle: str) -> Any:
        reads["n"] += 1
        if fail_after is not None and reads["n"] > fail_after:
            raise FakeNVMLError("GPU is lost")
        return types.SimpleNamespace(gpu=70, memory=10)

    mod.nvmlInit = init  # type: ignore[attr-defined]
    mod.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByPciBusId = by_bus  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = lambda i: "handle"  # type: ignore[attr-defined]
    mod.nvmlDeviceGetName = lambda h: b"NVIDIA Fake"  # type: ignore[attr-defined]
    mod.nvmlDeviceGetUtilizationRates = util  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        used=2 * 2**30, total=80 * 2**30
    )
    return mod


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    """torch is built with CUDA and reports one initialised CUDA device on PCI bus 0x17 (only
    for nvml's lookups; is_available() is never asked: it would initialise CUDA)."""
    import torch

    def never() -> bool:
        raise AssertionError("torch.cuda.is_available() initialises CUDA: never called")

    monkeypatch.setattr(torch.cuda, "is_available", never)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x17, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    return torch


def wait_for(condition: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_pci_bus_id_is_nvmls_name_of_the_device() -> None:
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0xDC, pci_device_id=3)
    assert nvml.pci_bus_id(props) == "0000:dc:03.0"
    assert nvml.pci_bus_id(types.SimpleNamespace(name="old torch")) is None


def test_the_loops_gpu_is_sampled_on_a_named_thread_until_stopped(
    monkeypatch: pytest.MonkeyPatch, fake_cuda: Any
) -> None:
    fake = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = GpuSampler()
    sampler.start_when_ready()
    assert sampler.running
    assert any(t.name == "traceml-nvml" for t in threading.enumerate())
    assert wait_for(lambda: len(sampler.samples) >= 2)
    sampler.stop()
    assert not sampler.running
    assert ("bus", b"0000:17:00.0") in fake.calls
    assert fake.calls[0] == "init" and fake.calls[-1] == "shutdown"
    cols = sampler.samples.columns()
    assert set(cols) == {"time_s", "gpu_util_pct", "gpu_mem_used_mib", "gpu_clock_mhz", "gpu_temp_c"}
    assert np.all(cols["gpu_util_pct"] == 70.0)
    assert np.all(cols["gpu_mem_used_mib"] == 2048.0)
    assert np.all(np.diff(cols["time_s"]) >= 0)
    assert sampler.note is None
    assert sampler.device == "NVIDIA Fake, 0000:17:00.0, 81920 MiB"
    assert sampler.samples.latest() == (70.0, 2048.0)


def test_sampling_is_never_faster_than_5_hz() -> None:
    assert GpuSampler(period_s=0.001).period_s == nvml.SAMPLE_PERIOD_S == 0.2


def test_an_nvml_error_starts_nothing_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=True))
    sampler = GpuSampler()
    sampler.start_when_ready()
    assert not sampler.running
    assert sampler.note == "GPU n/a (no NVML)"
    assert "NVML Shared Library Not Found" in (sampler.detail or "")
    sampler.stop()
    assert sampler.note == "GPU n/a (no NVML)"


def test_without_pynvml_the_note_says_no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    sampler = GpuSampler()
    sampler.start_when_ready()
    assert not sampler.running
    assert sampler.note == "GPU n/a (no NVML)"
    assert "nvidia-ml-py" in (sampler.detail or "")


def test_nvml_without_a_cuda_device_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml, "cuda_available", lambda: False)
    sampler = GpuSampler()
    sampler.start_when_ready()
    assert not sampler.running
    assert sampler.note == "GPU n/a (no CUDA device)"
    assert fake.calls == ["init", "shutdown"]


def test_a_loop_that_never_initialises_cuda_gets_no_thread(
    monkeypatch: pytest.MonkeyPatch, fake_cuda: Any
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setattr(fake_cuda.cuda, "is_initialized", lambda: False)
    sampler = GpuSampler()
    sampler.start_when_ready()
    sampler.start_when_ready()
    assert not sampler.running
    assert sampler.note == "GPU n/a (no CUDA work yet)"
    sampler.stop()
    assert sampler.note == "GPU n/a (the loop did not use CUDA)"


def test_sampling_starts_once_the_loop_initialises_cuda(
    monkeypatch: pytest.MonkeyPatch, fake_cuda: Any
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    initialised = {"yet": False}
    monkeypatch.setattr(fake_cuda.cuda, "is_initialized", lambda: initialised["yet"])
    sampler = GpuSampler()
    sampler.start_when_ready()
    assert not sampler.running
    initialised["yet"] = True
    sampler.start_when_ready()
    assert sampler.running
    sampler.stop()
    assert not sampler.running


def test_an_nvml_error_while_sampling_ends_the_thread_and_keeps_the_samples(
    monkeypatch: pytest.MonkeyPatch, fake_cuda: Any
) -> None:
    fake = fake_pynvml(fail_after=1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = GpuSampler()
    sampler.start_when_ready()
    assert wait_for(lambda: not sampler.running)
    assert sampler.note == "GPU n/a (NVML error)"
    assert "GPU is lost" in (sampler.detail or "")
    assert len(sampler.samples) == 1
    assert fake.calls[-1] == "shutdown"
    sampler.stop()


def test_this_machines_real_nvml_fails_cleanly() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine")
    sampler = GpuSampler()
    sampler.start_when_ready()
    sampler.stop()
    assert not sampler.running
    assert sampler.note == "GPU n/a (no NVML)"


def test_the_buffer_stays_bounded_and_keeps_the_whole_span() -> None:
    buffer = GpuSamples(capacity=8)
    for i in range(100):
        buffer.add(float(i), float(i % 100), 1.0)
    cols = buffer.columns()
    assert len(buffer) <= 8
    assert buffer.decimations >= 1
    assert cols["time_s"][0] == 0.0 and cols["time_s"][-1] == 99.0
    assert np.all(np.diff(cols["time_s"]) > 0)


def test_samples_are_placed_on_steps_by_time() -> None:
    samples = {
        "time_s": np.array([0.0, 1.0, 2.0]),
        "gpu_util_pct": np.array([0.0, 50.0, 100.0]),
        "gpu_mem_used_mib": np.array([10.0, 10.0, 30.0]),
    }
    placed = nvml.at_steps(samples, np.array([0.5, 1.5, 5.0]), min_inside=2)
    assert placed["gpu_util_pct"][:2].tolist() == [25.0, 75.0]
    assert np.isnan(placed["gpu_util_pct"][2])
    assert placed["gpu_mem_used_mib"][1] == 20.0
    # Two samples inside the loop are too few to judge utilisation by (memory is still shown).
    few = nvml.at_steps(samples, np.array([0.5, 1.5, 5.0]))
    assert np.isnan(few["gpu_util_pct"]).all() and few["gpu_mem_used_mib"][1] == 20.0
    empty = nvml.at_steps({"time_s": np.empty(0)}, np.array([1.0]))
    assert np.isnan(empty["gpu_util_pct"]).all()


def test_the_sampler_follows_the_loops_device_not_the_current_one(
    monkeypatch: pytest.MonkeyPatch, fake_cuda: Any
) -> None:
    """Training on cuda:1 while the current device is 0: NVML samples device 1's bus; a loop
    the capture has not seen on a GPU (a CPU loop next to a stale GPU tensor) gets none."""
    fake = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    bus = {0: 0x17, 1: 0x65}
    monkeypatch.setattr(
        fake_cuda.cuda,
        "get_device_properties",
        lambda i: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=bus[i], pci_device_id=0),
    )
    loop_device: list[int | None] = [None]
    sampler = GpuSampler(device_of_loop=lambda: loop_device[0])
    sampler.start_when_ready()
    assert not sampler.running and sampler.note == "GPU n/a (no CUDA work yet)"
    loop_device[0] = 1
    sampler.start_when_ready()
    assert wait_for(lambda: len(sampler.samples) >= 1)
    sampler.stop()
    assert ("bus", b"0000:65:00.0") in fake.calls
