"""The one GPU validation: every GPU behaviour the tests can only show on a stand-in GPU, on a
real one, in one process, in under 290 s on one GPU. Each scenario runs as a `%%traceml` cell
in a real IPython shell; its verdict and GPU timings are checked against what was injected (a
sleeping dataset for data wait, `torch.cuda._sleep` for a known GPU time, known copy sizes),
and after every cell the process is checked to be as it was (hygiene).

    .venv/bin/python scripts/gpu_check.py --all            # everything; exit 1 if a check fails
    .venv/bin/python scripts/gpu_check.py --all --only A,B # some scenarios (by key)
    .venv/bin/python scripts/gpu_check.py --second         # the second pass (≤ 60 s, gpu_second_pass.py)
    .venv/bin/python scripts/gpu_check.py --all --second   # both, one process, within 5 minutes
    .venv/bin/python scripts/gpu_check.py --list           # the scenarios, what each shows
    .venv/bin/python scripts/gpu_check.py --fork-check     # no CUDA initialised before a fork (CPU or GPU)

The table goes to stdout and JSON to $OUT/gpu_check.json ($OUT, else ./artifacts). Without a
CUDA device it prints "skipped: no CUDA device" and the scenario list, and exits 0.
tests/integration/gpu/test_gpu.py runs the script's own checks on the CPU (the listing, the fork check).

Scenarios A-M are the GPU review's (../shared/reviews/gpu-review.md, "Proposed validation");
the finding each one shows is in the list. Not covered on a single GPU whose MIG settings must
not change: DataParallel over several GPUs (finding 2 with replicas) and MIG (findings 5, 9):
the stand-in GPU tests cover them (tests/integration/gpu/test_gpu_review.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOLERANCE = 0.05  # timings within 5 % of the injected value ...
FLOOR_MS = 0.5  # ... or 0.5 ms, whichever is larger
BUDGET_S = 270.0  # scenarios not started by then are reported as not run (a failure)
BUDGET_WITH_SECOND_S = 200.0  # ... when the second pass (≤ 60 s) follows in the same 5 minutes
OVERHEAD_US = 10.0  # target: the GPU path's own host cost per step
TO_DTYPE_US = 1.0  # target: a `.to(dtype)` passing through the patch


@dataclass
class Check:
    """One scenario: what it should show, what it showed, and what did not match."""

    scenario: str
    expected: str
    finding: str = ""
    verdict: str = "-"
    numbers: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def expect(self, condition: bool, problem: str) -> None:
        if not condition:
            self.problems.append(problem)

    def near(self, name: str, got: float | None, want: float, tolerance: float = TOLERANCE) -> None:
        """`got` within `tolerance` of `want` or FLOOR_MS, whichever is larger."""
        if got is None:
            self.problems.append(f"{name}: not measured (want {want:.1f} ms)")
            return
        allowed = max(tolerance * want, FLOOR_MS)
        if abs(got - want) > allowed:
            self.problems.append(f"{name} {got:.2f} ms, want {want:.2f} ± {allowed:.2f} ms")


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    finding: str  # the review finding(s) it shows, or "" for the original groups
    expected: str
    run: Callable[[Context], list[Check]]
    # GPU memory back to its baseline after the cell (HF's Accelerator keeps its own state:
    # what it holds is reported, not failed)
    memory_must_return: bool = True


# -- the environment -------------------------------------------------------------------------


def cuda_available() -> bool:
    """A CUDA device torch can use (this script may initialise CUDA: scenario L forks from a
    fresh interpreter of its own)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def new_shell() -> Any:
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()  # type: ignore[no-untyped-call, unused-ignore]
    shell.run_line_magic("load_ext", "traceml_jupyter")
    return shell


class Context:
    """What the scenarios share: the shell, the `_sleep` rate, the originals hygiene compares
    with, and the memory the GPU held before the scenarios."""

    def __init__(self, shell: Any) -> None:
        import torch

        from traceml_jupyter.capture.gpu.syncs import SYNC_METHODS

        self.shell = shell
        self.torch = torch
        self.cycles_per_ms = 0.0
        self.sync_methods = SYNC_METHODS
        self.originals = {
            "torch.cuda.synchronize": torch.cuda.synchronize,
            "Event.synchronize": torch.cuda.Event.__dict__.get("synchronize"),
            "Stream.synchronize": torch.cuda.Stream.__dict__.get("synchronize"),
            "warnings.showwarning": warnings.showwarning,
        }
        self.tensor_attrs = {n: torch.Tensor.__dict__.get(n) for n in ("to", "cuda", *SYNC_METHODS)}
        self.baseline_mib = 0.0

    def cycles(self, ms: float) -> int:
        return int(ms * self.cycles_per_ms)

    def traced(self, name: str, cell: str, names: dict[str, Any], options: str = "--no-live") -> Any:
        """Run `cell` under `%%traceml --name NAME` with `names` defined; the run it made. The
        cell's first line is line 2 (the %%traceml line is line 1)."""
        from IPython.utils.capture import capture_output

        import traceml_jupyter

        self.shell.user_ns.update(names)
        with capture_output():
            source = textwrap.dedent(cell).lstrip("\n")
            result = self.shell.run_cell(f"%%traceml --name {name} {options}\n" + source)
        if result.error_in_exec is not None:
            raise result.error_in_exec
        run = traceml_jupyter.last()
        assert run is not None and run.name == name, f"no run named {name}"
        return run

    def plain(self, cell: str, names: dict[str, Any]) -> float:
        """Run `cell` without the magic; its wall time in seconds (GPU drained before and after)."""
        self.shell.user_ns.update(names)
        torch = self.torch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = self.shell.run_cell(textwrap.dedent(cell).lstrip("\n"))
        torch.cuda.synchronize()
        if result.error_in_exec is not None:
            raise result.error_in_exec
        return time.perf_counter() - t0

    def hygiene(self) -> list[str]:
        """The process as before the cell (review, section 3)."""
        from traceml_jupyter.capture.gpu.syncs import SYNC_MESSAGE

        torch, problems = self.torch, []
        if torch.cuda.get_sync_debug_mode() != 0:
            problems.append(f"sync debug mode left at {torch.cuda.get_sync_debug_mode()}")
        left = [n for n, v in self.tensor_attrs.items() if torch.Tensor.__dict__.get(n) is not v]
        if left:
            problems.append(f"torch.Tensor attributes left patched: {left}")
        now = {
            "torch.cuda.synchronize": torch.cuda.synchronize,
            "Event.synchronize": torch.cuda.Event.__dict__.get("synchronize"),
            "Stream.synchronize": torch.cuda.Stream.__dict__.get("synchronize"),
            "warnings.showwarning": warnings.showwarning,
        }
        changed = [k for k, v in now.items() if v is not self.originals[k]]
        if changed:
            problems.append(f"left patched: {changed}")
        filters = [f for f in warnings.filters if f[1] is not None and SYNC_MESSAGE in str(f[1].pattern)]
        if filters:
            problems.append("a sync-warning filter was left in warnings.filters")
        threads = [t.name for t in threading.enumerate() if t.name.startswith("traceml")]
        if threads:
            problems.append(f"threads left running: {threads}")
        return problems

    def memory_back(self, before: set[str]) -> list[str]:
        """Forget the scenario's names; the GPU memory it held must be freed (nothing kept)."""
        for name in set(self.shell.user_ns) - before:
            self.shell.user_ns.pop(name, None)
        gc.collect()
        torch = self.torch
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() / 2**20
        if held > self.baseline_mib + 1.0:
            return [f"{held - self.baseline_mib:.1f} MiB of GPU memory still allocated after the cell"]
        return []


def describe(check: Check, run: Any, want_clock: str | None = "gpu") -> None:
    s = run.summary
    check.verdict = f"{run.verdict} ({run.severity}, {run.clock})"
    check.numbers.update(
        {
            "wait": s["data_wait_ms"],
            "compute": s["compute_ms"],
            "step": s["step_ms"],
            "h2d": s.get("h2d_ms"),
            "backlog": s.get("gpu_backlog_ms"),
            "syncs": s.get("sync_calls"),
            "util": s.get("gpu_busy_share"),
        }
    )
    if want_clock is not None:
        check.expect(run.clock == want_clock, f"clock is {run.clock}, want {want_clock}")


def median_after_warmup(run: Any, column: str) -> float:
    import numpy as np

    cols = run.steps
    warm = int(run.summary.get("warmup_steps") or 0)
    values = np.asarray(cols[column], dtype=float)[warm:]
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else float("nan")


def sleepy_loader(n: int, ms: float, pin: bool = False) -> Any:
    """A DataLoader of `n` whole batches, each taking `ms` to make (num_workers=0)."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    class SleepyBatches(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> torch.Tensor:
            time.sleep(ms / 1000)
            return torch.ones(256)

    return DataLoader(SleepyBatches(), batch_size=None, pin_memory=pin)


# -- preflight -------------------------------------------------------------------------------


def preflight(ctx: Context) -> list[Check]:
    """Versions, the device as torch and NVML see it (read only), a warm GPU, the `_sleep` rate
    (5 runs of 10 ms agreeing within 2 %), and the host cost of CUDA events."""
    torch = ctx.torch
    check = Check("preflight", "calibrated, events < 5 µs")
    props = torch.cuda.get_device_properties(0)
    check.numbers.update(
        {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": props.name, "memory GiB": props.total_memory / 2**30}
    )
    try:
        import pynvml

        pynvml.nvmlInit()
        from traceml_jupyter.capture.resources.nvml import pci_bus_id

        handle = pynvml.nvmlDeviceGetHandleByPciBusId(str(pci_bus_id(props)).encode())
        check.numbers["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        check.numbers["nvml name"] = str(pynvml.nvmlDeviceGetName(handle))
        try:
            check.numbers["mig"] = pynvml.nvmlDeviceGetMigMode(handle)[0]
        except Exception:
            check.numbers["mig"] = "n/a"
        try:
            check.numbers["persistence"] = pynvml.nvmlDeviceGetPersistenceMode(handle)
        except Exception:
            check.numbers["persistence"] = "n/a"
        pynvml.nvmlShutdown()
    except Exception as exc:
        check.numbers["nvml"] = f"n/a ({type(exc).__name__}: {exc})"
    # Warm the GPU (clocks ramp up), then calibrate _sleep: cycles per ms.
    torch.cuda._sleep(int(1e9))
    torch.cuda.synchronize()
    rates = []
    probe = 10_000_000
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        rates.append(probe / float(start.elapsed_time(end)))
    rate = statistics.median(rates)
    probe = int(probe * 10.0 / (probe / rate))  # about 10 ms
    rates = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        rates.append(probe / float(start.elapsed_time(end)))
    ctx.cycles_per_ms = float(statistics.median(rates))
    spread = (max(rates) - min(rates)) / ctx.cycles_per_ms
    check.numbers["cycles/ms"] = ctx.cycles_per_ms
    check.numbers["spread"] = spread
    check.expect(spread < 0.02, f"_sleep calibration runs disagree by {spread:.1%} (want < 2 %)")
    # Host cost of an event record and a query.
    ev = torch.cuda.Event(enable_timing=True)
    n = 5000
    t0 = time.perf_counter()
    for _ in range(n):
        ev.record()
    record_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        ev.query()
    query_us = (time.perf_counter() - t0) / n * 1e6
    check.numbers.update({"record µs": record_us, "query µs": query_us})
    check.expect(record_us < 5.0, f"Event.record() costs {record_us:.2f} µs (want < 5)")
    check.expect(query_us < 3.0, f"Event.query() costs {query_us:.2f} µs (want < 3)")
    del start, end, ev
    return [check]


# -- the original groups -----------------------------------------------------------------------


def demo_scenarios(ctx: Context) -> list[Check]:
    """The demo's fast, slow, fixed and h2d, judged by their measured ratios: the GPU waits for
    data (INPUT-BOUND) exactly when the fetch is a large part of the step on the GPU clock."""
    from traceml_jupyter import demo

    checks, steps = [], {}
    for name in ("fast", "slow", "fixed", "h2d"):
        check = Check(f"demo {name}", "verdict = what the measured fetch/GPU-step ratio says")
        try:
            loader, model, opt, loss_fn, device = demo.setup(name, device="cuda")
            names = {"loader": loader, "model": model, "opt": opt, "loss_fn": loss_fn, "device": device}
            run = ctx.traced(f"demo-{name}", demo.training_loop(name), names)
        except Exception as exc:
            check.problems.append(f"{type(exc).__name__}: {exc}")
            checks.append(check)
            continue
        describe(check, run)
        s = run.summary
        fetch_cpu = median_after_warmup(run, "data_wait_ms")
        gpu_step = s["step_ms"]
        check.numbers.update({"fetch (CPU) ms": fetch_cpu, "GPU step ms": gpu_step, "intended": demo.INTENDED_VERDICT.get(name)})
        share = s["data_wait_share"] or 0.0
        if share >= 0.10:
            check.expect(run.verdict in ("INPUT-BOUND", "INPUT STRAGGLER"), f"data wait {share:.0%} of the GPU step, verdict {run.verdict}")
        else:
            check.expect(not run.verdict.startswith("INPUT"), f"data wait {share:.0%}, verdict {run.verdict}")
        # A blocking copy every step syncs: the GPU idles during the whole fetch.
        if name in ("slow", "fast") and gpu_step:
            predicted = fetch_cpu / gpu_step
            check.numbers["predicted share"] = predicted
            check.expect(abs(share - predicted) <= 0.10, f"GPU data-wait share {share:.2f}, the fetch predicts {predicted:.2f}")
        steps[name] = gpu_step
        if name == "h2d":
            check.expect((s.get("h2d_bytes") or 0) > 0, "no copy measured")
        if name == "fixed" and steps.get("slow"):
            speedup = steps["slow"] / gpu_step
            check.numbers["speedup"] = speedup
            check.expect(speedup >= demo.FIXED_SPEEDUP, f"fixed is {speedup:.2f}x faster than slow, want {demo.FIXED_SPEEDUP}x")
        checks.append(check)
    return checks


def injected_delays(ctx: Context) -> list[Check]:
    """20 ms per batch in the dataset, 10 ms of GPU work per step. With `.item()` at the end of
    the step the GPU waits the whole fetch; without, it hides 10 ms of it behind its work."""
    torch = ctx.torch
    checks = []
    for synced, want_wait in ((True, 20.0), (False, 10.0)):
        cell = """
        for x in loader:
            x = x.to(device)
            torch.cuda._sleep(CYCLES)
            s = (x * 2).sum()
            {sync}
        """.format(sync="v = s.item()" if synced else "pass")
        label = "item" if synced else "async"
        check = Check(f"delays {label}", f"INPUT-BOUND, wait {want_wait:.0f} ms, GPU 10 ms")
        names = {"loader": sleepy_loader(40, 20.0), "device": "cuda", "torch": torch, "CYCLES": ctx.cycles(10)}
        run = ctx.traced(f"delays-{label}", cell, names)
        describe(check, run)
        check.expect(run.verdict == "INPUT-BOUND", f"verdict {run.verdict}, want INPUT-BOUND")
        check.near("data wait (GPU)", run.summary["data_wait_ms"], want_wait)
        check.near("GPU compute", run.summary["compute_ms"], 10.0)
        check.near("data wait (CPU)", median_after_warmup(run, "data_wait_ms"), 20.0)
        checks.append(check)
    return checks


def known_gpu_time(ctx: Context) -> list[Check]:
    """8 ms of GPU work per step from an in-memory, pinned loader: COMPUTE-BOUND, GPU compute
    8 ms, the GPU always behind the host (backlog), and the sleeping line costs the GPU 8 ms."""
    torch = ctx.torch
    batches = [torch.ones(256).pin_memory() for _ in range(100)]
    cell = """
    for x in batches:
        x = x.to(device, non_blocking=True)
        torch.cuda._sleep(CYCLES)
        s = (x * 2).sum()
    """
    check = Check("known GPU time", "COMPUTE-BOUND, 8 ms")
    run = ctx.traced("known", cell, {"batches": batches, "device": "cuda", "torch": torch, "CYCLES": ctx.cycles(8)})
    describe(check, run)
    check.expect(run.verdict == "COMPUTE-BOUND", f"verdict {run.verdict}, want COMPUTE-BOUND")
    check.near("GPU compute", run.summary["compute_ms"], 8.0)
    backlog = run.summary.get("gpu_backlog_ms")
    check.expect(backlog is not None and backlog >= 1.0, f"backlog {backlog}, want >= 1 ms")
    gpu_lines = (run.result.line_costs or {}).get("gpu_ms_per_step") or {}
    check.numbers["gpu line 4"] = gpu_lines.get(4)
    check.near("GPU ms of line 4 (torch.cuda._sleep)", gpu_lines.get(4), 8.0)
    return [check]


def copies(ctx: Context) -> list[Check]:
    """64 MiB per step copied from pageable memory with a blocking .to(device), then from pinned
    memory with non_blocking=True: both H2D-BOUND, with the bytes, the pinning and the line
    right, and pinned copies faster."""
    torch = ctx.torch
    checks, rates = [], {}
    for kind in ("pageable", "pinned"):
        big = torch.ones(16 * 2**20)
        if kind == "pinned":
            big = big.pin_memory()
        nb = ", non_blocking=True" if kind == "pinned" else ""
        cell = f"""
        for i in range(30):  # traceml: loop
            x = big.to(device{nb})
            s = x[:1024].sum()
        """
        check = Check(f"h2d {kind}", "H2D-BOUND, 64 MiB")
        run = ctx.traced(f"h2d-{kind}", cell, {"big": big, "device": "cuda"})
        describe(check, run)
        s = run.summary
        check.expect(run.verdict == "H2D-BOUND", f"verdict {run.verdict}, want H2D-BOUND")
        check.expect(s.get("h2d_bytes") == 64 * 2**20, f"bytes per step {s.get('h2d_bytes')}")
        check.expect(s.get("h2d_lines") == [3], f"copy lines {s.get('h2d_lines')}, want [3]")
        pinned = 1.0 if kind == "pinned" else 0.0
        check.expect(s.get("h2d_pinned_share") == pinned, f"pinned share {s.get('h2d_pinned_share')}")
        check.expect(s.get("h2d_non_blocking_share") == pinned, f"async share {s.get('h2d_non_blocking_share')}")
        rates[kind] = s.get("h2d_gbps") or 0.0
        check.numbers["GB/s"] = rates[kind]
        check.expect(0.5 <= rates[kind] <= 1000, f"{rates[kind]:.1f} GB/s is not a copy rate")
        checks.append(check)
    checks[-1].expect(rates["pinned"] > rates["pageable"], "pinned copies are not faster")
    return checks


def tiny_kernels(ctx: Context) -> list[Check]:
    """200 tiny kernels a step: the GPU waits on Python's launches: HOST-BOUND (NVML sees it
    idle; without NVML the verdict may only be "can't tell", never COMPUTE-BOUND)."""
    torch = ctx.torch
    batches = [torch.ones(1024).pin_memory() for _ in range(60)]
    cell = """
    for x in batches:  # traceml: loop
        x = x.to(device, non_blocking=True)
        for _ in range(200):
            x = torch.sin(x) * 1.0001
        total = x.sum()
    """
    check = Check("tiny kernels", "HOST-BOUND")
    run = ctx.traced("tiny", cell, {"batches": batches, "device": "cuda", "torch": torch})
    describe(check, run)
    check.expect(run.verdict == "HOST-BOUND", f"verdict {run.verdict}, want HOST-BOUND")
    backlog = run.summary.get("gpu_backlog_ms")
    check.expect(backlog is not None and backlog < 1.0, f"backlog {backlog}, want < 1 ms")
    return [check]


def item_every_step(ctx: Context) -> list[Check]:
    """5 ms of GPU work, then `loss.item()`: one sync a step, named on its line; the host waits
    there for the GPU, which is busy: COMPUTE-BOUND, not HOST-BOUND."""
    torch = ctx.torch
    batches = [torch.ones(256).pin_memory() for _ in range(40)]
    cell = """
    for x in batches:
        x = x.to(device, non_blocking=True)
        torch.cuda._sleep(CYCLES)
        loss = (x * 2).sum()
        value = loss.item()
    """
    check = Check(".item() every step", "COMPUTE-BOUND, sync on line 6")
    run = ctx.traced("item", cell, {"batches": batches, "device": "cuda", "torch": torch, "CYCLES": ctx.cycles(5)})
    describe(check, run)
    check.expect(run.verdict == "COMPUTE-BOUND", f"verdict {run.verdict}, want COMPUTE-BOUND")
    top = ((run.result.gpu.sync_stalls or {}).get("sites") or [{}])[0]
    check.numbers["sync share"] = top.get("share")
    check.expect(top.get("line") == 6 and top.get("call") == "loss.item()", f"top sync {top}")
    check.expect(bool(top.get("every_step")), "the .item() line does not sync every step")
    check.expect((top.get("share") or 0) > 0.5, f"the host waits {top.get('share')} of the step there")
    return [check]


# -- the review's scenarios A-M ----------------------------------------------------------------


def hidden_input(ctx: Context) -> list[Check]:
    """A: the loader sleeps 8 ms a batch, the GPU works 12 ms a step, no sync: the host's wait
    hides behind queued work. COMPUTE-BOUND on the GPU clock although the CPU clock waits 8 ms."""
    torch = ctx.torch
    check = Check("A hidden input", "COMPUTE-BOUND; GPU wait < 0.5 ms; CPU wait 8 ms", "F9")
    cell = """
    for x in loader:
        x = x.to(device, non_blocking=True)
        torch.cuda._sleep(CYCLES)
    """
    names = {"loader": sleepy_loader(80, 8.0, pin=True), "device": "cuda", "torch": torch, "CYCLES": ctx.cycles(12)}
    run = ctx.traced("A-hidden", cell, names)
    describe(check, run)
    s = run.summary
    check.expect(run.verdict == "COMPUTE-BOUND", f"verdict {run.verdict}")
    check.expect((s["data_wait_ms"] or 0) < 0.5, f"GPU data wait {_cell(s['data_wait_ms'])} ms, want < 0.5")
    check.near("data wait (CPU)", median_after_warmup(run, "data_wait_ms"), 8.0, 0.125)
    check.near("GPU compute", s["compute_ms"], 12.0)
    check.expect((s.get("gpu_backlog_ms") or 0) > 10.0, f"backlog {s.get('gpu_backlog_ms')}, want > 10 ms")
    raw = [v for v in (run.result.gpu.samples or {}).get("gpu_util_pct", []) if v == v]
    check.numbers["raw NVML median"] = statistics.median(raw) if raw else None
    if raw:
        check.expect(statistics.median(raw) >= 90, f"raw NVML median {statistics.median(raw):.0f} %")
        check.expect((s.get("gpu_busy_share") or 0) >= 0.8, f"gpu_busy_share {s.get('gpu_busy_share')}, want >= 0.8")
    return [check]


def starved(ctx: Context) -> list[Check]:
    """B: the loader takes 14 ms, the GPU 10 ms: the GPU waits 4 ms a step."""
    torch = ctx.torch
    check = Check("B starved", "INPUT-BOUND critical; GPU wait 4 ms, share 0.29", "")
    cell = """
    for x in loader:
        x = x.to(device, non_blocking=True)
        torch.cuda._sleep(CYCLES)
    """
    names = {"loader": sleepy_loader(60, 14.0, pin=True), "device": "cuda", "torch": torch, "CYCLES": ctx.cycles(10)}
    run = ctx.traced("B-starved", cell, names)
    describe(check, run)
    s = run.summary
    check.expect((run.verdict, run.severity) == ("INPUT-BOUND", "critical"), f"verdict {run.verdict} {run.severity}")
    check.near("GPU data wait", s["data_wait_ms"], 4.0, 0.125)
    share = s["data_wait_share"] or 0.0
    check.expect(abs(share - 0.29) <= 0.04, f"data wait share {share:.2f}, want 0.29 ± 0.04")
    return [check]


def _nothing() -> None:
    pass


def _no_nvml(ctx: Context) -> Callable[[], None]:
    """NVML off for a scenario (the sampler says "no NVML"); returns the undo."""
    from traceml_jupyter.capture.resources import nvml

    original = nvml.open_nvml
    nvml.open_nvml = lambda: (None, "off for this check")

    def undo() -> None:
        nvml.open_nvml = original

    return undo


def gpu_bound_syncs(ctx: Context) -> list[Check]:
    """C1-C3: 10 ms of GPU work then a wait for the GPU each step (torch.cuda.synchronize,
    with and without NVML; `.to("cpu")` without): the wait is timed, the GPU is busy: never
    HOST-BOUND."""
    torch = ctx.torch
    checks = []
    variants = (
        ("C1 synchronize + NVML", "torch.cuda.synchronize()", True),
        ("C2 synchronize, no NVML", "torch.cuda.synchronize()", False),
        ("C3 .to('cpu'), no NVML", "v = y.sum().to('cpu')", False),
    )
    for title, sync, with_nvml in variants:
        check = Check(title, "COMPUTE-BOUND (not HOST-BOUND); the sync line timed", "F5, F9")
        batches = [torch.ones(256, device="cuda") for _ in range(60)]
        cell = f"""
        for x in batches:
            torch.cuda._sleep(CYCLES)
            y = x * 2
            {sync}
        """
        undo = _no_nvml(ctx) if not with_nvml else _nothing
        try:
            run = ctx.traced(title.split()[0], cell, {"batches": batches, "torch": torch, "CYCLES": ctx.cycles(10)})
        finally:
            undo()
        describe(check, run)
        check.expect(run.verdict != "HOST-BOUND", f"verdict {run.verdict}: {run.verdict_detail.why}")
        check.expect(run.verdict == "COMPUTE-BOUND", f"verdict {run.verdict}, want COMPUTE-BOUND")
        top = ((run.result.gpu.sync_stalls or {}).get("sites") or [{}])[0]
        check.numbers["sync line"] = top.get("line")
        check.expect(top.get("line") == 5, f"top sync line {top.get('line')}, want 5")
        check.expect((top.get("wait_ms_per_step") or 0) > 5.0, f"sync wait {top.get('wait_ms_per_step')} ms a step, want > 5")
        checks.append(check)
    return checks


def stale_tensor_cpu_loop(ctx: Context) -> list[Check]:
    """D: a tensor from an earlier cell sits on the GPU; the loop itself runs on the CPU."""
    torch = ctx.torch
    check = Check("D stale tensor + CPU loop", "CPU clock (not HOST-BOUND critical)", "F4")
    keep = torch.ones(1, device="cuda")
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(64, 256) for _ in range(60)]
    cell = """
    for x in batches:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    """
    run = ctx.traced("D-cpu", cell, {"keep": keep, "model": model, "opt": opt, "batches": batches})
    describe(check, run, want_clock=None)
    check.expect(run.clock == "cpu", f"clock {run.clock}, want cpu")
    check.expect(run.verdict != "HOST-BOUND", f"verdict {run.verdict}")
    return [check]


def in_place_loop(ctx: Context) -> list[Check]:
    """D2: a loop whose steps allocate nothing on the GPU (in-place kernels, as a CUDA graph's
    replay): it still runs on the GPU, and should be on the GPU clock."""
    torch = ctx.torch
    check = Check("D2 in-place kernels only", "GPU clock", "F4")
    cell = """
    for i in range(40):  # traceml: loop
        x.add_(1)
        torch.cuda._sleep(CYCLES)
    """
    run = ctx.traced("D2-in-place", cell, {"x": torch.zeros(16, device="cuda"), "torch": torch, "CYCLES": ctx.cycles(2)})
    describe(check, run)
    return [check]


def fetch_in_range_body(ctx: Context) -> list[Check]:
    """E: `for s in range(N): x = next(it)`: the fetch inside the body is data wait."""
    torch = ctx.torch
    check = Check("E fetch in a range body", "INPUT-BOUND", "F6")
    cell = """
    it = iter(loader)
    for s in range(40):
        x = next(it).to(device, non_blocking=True)
        torch.cuda._sleep(CYCLES)
        (x * 2).sum()
    """
    names = {"loader": sleepy_loader(41, 14.0, pin=True), "device": "cuda", "torch": torch, "CYCLES": ctx.cycles(5)}
    run = ctx.traced("E-range", cell, names)
    describe(check, run)
    check.expect(run.verdict == "INPUT-BOUND", f"verdict {run.verdict}, want INPUT-BOUND")
    return [check]


def side_streams(ctx: Context) -> list[Check]:
    """F1: the body's work on a side stream; F2: `set_stream` in the middle of the loop; G: a
    side-stream prefetcher (copies off the loop's stream); G2: a side-stream copy the loop waits
    for at once in a loop that syncs every step (the copy is step time)."""
    torch = ctx.torch
    checks = []
    # The loop's stream must wait for the side stream (wait_stream) for its work to be step
    # time: a side stream never joined runs beside the steps, not in them.
    check = Check("F1 body on a side stream, joined", "GPU compute 10 ms; no exception", "F10")
    cell = """
    for x in batches:
        with torch.cuda.stream(s):
            torch.cuda._sleep(CYCLES)
            y = x * 2
        torch.cuda.current_stream().wait_stream(s)
    """
    batches = [torch.ones(256, device="cuda") for _ in range(30)]
    names = {"batches": batches, "s": torch.cuda.Stream(), "torch": torch, "CYCLES": ctx.cycles(10)}
    run = ctx.traced("F1-side", cell, names)
    describe(check, run)
    check.near("GPU compute", run.summary["compute_ms"], 10.0)
    checks.append(check)

    check = Check("F2 set_stream mid-loop", "no exception; GPU timings or a note", "F3")
    cell = """
    for i in range(30):  # traceml: loop
        if i == 3:
            torch.cuda.set_stream(s)
        torch.cuda._sleep(CYCLES)
        y = x * 2
    torch.cuda.set_stream(torch.cuda.default_stream())
    """
    names = {"s": torch.cuda.Stream(), "torch": torch, "CYCLES": ctx.cycles(5), "x": torch.ones(256, device="cuda")}
    try:
        run = ctx.traced("F2-set-stream", cell, names)
        describe(check, run, want_clock=None)
        check.expect(run.clock == "gpu" or any("GPU" in n for n in run.notes), f"clock {run.clock}, notes {run.notes}")
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream())
    checks.append(check)

    check = Check("G side-stream prefetcher", "copies off the loop's stream; not H2D-BOUND", "F10, F14")
    pinned = [torch.ones(4 * 2**20).pin_memory() for _ in range(2)]  # 16 MiB
    cell = """
    for i in range(40):  # traceml: loop
        with torch.cuda.stream(side):
            nxt = pinned[i % 2].to("cuda", non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
        nxt.record_stream(torch.cuda.current_stream())
        torch.cuda._sleep(CYCLES)
        (nxt * 2).sum()
    """
    run = ctx.traced("G-prefetch", cell, {"pinned": pinned, "side": torch.cuda.Stream(), "torch": torch, "CYCLES": ctx.cycles(5)})
    describe(check, run)
    site = ((run.result.gpu.h2d or {}).get("sites") or [{}])[0]
    check.numbers["side/copies/timed"] = f"{site.get('side_stream')}/{site.get('copies')}/{site.get('timed')}"
    check.expect(site.get("side_stream") == site.get("copies") == site.get("timed"), f"copy site {site}")
    check.expect((run.summary.get("h2d_ms") or 0.0) < 0.05, f"h2d_ms {run.summary.get('h2d_ms')}, want ~0")
    check.expect(run.verdict != "H2D-BOUND", f"verdict {run.verdict}")
    checks.append(check)

    check = Check("G2 side-stream copy waited for at once", "the wait is step time: h2d_ms ~ the copy", "F10b")
    checks.append(waited_side_copy(ctx, check, "", "torch.cuda.current_stream().wait_stream(side)"))
    return checks


def waited_side_copy(ctx: Context, check: Check, recorded: str, join: str) -> Check:
    """64 MiB copied on a side stream (then `recorded`, inside the stream's block) that the
    loop's stream waits for at once (`join`), in a loop that syncs every step: the wait is
    step time (G2 with wait_stream; the second pass's G2e with wait_event)."""
    torch = ctx.torch
    big = [torch.ones(16 * 2**20).pin_memory() for _ in range(2)]  # 64 MiB
    inside = f"\n            {recorded}" if recorded else ""
    cell = f"""
    for i in range(30):  # traceml: loop
        with torch.cuda.stream(side):
            x = big[i % 2].to("cuda", non_blocking=True){inside}
        {join}
        x.record_stream(torch.cuda.current_stream())
        torch.cuda._sleep(CYCLES)
        loss = (x * 2).sum().item()
    """
    run = ctx.traced(check.scenario.split()[0], cell, {"big": big, "side": torch.cuda.Stream(), "torch": torch, "CYCLES": ctx.cycles(1)})
    describe(check, run)
    site = ((run.result.gpu.h2d or {}).get("sites") or [{}])[0]
    copy_ms, waited_ms = site.get("ms_per_step") or 0.0, site.get("waited_ms_per_step") or 0.0
    check.numbers["copy/waited ms per step"] = f"{copy_ms:.3f}/{waited_ms:.3f}"
    check.expect(copy_ms > 0 and waited_ms >= 0.8 * copy_ms, f"waited {waited_ms} of a {copy_ms} ms copy, want most")
    check.expect((run.summary.get("h2d_ms") or 0.0) >= 0.8 * copy_ms, f"h2d_ms {run.summary.get('h2d_ms')}")
    return check


def pageable_non_blocking(ctx: Context) -> list[Check]:
    """H: 64 MiB pageable `.to(dev, non_blocking=True)`: CUDA makes the host wait."""
    torch = ctx.torch
    check = Check("H pageable non_blocking", "a timed wait; async share 0", "F11")
    big = torch.ones(16 * 2**20)
    cell = """
    for i in range(20):  # traceml: loop
        x = big.to("cuda", non_blocking=True)
        s = x[:1024].sum()
    """
    run = ctx.traced("H-pageable-nb", cell, {"big": big})
    describe(check, run)
    s = run.summary
    check.expect(s.get("h2d_non_blocking_share") == 0.0, f"async share {s.get('h2d_non_blocking_share')}, want 0")
    kinds = {k for site in (run.result.gpu.sync_stalls or {}).get("sites", []) for k in site["kinds"]}
    check.expect("pageable non_blocking copy" in kinds, f"sync kinds {kinds}")
    return [check]


def long_run(ctx: Context) -> list[Check]:
    """I: 70 000 steps (past the recorder's 65 536-step fold): every GPU timing read, totals
    right, no data-wait spike at the fold, and the per-step overhead."""
    import numpy as np

    torch = ctx.torch
    check = Check("I 70 000 steps", "all GPU timings; no spike at 65 536; < 15 µs a step", "F12, F13")
    x = torch.zeros(16, device="cuda")
    cell = """
    for i in range(70_000):  # traceml: loop
        y = x + 1
    """
    run = ctx.traced("I-long", cell, {"x": x}, "--no-live --lines off")
    plain = ctx.plain("for i in range(70_000):\n    y = x + 1\n", {"x": x})
    describe(check, run)
    cols = run.steps
    check.expect(run.n_steps == 70_000, f"{run.n_steps} steps")
    finite = np.isfinite(cols["step_gpu_ms"])
    check.expect(bool(finite.all()), f"{int((~finite).sum())} kept steps without GPU timings")
    total = (run.summary.get("totals_ms") or {}).get("step_gpu_ms")
    colsum = float(np.nansum(cols["step_gpu_ms"])) * run.result.steps.stride
    check.numbers["totals vs columns"] = (total or 0) / colsum if colsum else None
    check.expect(total is not None and abs(total - colsum) <= 0.01 * colsum, f"total {total} vs columns {colsum}")
    wait = cols["data_wait_ms"]
    med = float(np.median(wait))
    near = (cols["step"] >= 65_530) & (cols["step"] <= 65_545)
    spike = float(wait[near].max()) if near.any() else 0.0
    check.numbers["wait at the fold / median"] = spike / med if med else None
    check.expect(spike <= 5 * max(med, 0.01), f"data wait {spike:.3f} ms at the fold, median {med:.3f} ms")
    wall = float(run.result.loop.wall_ms or 0.0) / 1000.0 if run.result.loop.wall_ms else None
    if wall is not None:
        per_step_us = (wall - plain) / 70_000 * 1e6
        check.numbers["overhead µs/step"] = per_step_us
        check.expect(per_step_us < 15.0, f"{per_step_us:.1f} µs a step over a plain loop (want < 15)")
    return [check]


def cuda_graph(ctx: Context) -> list[Check]:
    """J: a CUDA graph captured in step 0 (side-stream warm-up, as the docs require) and
    replayed after: no exception; GPU compute = the replay's time."""
    torch = ctx.torch
    check = Check("J CUDA graph replay", "no exception; GPU compute ≈ replay ± 10 %", "")
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(3)]).cuda()
    static_x = torch.randn(1024, 2048, device="cuda")
    cell = """
    for i in range(50):  # traceml: loop
        if i == 0:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    y = model(static_x)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_y = model(static_x)
        g.replay()
    """
    run = ctx.traced("J-graph", cell, {"model": model, "static_x": static_x, "torch": torch})
    describe(check, run)
    replay = replay_ms(torch, ctx.shell.user_ns["g"], 20)
    check.numbers["replay ms"] = replay
    check.near("GPU compute", run.summary["compute_ms"], replay, 0.10)
    return [check]


COMPILED_STEP_SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator(device="cuda").manual_seed(1)
data = [(torch.randn(64, 512, device="cuda", generator=g), torch.randn(64, 1, device="cuda", generator=g)) for _ in range(80)]
losses = []

@torch.compile(mode="reduce-overhead")
def train_step(x, y):
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss
"""
COMPILED_STEP_CELL = """
for x, y in data:
    loss = train_step(x, y)
    losses.append(loss.detach().clone())
"""


def compiled_step_counts(ctx: Context, traced: bool) -> tuple[dict[str, int], Any]:
    """The compiled step's cell from a fresh Dynamo, plainly or traced: what torch counted
    (compilations, recompilations, graphs, graph breaks, CUDA graph skips) and its losses."""
    torch = ctx.torch
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    result = ctx.shell.run_cell(COMPILED_STEP_SETUP)
    if result.error_in_exec is not None:
        raise result.error_in_exec
    if traced:
        ctx.traced("compile-reduce-overhead", COMPILED_STEP_CELL, {})
    else:
        ctx.plain(COMPILED_STEP_CELL, {})
    metrics = get_compilation_metrics()
    counts = {
        "compiles": len(metrics),
        "recompiles": sum(m.recompile_reason is not None for m in metrics),
        "graphs": counters["stats"]["unique_graphs"],
        "graph breaks": sum(counters["graph_break"].values()),
        "cudagraph skips": counters["inductor"]["cudagraph_skips"],
    }
    return counts, torch.stack(ctx.shell.user_ns["losses"]).cpu()


def compiled_graphs_stay(ctx: Context) -> list[Check]:
    """compile: a training step under torch.compile(mode="reduce-overhead") (Inductor's CUDA
    graph trees), plainly then traced: the magic changes nothing torch counts (no recompile, no
    graph break, no CUDA graph skipped: the graphs stay captured and replay) and the losses are
    the same bit for bit (issue 30)."""
    check = Check("compile reduce-overhead step", "torch's counts as plain; the same losses", "issue 30")
    plain, plain_losses = compiled_step_counts(ctx, traced=False)
    traced, traced_losses = compiled_step_counts(ctx, traced=True)
    check.numbers.update({f"plain {k}": v for k, v in plain.items()})
    check.numbers.update({f"traced {k}": v for k, v in traced.items()})
    check.expect(traced == plain, f"torch counted {traced} traced, {plain} plainly")
    check.expect(bool(ctx.torch.equal(traced_losses, plain_losses)), "the losses differ from the plain run's")
    return [check]


def replay_ms(torch: Any, graph: Any, n: int) -> float:
    """The GPU time of one replay of `graph`: the mean of `n`, with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / n


def amp(ctx: Context) -> list[Check]:
    """K: autocast + GradScaler: the scaler's `.item()` is named on the `scaler.step` line."""
    torch = ctx.torch
    check = Check("K AMP + GradScaler", "top sync = scaler.step line, every step; not HOST-BOUND", "")
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(512, 1024).pin_memory() for _ in range(30)]
    cell = """
    for x in batches:
        x = x.to("cuda", non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    """
    names = {"model": model, "opt": opt, "batches": batches, "torch": torch, "scaler": torch.amp.GradScaler("cuda")}
    run = ctx.traced("K-amp", cell, names)
    describe(check, run)
    top = ((run.result.gpu.sync_stalls or {}).get("sites") or [{}])[0]
    check.numbers["top sync"] = f"line {top.get('line')}: {top.get('call')}"
    check.expect(top.get("line") == 8 and bool(top.get("every_step")), f"top sync {top}")
    check.expect(run.verdict != "HOST-BOUND", f"verdict {run.verdict}")
    return [check]


def fork_after_traced_cell(ctx: Context | None = None) -> list[Check]:
    """L: in a fresh interpreter, a traced CPU cell, then a fork child that uses CUDA."""
    check = Check("L fork child after a traced cell", "child exits 0; CUDA not initialised", "F1")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--fork-check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    check.numbers["seconds"] = time.perf_counter() - t0
    check.numbers["output"] = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    check.expect(proc.returncode == 0, f"exit {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-400:]}")
    return [check]


def to_dtype_calls(ctx: Context) -> list[Check]:
    """M: 20 000 `t.to(torch.float16)` calls on a CUDA tensor in a traced loop vs a plain one."""
    torch = ctx.torch
    check = Check("M 20 000 .to(dtype)", f"< {TO_DTYPE_US:.0f} µs a call over plain", "F16")
    t = torch.ones(16, device="cuda")
    body = "for i in range(200):  # traceml: loop\n    for _ in range(100):\n        h = t.to(torch.float16)\n"
    plain = min(ctx.plain(body, {"t": t, "torch": torch}) for _ in range(3))
    run = ctx.traced("M-to-dtype", body, {"t": t, "torch": torch}, "--no-live --lines off")
    wall = float(run.result.loop.wall_ms or 0.0) / 1000.0
    per_call = (wall - plain) / 20_000 * 1e6
    check.verdict = run.verdict
    check.numbers["µs a call over plain"] = per_call
    check.expect(per_call < TO_DTYPE_US, f"{per_call:.2f} µs a call (want < {TO_DTYPE_US})")
    return [check]


def overhead_and_syncs(ctx: Context) -> list[Check]:
    """The GPU path's own cost: per-step overhead of a traced loop of tiny kernels over a plain
    one, and no added synchronisation (sync debug mode sees none; device/event synchronize
    calls do not grow with the steps)."""
    torch = ctx.torch
    check = Check("overhead + syncs", f"≤ {OVERHEAD_US:.0f} µs a step; no sync per step", "F12, F16")
    x = torch.zeros(16, device="cuda")
    counts: dict[str, int] = {"synchronize": 0, "Event.synchronize": 0}
    original_sync = torch.cuda.synchronize
    original_event_sync = torch.cuda.Event.synchronize

    def sync(*args: Any, **kwargs: Any) -> Any:
        counts["synchronize"] += 1
        return original_sync(*args, **kwargs)

    def event_sync(self: Any) -> Any:
        counts["Event.synchronize"] += 1
        return original_event_sync(self)

    results = {}
    for n in (500, 5000):
        cell = f"for i in range({n}):  # traceml: loop\n    y = x + 1\n"
        plain = min(ctx.plain(cell, {"x": x}) for _ in range(3))
        counts.update({"synchronize": 0, "Event.synchronize": 0})
        torch.cuda.set_sync_debug_mode(1)  # the watch leaves a user's mode alone: we see all
        torch.cuda.synchronize = sync
        torch.cuda.Event.synchronize = event_sync
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                run = ctx.traced(f"overhead-{n}", cell, {"x": x}, "--no-live --lines off")
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize = original_sync
            torch.cuda.Event.synchronize = original_event_sync
        wall = float(run.result.loop.wall_ms or 0.0) / 1000.0
        warned = sum("synchronizing CUDA operation" in str(w.message) for w in seen)
        results[n] = ((wall - plain) / n * 1e6, warned, dict(counts))
    per_step = results[5000][0]
    check.verdict = "-"
    check.numbers.update(
        {
            "overhead µs/step": per_step,
            "sync warnings (500, 5000 steps)": (results[500][1], results[5000][1]),
            "synchronize calls (500, 5000)": (results[500][2], results[5000][2]),
        }
    )
    check.expect(per_step <= OVERHEAD_US, f"{per_step:.1f} µs a step (target ≤ {OVERHEAD_US:.0f})")
    check.expect(results[5000][1] == 0, f"{results[5000][1]} sync warnings in a loop without syncs")
    check.expect(results[5000][2] == results[500][2], "synchronize calls grow with the steps")
    return [check]


def hf_trainer(ctx: Context) -> list[Check]:
    """The HF Trainer on the GPU, with and without gradient accumulation: a tiny GPT-2 made from
    a config and data made here (nothing downloaded). Steps are optimizer steps on the GPU
    clock; an in-memory dataset is not the bottleneck."""
    torch = ctx.torch
    try:
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    except Exception as exc:
        failed = Check("HF Trainer", "runs")
        failed.problems.append(f"transformers: {type(exc).__name__}: {exc}")
        return [failed]
    import tempfile

    from torch.utils.data import Dataset

    class Tokens(Dataset[dict[str, Any]]):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 512, (n, 64), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    checks = []
    for accumulation in (1, 4):
        check = Check(f"HF Trainer, accumulation {accumulation}", "30 optimizer steps on the GPU clock", "F7")
        model: Any = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
        model = model.to("cuda")
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(
                output_dir=out,
                max_steps=30,
                per_device_train_batch_size=8,
                gradient_accumulation_steps=accumulation,
                report_to=[],
                logging_strategy="no",
                save_strategy="no",
                disable_tqdm=True,
                dataloader_num_workers=0,
            )
            trainer = Trainer(model=model, args=args, train_dataset=Tokens(8 * 30 * accumulation))
            run = ctx.traced(f"hf-ga{accumulation}", "trainer.train()", {"trainer": trainer})
        describe(check, run)
        check.numbers["step kind"] = run.result.steps.kind
        check.numbers["batches/step"] = run.result.steps.batches_per_step
        check.expect(run.n_steps == 30, f"{run.n_steps} steps, want 30 optimizer steps")
        check.expect(run.result.steps.kind == "optimizer", f"steps are {run.result.steps.kind}")
        bps = run.result.steps.batches_per_step
        check.expect(bps is None or abs(bps - accumulation) < 0.01, f"{bps} batches a step, want {accumulation}")
        check.expect((run.verdict, run.severity) != ("INPUT-BOUND", "critical"), f"verdict {run.verdict} {run.severity}")
        del trainer, model
        checks.append(check)
    return checks


def step_parts(ctx: Context) -> list[Check]:
    """Issue 20: forward, backward and the optimizer step each queue a known GPU time
    (`torch.cuda._sleep`) while the host runs ahead: on the GPU clock the parts are those times,
    the rest is small, and the host's clock sees next to nothing of them."""
    torch = ctx.torch
    fwd_ms, bwd_ms, opt_ms = 6.0, 9.0, 3.0

    class SleepyNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(256, 1)

        def forward(self, x: Any) -> Any:
            torch.cuda._sleep(ctx.cycles(fwd_ms))
            return SleepyGrad.apply(self.fc(x))

    class SleepyGrad(torch.autograd.Function):
        @staticmethod
        def forward(_: Any, x: Any) -> Any:
            return x.view_as(x)

        @staticmethod
        def backward(_: Any, grad: Any) -> Any:
            torch.cuda._sleep(ctx.cycles(bwd_ms))
            return grad

    class SleepySGD(torch.optim.Optimizer):
        """Plain SGD that queues opt_ms first (not a subclass of a hooked torch optimizer whose
        step it would call: its step hooks would run twice a step)."""

        def __init__(self, params: Any, lr: float) -> None:
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            torch.cuda._sleep(ctx.cycles(opt_ms))
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    net = SleepyNet().to("cuda")
    batches = [torch.ones(8, 256).pin_memory() for _ in range(60)]
    cell = """
    for x in batches:
        x = x.to("cuda", non_blocking=True)
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    """
    check = Check("parts of the step", "forward, backward, optimizer on the GPU clock")
    run = ctx.traced("parts", cell, {"batches": batches, "net": net, "opt": SleepySGD(net.parameters(), lr=0.1)})
    describe(check, run)
    s = run.summary
    check.numbers.update({k: s.get(f"{k}_ms") for k in ("forward", "backward", "optimizer", "rest")})
    check.expect(s.get("parts_clock") == "gpu", f"parts on the {s.get('parts_clock')} clock, want gpu")
    check.expect(s.get("forward_modules") == ["net (SleepyNet)"], f"forward of {s.get('forward_modules')}")
    check.near("forward (GPU)", s.get("forward_ms"), fwd_ms)
    check.near("backward (GPU)", s.get("backward_ms"), bwd_ms)
    check.near("optimizer (GPU)", s.get("optimizer_ms"), opt_ms)
    rest = s.get("rest_ms")
    check.expect(rest is not None and rest < 1.0, f"the rest {rest} ms, want < 1 ms")
    host = median_after_warmup(run, "forward_ms")
    check.numbers["forward (host)"] = host
    check.expect(host < fwd_ms / 2, f"the host's forward {host:.2f} ms: the kernels should not block it")
    return [check]


# -- resources: GPU memory per step, held by earlier cells, out of memory ------------------------
# (issue 18) Each figure is checked against torch's own counters, read by hand in the same
# process: max_memory_allocated after reset_peak_memory_stats around one step, memory_allocated
# between steps, untyped_storage().nbytes() of what earlier cells hold.


def _step_peak_by_hand(ctx: Context, step: Callable[[], Any]) -> float:
    """torch's own peak of one step, in MiB: reset, run it, read (the allocator's docs' recipe)."""
    torch = ctx.torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated()) / 2**20


def memory_pressure(ctx: Context) -> list[Check]:
    """A ballast and a temporary buffer make every step peak at about 94.5 % of the device's
    memory: HIGH PRESSURE, with the per-step peak equal to torch's own for that step."""
    torch = ctx.torch
    check = Check("memory: HIGH PRESSURE", "peak >= 92 % of capacity, = torch's peak")
    total = float(torch.cuda.get_device_properties(0).total_memory)
    free, _ = torch.cuda.mem_get_info()
    held = float(torch.cuda.memory_allocated())
    ballast_bytes = int(0.90 * total - held)
    buffer_bytes = int(0.045 * total)
    if ballast_bytes + buffer_bytes > 0.97 * free:
        check.numbers["skipped"] = f"only {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB (a shared GPU)"
        return [check]
    ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device="cuda")
    batches = [torch.ones(1024, device="cuda") for _ in range(12)]

    def one_step() -> None:
        buffer = torch.empty(buffer_bytes, dtype=torch.uint8, device="cuda")
        (batches[0] * 2).sum()
        del buffer

    cell = """
    for x in batches:
        buffer = torch.empty(BUFFER, dtype=torch.uint8, device="cuda")
        y = (x * 2).sum()
        del buffer
    """
    run = ctx.traced("pressure", cell, {"batches": batches, "torch": torch, "BUFFER": buffer_bytes, "ballast": ballast})
    by_hand = _step_peak_by_hand(ctx, one_step)
    s = run.summary
    check.verdict = f"{run.verdict} ({run.clock})"
    check.numbers.update(peak_mib=s.get("gpu_mem_peak_mib"), by_hand_mib=by_hand, share=s.get("gpu_mem_peak_share"))
    labels = [f["label"] for f in s.get("resource_findings") or []]
    check.expect("HIGH PRESSURE" in labels, f"findings {labels}, want HIGH PRESSURE")
    check.expect(s.get("gpu_mem_capacity_mib") == total / 2**20, f"capacity {s.get('gpu_mem_capacity_mib')}")
    peak = s.get("gpu_mem_peak_mib")
    check.expect(peak is not None and abs(peak - by_hand) <= 2.0, f"peak {peak} MiB, torch's {by_hand:.1f} MiB")
    del ballast
    return [check]


def memory_creep(ctx: Context) -> list[Check]:
    """An evaluation without torch.no_grad() that keeps `total = total + loss`: the allocated
    memory at each step's end grows by what one step keeps (torch's memory_allocated between
    two steps by hand), and the finding names line 5."""
    torch = ctx.torch
    check = Check("memory: creep, kept graph", "growth per step = torch's, line 5")
    model = torch.nn.Linear(4096, 4096).cuda()
    batches = [torch.randn(256, 4096, device="cuda") for _ in range(8)] * 6
    cell = """
    total = 0
    for x in batches:
        loss = model(x).pow(2).mean()
        total = total + loss
    """
    run = ctx.traced("creep", cell, {"model": model, "batches": batches})
    ctx.shell.user_ns.pop("total", None)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    total = model(batches[0]).pow(2).mean()
    total = total + model(batches[1]).pow(2).mean()
    first = torch.cuda.memory_allocated()
    total = total + model(batches[2]).pow(2).mean()
    per_step = (torch.cuda.memory_allocated() - first) / 2**20
    del total
    s = run.summary
    check.verdict = f"{run.verdict} ({run.clock})"
    check.numbers.update(per_step_mib=s.get("gpu_mem_growth_per_step_mib"), by_hand_mib=per_step, before=before / 2**20)
    found = [f for f in s.get("resource_findings") or [] if f["label"] in ("MEMORY CREEP", "MEMORY RISING")]
    check.expect(bool(found), f"no MEMORY RISING/CREEP in {[f['label'] for f in s.get('resource_findings') or []]}")
    if found:
        check.expect(found[0]["line"] == 5, f"line {found[0]['line']}, want 5")
    got = s.get("gpu_mem_growth_per_step_mib")
    check.expect(got is not None and abs(got - per_step) <= max(0.05 * per_step, 0.5), f"{got} MiB a step, torch's {per_step:.2f}")
    return [check]


def memory_held(ctx: Context) -> list[Check]:
    """Tensors, a module and a list left by earlier cells: named, biggest first, with torch's
    own storage sizes; the alias of the same module counted once."""
    torch = ctx.torch
    check = Check("memory: held by earlier cells", "holders by name = storage sizes")
    old_model = torch.nn.Linear(8192, 8192).cuda()  # 256 MiB + 32 KiB
    outputs = [torch.empty(100 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(3)]
    batches = [torch.ones(1024, device="cuda") for _ in range(8)]
    names = {"old_model": old_model, "same_model": old_model, "outputs": outputs, "batches": batches}
    run = ctx.traced("held", "for x in batches:\n    y = (x * 2).sum()\n", names)
    devices = (run.result.resources.held_before or {}).get("devices") or []
    holders = {h["name"]: h["mib"] for h in devices[0]["holders"]} if devices else {}
    want_model = sum(p.untyped_storage().nbytes() for p in old_model.parameters()) / 2**20
    check.numbers.update(holders=holders, allocated=devices[0]["allocated_mib"] if devices else None)
    check.expect(abs(holders.get("old_model", 0.0) - want_model) < 0.01, f"old_model {holders.get('old_model')} MiB, want {want_model:.2f}")
    check.expect(abs(holders.get("outputs", 0.0) - 300.0) < 0.01, f"outputs {holders.get('outputs')} MiB, want 300")
    check.expect("same_model" not in holders, "the alias was counted twice")
    return [check]


def memory_oom(ctx: Context) -> list[Check]:
    """A cell whose 4th step asks for twice the device's memory: the error is the user's,
    unchanged, and the report explains it (step 4, the request, the capacity)."""
    from IPython.utils.capture import capture_output

    import traceml_jupyter

    torch = ctx.torch
    check = Check("memory: out of memory explained", "OutOfMemoryError, step 4, request")
    total = int(torch.cuda.get_device_properties(0).total_memory)
    ctx.shell.user_ns.update(batches=[torch.ones(1024, device="cuda") for _ in range(8)], torch=torch, HUGE=2 * total)
    cell = (
        "%%traceml --no-live --name oom\n"
        "for i, x in enumerate(batches):\n"
        "    y = (x * 2).sum()\n"
        "    if i == 3:\n"
        "        big = torch.empty(HUGE, dtype=torch.uint8, device='cuda')\n"
    )
    with capture_output() as out:
        result = ctx.shell.run_cell(cell)
    error = result.error_in_exec
    run = traceml_jupyter.last()
    text = run.text() if run is not None else ""
    check.verdict = type(error).__name__
    check.expect(isinstance(error, torch.cuda.OutOfMemoryError), f"the cell raised {error!r}")
    oom = run.result.resources.oom or {}
    check.numbers.update(step=oom.get("step"), requested_mib=oom.get("requested_mib"), capacity_mib=oom.get("capacity_mib"))
    check.expect(oom.get("step") == 4, f"step {oom.get('step')}, want 4")
    check.expect("OUT OF MEMORY: CUDA ran out of memory in step 4" in text, "the report does not explain it")
    check.expect("Also: OUT OF MEMORY" in out.stdout + "".join(o.data.get("text/plain", "") for o in out.outputs), "not shown")
    sys.last_value = sys.last_traceback = None  # nothing of the failed cell stays referenced
    return [check]


def allocator_reads(ctx: Context) -> list[Check]:
    """The per-step reads (memory_stats_as_nested_dict + reset_peak_memory_stats): host µs a
    pair, and no synchronisation (sync debug mode "error" would raise)."""
    torch = ctx.torch
    check = Check("memory: allocator reads", "no sync; µs a read")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.cuda.memory_stats_as_nested_dict(0)
        torch.cuda.reset_peak_memory_stats(0)
        synced = False
    except RuntimeError:
        synced = True
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        torch.cuda.memory_stats_as_nested_dict(0)
        torch.cuda.reset_peak_memory_stats(0)
    us = (time.perf_counter() - t0) / n * 1e6
    check.numbers["us_per_read"] = us
    check.expect(not synced, "an allocator read synchronised")
    return [check]


RESOURCE_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("pressure", "GPU memory: a step peaking at 94.5 % of the device", "", "HIGH PRESSURE, = torch's peak", memory_pressure),
    Scenario("creep", "GPU memory: total = total + loss without no_grad", "", "RISING/CREEP, line 5", memory_creep),
    Scenario("held", "GPU memory held by earlier cells", "", "holders by name", memory_held),
    Scenario("oom", "an out-of-memory error in step 4", "", "explained, unchanged", memory_oom),
    Scenario("allocator", "the per-step allocator reads", "", "no sync", allocator_reads),
)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("demo", "the demo notebook's fast, slow, fixed, h2d", "", "verdicts from measured ratios", demo_scenarios),
    Scenario("delays", "injected data and GPU delays, with and without .item()", "", "INPUT-BOUND, waits ± 5 %", injected_delays),
    Scenario("known", "a known GPU time and its line's GPU cost", "", "COMPUTE-BOUND, 8 ms", known_gpu_time),
    Scenario("h2d", "64 MiB copies, pageable then pinned", "", "H2D-BOUND, bytes and lines", copies),
    Scenario("tiny", "200 tiny kernels a step", "F5", "HOST-BOUND", tiny_kernels),
    Scenario("item", ".item() every step", "", "COMPUTE-BOUND, the line named", item_every_step),
    Scenario("A", "hidden input: host waits hidden by queued GPU work", "F9", "COMPUTE-BOUND", hidden_input),
    Scenario("B", "starved: loader slower than the GPU", "", "INPUT-BOUND critical", starved),
    Scenario("C", "syncs each step: synchronize (NVML on/off), .to('cpu')", "F5, F9", "not HOST-BOUND", gpu_bound_syncs),
    Scenario("D", "a stale GPU tensor and a CPU loop", "F4", "CPU clock", stale_tensor_cpu_loop),
    Scenario("D2", "a loop of in-place kernels (allocates nothing on the GPU)", "F4", "GPU clock", in_place_loop),
    Scenario("E", "next(it) inside a range loop", "F6", "INPUT-BOUND", fetch_in_range_body),
    Scenario("F", "side stream body, set_stream mid-loop, side-stream prefetcher (F1, F2, G, G2)", "F3, F10, F14", "no exception; right times", side_streams),
    Scenario("H", "pageable non_blocking copies", "F11", "a timed wait", pageable_non_blocking),
    Scenario("I", "70 000 steps past the fold", "F12, F13", "all timings, no spike", long_run),
    Scenario("J", "CUDA graph replay", "", "no exception", cuda_graph),
    Scenario("compile", "a training step under torch.compile(mode='reduce-overhead'), plain vs traced", "issue 30", "the same compiles, no CUDA graph skipped, the same losses", compiled_graphs_stay),
    Scenario("K", "AMP + GradScaler", "", "scaler.step named", amp),
    Scenario("L", "fork child after a traced cell (fresh interpreter)", "F1", "child exits 0", fork_after_traced_cell),
    Scenario("M", "20 000 .to(dtype) pass-throughs", "F16", "< 1 µs a call", to_dtype_calls),
    Scenario("overhead", "per-step overhead and syncs on the GPU path", "F12, F16", "≤ 10 µs a step, no sync", overhead_and_syncs),
    Scenario("hf", "HF Trainer with and without gradient accumulation", "F7", "optimizer steps on the GPU clock", hf_trainer, False),
    Scenario("parts", "forward, backward, optimizer of known GPU times (issue 20)", "", "the parts on the GPU clock", step_parts),
    *RESOURCE_SCENARIOS,
)


def scenario_list(first: bool = True, second: bool = True) -> str:
    lines = []
    if first:
        lines.append(f"{len(SCENARIOS)} scenario groups (preflight first; hygiene after every cell):")
        for s in SCENARIOS:
            finding = f" [{s.finding}]" if s.finding else ""
            lines.append(f"  {s.key:<9} {s.title}{finding}: {s.expected}")
        lines.append("  not covered on one GPU: DataParallel replicas (F2), MIG (F5, F9): stand-in GPU tests")
    if second:
        lines.extend(second_pass().listed())
    return "\n".join(lines)


def second_pass() -> Any:
    """scripts/gpu_second_pass.py (issue 23), which imports this module as `gpu_check`."""
    sys.modules.setdefault("gpu_check", sys.modules[__name__])
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import gpu_second_pass

    return gpu_second_pass


# -- running them ---------------------------------------------------------------------------------


def run_all(shell: Any | None = None, only: Callable[[str], bool] | None = None, second: bool = False) -> list[Check]:
    """Preflight, then each scenario group with hygiene after it; then the event-leak check.
    `only`: the groups of either pass whose key it accepts; else the first pass's, and with
    `second` the second pass's after them (each pass within its budget)."""
    began = time.perf_counter()
    ctx = Context(shell or new_shell())
    torch = ctx.torch
    checks = preflight(ctx)
    torch.cuda.synchronize()
    gc.collect()
    ctx.baseline_mib = torch.cuda.memory_allocated() / 2**20
    later = second_pass()
    first_budget = BUDGET_WITH_SECOND_S if second else BUDGET_S
    planned = [(s, began, first_budget) for s in SCENARIOS if only is None or only(s.key)]
    if second or only is not None:
        planned += [(s, None, later.SECOND_BUDGET_S) for s in later.SECOND_PASS if only is None or only(s.key)]
    second_began: float | None = None
    for scenario, since, budget in planned:
        if since is None:  # the second pass: its budget counts from its first group
            second_began = second_began or time.perf_counter()
            since = second_began
        if time.perf_counter() - since > budget:
            late = Check(scenario.title, scenario.expected, scenario.finding)
            late.problems.append(f"not run: the {budget:.0f} s budget was spent")
            checks.append(late)
            continue
        before = set(ctx.shell.user_ns)
        t0 = time.perf_counter()
        try:
            found = scenario.run(ctx)
        except Exception as exc:
            failed = Check(scenario.title, scenario.expected, scenario.finding)
            failed.problems.append(f"{type(exc).__name__}: {exc}")
            found = [failed]
        for check in found:
            check.finding = check.finding or scenario.finding
        found[-1].problems.extend(f"hygiene: {p}" for p in ctx.hygiene())
        memory = ctx.memory_back(before)
        if scenario.memory_must_return:
            found[-1].problems.extend(f"hygiene: {p}" for p in memory)
        elif memory:
            found[-1].numbers["memory kept"] = memory[0]
        found[-1].seconds = time.perf_counter() - t0
        checks.extend(found)
    checks.append(event_leak_check(ctx))
    return checks


def event_leak_check(ctx: Context) -> Check:
    """Live torch.cuda.Event objects before and after forgetting every run."""
    from traceml_jupyter import kernel_state

    torch = ctx.torch
    check = Check("events after the runs", "0 after forgetting the runs", "F17")
    gc.collect()
    before = sum(isinstance(o, torch.cuda.Event) for o in gc.get_objects())
    kernel_state.RUNS.clear()
    gc.collect()
    after = sum(isinstance(o, torch.cuda.Event) for o in gc.get_objects())
    check.numbers.update({"events with the runs": before, "after": after})
    check.expect(after == 0, f"{after} CUDA events still alive")
    return check


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def table(checks: list[Check]) -> str:
    cols = ("wait", "compute", "step", "h2d", "backlog", "syncs", "util")
    head = f"{'scenario':<34} {'verdict':<34} " + " ".join(f"{c:>8}" for c in cols)
    lines = [head, "-" * len(head)]
    for c in checks:
        nums = " ".join(f"{_cell(c.numbers.get(k)):>8}" for k in cols)
        lines.append(f"{c.scenario:<34} {c.verdict:<34} {nums}  {'ok' if c.ok else 'FAIL'}")
        lines.append(" " * 35 + f"expected: {c.expected}" + (f" [{c.finding}]" if c.finding else ""))
        extra = {k: v for k, v in c.numbers.items() if k not in cols and not isinstance(v, dict)}
        if extra:
            lines.append(" " * 35 + ", ".join(f"{k}: {_cell(v)}" for k, v in extra.items()))
        lines.extend(" " * 35 + "! " + p for p in c.problems)
    return "\n".join(lines)


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or ROOT / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def write_json(checks: list[Check], info: dict[str, Any]) -> Path:
    path = out_dir() / "gpu_check.json"
    data = {**info, "checks": [{**asdict(c), "ok": c.ok} for c in checks]}
    path.write_text(json.dumps(_jsonable(data), indent=1), encoding="utf-8")
    return path


# -- the fork check, alone: a fork child after a traced cell -----------------------------------------


def fork_check() -> int:
    """In this (fresh) interpreter: a traced CPU cell must not initialise CUDA; then a fork child
    uses CUDA (a GPU machine) or checks it is not in a bad fork (a CPU machine). 0: ok."""
    import torch
    from IPython.utils.capture import capture_output

    shell = new_shell()
    shell.user_ns["torch"] = torch
    cell = """%%traceml --name fork-check
model = torch.nn.Linear(32, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 32)), batch_size=16)
for (x,) in loader:
    opt.zero_grad()
    loss = model(x.to("cpu")).square().mean()
    loss.backward()
    opt.step()
    v = loss.item()
"""
    with capture_output():
        result = shell.run_cell(cell)
    if result.error_in_exec is not None:
        print(f"fork check: the traced cell failed: {result.error_in_exec!r}")
        return 1
    if torch.cuda.is_initialized():
        print("fork check: the traced CPU cell initialised CUDA")
        return 1
    gpu = torch.backends.cuda.is_built() and getattr(torch.cuda, "_device_count_nvml", lambda: -1)() > 0
    pid = os.fork()
    if pid == 0:  # the child: what a fork-started DDP rank does first
        code = 0
        try:
            if torch.cuda._is_in_bad_fork():
                code = 3
            elif gpu:
                torch.zeros(1, device="cuda").add_(1).sum().item()
        except Exception as exc:
            print(f"fork check: the child failed: {type(exc).__name__}: {exc}", flush=True)
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    where = "used CUDA" if gpu else "is not in a bad fork (no GPU here)"
    print(f"fork check: {'ok' if code == 0 else f'FAIL ({code})'}: the child {where}")
    return 0 if code == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every scenario (the default)")
    parser.add_argument("--only", default=None, help="comma-separated scenario keys")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--fork-check", action="store_true", help="a fork child after a traced cell: no CUDA initialised before it (CPU or GPU)")
    parser.add_argument("--second", action="store_true", help="the second pass (gpu_second_pass.py, ≤ 60 s)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the second pass's child process
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.fork_check:
        return fork_check()
    if args.child:
        return int(second_pass().child_main(args.child))
    first = args.all or not args.second
    if args.list:
        print(scenario_list(first, args.second or not args.all))
        return 0
    if not cuda_available():
        print("skipped: no CUDA device")
        print(scenario_list(first, args.second))
        return 0
    import torch

    only = None
    if args.only:
        keys = {k.strip() for k in args.only.split(",")}
        only = keys.__contains__
    elif args.second and not args.all:
        only = {s.key for s in second_pass().SECOND_PASS}.__contains__
    print(f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA {torch.version.cuda}")
    t0 = time.perf_counter()
    checks = run_all(only=only, second=args.second)
    elapsed = time.perf_counter() - t0
    print(table(checks))
    calibration = second_pass().calibration_report(checks)
    if calibration:
        print(second_pass().calibration_text(calibration))
    failed = [c for c in checks if not c.ok]
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seconds": elapsed,
        "ok": not failed,
        "calibration": calibration,
    }
    path = write_json(checks, info)
    print(f"{len(checks) - len(failed)} of {len(checks)} checks ok in {elapsed:.0f} s; JSON: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
