"""The GPU watches where CUDA is hard to get right, on the stand-in GPU (tests/fake_gpu.py):
several devices and streams, event device affinity, elapsed_time on incomplete events, sticky
CUDA errors, launch latency and a bounded launch queue, float32 event times, NVML's averaging
window, MIG and shared GPUs (the cases of ../shared/reviews/gpu-review.md).

The watch runs as the capture runs it: `loop_started(device)` once on the loop's thread, the
step index from `run.current_step()`, `step_ended(t)` after each step. The step's own GPU
timings come from a pair of events per step (the capture core's job, cuda_clock.py)."""

from __future__ import annotations

import gc
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fake_gpu import CudaError, FakeEvent, FakeGpu, FakeNvml, FakeTensor, HostClock, implicit_sync

from traceml_jupyter.analysis.summary import summarize
from traceml_jupyter.analysis.verdict import diagnose
from traceml_jupyter.capture.gpu.gpu_watch import GpuWatch, costliest_host_line
from traceml_jupyter.capture.inside.line_costs import CudaLineClock, Statement
from traceml_jupyter.capture.resources import nvml as nvml_module
from traceml_jupyter.capture.resources.nvml import GpuSampler, at_steps
from traceml_jupyter.run import Run


class Bench:
    """A traced loop on the stand-in GPU: the user's body is cell code (line 1 is %%traceml),
    run as steps on this thread; the watch sees what the capture would show it."""

    def __init__(self, gpu: FakeGpu, body: str, device: int = 0, names: dict[str, Any] | None = None) -> None:
        self.gpu, self.clock, self.device = gpu, gpu.clock, device
        source = "%%traceml\n" + textwrap.dedent(body).strip("\n") + "\n"
        self.code = compile("\n" + textwrap.dedent(body).strip("\n") + "\n", "<cell>", "exec")
        self.names: dict[str, Any] = {"gpu": gpu, "cuda": gpu.module, "FakeTensor": FakeTensor}
        self.names.update(names or {})
        self.handle = Run()
        run = self.run = self.handle.recording
        run.recorder.origin_ns = self.clock()
        run.cell_filename, run.cell_source = "<cell>", source
        self.step: int | None = None
        run.current_step = lambda: self.step  # type: ignore[method-assign]
        run.capture_thread = threading.get_ident()
        run.cuda_device = device
        run.gpu_used = True
        self.watch = GpuWatch(run, gpu.api(device=device), self.clock)
        run.gpu_watch = self.watch
        self._events: list[tuple[int, FakeEvent, FakeEvent]] = []

    def start(self) -> Bench:
        self.watch.loop_started(self.device)
        return self

    def steps(self, n: int, fetch_ms: float = 0.0) -> Bench:
        gpu, clock = self.gpu, self.clock
        for _ in range(n):
            k = self.run.recorder.n_steps
            self.step = k
            stream = gpu.current_stream(self.device)
            t0 = clock()
            clock.sleep(fetch_ms * 1e6)
            start = gpu.event()
            start.record(stream)
            t1 = clock()
            self.names["k"] = k
            exec(self.code, self.names)
            end = gpu.event()
            end.record(stream)
            self.run.recorder.add(t0, t1, clock())
            self._events.append((k, start, end))
            self.watch.step_ended(clock())
        self.step = None
        return self

    def close(self) -> Run:
        gpu = self.gpu
        gpu.synchronize(self.device)
        for k, start, end in self._events:  # the capture core's GPU step timings
            self.run.recorder.add_gpu(k, 0.0, start.elapsed_time(end))
        self._events.clear()
        self.watch.close()
        return self.handle.finish()


@pytest.fixture()
def fake_clock() -> HostClock:
    return HostClock(fake=True)


@pytest.fixture(autouse=True)
def tensors_on(fake_clock: HostClock) -> Iterator[None]:
    yield
    FakeTensor.gpu = None


def machine(clock: HostClock, **kw: Any) -> FakeGpu:
    gpu = FakeGpu(clock, **kw)
    FakeTensor.gpu = gpu
    return gpu


# -- events per device and per thread -------------------------------------------------------


def test_a_dataparallel_replica_thread_copying_to_its_device_passes_through(fake_clock: HostClock) -> None:
    """A replica's forward runs in its own thread under `device(1)` and `stream(s1)` and moves a
    CPU tensor to its device (`torch.arange(T).to(x.device)`): never timed, never raises."""
    gpu = machine(fake_clock, devices=2)
    errors: list[BaseException] = []

    def replica() -> None:
        try:
            with gpu.module.device(1), gpu.module.stream(gpu.new_stream(1)):
                for _ in range(3):
                    FakeTensor(1000).to("cuda:1").work(0.1).item()
        except BaseException as exc:
            errors.append(exc)

    bench = Bench(gpu, "x = batch.to('cuda', non_blocking=True).work(2.0)\nt = threading.Thread(target=replica)\nt.start(); t.join()", names={"batch": FakeTensor(4000, pinned=True), "replica": replica, "threading": threading})
    bench.start().steps(6)
    run = bench.close()
    assert not errors
    assert run.result.gpu.h2d is not None and run.result.gpu.h2d["copies"] == 6  # the loop's own copies only
    assert run.result.gpu.sync_stalls is not None and run.result.gpu.sync_stalls["calls"] == 0  # not the replicas' .item()


def test_set_device_in_the_loop_times_each_copy_on_its_own_device(fake_clock: HostClock) -> None:
    """Model parallel: copies to cuda:0 then cuda:1 in the same steps. Pooled events are kept
    per device: no "Event device 0 does not match recording stream's device 1"."""
    gpu = machine(fake_clock, devices=2)
    body = """
    a = x.to("cuda:0", non_blocking=True)
    cuda.set_device(1)
    b = x.to("cuda", non_blocking=True)
    cuda.set_device(0)
    """
    bench = Bench(gpu, body, names={"x": FakeTensor(10_000_000, pinned=True)}).start().steps(8)
    run = bench.close()
    sites = {s["line"]: s for s in run.result.gpu.h2d["sites"]}
    assert sites[2]["timed"] == sites[4]["timed"] == 8
    assert sites[2]["side_stream"] == 0 and sites[4]["side_stream"] == 8  # another device's copy
    assert np.allclose(run.steps["h2d_ms"], 1.0)  # only the loop device's copy is step time
    assert not any("not timed" in n for n in run.notes)


def test_an_error_of_ours_turns_the_copy_watch_off_and_the_users_copy_still_runs(fake_clock: HostClock) -> None:
    gpu = machine(fake_clock)
    bench = Bench(gpu, "y = x.to('cuda')\nout.append(y.device)", names={"x": FakeTensor(1000), "out": []})
    bench.start().steps(2)
    assert bench.watch.api is not None

    def broken() -> Any:
        raise RuntimeError("CUDA driver hiccup")

    assert bench.watch.copies is not None
    bench.watch.copies.pool._make = broken
    bench.watch.copies.pool.clear()
    bench.steps(3)
    run = bench.close()
    assert bench.names["out"] == ["cuda:0"] * 5  # every copy was made
    assert run.result.gpu.h2d is None and "h2d_ms" not in run.steps
    assert any("Copies to the GPU were not timed after an error: RuntimeError: CUDA driver hiccup" in n for n in run.notes)


BODY = "y = x.to('cuda')\nout.append(float(y.work(1.0).item()))"


def watched_outputs(fake_clock: HostClock, broken: dict[str, Any] | None = None) -> tuple[list[Any], Run]:
    """The user's loop on the stand-in GPU, with the watch's `broken` functions raising: what the
    loop computed, and the run (its GPU watch kept as `WATCHES[-1]`)."""
    gpu = machine(fake_clock)
    bench = Bench(gpu, BODY, names={"x": FakeTensor(1000), "out": []})
    methods = {name: FakeTensor.__dict__.get(name) for name in ("to", "item")}

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("our bug")

    with pytest.MonkeyPatch.context() as mp:
        for owner, name in (broken or {}).items():
            mp.setattr(owner, name, fail)
        run = bench.start().steps(4).close()
    assert {name: FakeTensor.__dict__.get(name) for name in methods} == methods  # nothing stays patched
    WATCHES.append(bench.watch)
    return bench.names["out"], run


WATCHES: list[GpuWatch] = []


def test_a_failure_inside_loop_started_stops_at_its_edge_and_nothing_stays_patched(fake_clock: HostClock) -> None:
    """An inner step of `loop_started` fails (counting the sync warnings): the watch is off with
    a note, `Tensor.to` is torch's again, and the loop computes what it computes without it."""
    from traceml_jupyter.capture.gpu import gpu_watch

    expected, _ = watched_outputs(fake_clock)
    got, run = watched_outputs(fake_clock, {gpu_watch: "sync_warnings_counted"})
    assert got == expected
    assert any("Copies and syncs were not watched: RuntimeError: our bug" in n for n in run.notes)
    assert run.result.gpu.h2d is None and run.result.gpu.sync_stalls is None


def test_a_failure_tying_the_clocks_leaves_copies_and_syncs_watched_without_the_backlog(fake_clock: HostClock) -> None:
    expected, _ = watched_outputs(fake_clock)
    got, run = watched_outputs(fake_clock, {GpuWatch: "_tie_clocks"})
    assert got == expected
    h2d = run.result.gpu.h2d
    assert h2d is not None and h2d["copies"] == 4 and run.result.gpu.sync_stalls is not None
    assert "gpu_backlog_ms" not in run.steps
    assert any("GPU backlog was not measured after an error: RuntimeError: our bug" in n for n in run.notes)


def test_a_failure_reporting_at_the_cells_end_stops_at_close(fake_clock: HostClock) -> None:
    """The summary of what was watched fails as the cell ends: close() notes it and raises
    nothing; every CUDA event is dropped."""
    from traceml_jupyter.capture.gpu import gpu_watch

    expected, _ = watched_outputs(fake_clock)
    got, run = watched_outputs(fake_clock, {gpu_watch: "watch_summary"})
    assert got == expected
    assert any("The GPU watch failed at the cell's end: RuntimeError: our bug" in n for n in run.notes)
    assert WATCHES[-1].api is None  # every CUDA event dropped


@pytest.mark.parametrize("inner", ["copied", "_add"])
def test_a_failure_inside_a_copy_or_sync_hook_stops_at_the_hooks_edge(fake_clock: HostClock, inner: str) -> None:
    """`CopyWatch.copied` (under `CopyWatch.guarded`) or `SyncWatch._add` (under `synced`) fails:
    that watch turns itself off with a note; every copy and `.item()` of the loop ran and
    returned what it returns without the watch."""
    from traceml_jupyter.capture.gpu.h2d import CopyWatch
    from traceml_jupyter.capture.gpu.syncs import SyncWatch

    owner = CopyWatch if inner == "copied" else SyncWatch
    expected, _ = watched_outputs(fake_clock)
    got, run = watched_outputs(fake_clock, {owner: inner})
    assert got == expected and len(got) == 4
    off = "Copies to the GPU were not timed" if inner == "copied" else "Synchronising calls were not watched"
    assert any(f"{off} after an error: RuntimeError: our bug" in n for n in run.notes)


# -- elapsed_time only on completed events; no error of ours replaces the user's -----------


def statements(n: int) -> list[Statement]:
    return [Statement(i, 10 + i, 10 + i, f"s{i}") for i in range(n)]


def test_the_line_clock_reads_a_step_only_when_every_mark_is_done(fake_clock: HostClock) -> None:
    """The body switches streams between statements (`set_stream`): the step's last mark is
    done long before its first ones; reading on the last alone would raise."""
    gpu = machine(fake_clock)
    side = gpu.new_stream(0)
    clock = CudaLineClock(statements(2), gpu.event, lambda: True, warmup_until=-1, full=8, every=1)
    for _ in range(8):  # events on steps 0 and 4
        gpu.set_stream(gpu.devices[0].default_stream)
        assert clock.sample()
        clock.start()  # reads the previous sampled step if all its marks are done
        gpu.launch(5.0)
        clock.lap(0)
        gpu.set_stream(side)  # the next mark lands on an idle stream: done at once
        clock.lap(1)
    gpu.set_stream(gpu.devices[0].default_stream)
    clock.finish()
    assert clock.gpu_off is None and clock.gpu_sampled == 2
    gpu_ms = clock.gpu_ms()
    assert gpu_ms is not None and gpu_ms[0][0] == pytest.approx(2 * 5.0)


def test_a_sticky_cuda_error_in_the_body_leaves_the_users_own_error(fake_clock: HostClock) -> None:
    """After an illegal address in statement 0, the lap in its `finally` must not raise (it
    would replace the user's error in the traceback); the per-line GPU times turn off."""
    gpu = machine(fake_clock)
    clock = CudaLineClock(statements(2), gpu.event, lambda: True, warmup_until=-1, full=4, every=1)
    clock.sample()
    clock.start()
    with pytest.raises(CudaError, match="illegal memory access"):
        try:
            gpu.fail()
            gpu.launch(1.0)  # the user's kernel raises
        finally:
            clock.lap(0)  # the rewritten body's `finally`
    assert clock.gpu_off is not None and "illegal memory access" in clock.gpu_off
    off = clock.finish()  # the caller turns this into a note
    assert off is not None and off.startswith("GPU time per line turned off")
    assert clock.gpu_ms() is None


def test_a_sticky_error_mid_loop_never_raises_from_the_watch(fake_clock: HostClock) -> None:
    gpu = machine(fake_clock)
    bench = Bench(gpu, "y = x.to('cuda', non_blocking=True).work(1.0)", names={"x": FakeTensor(1000, pinned=True)})
    bench.start().steps(4)
    gpu.fail()
    bench.watch.step_ended(fake_clock())  # probes record: must not raise
    for _ in range(4):
        bench.watch.step_ended(fake_clock())
    with pytest.raises(CudaError):  # the user's copy raises the user's error, unchanged
        bench.step = 4
        FakeTensor(1000, pinned=True).to("cuda", non_blocking=True)
    bench.step = None
    bench.watch.close()  # never raises either
    run = bench.run
    assert any("illegal memory access" in n for n in run.notes)
    assert FakeTensor.__dict__.get("to") is FakeTensor.__dict__["to"]


# -- the loop's device ---------------------------------------------------------------------


def test_a_loop_on_cuda_1_is_measured_on_cuda_1(fake_clock: HostClock) -> None:
    """Training on cuda:1 without set_device, while device 0 is idle (or busy with others)."""
    gpu = machine(fake_clock, devices=2)
    body = """
    x = batch.to("cuda:1", non_blocking=True)
    y = x.work(8.0)
    """
    bench = Bench(gpu, body, device=1, names={"batch": FakeTensor(1_000_000, pinned=True)})
    bench.start().steps(40)
    run = bench.close()
    assert gpu.current_device == 0
    assert run.summary["gpu_backlog_ms"] > 10.0  # device 1's queue, not idle device 0's
    assert run.result.gpu.h2d["sites"][0]["side_stream"] == 0
    assert run.verdict == "COMPUTE-BOUND"


# -- HOST-BOUND only with evidence ----------------------------------------------------------


GPU_BOUND_SYNCS = {
    "torch.cuda.synchronize()": "cuda.synchronize()",
    "Event.synchronize()": "e = cuda.Event(enable_timing=True); e.record(); e.synchronize()",
    "Stream.synchronize()": "cuda.current_stream().synchronize()",
    ".to('cpu')": "v = y.to('cpu')",
}


@pytest.mark.parametrize("sync", list(GPU_BOUND_SYNCS))
def test_a_gpu_bound_loop_that_waits_in_a_sync_is_not_host_bound(fake_clock: HostClock, sync: str) -> None:
    """10 ms of GPU work and 0.3 ms of Python a step, then a wait for the GPU that sync debug
    mode does not always report. No NVML. The wait is timed: not HOST-BOUND."""
    gpu = machine(fake_clock)
    body = f"""
    y = x.to("cuda", non_blocking=True).work(10.0)
    gpu.clock.sleep(0.3e6)
    {GPU_BOUND_SYNCS[sync]}
    """
    run = Bench(gpu, body, names={"x": FakeTensor(1000, pinned=True)}).start().steps(30).close()
    s = run.summary
    assert s["sync_ms"] == pytest.approx(9.7, abs=0.2)  # the host's wait, timed
    assert run.verdict == "COMPUTE-BOUND", run.verdict_detail.why
    top = run.result.gpu.sync_stalls["sites"][0]
    assert top["line"] == 4 and top["every_step"] and top["wait_ms_per_step"] > 9


def test_an_untimed_sync_makes_the_host_time_unknown_not_host_bound(fake_clock: HostClock) -> None:
    """`torch.nonzero` every step: only sync debug mode's warning shows it, without a time."""
    gpu = machine(fake_clock)
    body = """
    y = x.to("cuda", non_blocking=True).work(10.0)
    gpu.clock.sleep(0.3e6)
    z = implicit_sync(y)
    """
    run = Bench(gpu, body, names={"x": FakeTensor(1000, pinned=True), "implicit_sync": implicit_sync}).start().steps(30).close()
    s = run.summary
    assert s["untimed_sync_share"] == 1.0 and s["host_issue_ms"] is None
    assert run.verdict == "MIXED" and "GPU busy is unknown" in run.verdict_detail.why


def test_a_gpu_bound_loop_throttled_by_the_launch_queue_is_not_host_bound(fake_clock: HostClock) -> None:
    """5 000 kernels of 20 µs a step (100 ms of GPU work); the launch queue holds 256 commands,
    so the host is blocked in launches and the backlog at step end is ~5 ms: 5 % of the step,
    under the 10 % gate, but a GPU waiting on the host has microseconds."""
    gpu = machine(fake_clock, queue_depth=256, launch_us=5.0)
    body = """
    for _ in range(5000):
        gpu.launch(0.02)
    """
    run = Bench(gpu, body).start().steps(12).close()
    s = run.summary
    assert gpu.host_blocked_ns > 0
    assert 1.0 <= s["gpu_backlog_ms"] < 0.1 * s["step_ms"]
    assert s["host_issue_ms"] > 0.5 * s["step_ms"]  # the host looks busy: it is blocked
    assert run.verdict == "COMPUTE-BOUND"


# -- NVML ------------------------------------------------------------------------------------


def sampler_on(gpu: FakeGpu, nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, device: int = 0) -> GpuSampler:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml)
    sampler = GpuSampler(origin_ns=0, clock=gpu.clock)
    assert sampler.open(("pci", f"0000:{0x17 + device:02x}:00.0", f"fake-uuid-{device}"))
    return sampler


def test_utilisation_is_averaged_over_a_window_and_stamped_at_its_middle(
    fake_clock: HostClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = machine(fake_clock)
    nvml = FakeNvml(gpu, window_s=0.2)
    sampler = sampler_on(gpu, nvml, monkeypatch)
    sampler.window_s = 0.2  # what the sampler takes NVML's window to be (1/6 s by default)
    for _ in range(10):  # 50 % duty cycle: 10 ms of work every 20 ms
        gpu.launch(10.0)
        fake_clock.sleep(20e6)
    sampler.sample_once()
    cols = sampler.samples.columns()
    assert cols["gpu_util_pct"][0] == 50.0
    assert cols["time_s"][0] == pytest.approx(0.2 - 0.1)  # read at 0.2 s: the window's middle
    sampler.close()


def test_steps_are_matched_with_samples_on_the_gpus_timeline(fake_clock: HostClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host issues 100 steps of 8 ms in 20 ms; the GPU drains them for 800 ms at 100 %.
    On host time every step falls before the first busy sample; shifted by the backlog, each
    step meets the samples of its GPU time."""
    gpu = machine(fake_clock)
    nvml = FakeNvml(gpu, window_s=1 / 6)
    sampler = sampler_on(gpu, nvml, monkeypatch)
    body = "y = x.to('cuda', non_blocking=True).work(8.0)\ngpu.clock.sleep(0.2e6)"
    bench = Bench(gpu, body, names={"x": FakeTensor(1000, pinned=True)}).start().steps(100)
    while fake_clock() < 900e6:  # the sampler's thread, every 200 ms, while the GPU drains
        fake_clock.sleep(200e6)
        sampler.sample_once()
    bench.run.gpu_samples = sampler.samples.columns()  # as the resource watch leaves them
    run = bench.close()
    cols = run.columns()
    placed = at_steps(sampler.samples.columns(), cols["time_s"], cols["gpu_backlog_ms"])
    assert np.nanmedian(placed["gpu_util_pct"]) == 100.0
    on_host = at_steps(sampler.samples.columns(), cols["time_s"])  # placed on the host's timeline
    assert np.isnan(on_host["gpu_util_pct"]).all()  # too few samples inside the host span


def test_too_few_samples_inside_the_loop_are_not_used(fake_clock: HostClock) -> None:
    samples = {"time_s": np.array([0.0, 0.5, 1.0]), "gpu_util_pct": np.array([10.0, 20.0, 30.0]), "gpu_mem_used_mib": np.array([1.0, 1.0, 1.0])}
    inside = at_steps(samples, np.linspace(0.0, 1.0, 11))
    assert np.isfinite(inside["gpu_util_pct"]).all()
    short = at_steps(samples, np.linspace(0.4, 0.6, 11))  # one sample inside
    assert np.isnan(short["gpu_util_pct"]).all() and np.isfinite(short["gpu_mem_used_mib"]).all()


def test_a_mig_slice_has_no_utilisation_and_its_own_memory(fake_clock: HostClock, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = machine(fake_clock)
    nvml = FakeNvml(gpu, mig=True)
    sampler = sampler_on(gpu, nvml, monkeypatch)
    sampler.sample_once()
    assert sampler.util_note == nvml_module.MIG_NO_UTIL and sampler.device and "(MIG slice)" in sampler.device
    assert ("uuid", b"MIG-fake-uuid-0") in nvml.calls
    cols = sampler.samples.columns()
    assert np.isnan(cols["gpu_util_pct"]).all() and cols["gpu_mem_used_mib"][0] == 2048.0
    sampler.close()


def test_other_processes_on_the_gpu_are_noted(fake_clock: HostClock, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = machine(fake_clock)
    assert sampler_on(gpu, FakeNvml(gpu), monkeypatch).shared_note is None
    note = sampler_on(gpu, FakeNvml(gpu, others=2), monkeypatch).shared_note
    assert note is not None and "2 other process(es)" in note


# -- the loop's stream, not "the default stream" ------------------------------------------


def test_a_loop_on_a_non_default_stream_counts_its_copies_and_its_backlog(fake_clock: HostClock) -> None:
    """`with torch.cuda.stream(s):` around the whole loop: the copies run serially with the
    compute on s (step time: H2D-BOUND can fire) and the probes see s's queue."""
    gpu = machine(fake_clock)
    s = gpu.new_stream(0)
    gpu.set_stream(s)
    body = """
    x = batch.to("cuda", non_blocking=True)
    y = x.work(2.0)
    """
    run = Bench(gpu, body, names={"batch": FakeTensor(30_000_000, pinned=True)}).start().steps(30).close()
    gpu.set_stream(gpu.devices[0].default_stream)
    assert run.result.gpu.h2d["sites"][0]["side_stream"] == 0
    assert run.summary["h2d_ms"] == pytest.approx(3.0)
    assert run.summary["gpu_backlog_ms"] > 10.0
    assert run.verdict == "H2D-BOUND"


def prefetched(clock: HostClock, batch_bytes: int, work_ms: float, steps: int) -> Run:
    """apex's data_prefetcher: each step waits for the side stream, takes the batch copied
    there during the previous step, starts the next one's copy and computes for `work_ms`."""
    gpu = machine(clock)
    side = gpu.new_stream(0)
    body = """
    cuda.current_stream().wait_stream(side)
    x = nxt
    with cuda.stream(side):
        nxt = batch.to("cuda", non_blocking=True)
    y = x.work(work_ms)
    """
    names = {
        "batch": FakeTensor(batch_bytes, pinned=True),
        "side": side,
        "nxt": FakeTensor(10, device="cuda"),
        "work_ms": work_ms,
    }
    return Bench(gpu, body, names=names).start().steps(steps).close()


def test_a_prefetch_on_a_side_stream_is_not_step_time(fake_clock: HostClock) -> None:
    """1 ms copies behind 5 ms steps: the loop's stream finds each copy done when it waits."""
    run = prefetched(fake_clock, 10_000_000, 5.0, 20)
    site = run.result.gpu.h2d["sites"][0]
    assert site["side_stream"] == site["copies"] == site["timed"] == 20
    assert site["waited_ms_per_step"] == 0.0
    assert run.summary["h2d_ms"] == 0.0 and run.verdict != "H2D-BOUND"


def test_a_prefetch_longer_than_the_step_counts_what_it_does_not_hide(fake_clock: HostClock) -> None:
    """3 ms copies behind 1 ms steps: each step waits 2 ms for its batch."""
    run = prefetched(fake_clock, 30_000_000, 1.0, 30)
    assert run.summary["h2d_ms"] == pytest.approx(2.0, abs=0.01)
    assert run.verdict == "H2D-BOUND"


def test_a_side_stream_copy_waited_for_at_once_is_step_time(fake_clock: HostClock) -> None:
    """A copy on a side stream followed at once by wait_stream (a naive "overlap"), in a loop
    whose host waits for each step (loss.item()): nothing runs beside the copy, which takes
    its whole time out of the step as a copy on the loop's stream would."""
    gpu = machine(fake_clock)
    side = gpu.new_stream(0)
    body = """
    with cuda.stream(side):
        x = batch.to("cuda", non_blocking=True)
    cuda.current_stream().wait_stream(side)
    y = x.work(2.0)
    loss = y.item()
    """
    run = Bench(gpu, body, names={"batch": FakeTensor(30_000_000, pinned=True), "side": side}).start().steps(30).close()
    site = run.result.gpu.h2d["sites"][0]
    assert site["side_stream"] == 30 and site["waited_ms_per_step"] == pytest.approx(3.0)
    assert run.summary["h2d_ms"] == pytest.approx(3.0)
    assert run.summary["h2d_side_stream_waited"] == [3]
    v = run.verdict_detail
    assert v.label == "H2D-BOUND"
    assert "on line 3 runs on a side stream, but the loop's stream waits for it" in v.why


def test_the_wait_for_a_side_stream_is_harmless_after_the_cell(fake_clock: HostClock) -> None:
    gpu = machine(fake_clock)
    side = gpu.new_stream(0)
    stream_type = gpu.module.Stream
    before = dict(vars(stream_type))
    bench = Bench(gpu, "cuda.current_stream().wait_stream(side)", names={"side": side}).start()
    assert "wait_stream" in vars(stream_type)  # patched while the loop runs
    bench.steps(3).close()
    assert dict(vars(stream_type)) == before
    gpu.current_stream(0).wait_stream(side)  # still works


# -- pageable non_blocking copies make the host wait ----------------------------------------


def test_pageable_non_blocking_is_a_timed_wait_not_an_async_copy(fake_clock: HostClock) -> None:
    gpu = machine(fake_clock)
    body = """
    y = big.work(6.0)
    x = big.to("cuda", non_blocking=True)
    """
    run = Bench(gpu, body, names={"big": FakeTensor(20_000_000)}).start().steps(30).close()
    s = run.summary
    assert s["h2d_non_blocking_share"] == 0.0  # not asynchronous, whatever it says
    site = run.result.gpu.h2d["sites"][0]
    assert site["non_blocking"] == site["pageable_non_blocking"] == 30
    kinds = {k for x in run.result.gpu.sync_stalls["sites"] for k in x["kinds"]}
    assert kinds == {"pageable non_blocking copy"}
    assert s["sync_ms"] > 5.0  # the host waited for the 6 ms kernel before the copy
    v = run.verdict_detail
    assert v.label == "H2D-BOUND" and "non_blocking=True without pinned memory is synchronous on line 3" in v.why


# -- syncs: one when the loop starts on the GPU, none per step, one at the end -------------


def test_no_synchronize_on_the_per_step_path(fake_clock: HostClock, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = machine(fake_clock)
    calls: list[str] = []
    original = gpu.synchronize

    def counted(device: int | None = None) -> None:
        calls.append("synchronize")
        original(device)

    monkeypatch.setattr(gpu.module, "synchronize", counted)
    body = "y = x.to('cuda', non_blocking=True).work(3.0)"
    bench = Bench(gpu, body, names={"x": FakeTensor(1000, pinned=True)})
    bench.start()
    assert calls == ["synchronize"]  # ties the clocks, once
    bench.steps(200)
    assert calls == ["synchronize"]
    bench.watch.close()
    assert calls == ["synchronize", "synchronize"]


# -- copies on two streams are all read at the end ----------------------------------------


def test_a_slow_side_stream_copy_at_the_head_does_not_hide_the_others(fake_clock: HostClock) -> None:
    gpu = machine(fake_clock)
    side = gpu.new_stream(0)
    body = """
    if k == 0:
        side_work.work(500.0)  # the side stream is busy for half a second
        with cuda.stream(side):
            early = batch.to("cuda", non_blocking=True)
    x = batch.to("cuda", non_blocking=True).work(1.0)
    """
    names = {"batch": FakeTensor(1_000_000, pinned=True), "side": side}
    with gpu.module.stream(side):
        names["side_work"] = FakeTensor(10, device="cuda")
    run = Bench(gpu, body, names=names).start().steps(20).close()
    for site in run.result.gpu.h2d["sites"]:
        assert site["timed"] == site["copies"], site


# -- backlog precision in long runs ------------------------------------------------------


def test_the_backlog_stays_precise_after_hours_of_float32_event_times(fake_clock: HostClock) -> None:
    """Steps of 20 s for 3 hours on a GPU that keeps up (true backlog ~0). One float32
    elapsed_time from the loop's start has a resolution of ~1 ms by then; chained probes keep
    the backlog within a few µs."""
    gpu = machine(fake_clock, float32=True)
    run = Bench(gpu, "y = gpu.launch(1.0)\ngpu.clock.sleep(20e9)").start().steps(540).close()
    backlog = run.steps["gpu_backlog_ms"]
    assert np.nanmax(backlog) < 0.01
    # One float32 span from the anchor could not tell 1 ms apart by then.
    assert np.spacing(np.float32(540 * 20_000.0)) >= 1.0


# -- no CUDA event outlives the cell -------------------------------------------------------


@pytest.mark.slow
def test_no_event_is_kept_after_the_cell(fake_clock: HostClock) -> None:
    gpu = machine(fake_clock)
    body = "y = x.to('cuda', non_blocking=True).work(1.0)\nv = y.item()"
    run = Bench(gpu, body, names={"x": FakeTensor(1000, pinned=True)}).start().steps(50).close()
    assert run.result.gpu.h2d["copies"] == 50
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, FakeEvent) and o.gpu is gpu]
    assert alive == []
    assert run.steps["gpu_backlog_ms"] is not None  # the columns stay readable


# -- what the verdict says -----------------------------------------------------------


def test_host_bound_names_the_costliest_host_line() -> None:
    from test_host_bound import gpu_columns

    costs = {"statements": [{"line": 3, "text": "xb, yb = get_batch('train')", "ms_per_step": 7.0, "share": 0.7}, {"line": 4, "text": "loss = model(xb)", "ms_per_step": 1.0, "share": 0.1}]}
    s = summarize(gpu_columns(30, host=9.0, gpu_util_pct=30.0, gpu_backlog_ms=0.01), 30, 0, True)
    s["host_top_line"] = costliest_host_line(costs)
    v = diagnose(s)
    assert v.label == "HOST-BOUND"
    assert "Line 3 (`xb, yb = get_batch('train')`) takes the host most time: 7.0 ms a step" in v.why
    assert "starved by input" in v.why


def test_h2d_advice_says_what_pinning_leaves_and_how_to_overlap() -> None:
    from test_host_bound import gpu_columns

    s = summarize(gpu_columns(30, h2d_ms=4.0, h2d_bytes=20e6, h2d_pinned_bytes=0.0, h2d_async_bytes=0.0, gpu_backlog_ms=5.0), 30, 0, True)
    v = diagnose(s)
    assert v.label == "H2D-BOUND"
    assert "about 20.0 % of the step would remain" in v.next  # 40 % of the step, twice as fast
    assert "side CUDA stream" in v.next and "wait_stream" in v.next


# -- the fake itself: what the findings rest on ------------------------------------------------


def test_the_stand_in_refuses_what_cuda_refuses(fake_clock: HostClock) -> None:
    gpu = machine(fake_clock, devices=2)
    ev = gpu.event()
    ev.record(gpu.current_stream(0))
    with pytest.raises(RuntimeError, match="does not match recording stream's device"):
        ev.record(gpu.current_stream(1))
    a, b = gpu.event(), gpu.event()
    a.record()
    gpu.launch(5.0)
    b.record()
    with pytest.raises(RuntimeError, match="Both events must be completed"):
        a.elapsed_time(b)
    b.synchronize()
    assert a.elapsed_time(b) == pytest.approx(5.0)


def test_the_stand_in_models_launch_latency_and_a_bounded_queue(fake_clock: HostClock) -> None:
    gpu = machine(fake_clock, launch_us=5.0, queue_depth=4)
    ev = gpu.event()
    ev.record()
    assert not ev.query()  # an idle GPU reaches an event a few µs after the host records it
    fake_clock.sleep(5_000)
    assert ev.query()
    for _ in range(4):
        gpu.launch(1.0)
    before = fake_clock()
    gpu.launch(1.0)  # the fifth command waits for the first to finish
    assert fake_clock() - before > 0 and gpu.host_blocked_ns > 0


def test_the_checklist_says_non_blocking_from_pageable_memory_is_synchronous() -> None:
    from traceml_jupyter.analysis.cell_code import CodeSite, Transfer
    from traceml_jupyter.analysis.checklist import FIX, OK, CopySeen, Facts, non_blocking_item

    site = CodeSite(3)
    transfers = (Transfer(site, 'x.to("cuda", non_blocking=True)', True),)

    def copy(pinned: float) -> CopySeen:
        return CopySeen(site, 'x.to("cuda", non_blocking=True)', 20e6, 4.0, 5.0, pinned, 1.0)

    item = non_blocking_item(Facts("H2D-BOUND", None, 8, on_gpu=True, transfers=transfers, copies=(copy(0.0),)))
    assert item.status == FIX and item.to_try == "pin_memory=True"
    assert "non_blocking=True without pinned memory is synchronous" in item.reason
    pinned = non_blocking_item(Facts("H2D-BOUND", None, 8, on_gpu=True, transfers=transfers, copies=(copy(1.0),)))
    assert pinned.status == OK


# -- copies and syncs stay on their own step ------------------------------------------------


def test_merged_micro_steps_carry_their_copies_into_the_one_step(fake_clock: HostClock) -> None:
    """Gradient accumulation: the capture first closes a step per iteration, then, at the first
    optimizer step, merges them into one step. The watch's sums follow."""
    gpu = machine(fake_clock)
    bench = Bench(gpu, "y = x.to('cuda')", names={"x": FakeTensor(1000)}).start().steps(4)
    merged = bench.run.recorder.pop_tail(3)  # steps 1-3 become the open step, now step 1
    assert merged is not None
    bench.watch.merged(3)
    assert bench.run.recorder.n_steps == 1
    bench.steps(3)  # steps 1 (the merged one, its last micro-step), 2 and 3
    run = bench.close()
    copied = dict(zip(run.steps["step"].tolist(), run.steps["h2d_bytes"].tolist(), strict=True))
    assert copied == {0: 1000.0, 1: 4000.0, 2: 1000.0, 3: 1000.0}
