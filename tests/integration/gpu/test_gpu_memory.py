"""GPU memory on the stand-in GPU (its caching allocator's statistics and capacity, as torch's):
HIGH PRESSURE, a creep with the kept-graph line, what earlier cells hold by name, an out-of-memory
error explained above the unchanged traceback; the per-step reads and their bounds."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from fake_gpu import (
    MIB,
    FakeAllocator,
    FakeGpu,
    FakeModel,
    FakeOptimizer,
    FakeTensor,
    MemTensor,
    install_fake_allocator,
)
from helpers import gpu_fixture, run

import traceml_jupyter
from traceml_jupyter.capture.resources import gpu_memory
from traceml_jupyter.capture.resources.gpu_memory import (
    GpuMemory,
    held_before,
    oom_facts,
    reads_peak,
)
from traceml_jupyter.capture.steps.recorder import HISTORY_CAP

# A launch queue of 8 commands: the host keeps pace with the GPU's 1 ms steps, as on a GPU.
gpu = gpu_fixture(queue_depth=8)


@pytest.fixture()
def allocator(gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAllocator]:
    yield install_fake_allocator(monkeypatch, gpu, capacity_gib=8.0)
    MemTensor.allocator = None


@pytest.fixture()
def every_step_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's memory read: the stand-in's 1 ms steps are short enough that a read through
    its allocator (10-30 µs, more on a loaded machine) can cost over the 1 % that spaces the
    reads, and how many steps are read would then depend on the machine. The spacing has its
    own test (test_reads_are_spaced_to_cost_at_most_one_percent_of_the_steps)."""
    monkeypatch.setattr(gpu_memory, "READ_BUDGET", 1.0)


@pytest.fixture(autouse=True)
def names_forgotten(ip: Any) -> Iterator[None]:
    """What a test's cells defined goes, what they rebound comes back (the stand-in's tensors go
    with them)."""
    before = dict(ip.user_ns)
    yield
    for name in set(ip.user_ns) - set(before):
        ip.user_ns.pop(name, None)
    for name, value in before.items():
        if ip.user_ns.get(name, value) is not value:
            ip.user_ns[name] = value


def traced(ip: Any, cell: str, names: dict[str, Any]) -> tuple[Any, Any, str]:
    ip.user_ns.update(names)
    result = run(ip, cell)
    return traceml_jupyter.last(), result, result.shown


def batches(n: int = 30) -> list[FakeTensor]:
    return [FakeTensor(1_000_000, "cuda") for _ in range(n)]


# -- the stand-in's allocator behaves as torch's ------------------------------------------------


def test_the_stand_in_allocator_counts_as_torch_documents(gpu: FakeGpu, allocator: FakeAllocator) -> None:
    cuda = gpu.module
    a = MemTensor(1000)  # rounded up to 512 bytes: 1024; from a 2 MiB small segment
    assert cuda.memory_allocated(0) == 1024 and cuda.memory_reserved(0) == 2 * MIB
    b = MemTensor(30 * MIB)  # > 10 MiB: its own segment, rounded up to 2 MiB
    assert cuda.memory_reserved(0) == 32 * MIB and cuda.max_memory_allocated(0) == 1024 + 30 * MIB
    del b  # freed: allocated falls, reserved stays (cached), the peak stays
    assert cuda.memory_allocated(0) == 1024 and cuda.memory_reserved(0) == 32 * MIB
    assert cuda.max_memory_allocated(0) == 1024 + 30 * MIB
    cuda.reset_peak_memory_stats(0)  # the peak becomes the current value
    assert cuda.max_memory_allocated(0) == 1024
    stats = cuda.memory_stats_as_nested_dict(0)
    assert stats["allocated_bytes"]["all"]["current"] == 1024
    assert cuda.memory_stats(0)["reserved_bytes.all.current"] == 32 * MIB
    assert cuda.get_device_properties(0).total_memory == 8 * 1024 * MIB
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"Tried to allocate 9.00 GiB. GPU 0 has a total capacity of 8.00 GiB"):
        MemTensor(9 * 1024 * MIB)
    assert cuda.memory_reserved(0) == 2 * MIB  # the cache was emptied before the error
    del a


# -- per step --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_high_pressure_from_the_per_step_peak_checked_against_the_allocator(
    ip: Any, gpu: FakeGpu, allocator: FakeAllocator, every_step_read: None
) -> None:
    # 6000 MiB of parameters, 1600 MiB of activations saved in each forward and freed by
    # backward: every step peaks at 92.8 % of the 8 GiB device.
    model = FakeModel(params_mib=6000, activations_mib=1600)
    run, result, shown = traced(
        ip,
        """\
        %%traceml --no-live --name pressure
        for x in batches:
            out = model(x)
            loss = out.mean()
            loss.backward()
        """,
        {"model": model, "batches": batches()},
    )
    assert result.error_in_exec is None
    assert run.clock == "gpu"
    s = run.summary
    cols = run.steps
    peak = cols["gpu_mem_peak_mib"]
    read = np.isfinite(peak)
    assert np.isnan(peak[0]) and read.sum() >= 10  # read from the step the device is known
    # The allocator's own figure for one step, measured by hand as its docs say.
    cuda = gpu.module
    cuda.reset_peak_memory_stats(0)
    out = model(batches()[0])
    out.mean().backward()
    del out
    assert peak[read][-1] == cuda.max_memory_allocated(0) / MIB
    assert s["gpu_mem_peak_mib"] == pytest.approx(6000 + 1600, abs=0.1)
    assert s["gpu_mem_capacity_mib"] == 8192
    assert s["gpu_mem_peak_share"] == pytest.approx(7600 / 8192, abs=1e-3)
    found = s["resource_findings"][0]
    assert (found["label"], found["severity"]) == ("HIGH PRESSURE", "warn"), s["resource_findings"]
    assert "7.42 GiB of the GPU's 8.00 GiB (92.8 %)" in found["text"]
    assert "Also: HIGH PRESSURE" in shown
    # Two allocator calls a step (statistics, reset), no more.
    measured = int(np.isfinite(peak).sum())
    assert allocator.calls["stats"] == measured and allocator.calls["reset"] == measured + 2


@pytest.mark.slow
def test_a_kept_graph_creeps_and_the_cell_line_is_named(
    ip: Any, gpu: FakeGpu, allocator: FakeAllocator, every_step_read: None
) -> None:
    model = FakeModel(params_mib=500, out_mib=64)
    run, result, shown = traced(
        ip,
        """\
        %%traceml --no-live --name creep
        history = []
        for x in batches:
            out = model(x)
            history.append(out)
        """,
        {"model": model, "batches": batches()},
    )
    assert result.error_in_exec is None
    s = run.summary
    assert s["gpu_mem_growth_per_step_mib"] == pytest.approx(64.0, rel=0.01)
    found = next(f for f in s["resource_findings"] if f["label"].startswith("MEMORY"))
    assert (found["label"], found["severity"], found["line"]) == ("MEMORY CREEP", "warn", 5)
    assert "+64 MiB a step" in found["text"]
    assert "Likely cause: line 5 keeps every step's graph (`history.append(out)`): use `out.detach()`" in found["text"]
    from traceml_jupyter.views.report import report_html

    page = report_html(run)
    assert "GPU memory per step" in page and 'title="line 5: change memory creep"' in page
    ends = run.steps["gpu_mem_allocated_mib"]
    ok = np.isfinite(ends)  # read every step, or every k-th where a read costs > 1 % of a step
    assert np.diff(ends[ok]) == pytest.approx(64.0 * np.diff(run.steps["step"][ok]), abs=0.01)


@pytest.mark.slow
def test_memory_held_by_earlier_cells_is_named_biggest_first(ip: Any, gpu: FakeGpu, allocator: FakeAllocator) -> None:
    old_model = FakeModel(params_mib=1200)
    old_opt = FakeOptimizer(old_model.parameters())
    old_opt.step()  # two state tensors per parameter: 2400 MiB
    names = {
        "old_model": old_model,
        "same_model": old_model,  # the same storage under another name: counted once
        "old_opt": old_opt,
        "outputs": [MemTensor(400 * MIB), MemTensor(400 * MIB)],
        "model": FakeModel(params_mib=10),
        "batches": batches(12),
    }
    before = gpu.module.memory_allocated(0) / MIB
    run, result, shown = traced(
        ip,
        """\
        %%traceml --no-live --name held
        for x in batches:
            out = model(x)
        """,
        names,
    )
    held = run.result.resources.held_before["devices"][0]
    assert held["allocated_mib"] == pytest.approx(before)
    mine = [(h["name"], round(h["mib"])) for h in held["holders"] if h["name"] in names]
    assert mine == [("old_opt", 2400), ("old_model", 1200), ("outputs", 800), ("model", 10)]
    found = next(f for f in run.summary["resource_findings"] if f["label"] == "HELD BY EARLIER CELLS")
    assert "the biggest holders: old_opt 2.34 GiB, old_model 1.17 GiB, outputs 800 MiB" in found["text"]
    assert "`del old_opt, old_model, outputs`" in found["next"]


def test_held_before_reads_real_torch_objects_by_storage() -> None:
    # The same walk over real torch objects (on the CPU: the device test is the caller's).
    model = torch.nn.Linear(256, 256)  # 256 KiB of weight, 1 KiB of bias
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    view = model.weight.data[:10]  # a view: the weight's storage, counted once
    ns = {"model": model, "opt": opt, "view": view, "Out": {3: torch.zeros(1024)}, "_3": torch.zeros(1024)}

    class Cuda:
        def is_initialized(self) -> bool:
            return True

        def device_count(self) -> int:
            return 1

        def memory_allocated(self, d: int) -> int:
            return 10 * MIB

        def get_device_properties(self, d: int) -> Any:
            return type("P", (), {"total_memory": 100 * MIB})()

    from traceml_jupyter.capture.resources import gpu_memory

    rows, stopped = gpu_memory.held_by_names(ns, lambda t: t.device.type == "cpu", gpu_memory.torch_kinds())  # type: ignore[arg-type]
    got = {name: round(value * 1024) for name, value in rows}  # KiB
    # weight + bias + their grads; Adam's exp_avg, exp_avg_sq (and step counters)
    assert got["model"] == 2 * (256 + 1)
    assert got["opt"] >= 2 * (256 + 1) and "view" not in got and got["Out[3]"] == 4
    assert not stopped
    assert held_before(ns, Cuda(), gpu_memory.torch_kinds()) is not None


# -- out of memory ----------------------------------------------------------------------------


@pytest.mark.slow
def test_an_out_of_memory_error_is_explained_above_the_unchanged_traceback(ip: Any, gpu: FakeGpu, allocator: FakeAllocator) -> None:
    names = {"model": FakeModel(params_mib=1000), "batches": batches(), "kept": [MemTensor(2000 * MIB)], "MemTensor": MemTensor}
    run, result, shown = traced(
        ip,
        """\
        %%traceml --no-live --name oom
        for i, x in enumerate(batches):
            out = model(x)
            if i == 6:
                big = MemTensor(100 * 2**30)
        """,
        names,
    )
    error = result.error_in_exec
    assert isinstance(error, torch.cuda.OutOfMemoryError)  # the user's error, unchanged
    frames = traceback.extract_tb(error.__traceback__)
    cell_frames = [f for f in frames if f.filename == run.result.loop.cell_filename]
    assert cell_frames and cell_frames[-1].lineno == 5  # points at the cell's own line
    oom = run.result.resources.oom
    assert (oom["step"], oom["completed_steps"], oom["device"]) == (7, 6, 0)  # i == 6: the 7th
    assert oom["requested_mib"] == pytest.approx(100 * 1024) and oom["capacity_mib"] == 8192
    assert oom["allocated_mib"] == pytest.approx(gpu.module.memory_allocated(0) / MIB)
    found = run.summary["resource_findings"][0]
    assert (found["label"], found["severity"]) == ("OUT OF MEMORY", "critical")
    assert "CUDA ran out of memory in step 7 (after 6 completed steps): it tried to allocate 100.00 GiB on GPU 0" in found["text"]
    assert "capacity 8.00 GiB" in found["text"] and "Before it, earlier cells hold" in found["text"]
    assert "kept 1.95 GiB" in found["text"]
    assert "Also: OUT OF MEMORY" in shown and "Stopped by: OutOfMemoryError" in shown


@pytest.mark.slow
def test_an_out_of_memory_error_before_the_first_step_is_explained_too(ip: Any, gpu: FakeGpu, allocator: FakeAllocator) -> None:
    names = {"FakeModel": FakeModel, "batches": batches()}
    run, result, shown = traced(
        ip,
        """\
        %%traceml --no-live --name oom0
        model = FakeModel(params_mib=100 * 1024)
        for x in batches:
            out = model(x)
        """,
        names,
    )
    assert isinstance(result.error_in_exec, torch.cuda.OutOfMemoryError)
    assert "traceml: no step ran: the cell stopped with OutOfMemoryError" in shown
    assert "traceml: OUT OF MEMORY: CUDA ran out of memory in step 1 (after 0 completed steps): it tried to allocate 100.00 GiB" in shown


def test_oom_facts_read_torchs_message() -> None:
    error = RuntimeError(
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1 has a total capacity of 14.75 GiB "
        "of which 3.06 MiB is free. Including non-PyTorch memory, this process has 14.74 GiB memory "
        "in use. Of the allocated memory 14.50 GiB is allocated by PyTorch, and 110.61 MiB is "
        "reserved by PyTorch but unallocated."
    )
    facts = oom_facts(error, None, cuda=None)
    assert facts["requested_mib"] == pytest.approx(20.0) and facts["device"] == 1
    assert facts["capacity_mib"] == pytest.approx(14.75 * 1024) and facts["free_mib"] == pytest.approx(3.06)


# -- the watch's own behaviour -------------------------------------------------------------------


@pytest.mark.slow
def test_code_that_reads_the_peak_keeps_it(ip: Any, gpu: FakeGpu, allocator: FakeAllocator) -> None:
    assert reads_peak("print(torch.cuda.max_memory_allocated())") and not reads_peak("x = model(y)")
    model = FakeModel(params_mib=100, activations_mib=300)
    run, result, shown = traced(
        ip,
        """\
        %%traceml --no-live --name reads
        for x in batches:
            out = model(x)
            out.mean().backward()
        peak = torch.cuda.max_memory_allocated()
        """,
        {"model": model, "batches": batches(), "torch": torch},
    )
    assert allocator.calls["reset"] == 0  # never reset under the user's own reading
    assert run.result.resources.gpu_memory["peak_reset_each_step"] is False
    assert run.summary["gpu_mem_peak_mib"] == pytest.approx(400.0, abs=0.5)


def test_no_statistics_from_the_allocator_is_a_note(gpu: FakeGpu) -> None:
    gpu.module.memory_stats_as_nested_dict = lambda device=None: {}  # cudaMallocAsync reports zeros
    gpu.module.reset_peak_memory_stats = lambda device=None: None
    watch = GpuMemory(cuda=lambda: gpu.module)
    watch.loop_started(0)
    watch.step_ended(0)
    assert watch.off is not None and "no statistics" in watch.off and watch.steps_read == 0


def test_a_failing_allocator_read_turns_the_watch_off_without_raising(gpu: FakeGpu, allocator: FakeAllocator) -> None:
    params = MemTensor(MIB)  # noqa: F841  (a loop on the GPU holds something there)
    broken: list[bool] = []

    def stats(device: Any = None) -> Any:
        if broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return allocator.stats(device)

    gpu.module.memory_stats_as_nested_dict = stats
    watch = GpuMemory(cuda=lambda: gpu.module)
    watch.loop_started(0)
    watch.step_ended(0)
    broken.append(True)
    watch.step_ended(1)  # never raises: the watch is off, with why
    watch.step_ended(2)
    assert watch.steps_read == 1 and "illegal memory access" in (watch.off or "")


@pytest.mark.slow
def test_memory_columns_are_bounded_like_the_recorders(gpu: FakeGpu, allocator: FakeAllocator) -> None:
    params = MemTensor(MIB)  # noqa: F841
    watch = GpuMemory(cuda=lambda: gpu.module)
    watch.loop_started(0)
    for step in range(3 * HISTORY_CAP):
        watch.step_ended(step)
    tally = watch.tallies["gpu_mem_peak_mib"]
    assert len(tally) <= HISTORY_CAP and tally.stride >= 2
    watch.merged(3 * HISTORY_CAP - 10)  # merged steps are unmeasured, the rest stays
    assert np.isnan(tally.column(np.array([3 * HISTORY_CAP - 8]))[0])


def test_reads_are_spaced_to_cost_at_most_one_percent_of_the_steps(gpu: FakeGpu, allocator: FakeAllocator) -> None:
    import time

    params = MemTensor(MIB)  # noqa: F841

    def slow_stats(device: Any = None) -> Any:
        time.sleep(0.0002)  # a read of 0.2 ms or more
        return allocator.stats(device)

    gpu.module.memory_stats_as_nested_dict = slow_stats
    watch = GpuMemory(cuda=lambda: gpu.module)
    watch.loop_started(0)
    t = 0
    for step in range(40):  # 1 ms steps: one read costs 20 % of a step
        t += 1_000_000
        watch.step_ended(step, t)
    assert watch.read_every >= 20 and watch.steps_read < 10
    slow = GpuMemory(cuda=lambda: gpu.module)
    slow.loop_started(0)
    for step in range(10):  # 1 s steps: every step is read
        slow.step_ended(step, (step + 1) * 1_000_000_000)
    assert slow.read_every == 1 and slow.steps_read == 10
