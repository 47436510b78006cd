"""HOST-BOUND and the sync stalls: the rule at its thresholds from synthetic columns, the GPU
backlog and the sync waits measured on a stand-in GPU, and the user's story through the magic
(a loop that starves the GPU from Python, and one that calls `.item()` every step)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from fake_gpu import FakeGpu, FakeTensor, HostClock
from helpers import gpu_fixture, run

import traceml_jupyter
from traceml_jupyter.analysis.summary import GPU_WORK_KEYS, summarize
from traceml_jupyter.analysis.verdict import diagnose, host_bound, sync_sentence
from traceml_jupyter.capture.gpu.gpu_watch import GpuWatch, gpu_watched
from traceml_jupyter.capture.gpu.syncs import SYNC_MESSAGE, call_text
from traceml_jupyter.capture.resources import nvml
from traceml_jupyter.run import Recording, Run

# -- the rule, from synthetic columns ----------------------------------------------------------


def gpu_columns(n: int, step: float = 10.0, wait: float = 0.0, **extra: float) -> dict[str, np.ndarray]:
    """`n` identical GPU-clock steps; `host` is the body's CPU time (default: the GPU body time);
    any other keyword is an optional column (h2d_ms, sync_ms, gpu_backlog_ms, gpu_util_pct...)."""
    compute = step - wait
    host = extra.pop("host", compute)

    def full(v: float) -> np.ndarray:
        return np.full(n, float(v))

    cols = {
        "step": np.arange(n),
        "time_s": np.arange(n) * step / 1000,
        "data_wait_ms": full(wait),
        "compute_ms": full(host),
        "step_ms": full(wait + host),
        "data_wait_gpu_ms": full(wait),
        "compute_gpu_ms": full(compute),
        "step_gpu_ms": full(step),
    }
    cols.update({name: full(value) for name, value in extra.items()})
    return cols


def verdict_of(n: int = 30, gpu: bool = True, seen: bool = True, **kw: float) -> tuple[str, str]:
    """The verdict of `n` identical steps; `seen`: every synchronising call was seen."""
    s = summarize(gpu_columns(n, **kw), n, 0, gpu)
    s["syncs_all_seen"] = seen
    v = diagnose(s)
    return v.label, v.severity


def test_gpu_idle_inside_steps_is_host_bound_from_ten_percent() -> None:
    # NVML: utilisation 90.1 % leaves 9.9 % idle; 90 % leaves 10 %.
    assert verdict_of(gpu_util_pct=90.1, gpu_backlog_ms=0.0) == ("COMPUTE-BOUND", "info")
    assert verdict_of(gpu_util_pct=90.0, gpu_backlog_ms=0.0) == ("HOST-BOUND", "warn")


def test_host_bound_is_critical_from_twenty_percent_with_twenty_steps() -> None:
    assert verdict_of(gpu_util_pct=80.1, gpu_backlog_ms=0.0) == ("HOST-BOUND", "warn")
    assert verdict_of(gpu_util_pct=80.0, gpu_backlog_ms=0.0) == ("HOST-BOUND", "critical")
    assert verdict_of(19, gpu_util_pct=50.0) == ("HOST-BOUND", "warn")
    assert verdict_of(20, gpu_util_pct=50.0) == ("HOST-BOUND", "critical")


def test_a_gpu_with_work_queued_at_step_end_is_not_waiting_on_the_host() -> None:
    # Backlog of 10 % of the step or more: the GPU is behind, whatever NVML says.
    assert verdict_of(gpu_util_pct=50.0, gpu_backlog_ms=0.99)[0] == "HOST-BOUND"
    assert verdict_of(gpu_util_pct=50.0, gpu_backlog_ms=1.0)[0] == "COMPUTE-BOUND"


def test_a_millisecond_of_backlog_means_the_gpu_was_behind_however_long_the_step() -> None:
    # A 200 ms step of 5k kernels throttled by the launch queue: 1 024 queued kernels are a
    # few ms of backlog, far under 10 % of the step, and the host is blocked in launches.
    assert verdict_of(step=200.0, gpu_util_pct=50.0, gpu_backlog_ms=0.9)[0] == "HOST-BOUND"
    assert verdict_of(step=200.0, gpu_util_pct=50.0, gpu_backlog_ms=1.0)[0] == "COMPUTE-BOUND"
    assert verdict_of(step=200.0, gpu_backlog_ms=4.0, host=190.0, sync_ms=0.0)[0] == "COMPUTE-BOUND"


def test_a_host_that_waits_in_syncs_is_not_what_holds_the_gpu_back() -> None:
    assert verdict_of(gpu_util_pct=50.0, gpu_backlog_ms=0.0, sync_ms=0.99)[0] == "HOST-BOUND"
    assert verdict_of(gpu_util_pct=50.0, gpu_backlog_ms=0.0, sync_ms=1.0)[0] == "COMPUTE-BOUND"


def test_without_nvml_a_host_that_sets_the_pace_is_a_warning_only() -> None:
    # No backlog, every sync seen and timed, and the host issues work for at least half of the
    # step (body minus syncs).
    assert verdict_of(gpu_backlog_ms=0.5, host=5.0, sync_ms=0.0) == ("HOST-BOUND", "warn")
    assert verdict_of(gpu_backlog_ms=0.5, host=4.99, sync_ms=0.0)[0] != "HOST-BOUND"
    assert verdict_of(gpu_backlog_ms=0.5, host=9.0, sync_ms=0.0, gpu_util_pct=95.0)[0] == "COMPUTE-BOUND"


def test_without_nvml_anything_hidden_means_cant_tell_not_host_bound() -> None:
    # Some syncs were not counted (the user's own sync debug mode, or too many warnings).
    assert verdict_of(gpu_backlog_ms=0.5, host=9.0, sync_ms=0.0, seen=False)[0] == "MIXED"
    # Syncs not watched at all, or no backlog probe.
    assert verdict_of(gpu_backlog_ms=0.5, host=9.0)[0] == "MIXED"
    assert verdict_of(host=9.0, sync_ms=0.0)[0] == "MIXED"
    # An untimed wait for the GPU (torch.nonzero) in every step: the host's time is unknown.
    assert verdict_of(gpu_backlog_ms=0.5, host=9.0, sync_ms=0.0, sync_untimed=1.0)[0] == "MIXED"


def test_untimed_syncs_make_the_hosts_issue_time_unknown() -> None:
    cols = gpu_columns(30, gpu_backlog_ms=0.0, host=9.0, sync_ms=0.0, sync_untimed=0.0)
    cols["sync_untimed"][:14] = 2.0  # 14 of 30 steps waited untimed: the other 16 tell
    s = summarize(cols, 30, 0, True)
    assert s["untimed_sync_share"] == pytest.approx(14 / 30) and s["host_issue_ms"] == 9.0
    cols["sync_untimed"][:16] = 1.0  # most steps waited untimed: unknown
    s = summarize(cols, 30, 0, True)
    assert s["host_issue_ms"] is None


def test_compute_bound_on_the_gpu_clock_needs_evidence_of_gpu_work() -> None:
    # The body's GPU-timeline span is 100 % of the step; nothing shows the GPU worked in it.
    s = summarize(gpu_columns(30, host=2.0, gpu_backlog_ms=0.01), 30, 0, True)
    v = diagnose(s)
    assert v.label == "MIXED" and "GPU busy is unknown" in v.why
    assert "GPU-timeline span of the step body" in v.why and "nvidia-ml-py" in v.next
    # Any of: utilisation >= 90 %, a backlog, the host waiting for the GPU.
    for extra in ({"gpu_util_pct": 95.0}, {"gpu_backlog_ms": 3.0}, {"sync_ms": 2.0}):
        v = diagnose(summarize(gpu_columns(30, host=2.0, **extra), 30, 0, True))
        assert v.label == "COMPUTE-BOUND", extra
        assert "GPU-timeline span of the step body" in v.why
    # The CPU clock needs none: its compute is the host's own time.
    assert diagnose(summarize(gpu_columns(30), 30, 0, False)).label == "COMPUTE-BOUND"


def test_host_bound_needs_the_gpu_clock_and_leaves_the_cpu_verdicts_alone() -> None:
    assert verdict_of(gpu=False, gpu_util_pct=10.0, gpu_backlog_ms=0.0) == ("COMPUTE-BOUND", "info")
    s = summarize(gpu_columns(30, gpu_util_pct=10.0, h2d_ms=5.0), 30, 0, False)
    assert s["clock"] == "cpu"
    assert all(s[key] is None for key in GPU_WORK_KEYS)


def test_input_and_copies_come_before_the_host() -> None:
    assert verdict_of(wait=2.0, gpu_util_pct=10.0, gpu_backlog_ms=0.0)[0] == "INPUT-BOUND"
    assert verdict_of(h2d_ms=3.0, gpu_util_pct=10.0, gpu_backlog_ms=0.0)[0] == "H2D-BOUND"


def test_idle_share_takes_out_the_data_wait_and_the_copies() -> None:
    s = summarize(gpu_columns(30, wait=0.5, gpu_util_pct=70.0, h2d_ms=0.5), 30, 0, True)
    assert s["host_share"] == pytest.approx(0.3 - 0.05 - 0.05)
    assert host_bound(s) == "critical"


def test_unmeasured_columns_give_none_never_zero() -> None:
    s = summarize(gpu_columns(30, sync_ms=np.nan, gpu_backlog_ms=np.nan, gpu_util_pct=np.nan), 30, 0, True)
    assert s["sync_ms"] is None and s["gpu_backlog_ms"] is None and s["gpu_busy_share"] is None
    assert s["host_issue_ms"] is None  # the body minus an unknown wait is unknown
    s = summarize(gpu_columns(30, sync_ms=0.0), 30, 0, True)
    assert s["sync_ms"] == 0.0 and s["host_issue_ms"] == 10.0


def test_the_host_bound_verdict_gives_the_numbers_and_the_checklist() -> None:
    s = summarize(gpu_columns(30, host=9.0, gpu_util_pct=40.0, gpu_backlog_ms=0.02, sync_ms=0.1, sync_calls=1.0), 30, 0, True)
    s["sync_top"] = {
        "line": 7,
        "in_cell": True,
        "call": "loss.item()",
        "calls_per_step": 1.0,
        "every_step": True,
        "wait_ms_per_step": 0.1,
        "share": 0.31,
    }
    v = diagnose(s)
    assert v.label == "HOST-BOUND" and v.severity == "critical"
    assert "idles 60.0 % of the step" in v.why and "NVML utilisation 40.0 %" in v.why
    assert "`loss.item()` on line 7 synchronises every step: the host waits there 31.0 % of the step." in v.why
    for advice in ("larger batch", "mixed precision", "torch.compile", "CUDA graphs", "fewer small ops", ".item()"):
        assert advice in v.next
    rows = dict(v.evidence)
    assert rows["GPU backlog at step end (median)"] == "0.0 ms"
    assert rows["Syncs per step (median)"] == "1"


def test_sync_sentence_says_how_often() -> None:
    top = {"line": 4, "in_cell": True, "call": "x.cpu()", "calls_per_step": 0.25, "every_step": False, "share": None}
    assert sync_sentence(top) == "`x.cpu()` on line 4 synchronises 0.25 times per step."
    assert sync_sentence({**top, "every_step": True, "calls_per_step": 3.0}) == (
        "`x.cpu()` on line 4 synchronises 3 times every step."
    )
    assert sync_sentence({**top, "in_cell": False}) is None and sync_sentence(None) is None


def test_call_text_finds_the_syncing_call_on_the_line() -> None:
    source = "%%traceml --name a\nfor x in data:\n    print(f'{loss.item():.3f}', x.mean())\n    y = x\n"
    assert call_text(source, 3) == "loss.item()"
    assert call_text(source, 4) == "y = x"
    assert call_text(source, 99) is None


# -- the measurements, on a stand-in GPU with a fake clock ------------------------------------


class Loop:
    """What the capture tells the watch: the step being run on its thread (None between)."""

    def __init__(self, run: Recording) -> None:
        self.step: int | None = None
        run.current_step = lambda: self.step  # type: ignore[method-assign]


def watched_run(gpu: FakeGpu, clock: HostClock) -> tuple[Recording, GpuWatch, Loop]:
    run = Run().recording
    run.cell_filename = "<cell>"
    run.cell_source = "%%traceml\nfor x in data:\n    y = x.item()\n    z = f(y)\n"
    loop = Loop(run)
    watch = GpuWatch(run, gpu.api(), clock)
    run.gpu_watch = watch
    return run, watch, loop


def step(run: Recording, loop: Loop, clock: HostClock, host_ms: float, gpu: FakeGpu, gpu_ms: float) -> None:
    loop.step = run.recorder.n_steps
    t0 = clock()
    gpu.launch(gpu_ms)
    clock.sleep(host_ms * 1e6)
    run.recorder.add(t0, t0, clock())
    loop.step = None
    run.gpu_watch.step_ended(clock())


def test_backlog_is_how_far_the_gpu_is_behind_when_a_step_ends() -> None:
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock, drift=2e-4)  # the GPU's timer runs 200 ppm fast
    run, watch, loop = watched_run(gpu, clock)
    watch.loop_started(0)
    for _ in range(40):  # each step queues 5 ms of GPU work in 1 ms of host time
        step(run, loop, clock, 1.0, gpu, 5.0)
    watch.close()
    cols = run.columns()
    probed = np.isfinite(cols["gpu_backlog_ms"])
    assert cols["step"][probed].tolist() == list(range(3, 40, 4))  # every 4th step end
    expected = 4.0 * (cols["step"][probed] + 1)  # 4 ms more behind after each step
    assert np.allclose(cols["gpu_backlog_ms"][probed], expected, rtol=1e-3)
    assert watch.drift == pytest.approx(2e-4, rel=1e-6)


def test_a_gpu_that_keeps_up_has_no_backlog() -> None:
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock)
    run, watch, loop = watched_run(gpu, clock)
    watch.loop_started(0)
    for _ in range(20):  # 5 ms of Python for 0.1 ms of GPU work
        step(run, loop, clock, 5.0, gpu, 0.1)
    watch.close()
    backlog = run.columns()["gpu_backlog_ms"]
    assert np.nanmax(backlog) == 0.0 and np.isfinite(backlog).sum() == 5


def test_item_waits_are_timed_and_implicit_syncs_counted_on_their_lines() -> None:
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock)
    FakeTensor.gpu = gpu
    run, watch, loop = watched_run(gpu, clock)
    original_item = FakeTensor.__dict__["item"]
    assert run.gpu_watch is watch and FakeTensor.__dict__["item"] is original_item  # not yet
    watch.loop_started(0)
    assert FakeTensor.__dict__["item"] is not original_item
    code = compile("y = x.item()\nz = f(y)\n", "<cell>", "exec")
    x = FakeTensor(device="cuda")
    try:
        for k in range(10):
            loop.step = k
            gpu.launch(3.0)  # the step's work; .item() waits for it
            exec(code, {"x": x, "f": lambda y: gpu.warn_sync()})
            run.recorder.add(clock(), clock(), clock())
        loop.step = None
    finally:
        watch.close()
    assert FakeTensor.__dict__["item"] is original_item
    assert gpu.sync_mode == 0
    stalls = run.sync_stalls
    assert stalls is not None
    sites = {s["line"]: s for s in stalls["sites"]}
    item, implicit = sites[1], sites[2]
    assert item["kinds"] == ["item"] and item["calls_per_step"] == 1.0 and item["every_step"]
    assert item["wait_ms_per_step"] == pytest.approx(3.0)
    assert implicit["kinds"] == ["implicit"] and implicit["wait_ms_per_step"] is None
    cols = run.columns()
    assert cols["sync_calls"].tolist() == [2.0] * 10
    assert cols["sync_untimed"].tolist() == [1.0] * 10
    assert np.allclose(cols["sync_ms"], 3.0)
    assert stalls["counted_implicit"] is True
    assert run.watch_summary["syncs_all_seen"] is True


def test_sync_counting_stops_after_many_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    from traceml_jupyter.capture.gpu import syncs

    monkeypatch.setattr(syncs, "MAX_SYNC_WARNINGS", 3)
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock)
    FakeTensor.gpu = gpu
    run, watch, loop = watched_run(gpu, clock)
    watch.loop_started(0)
    code = compile("z = f(x)\n", "<cell>", "exec")
    try:
        for k in range(5):
            loop.step = k
            assert watch.syncs is not None
            assert gpu.sync_mode == (1 if watch.syncs.warnings < 3 else 0)
            exec(code, {"x": FakeTensor(device="cuda"), "f": lambda t: gpu.warn_sync()})
            run.recorder.add(clock(), clock(), clock())
    finally:
        loop.step = None
        watch.close()
        FakeTensor.gpu = None
    assert run.sync_stalls is not None and run.sync_stalls["calls"] == 3
    assert any("first 3" in note for note in run.notes) and gpu.sync_mode == 0
    # Syncs went uncounted after that: the host's issue time can no longer be trusted.
    assert run.watch_summary["syncs_all_seen"] is False


def test_nothing_is_timed_while_torch_compile_traces() -> None:
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock)
    FakeTensor.gpu = gpu
    run, watch, loop = watched_run(gpu, clock)
    assert watch.api is not None
    watch.api.compiling = lambda: True
    watch.loop_started(0)
    loop.step = 0
    try:
        x = FakeTensor()
        assert x.to("cuda").is_cuda and x.to("cuda").item() == 0.5
    finally:
        loop.step = None
        watch.close()
        FakeTensor.gpu = None
    assert run.h2d is not None and run.h2d["copies"] == 0  # no copy timed
    assert watch.syncs is not None
    assert all(site.timed == 0 for site in watch.syncs.sites.values())  # no wait timed
    # The fake still warned of its syncs: with no cell frame, they count where they came from.
    assert {site.filename.rsplit("/", 1)[-1] for site in watch.syncs.sites.values()} == {"fake_gpu.py"}


def test_the_users_own_sync_debug_mode_is_left_alone() -> None:
    clock = HostClock(fake=True)
    gpu = FakeGpu(clock)
    gpu.sync_mode = 2  # "error": the user wants to find syncs themselves
    run, watch, loop = watched_run(gpu, clock)
    watch.loop_started(0)
    assert gpu.sync_mode == 2 and not watch.counting_sync_warnings
    watch.close()
    assert gpu.sync_mode == 2
    assert run.watch_summary["syncs_all_seen"] is False  # untimed syncs were not counted


def test_a_loop_that_never_runs_on_cuda_patches_nothing() -> None:
    gpu = FakeGpu(HostClock(fake=True))
    run = Run().recording
    before = dict(FakeTensor.__dict__)
    with gpu_watched(run, gpu.api()) as watch:
        assert run.gpu_watch is watch
        assert dict(FakeTensor.__dict__) == before
    assert run.gpu_watch is None and run.h2d is None and run.sync_stalls is None
    assert run.extra_columns == {}


def test_without_cuda_the_watch_stays_dormant_and_touches_nothing() -> None:
    import torch

    run = Run().recording
    before = dict(torch.Tensor.__dict__)
    with gpu_watched(run) as watch:  # this machine has no CUDA device: nothing initialised
        assert run.gpu_watch is watch and watch.api is None
        assert dict(torch.Tensor.__dict__) == before
    assert run.h2d is None and run.sync_stalls is None and run.extra_columns == {}
    # Started anyway (a core that thought CUDA was in use): a note, nothing patched.
    with gpu_watched(run) as watch:
        watch.loop_started(0)
        assert dict(torch.Tensor.__dict__) == before
    assert any("CUDA is not initialised" in note for note in run.notes)


# -- the user's story, through the magic, on the stand-in GPU ---------------------------------

SETUP = """
import time
from fake_gpu import FakeTensor, implicit_sync
batches = [FakeTensor(400_000, pinned=True) for _ in range(30)]
"""


gpu = gpu_fixture()


def traced(ip: Any, cell: str) -> Any:
    ip.run_cell(SETUP)
    run(ip, cell, check=True)
    got = traceml_jupyter.last()
    assert got is not None
    return got


STARVED = """\
    %%traceml --no-live --name starved
    for x in batches:
        xg = x.to("cuda", non_blocking=True)
        time.sleep(0.003)  # Python between tiny kernels
        y = xg.work(0.05)
    """


@pytest.mark.slow
def test_python_that_starves_the_gpu_is_host_bound(ip: Any, gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch) -> None:
    run = traced(ip, STARVED)
    assert run.clock == "gpu"
    s = run.summary
    assert s["gpu_backlog_ms"] == pytest.approx(0.0, abs=0.05)
    assert s["host_issue_ms"] > 0.5 * s["step_ms"]
    assert (run.verdict, run.severity) == ("HOST-BOUND", "warn")  # no NVML: how idle is unknown
    assert "GPU utilisation is unknown" in run.verdict_detail.why
    # NVML samples (the GPU 20 % busy all along) make it quantitative.
    t = np.linspace(0.0, 30.0, 3000)
    idle = {"time_s": t, "gpu_util_pct": np.full(len(t), 20.0), "gpu_mem_used_mib": np.ones(len(t))}
    monkeypatch.setattr(nvml.GpuSamples, "columns", lambda self: idle)
    run = traced(ip, STARVED)
    assert (run.verdict, run.severity) == ("HOST-BOUND", "critical")
    assert run.summary["gpu_busy_share"] == pytest.approx(0.2)


@pytest.mark.slow
def test_item_every_step_is_named_on_its_line(ip: Any, gpu: FakeGpu) -> None:
    run = traced(
        ip,
        """\
        %%traceml --no-live --name item
        for x in batches:
            xg = x.to("cuda", non_blocking=True)
            loss = xg.work(6.0)
            print(f"{loss.item():.2f}", end="")
            implicit_sync(loss)
        """,
    )
    assert run.clock == "gpu"
    top = run.result.gpu.sync_stalls["sites"][0]
    assert (top["line"], top["call"], top["every_step"]) == (5, "loss.item()", True)
    assert top["share"] > 0.5  # the host waits there for the GPU's 6 ms
    assert [s["line"] for s in run.result.gpu.sync_stalls["sites"]] == [5, 6]  # the capture's own waits are not
    implicit = next(s for s in run.result.gpu.sync_stalls["sites"] if s["line"] == 6)
    assert implicit["kinds"] == ["implicit"] and implicit["calls_per_step"] == 1.0
    assert run.summary["sync_top"]["call"] == "loss.item()"
    assert run.summary["sync_calls"] == 2.0
    # The GPU is busy while the host waits: not the host's fault.
    assert run.verdict == "COMPUTE-BOUND"
    assert SYNC_MESSAGE not in str(warnings.filters[:3])
    saved = run.to_dict()
    assert saved["sync_stalls"]["sites"][0]["line"] == 5 and "sync_ms" in saved["steps"]


@pytest.mark.slow
def test_a_busy_gpu_is_not_host_bound(ip: Any, gpu: FakeGpu) -> None:
    run = traced(
        ip,
        """\
        %%traceml --no-live --name busy
        for x in batches:
            xg = x.to("cuda", non_blocking=True)
            y = xg.work(8.0)
        """,
    )
    assert run.clock == "gpu"
    assert run.summary["gpu_backlog_ms"] > 0.5 * run.summary["step_ms"]
    assert run.verdict == "COMPUTE-BOUND"
