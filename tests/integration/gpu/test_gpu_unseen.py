"""What the GPU path sees that is easy to miss, on the stand-in GPU: a GPU loop the allocator's
counts do not show, waits nobody reports, a `wait_event` prefetcher, and traceml's own host time
(cases 2, 4 and 5 of ../shared/reviews/gpu-double-review.md). First the stand-in's behaviours
that these need, each against the rule it models (tests/fake_gpu.py cites the documentation)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
from fake_gpu import FakeGpu, FakeTensor, allocator_stats, hidden_sync
from helpers import gpu_fixture
from helpers import traced as traced_with
from stand_in_cells import machine

from traceml_jupyter.capture.gpu import hidden_waits
from traceml_jupyter.capture.gpu.syncs import SYNC_MESSAGE
from traceml_jupyter.capture.resources import nvml

# -- the stand-in, closer to CUDA ------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_tensors_left() -> Iterator[None]:
    yield
    FakeTensor.gpu = None


def test_allocator_statistics_per_backend() -> None:
    """native counts allocations; cudaMallocAsync keeps every count at 0 and reports only the
    bytes in use and reserved (CUDAMallocAsyncAllocator.cpp, getDeviceStats)."""
    gpu = machine()
    FakeTensor(1000, device="cuda").work(1.0)
    native = allocator_stats(gpu, 0)
    assert native["allocation.all.allocated"] == 2 and native["allocated_bytes.all.current"] > 0
    gpu.backend = "cudaMallocAsync"
    before = gpu.module.memory_stats(0)
    FakeTensor(1000, device="cuda")
    after = gpu.module.memory_stats(0)
    assert after["allocation.all.allocated"] == 0 and after["num_device_free"] == 0
    assert after["allocated_bytes.all.current"] > before["allocated_bytes.all.current"]
    assert gpu.module.get_allocator_backend() == "cudaMallocAsync"


def test_launch_blocking_makes_every_launch_wait_without_a_warning() -> None:
    gpu = machine()
    gpu.launch_blocking = True
    gpu.sync_mode = 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gpu.launch(5.0)
    assert gpu.clock() == 5_000_000 and not seen


def test_waits_nobody_warns_about() -> None:
    """An NCCL collective or an extension's own sync (hidden_sync), empty_cache (cudaFree, or
    cudaDeviceSynchronize for cudaMallocAsync): the host waits, no sync debug warning."""
    gpu = machine()
    gpu.sync_mode = 1
    x = FakeTensor(1000, device="cuda").work(4.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        hidden_sync(x)
        assert gpu.clock() == 4_000_000
        x.work(2.0)
        gpu.module.empty_cache()
    assert gpu.clock() == 6_000_000 and not seen
    assert gpu.module.memory_stats(0)["num_device_free"] == 1


def test_small_pageable_non_blocking_copies_may_not_wait() -> None:
    """CUDA: from pageable memory the driver "may synchronize with the stream" to stage the
    copy; a small one is staged at once (64 KiB here until a GPU run measures it)."""
    gpu = machine()
    x = FakeTensor(1000, device="cuda")
    x.work(5.0)
    FakeTensor(4096).to("cuda", non_blocking=True)
    assert gpu.clock() == 0  # staged: the host did not wait for the 5 ms
    FakeTensor(64 * 2**20).to("cuda", non_blocking=True)
    assert gpu.clock() > 5_000_000  # a large one waits for the stream, then the copy


def test_copies_on_two_streams_share_one_copy_engine() -> None:
    gpu = machine()
    a, b = gpu.new_stream(), gpu.new_stream()
    gpu.copy_h2d(4.0, a)
    gpu.copy_h2d(4.0, b)
    assert (a.free_at, b.free_at) == (4_000_000, 8_000_000)  # kernels on two streams would overlap
    gpu.launch(4.0, a)
    gpu.launch(4.0, gpu.new_stream())
    assert a.free_at == 8_000_000


def test_each_cuda_call_costs_the_host_time() -> None:
    gpu = machine()
    gpu.call_us = 20.0
    ev = gpu.event()
    ev.record()
    ev.query()
    assert gpu.clock() == 40_000


def test_stream_wait_event_is_event_wait_as_in_torch() -> None:
    gpu = machine()
    side = gpu.new_stream()
    gpu.launch(3.0, side)
    ev = side.record_event()
    gpu.current_stream().wait_event(ev)
    assert gpu.current_stream().free_at == 3_000_000


# -- through the magic ----------------------------------------------------------------------

SETUP = """
tiny = torch.nn.Linear(2, 1)
tiny_opt = torch.optim.SGD(tiny.parameters(), lr=0.1)
"""


gpu = gpu_fixture(SETUP, devices=2)


traced = partial(traced_with, options="--no-live --lines off")


def test_under_cuda_malloc_async_a_training_loop_is_still_a_gpu_loop(ip: Any, gpu: FakeGpu) -> None:
    """Its allocation counts stay 0; the bytes in use move on the device it trains on."""
    gpu.backend = "cudaMallocAsync"
    run = traced(
        ip,
        """\
        for batch in DataLoader(Slow(16, 1.0), batch_size=None):
            x = batch.to("cuda:1", non_blocking=True)
            x.work(4.0).item()
            tiny_opt.step()
        """,
    )
    assert gpu.module.memory_stats(1)["allocation.all.allocated"] == 0
    assert run.result.gpu.cuda_device == 1 and run.clock == "gpu"
    assert run.summary["step_ms"] == pytest.approx(4.0 + 1.0, rel=0.4)


def test_a_loop_that_allocates_nothing_and_syncs_every_step_keeps_the_gpu_clock(ip: Any, gpu: FakeGpu) -> None:
    """In-place kernels and `.item()` (a graph replay's pattern without the graph): nothing is
    queued when a step ends, but the host waited for a busy GPU."""
    ip.user_ns["static"] = FakeTensor(1000, device="cuda:0")
    allocations = gpu.devices[0].allocations
    run = traced(ip, "for i in range(20):  # traceml: loop\n    gpu.launch(5.0)\n    v = static.item()\n")
    assert gpu.devices[0].allocations == allocations
    assert run.result.gpu.cuda_device == 0 and run.clock == "gpu"
    assert run.summary["compute_ms"] == pytest.approx(5.0, rel=0.3)


def test_in_place_kernels_then_synchronize_keep_the_gpu_clock(ip: Any, gpu: FakeGpu) -> None:
    """gpu_check's D3: `x.add_(1); torch.cuda._sleep(...); torch.cuda.synchronize()`."""
    run = traced(ip, "for i in range(20):  # traceml: loop\n    gpu.launch(5.0)\n    cuda.synchronize()\n")
    assert run.result.gpu.cuda_device == 0 and run.clock == "gpu"
    assert not any("timed on the CPU clock" in n for n in run.notes)


@pytest.mark.slow
def test_a_cpu_loop_while_cuda_is_initialised_is_not_taken_in_silence(ip: Any, gpu: FakeGpu) -> None:
    gpu.devices[0].allocations = 50  # a model of an earlier cell sits on the GPU
    run = traced(ip, "for batch in DataLoader(Slow(12, 1.0), batch_size=None):\n    time.sleep(0.002)\n")
    assert run.clock == "cpu" and run.result.gpu.cuda_device is None
    assert any("CUDA is initialised, but the loop's first 3 steps showed no work on a GPU" in n for n in run.notes)
    gpu.backend = "cudaMallocAsync"
    run = traced(ip, "for batch in DataLoader(Slow(12, 1.0), batch_size=None):\n    time.sleep(0.002)\n")
    assert any("cudaMallocAsync" in n for n in run.notes)


GPU_BOUND = """\
for batch in DataLoader(Slow(24, 0.1), batch_size=None):
    x = batch.to("cuda", non_blocking=True)
    x.work(16.0)
"""


@pytest.mark.slow
def test_cuda_launch_blocking_withholds_all_syncs_seen_and_host_bound(ip: Any, gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch waits for its kernel, unreported: the host seems to issue work the whole
    step with nothing queued. Without NVML that is no HOST-BOUND; with NVML the busy GPU is
    COMPUTE-BOUND."""
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    gpu.launch_blocking = True
    run = traced(ip, GPU_BOUND)
    s = run.summary
    assert run.clock == "gpu" and s["gpu_backlog_ms"] == pytest.approx(0.0, abs=0.3)
    assert s["host_issue_ms"] > 0.5 * s["step_ms"]  # host time alone would say HOST-BOUND
    assert not s["syncs_all_seen"] and "CUDA_LAUNCH_BLOCKING=1" in s["syncs_hidden"][0]
    assert run.verdict != "HOST-BOUND"
    assert "CUDA_LAUNCH_BLOCKING=1" in run.verdict_detail.why
    # The same loop where NVML sees the GPU 97 % busy throughout: COMPUTE-BOUND.
    t = np.linspace(0.0, 30.0, 3000)
    busy = {"time_s": t, "gpu_util_pct": np.full(len(t), 97.0), "gpu_mem_used_mib": np.ones(len(t))}
    monkeypatch.setattr(nvml.GpuSamples, "columns", lambda self: busy)
    assert traced(ip, GPU_BOUND).verdict == "COMPUTE-BOUND"


def test_without_launch_blocking_the_same_host_pattern_is_still_host_bound(ip: Any, gpu: FakeGpu) -> None:
    """The control: Python between tiny kernels, every sync seen, no NVML: HOST-BOUND (warn)."""
    ip.user_ns["batches"] = [FakeTensor(400_000, pinned=True) for _ in range(24)]
    run = traced(
        ip,
        """\
        for batch in batches:
            x = batch.to("cuda", non_blocking=True)
            time.sleep(0.004)
            x.work(0.05)
        """,
    )
    assert run.summary["syncs_all_seen"] and run.summary["syncs_hidden"] == []
    assert (run.verdict, run.severity) == ("HOST-BOUND", "warn")


@pytest.mark.slow
def test_empty_cache_every_step_is_a_timed_wait_not_host_bound(ip: Any, gpu: FakeGpu) -> None:
    run = traced(
        ip,
        """\
        for batch in DataLoader(Slow(24, 0.0), batch_size=None):  # no wait: 8 ms of work a step
            x = batch.to("cuda", non_blocking=True)
            x.work(8.0)
            cuda.empty_cache()
        """,
    )
    top = run.result.gpu.sync_stalls["sites"][0]
    assert top["kinds"] == ["torch.cuda.empty_cache"] and top["call"] == "cuda.empty_cache()"
    assert run.summary["syncs_all_seen"]  # timed where it is called: seen
    assert run.verdict == "COMPUTE-BOUND"


def test_unseen_waits_from_the_allocator_and_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hidden_waits.at_loop_end({"num_alloc_retries": 0}, {"num_alloc_retries": 2}, 0)
    frees = hidden_waits.at_loop_end({"num_device_free": 1}, {"num_device_free": 4}, 0)
    assert frees and "3 time(s)" in frees[0]
    assert hidden_waits.at_loop_end({"num_device_free": 1}, {"num_device_free": 4}, 3) == []  # empty_cache: timed
    assert hidden_waits.allocator_frees(None) == {"num_alloc_retries": 0, "num_device_free": 0}
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    assert any("NCCL" in r for r in hidden_waits.at_loop_start())
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert hidden_waits.at_loop_start() == []


@pytest.mark.parametrize("record", ["ev = side.record_event()", "ev = cuda.Event(); ev.record()"])
def test_a_wait_event_prefetcher_is_followed_like_wait_stream(ip: Any, gpu: FakeGpu, record: str) -> None:
    """G2 with `wait_event`: a side-stream copy the loop's stream waits for at once, in a loop
    that syncs every step: the copy is step time, and H2D-BOUND names its line."""
    ip.user_ns.update(side=gpu.new_stream(0), big=FakeTensor(40_000_000, pinned=True))
    run = traced(
        ip,
        f"""\
        for i in range(20):  # traceml: loop
            with cuda.stream(side):
                x = big.to("cuda", non_blocking=True)
                {record}
            cuda.current_stream().wait_event(ev)
            x.work(1.0)
            v = x.item()
        """,
    )
    site = run.result.gpu.h2d["sites"][0]
    assert site["side_stream"] == site["copies"] and site["waited"] == site["copies"]
    assert site["waited_ms_per_step"] == pytest.approx(site["ms_per_step"], rel=0.1)  # 4 ms copies
    assert run.summary["h2d_ms"] == pytest.approx(4.0, rel=0.15)
    assert run.verdict == "H2D-BOUND" and "line 4 runs on a side stream" in run.verdict_detail.why


@pytest.mark.slow
def test_our_own_host_time_is_measured_and_taken_out_of_the_hosts_issue_time(ip: Any, gpu: FakeGpu) -> None:
    """Each CUDA call costs the host 50 µs here: 20 copies a step cost us 2 event records each.
    The host's issue time is the body's minus that; the user's own Python stays in it."""
    gpu.call_us = 50.0
    ip.user_ns["batch"] = {f"t{i}": FakeTensor(4_000, pinned=True) for i in range(20)}
    run = traced(
        ip,
        """\
        for i in range(30):  # traceml: loop
            xs = {k: t.to("cuda", non_blocking=True) for k, t in batch.items()}
            time.sleep(0.003)
            xs["t0"].work(0.1)
        """,
    )
    s = run.summary
    assert s["own_host_ms"] > 20 * 2 * 0.05  # at least the copies' two records each
    host = float(np.median(run.steps["compute_ms"][5:]))
    assert s["host_issue_ms"] < host - 20 * 2 * 0.05  # ours is out of the host's issue time
    assert s["host_issue_ms"] > 3.0 + 20 * 0.05  # the user's sleep and their own copies stay
    assert "own_host_ms" in run.to_dict()["steps"]
    if run.verdict == "HOST-BOUND":
        assert "traceml's own hooks took" in run.verdict_detail.why


def test_sync_warnings_cost_is_measured(ip: Any, gpu: FakeGpu) -> None:
    run = traced(
        ip,
        """\
        for i in range(20):  # traceml: loop
            x = FakeTensor(1000, device="cuda").work(0.5)
            implicit_sync(x)
        """,
    )
    assert run.result.gpu.sync_stalls["warning_us"] > 0
    assert run.summary["own_host_ms"] > 0
    assert SYNC_MESSAGE not in str(warnings.filters[:3])
