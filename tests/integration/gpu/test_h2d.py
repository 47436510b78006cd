"""H2D-BOUND: the rule at its thresholds from synthetic columns, copies timed and attributed on
a stand-in GPU, `Tensor.to`/`.cuda` always restored, and the user's story through the magic
(large pageable batches copied with blocking `.to(device)`, then the fix)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from fake_gpu import FakeGpu, FakeTensor, HostClock
from helpers import gpu_fixture, run
from IPython.utils.capture import capture_output
from test_host_bound import gpu_columns

import traceml_jupyter
from traceml_jupyter.analysis.summary import summarize
from traceml_jupyter.analysis.verdict import diagnose
from traceml_jupyter.capture.gpu.copy_calls import non_blocking_of, target_is_cuda
from traceml_jupyter.capture.gpu.h2d import CopyWatch, copies_timed
from traceml_jupyter.capture.gpu.syncs import SYNC_METHODS, SyncWatch, syncs_timed

TENSOR_ATTRS = ("to", "cuda", *SYNC_METHODS)


@pytest.fixture(autouse=True)
def torch_tensor_untouched() -> Iterator[None]:
    """No test may leave torch.Tensor's methods patched (the conftest guard checks loaders)."""
    before = {name: torch.Tensor.__dict__.get(name) for name in TENSOR_ATTRS}
    to, cuda = torch.Tensor.to, torch.Tensor.cuda
    yield
    assert {name: torch.Tensor.__dict__.get(name) for name in TENSOR_ATTRS} == before
    assert torch.Tensor.to is to and torch.Tensor.cuda is cuda


# -- the rule ---------------------------------------------------------------------------------


def verdict_of(h2d_ms: float, n: int = 30, gpu: bool = True) -> tuple[str, str]:
    # The GPU is 2 ms behind when steps end: busy, so COMPUTE-BOUND below the H2D threshold.
    v = diagnose(summarize(gpu_columns(n, h2d_ms=h2d_ms, h2d_bytes=8e6, gpu_backlog_ms=2.0), n, 0, gpu))
    return v.label, v.severity


def test_copies_are_h2d_bound_from_ten_percent_of_the_step() -> None:
    assert verdict_of(0.99) == ("COMPUTE-BOUND", "info")
    assert verdict_of(1.0) == ("H2D-BOUND", "warn")


def test_h2d_bound_is_critical_from_twenty_percent_with_twenty_steps() -> None:
    assert verdict_of(1.99) == ("H2D-BOUND", "warn")
    assert verdict_of(2.0) == ("H2D-BOUND", "critical")
    assert verdict_of(5.0, n=19) == ("H2D-BOUND", "warn")
    assert verdict_of(5.0, n=20) == ("H2D-BOUND", "critical")


def test_h2d_bound_needs_the_gpu_clock() -> None:
    assert verdict_of(5.0, gpu=False) == ("COMPUTE-BOUND", "info")


def test_the_h2d_verdict_gives_bytes_bandwidth_pinning_and_the_lines() -> None:
    cols = gpu_columns(30, h2d_ms=4.0, h2d_bytes=20e6, h2d_pinned_bytes=0.0, h2d_async_bytes=0.0)
    s = summarize(cols, 30, 0, True)
    s["h2d_lines"] = [4, 5]
    assert s["h2d_gbps"] == pytest.approx(5.0)
    v = diagnose(s)
    assert v.label == "H2D-BOUND" and v.severity == "critical"
    assert "40.0 % of each step" in v.why and "20.0 MB per step at 5.0 GB/s" in v.why
    assert "(pageable memory, blocking)" in v.why
    assert "pin_memory=True" in v.next and ".to(device, non_blocking=True) on lines 4, 5" in v.next
    rows = dict(v.evidence)
    assert rows["Copied per step"] == "20.0 MB" and rows["Effective bandwidth"] == "5.0 GB/s"
    assert rows["Pinned memory"] == "0.0 %" and rows["Copy lines"] == "4, 5"


def test_pinned_and_non_blocking_shares_are_by_bytes() -> None:
    cols = gpu_columns(30, h2d_ms=0.5, h2d_bytes=4e6, h2d_pinned_bytes=3e6, h2d_async_bytes=4e6)
    s = summarize(cols, 30, 0, True)
    assert s["h2d_pinned_share"] == pytest.approx(0.75) and s["h2d_non_blocking_share"] == 1.0
    assert s["h2d_share"] == pytest.approx(0.05)


# -- reading a .to(...) call ------------------------------------------------------------------


def test_which_calls_copy_to_a_cuda_device() -> None:
    assert target_is_cuda(("cuda",), {}) and target_is_cuda(("cuda:1",), {})
    assert target_is_cuda((torch.device("cuda", 0),), {}) and target_is_cuda((0,), {})
    assert target_is_cuda((), {"device": "cuda", "dtype": torch.float16})
    assert target_is_cuda((FakeTensor(device="cuda"),), {})
    assert not target_is_cuda((torch.float16,), {}) and not target_is_cuda(("cpu",), {})
    assert not target_is_cuda((torch.device("cpu"),), {}) and not target_is_cuda((), {})
    assert not target_is_cuda((True,), {})


def test_non_blocking_by_keyword_or_position() -> None:
    assert non_blocking_of(("cuda",), {"non_blocking": True})
    assert non_blocking_of(("cuda", torch.float16, True), {})
    assert non_blocking_of((0, True), {})  # .cuda(0, True)
    assert not non_blocking_of(("cuda", None, False, True), {})  # copy=True, not non_blocking
    assert not non_blocking_of(("cuda",), {})


# -- copies on the stand-in GPU ---------------------------------------------------------------


def test_copies_are_timed_per_step_and_per_line() -> None:
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock)
    FakeTensor.gpu = gpu
    steps: list[int | None] = [None]
    watch = CopyWatch(lambda: steps[0], gpu.event, "<cell>")
    syncs = SyncWatch(lambda: steps[0], "<cell>", clock)
    watch.watch_from(0)
    code = compile(
        "a = x.to('cuda')\nb = p.cuda(non_blocking=True)\nc = x.to(dtype=None)\n", "<cell>", "exec"
    )
    x, p = FakeTensor(10_000_000), FakeTensor(20_000_000, pinned=True)
    original_to = FakeTensor.__dict__["to"]
    try:
        with copies_timed(watch, FakeTensor, syncs.synced, syncs.inside, clock):
            exec(code, {"x": x, "p": p})  # outside the loop: not counted
            for k in range(5):
                steps[0] = k
                exec(code, {"x": x, "p": p})
                gpu.launch(1.0)
            steps[0] = None
            watch.synchronize()
    finally:
        FakeTensor.gpu = None
    assert FakeTensor.__dict__["to"] is original_to
    result = watch.result(5)
    sites = {s["line"]: s for s in result["sites"]}
    assert set(sites) == {1, 2}  # the dtype-only .to(...) copies nothing
    pageable, pinned = sites[1], sites[2]
    assert pageable["copies_per_step"] == 1.0 and pageable["bytes_per_step"] == 10_000_000
    assert pageable["ms_per_step"] == pytest.approx(2.0)  # 10 MB at 5 GB/s
    assert pageable["gb_per_s"] == pytest.approx(5.0) and pageable["pinned"] == 0
    assert pinned["ms_per_step"] == pytest.approx(2.0) and pinned["gb_per_s"] == pytest.approx(10.0)
    assert pinned["pinned"] == 5 and pinned["non_blocking"] == 5 and pageable["non_blocking"] == 0
    steps_col = np.arange(5)
    assert watch.tallies["h2d_ms"].column(steps_col) == pytest.approx([4.0] * 5)
    assert watch.tallies["h2d_bytes"].column(steps_col).tolist() == [30e6] * 5
    assert watch.tallies["h2d_pinned_bytes"].column(steps_col).tolist() == [20e6] * 5
    assert watch.tallies["h2d_async_bytes"].column(steps_col).tolist() == [20e6] * 5
    # The blocking copy made the host wait (the stream's previous step, then the copy itself);
    # its sync warning was not counted twice.
    assert {s.line for s in syncs.sites.values()} == {1}
    assert syncs.sites[("<cell>", 1)].kinds == {"blocking copy"}
    assert syncs.tallies["sync_calls"].column(steps_col).tolist() == [1.0] * 5


def test_real_tensor_methods_are_restored_and_cpu_work_passes_through() -> None:
    steps: list[int | None] = [0]
    made: list[Any] = []
    watch = CopyWatch(lambda: steps[0], lambda: made.append(1), "<cell>")
    syncs = SyncWatch(lambda: steps[0], "<cell>")
    t = torch.arange(4.0)
    with copies_timed(watch, torch.Tensor, syncs.synced, syncs.inside):
        with syncs_timed(syncs, torch.Tensor):
            assert "to" in torch.Tensor.__dict__ and "item" in torch.Tensor.__dict__
            assert t.to(torch.float64).dtype == torch.float64
            assert t.to("cpu") is t and t[1].item() == 1.0 and t.tolist() == [0.0, 1.0, 2.0, 3.0]
            assert bool(t[1]) and float(t[2]) == 2.0 and int(t[3]) == 3 and t.cpu() is t
            assert torch.Tensor.to.__doc__ == torch._C.TensorBase.to.__doc__
    assert not made and not watch.sites and not syncs.sites  # CPU tensors: nothing timed
    assert "to" not in torch.Tensor.__dict__ and "item" not in torch.Tensor.__dict__


def test_methods_are_restored_after_an_error_inside() -> None:
    watch = CopyWatch(lambda: 0, lambda: None, "<cell>")
    syncs = SyncWatch(lambda: 0, "<cell>")
    with pytest.raises(ZeroDivisionError):
        with copies_timed(watch, torch.Tensor), syncs_timed(syncs, torch.Tensor):
            1 / 0  # noqa: B018


# -- the user's story -------------------------------------------------------------------------

SETUP = """
from fake_gpu import FakeTensor
pageable = [FakeTensor(20_000_000) for _ in range(30)]  # float32 images, pageable memory
compact = [FakeTensor(5_000_000, pinned=True) for _ in range(30)]  # uint8, pinned
"""


gpu = gpu_fixture()


def traced(ip: Any, cell: str) -> tuple[Any, str]:
    ip.run_cell(SETUP)
    result = run(ip, cell, check=True)
    got = traceml_jupyter.last()
    assert got is not None
    return got, result.shown


@pytest.mark.slow
def test_large_pageable_batches_are_h2d_bound(ip: Any, gpu: FakeGpu) -> None:
    run, shown = traced(
        ip,
        """\
        %%traceml --no-live --name pageable
        for x in pageable:
            y = x.work(1.0)
            x = x.to("cuda")
            y = x.work(1.0)
        """,
    )
    assert run.clock == "gpu"
    assert (run.verdict, run.severity) == ("H2D-BOUND", "critical")  # 4 ms of a 6 ms step
    s = run.summary
    # 20 MB at 5 GB/s, plus the host's return from the blocking copy before the end event
    assert s["h2d_bytes"] == 20_000_000 and s["h2d_gbps"] == pytest.approx(5.0, rel=0.15)
    assert s["h2d_pinned_share"] == 0.0 and s["h2d_non_blocking_share"] == 0.0
    assert s["h2d_lines"] == [4]
    assert "on line 4" in run.verdict_detail.next
    assert "|  Step Time: H2D-BOUND" in shown and "GPU compute:" in shown
    site = run.result.gpu.h2d["sites"][0]
    assert (site["line"], site["in_cell"], site["copies_per_step"]) == (4, True, 1.0)
    saved = run.to_dict()
    assert saved["h2d"]["sites"][0]["line"] == 4 and "h2d_ms" in saved["steps"]
    assert saved["verdict"]["label"] == "H2D-BOUND"


@pytest.mark.slow
def test_pinned_compact_non_blocking_copies_fix_it(ip: Any, gpu: FakeGpu) -> None:
    run, _ = traced(
        ip,
        """\
        %%traceml --no-live --name fixed
        for x in compact:
            x = x.cuda(non_blocking=True)
            y = x.work(8.0)
        """,
    )
    assert run.clock == "gpu"
    assert run.verdict != "H2D-BOUND"
    s = run.summary
    assert s["h2d_share"] < 0.1 and s["h2d_pinned_share"] == 1.0 and s["h2d_non_blocking_share"] == 1.0


@pytest.mark.slow
def test_a_cpu_machine_patches_nothing_and_measures_no_copies(ip: Any) -> None:
    ip.run_cell("import torch\nxs = [torch.ones(4) for _ in range(12)]")
    with capture_output():
        ip.run_cell("%%traceml --no-live\nfor x in xs:\n    y = x.to(torch.float64).sum().item()\n")
    run = traceml_jupyter.last()
    assert run is not None and run.result.gpu.h2d is None and run.result.gpu.sync_stalls is None
    assert run.summary["h2d_ms"] is None and "h2d_ms" not in run.steps
