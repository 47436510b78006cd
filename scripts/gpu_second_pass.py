"""The second pass of the one GPU validation (issue 23; ../shared/reviews/gpu-double-review.md):
what a real GPU would still prove wrong after the stand-in's tests, in under 60 s, run by
scripts/gpu_check.py (`--second`, or `--only KEY,...`; `--all --second` runs both passes in
one process within 5 minutes).

- calibration: the GPU's launch-queue depth, idle event latency, `elapsed_time`'s type,
  resolution and errors, NVML's update period and lag (a cadence probe across busy/idle
  edges), the host cost of a CUDA event call and of `is_current_stream_capturing()`: written
  to the JSON next to the stand-in's defaults (tests/fake_gpu.py, STAND_IN_DEFAULTS), so one
  real run corrects the stand-in;
- CUDA graphs: the documentation's whole-network capture then replays, a pinned non_blocking
  copy inside a capture, torch.compile(mode="reduce-overhead");
- the loop's device without the allocator: in-place kernels + synchronize(), a graph replay +
  `.item()`, and in a child process with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync and
  CUDA_LAUNCH_BLOCKING=1 a training loop (GPU clock) and a GPU-bound loop without NVML (the
  "all syncs seen" claim withheld, no HOST-BOUND);
- NVML: a 50 %-duty loop (host share 0.5 ± 0.15), a copy-only loop (utilisation ≈ 0,
  H2D-BOUND);
- syncs: which calls warn in sync debug mode and which make the host wait behind a 20 ms
  kernel (pageable non_blocking at 4 KB and 64 MiB included), against the stand-in's table;
  `empty_cache()` every step without NVML; the side-stream copy waited for with `wait_event`;
- our own cost: µs per timed copy (a 20-tensor pinned dict every step), µs per sync warning,
  the `--lines on` overhead per step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from typing import Any

from gpu_check import (
    ROOT,
    Check,
    Context,
    Scenario,
    _no_nvml,
    describe,
    new_shell,
    replay_ms,
    waited_side_copy,
)

SECOND_BUDGET_S = 60.0  # groups of the second pass not started by then are reported as not run
CHILD_MARK = "SECOND-PASS-CHILD: "
CHILD_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "CUDA_LAUNCH_BLOCKING": "1"}


def stand_in_defaults() -> dict[str, Any]:
    """What the stand-in assumes (tests/fake_gpu.py), for the JSON next to the measured values."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from fake_gpu import STAND_IN_DEFAULTS

        return dict(STAND_IN_DEFAULTS)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        sys.path.remove(str(ROOT / "tests"))


# -- calibration ---------------------------------------------------------------------------------


def calibration(ctx: Context) -> list[Check]:
    """The GPU's launch queue, event latency and `elapsed_time`, NVML's cadence, CUDA calls' host
    cost: measured, written to the JSON next to the stand-in's defaults."""
    torch = ctx.torch
    check = Check("calibration", "measured; written next to the stand-in's defaults")
    measured: dict[str, Any] = {}
    # The launch queue: behind a 0.4 s kernel, tiny launches until one blocks the host.
    torch.cuda.synchronize()
    torch.cuda._sleep(ctx.cycles(400))
    depth, blocked_ms = None, None
    for i in range(60_000):
        t0 = time.perf_counter()
        torch.cuda._sleep(1)
        dt = time.perf_counter() - t0
        if dt > 0.002:
            depth, blocked_ms = i + 1, dt * 1e3
            break
    torch.cuda.synchronize()
    measured["launch_queue_depth"] = depth if depth is not None else "> 60000"
    measured["first_blocked_launch_ms"] = blocked_ms
    # An event on an idle GPU: from record to query() True, host-side.
    ev = torch.cuda.Event(enable_timing=True)
    lat = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        ev.record()
        while not ev.query():
            pass
        lat.append((time.perf_counter_ns() - t0) / 1e3)
    lat.sort()
    measured["idle_event_latency_us"] = lat[len(lat) // 2]
    # elapsed_time: its type, its resolution, and what it does on incomplete or unrecorded events.
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    diffs = []
    for _ in range(50):
        a.record()
        b.record()
        b.synchronize()
        diffs.append(float(a.elapsed_time(b)))
    positive = sorted(d for d in diffs if d > 0)
    measured["elapsed_time_type"] = type(a.elapsed_time(b)).__name__
    measured["elapsed_time_resolution_us"] = positive[0] * 1e3 if positive else 0.0
    a.record()
    torch.cuda._sleep(ctx.cycles(50))
    b.record()
    try:
        a.elapsed_time(b)
        measured["elapsed_time_incomplete_raises"] = False
    except RuntimeError as exc:
        measured["elapsed_time_incomplete_raises"] = True
        measured["elapsed_time_incomplete_error"] = str(exc).splitlines()[0][:120]
    torch.cuda.synchronize()
    try:
        torch.cuda.Event(enable_timing=True).elapsed_time(b)
        measured["elapsed_time_unrecorded_raises"] = False
    except RuntimeError:
        measured["elapsed_time_unrecorded_raises"] = True
    # Host cost of CUDA calls: an event record and query, is_current_stream_capturing().
    n = 5000
    t0 = time.perf_counter()
    for _ in range(n):
        ev.record()
    measured["cuda_call_us"] = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        torch.cuda.is_current_stream_capturing()
    measured["is_current_stream_capturing_us"] = (time.perf_counter() - t0) / n * 1e6
    measured.update(nvml_cadence(ctx))
    check.numbers["calibration"] = measured
    check.numbers.update({k: v for k, v in measured.items() if k in ("launch_queue_depth", "idle_event_latency_us")})
    check.expect(depth is None or depth > 16, f"launches block after {depth} commands")
    check.expect(measured["idle_event_latency_us"] < 1000, f"idle event latency {measured['idle_event_latency_us']:.0f} µs")
    return [check]


def nvml_cadence(ctx: Context) -> dict[str, Any]:
    """NVML's utilisation polled every 5 ms across two busy/idle edges of 300 ms: how often the
    value changes (its update period) and how late it follows an edge (its lag)."""
    torch = ctx.torch
    try:
        import pynvml

        from traceml_jupyter.capture.resources.nvml import UTIL_WINDOW_S, pci_bus_id

        pynvml.nvmlInit()
    except Exception as exc:
        return {"nvml": f"n/a ({type(exc).__name__}: {exc})"}
    try:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(str(pci_bus_id(torch.cuda.get_device_properties(0))).encode())
        samples: list[tuple[float, int]] = []
        edges: list[tuple[float, bool]] = []
        t_start = time.perf_counter()
        for busy in (True, False, True, False):
            edges.append((time.perf_counter() - t_start, busy))
            if busy:
                torch.cuda._sleep(ctx.cycles(300))
            end = time.perf_counter() + 0.3
            while time.perf_counter() < end:
                samples.append((time.perf_counter() - t_start, int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)))
                time.sleep(0.005)
        torch.cuda.synchronize()
    finally:
        pynvml.nvmlShutdown()
    changes = [t for (t, v), (_, w) in zip(samples[1:], samples, strict=False) if v != w]
    # The value changes only when NVML updates it: the shortest gap between two changes (past
    # the polling's own 5 ms) is its update period.
    gaps = sorted(g for g in (b - a for a, b in zip(changes, changes[1:], strict=False)) if g > 0.01)
    lags = []
    for t_edge, busy in edges[1:]:
        after = [t for t, v in samples if t >= t_edge and ((v >= 50) if busy else (v <= 50))]
        if after:
            lags.append(after[0] - t_edge)
    return {
        "nvml_update_period_s": gaps[0] if gaps else None,
        "nvml_change_gap_median_s": gaps[len(gaps) // 2] if gaps else None,
        "nvml_lag_s": max(lags) if lags else None,
        "nvml_values_seen": len(set(v for _, v in samples)),
        "traceml_util_window_s": UTIL_WINDOW_S,
    }


# -- CUDA graphs ----------------------------------------------------------------------------------


def graph_capture(ctx: Context) -> list[Check]:
    """G1: the documentation's whole-network capture (side-stream warm-up, capture of forward,
    backward and optimizer step) then a replay loop; G2c: a pinned non_blocking copy inside a
    capture. No exception, the capture intact, each replay a step on the GPU clock."""
    torch = ctx.torch
    checks = []
    check = Check("G1 whole-network capture", "no exception; replays are steps; GPU compute ≈ replay")
    width = 2048  # about 1 ms of forward, backward and step a replay on a large GPU
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    static_x = torch.randn(1024, width, device="cuda")
    inputs = [torch.randn(1024, width, device="cuda") for _ in range(40)]
    cell = """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            opt.zero_grad(set_to_none=True)
            model(static_x).square().mean().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = model(static_x).square().mean()
        static_loss.backward()
        opt.step()
    for x in inputs:
        static_x.copy_(x)
        g.replay()
    """
    run = ctx.traced("G1-graph", cell, {"model": model, "opt": opt, "static_x": static_x, "inputs": inputs, "torch": torch})
    describe(check, run)
    graphs = run.result.gpu.cuda_graphs or {}
    replay = replay_ms(torch, ctx.shell.user_ns["g"], 10)
    check.numbers.update({"replay ms": replay, "replays": graphs.get("replays"), "steps": run.n_steps})
    check.expect(graphs.get("captures") == 1 and graphs.get("invalidated") == 0, f"graphs {graphs}")
    check.expect(run.n_steps == 3 + 40, f"{run.n_steps} steps, want 3 warm-up + 40 replays")
    check.near("GPU compute", run.summary["compute_ms"], replay, 0.15)
    checks.append(check)

    check = Check("G2c pinned copy inside a capture", "no exception; the copy left to the replay")
    pinned = torch.ones(4 * 2**20).pin_memory()
    cell = """
    for i in range(30):  # traceml: loop
        if i == 5:
            g2 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g2):
                xg = pinned.to("cuda", non_blocking=True)
                yg = xg * 2
        if i >= 5:
            g2.replay()
        else:
            yg = pinned.to("cuda", non_blocking=True) * 2
        v = yg[0].item()
    """
    try:  # torch itself first, without traceml: a refusal there is not ours to check
        ctx.plain(cell, {"pinned": pinned, "torch": torch})
    except Exception as exc:
        check.verdict = "-"
        check.numbers["without traceml"] = f"torch refuses it: {type(exc).__name__}: {str(exc)[:120]}"
        checks.append(check)
        return checks
    run = ctx.traced("G2c-copy-in-capture", cell, {"pinned": pinned, "torch": torch})
    describe(check, run)
    graphs = run.result.gpu.cuda_graphs or {}
    check.numbers["skipped in capture"] = graphs.get("calls_skipped_during_capture")
    check.expect(graphs.get("invalidated") == 0 and graphs.get("replays") == 25, f"graphs {graphs}")
    checks.append(check)
    return checks


def compiled_reduce_overhead(ctx: Context) -> list[Check]:
    """G3: torch.compile(mode="reduce-overhead") (CUDA graph trees, "thread_local" capture inside
    the user's steps): no exception, GPU clock, replays counted."""
    torch = ctx.torch
    check = Check("G3 torch.compile reduce-overhead", "no exception; GPU clock; replays")
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    batches = [torch.randn(256, 512).pin_memory() for _ in range(40)]
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(batches[0].cuda())  # the compile itself, outside the traced cell
    check.numbers["compile s"] = time.perf_counter() - t0
    cell = """
    with torch.no_grad():
        for x in batches:
            x = x.to("cuda", non_blocking=True)
            y = compiled(x)
            v = y[0, 0].item()
    """
    run = ctx.traced("G3-compile", cell, {"compiled": compiled, "batches": batches, "torch": torch})
    describe(check, run)
    check.numbers["replays"] = (run.result.gpu.cuda_graphs or {}).get("replays")
    check.expect(run.n_steps == 40, f"{run.n_steps} steps")
    return [check]


# -- the loop's device without the allocator --------------------------------------------------------


def no_allocation_loops(ctx: Context) -> list[Check]:
    """D3: in-place kernels then torch.cuda.synchronize() every step; D4: a graph replay then
    `.item()` every step. Neither allocates: both on the GPU clock."""
    torch = ctx.torch
    checks = []
    check = Check("D3 in-place + synchronize", "GPU clock")
    cell = """
    for i in range(40):  # traceml: loop
        x.add_(1)
        torch.cuda._sleep(CYCLES)
        torch.cuda.synchronize()
    """
    run = ctx.traced("D3-sync", cell, {"x": torch.zeros(16, device="cuda"), "torch": torch, "CYCLES": ctx.cycles(3)})
    describe(check, run)
    check.near("GPU compute", run.summary["compute_ms"], 3.0, 0.15)
    checks.append(check)

    check = Check("D4 graph replay + .item()", "GPU clock; replays are the steps")
    static = torch.zeros(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        static.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        static.add_(1)
        torch.cuda._sleep(ctx.cycles(3))
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    cell = """
    for i in range(40):  # traceml: loop
        g.replay()
        v = static[0].item()
    """
    run = ctx.traced("D4-replay-item", cell, {"g": g, "static": static})
    describe(check, run)
    check.numbers["allocations in the loop"] = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    check.near("GPU compute", run.summary["compute_ms"], 3.0, 0.15)
    checks.append(check)
    del g
    return checks


def child_envs(ctx: Context) -> list[Check]:
    """In a child process with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync and
    CUDA_LAUNCH_BLOCKING=1: a training loop is on the GPU clock although the allocator counts
    nothing; a GPU-bound loop without NVML withholds "all syncs seen" and is not HOST-BOUND."""
    env = {**os.environ, **CHILD_ENV}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--child", "envs"],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=str(ROOT),
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(CHILD_MARK)]
    if proc.returncode != 0 or not lines:
        failed = Check("child: cudaMallocAsync + CUDA_LAUNCH_BLOCKING=1", "runs")
        failed.problems.append(f"exit {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-600:]}")
        return [failed]
    checks = []
    for data in json.loads(lines[-1][len(CHILD_MARK) :]):
        check = Check(data["scenario"], data["expected"], verdict=data["verdict"], numbers=data["numbers"], problems=data["problems"])
        checks.append(check)
    checks[-1].numbers["child s"] = time.perf_counter() - t0
    return checks


def child_main(which: str) -> int:
    """Run in the child process: its checks as one JSON line on stdout."""
    import torch

    ctx = Context(new_shell())
    torch.cuda._sleep(int(2e8))
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(int(1e7))
    end.record()
    end.synchronize()
    ctx.cycles_per_ms = 1e7 / float(start.elapsed_time(end))
    checks = []
    check = Check("E1 cudaMallocAsync training loop", "GPU clock; allocation counts 0")
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(256, 1024).pin_memory() for _ in range(30)]
    cell = """
    for x in batches:
        x = x.to("cuda", non_blocking=True)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        v = loss.item()
    """
    run = ctx.traced("E1-async-alloc", cell, {"model": model, "opt": opt, "batches": batches})
    describe(check, run)
    check.numbers["backend"] = torch.cuda.get_allocator_backend()
    check.numbers["allocation.all.allocated"] = torch.cuda.memory_stats()["allocation.all.allocated"]
    check.expect(check.numbers["backend"] == "cudaMallocAsync", "the child's allocator is not cudaMallocAsync")
    checks.append(check)

    check = Check("E2 CUDA_LAUNCH_BLOCKING=1, no NVML", "not HOST-BOUND; 'all syncs seen' withheld")
    undo = _no_nvml(ctx)
    try:
        cell = """
        for x in batches:
            torch.cuda._sleep(CYCLES)
            y = x * 2
        """
        gpu_batches = [torch.ones(256, device="cuda") for _ in range(40)]
        run = ctx.traced("E2-launch-blocking", cell, {"batches": gpu_batches, "torch": torch, "CYCLES": ctx.cycles(8)})
    finally:
        undo()
    describe(check, run)
    s = run.summary
    check.numbers["syncs_hidden"] = s.get("syncs_hidden")
    check.expect(run.verdict != "HOST-BOUND", f"verdict {run.verdict}: {run.verdict_detail.why}")
    check.expect(not s.get("syncs_all_seen"), "'all syncs seen' claimed under CUDA_LAUNCH_BLOCKING=1")
    checks.append(check)
    out = [{"scenario": c.scenario, "expected": c.expected, "verdict": c.verdict, "numbers": c.numbers, "problems": c.problems} for c in checks]
    print(CHILD_MARK + json.dumps(out, default=str), flush=True)
    return 0


# -- NVML -----------------------------------------------------------------------------------------


def nvml_loops(ctx: Context) -> list[Check]:
    """N1: 5 ms of GPU work then 5 ms of host sleep, synchronised, each step: NVML sees the GPU
    half busy, host share 0.5 ± 0.15. N2: 64 MiB pinned copies and no kernel: utilisation ≈ 0
    (NVML counts kernels, not copies), H2D-BOUND."""
    torch = ctx.torch
    checks = []
    check = Check("N1 50 %-duty loop", "host share 0.5 ± 0.15 (NVML)")
    cell = """
    for i in range(150):  # traceml: loop
        torch.cuda._sleep(CYCLES)
        torch.cuda.synchronize()
        time.sleep(0.005)
    """
    run = ctx.traced("N1-duty", cell, {"torch": torch, "time": time, "CYCLES": ctx.cycles(5)})
    describe(check, run)
    share = run.summary.get("host_share")
    check.numbers["host_share"] = share
    check.expect(share is not None and abs(share - 0.5) <= 0.15, f"host share {share}, want 0.5 ± 0.15")
    checks.append(check)

    check = Check("N2 copy-only loop", "utilisation ≈ 0; H2D-BOUND")
    big = torch.ones(16 * 2**20).pin_memory()
    cell = """
    for i in range(800):  # traceml: loop (about 1 s: NVML needs 3 samples inside)
        x = big.to("cuda", non_blocking=True)
    """
    run = ctx.traced("N2-copies", cell, {"big": big})
    describe(check, run)
    busy = run.summary.get("gpu_busy_share")
    check.expect(run.verdict == "H2D-BOUND", f"verdict {run.verdict}")
    check.expect(busy is None or busy <= 0.2, f"NVML utilisation {busy} for copies only")
    checks.append(check)
    return checks


# -- syncs ----------------------------------------------------------------------------------------

# What the stand-in and the sync watch assume: (warns in sync debug mode, the host waits for a
# kernel queued before). The real table is measured against it.
EXPECTED_SYNCS = {
    "x.item()": (True, True),
    "x.cpu()": (True, True),
    "x.to('cpu')": (True, True),
    "torch.cuda.synchronize()": (False, True),
    "Event.synchronize()": (False, True),
    "Stream.synchronize()": (True, True),
    "torch.nonzero(x)": (True, True),
    "x[x > 0]": (True, True),
    "pageable 4 KB .to(non_blocking)": (False, False),
    "pageable 64 MiB .to(non_blocking)": (False, True),
    "pinned 64 MiB .to(non_blocking)": (False, False),
    "pageable 4 KB .to() blocking": (True, True),
    "torch.cuda.empty_cache()": (False, True),
}


def sync_table(ctx: Context) -> list[Check]:
    """S1: each call behind a 20 ms kernel: does it warn in sync debug mode, does the host wait?
    Against what the stand-in and the sync watch assume (a difference is a stand-in to correct)."""
    torch = ctx.torch
    check = Check("S1 sync-behaviour table", "as the stand-in assumes")
    x = torch.ones(1024, device="cuda")
    small, large = torch.ones(1024), torch.ones(16 * 2**20)
    pinned = large.pin_memory()
    ev = torch.cuda.Event()
    calls = {
        "x.item()": lambda: x[0].item(),
        "x.cpu()": lambda: x.cpu(),
        "x.to('cpu')": lambda: x.to("cpu"),
        "torch.cuda.synchronize()": torch.cuda.synchronize,
        "Event.synchronize()": lambda: (ev.record(), ev.synchronize()),
        "Stream.synchronize()": lambda: torch.cuda.current_stream().synchronize(),
        "torch.nonzero(x)": lambda: torch.nonzero(x),
        "x[x > 0]": lambda: x[x > 0],
        "pageable 4 KB .to(non_blocking)": lambda: small.to("cuda", non_blocking=True),
        "pageable 64 MiB .to(non_blocking)": lambda: large.to("cuda", non_blocking=True),
        "pinned 64 MiB .to(non_blocking)": lambda: pinned.to("cuda", non_blocking=True),
        "pageable 4 KB .to() blocking": lambda: small.to("cuda"),
        "torch.cuda.empty_cache()": torch.cuda.empty_cache,
    }
    table: dict[str, Any] = {}
    for name, call in calls.items():
        torch.cuda.synchronize()
        torch.cuda._sleep(ctx.cycles(20))
        torch.cuda.set_sync_debug_mode(1)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                t0 = time.perf_counter()
                call()
                waited_ms = (time.perf_counter() - t0) * 1e3
        finally:
            torch.cuda.set_sync_debug_mode(0)
        warned = any("synchronizing CUDA operation" in str(w.message) for w in seen)
        table[name] = {"warns": warned, "waits": waited_ms >= 10.0, "ms": round(waited_ms, 2)}
        want = EXPECTED_SYNCS[name]
        if (warned, waited_ms >= 10.0) != want:
            check.problems.append(f"{name}: warns {warned}, waits {waited_ms:.1f} ms; the stand-in assumes warns {want[0]}, waits {want[1]}")
    torch.cuda.synchronize()
    check.numbers["table"] = table
    return [check]


def empty_cache_loop(ctx: Context) -> list[Check]:
    """S2: 8 ms of GPU work and `torch.cuda.empty_cache()` every step, NVML off: the wait is timed
    where it is called; not HOST-BOUND."""
    torch = ctx.torch
    check = Check("S2 empty_cache every step, no NVML", "not HOST-BOUND; the call timed")
    undo = _no_nvml(ctx)
    try:
        cell = """
        for i in range(30):  # traceml: loop
            torch.cuda._sleep(CYCLES)
            y = torch.ones(1024, device="cuda") * 2
            torch.cuda.empty_cache()
        """
        run = ctx.traced("S2-empty-cache", cell, {"torch": torch, "CYCLES": ctx.cycles(8)})
    finally:
        undo()
    describe(check, run)
    top = ((run.result.gpu.sync_stalls or {}).get("sites") or [{}])[0]
    check.numbers["top sync"] = f"line {top.get('line')}: {top.get('call')}"
    check.expect(run.verdict != "HOST-BOUND", f"verdict {run.verdict}")
    check.expect(top.get("line") == 5, f"top sync {top}")
    return [check]


def wait_event_prefetch(ctx: Context) -> list[Check]:
    """G2e: gpu_check's G2 with `record_event` + `wait_event` instead of `wait_stream`: the
    waited copy is step time."""
    check = Check("G2e side-stream copy, wait_event", "h2d_ms ~ the copy; waited")
    return [waited_side_copy(ctx, check, "ev = side.record_event()", "torch.cuda.current_stream().wait_event(ev)")]


# -- our own cost ---------------------------------------------------------------------------------


def own_costs(ctx: Context) -> list[Check]:
    """C4: µs per timed copy (a 20-tensor pinned dict each step), µs per sync warning (a
    `torch.nonzero` each step), the `--lines on` overhead per step; traced vs plain, and what
    the run measured of its own time (own_host_ms)."""
    torch = ctx.torch
    check = Check("C4 our own host cost", "per copy, per warning, per line lap: measured")
    batch = {f"t{i}": torch.ones(1024).pin_memory() for i in range(20)}
    x = torch.ones(1024, device="cuda")
    copy_cell = "for i in range(200):  # traceml: loop\n    xs = {k: t.to('cuda', non_blocking=True) for k, t in batch.items()}\n"
    plain = min(ctx.plain(copy_cell.replace("  # traceml: loop", ""), {"batch": batch}) for _ in range(3))
    run = ctx.traced("C4-copies", copy_cell, {"batch": batch}, "--no-live --lines off")
    per_copy = ((run.result.loop.wall_ms or 0.0) / 1e3 - plain) / (200 * 20) * 1e6
    check.numbers["µs per timed copy"] = per_copy
    check.numbers["own_host_ms a step (copies)"] = run.summary.get("own_host_ms")
    warn_cell = "for i in range(200):  # traceml: loop\n    n = torch.nonzero(x)\n"
    plain = min(ctx.plain(warn_cell.replace("  # traceml: loop", ""), {"x": x, "torch": torch}) for _ in range(3))
    run = ctx.traced("C4-warnings", warn_cell, {"x": x, "torch": torch}, "--no-live --lines off")
    check.numbers["µs per sync warning"] = ((run.result.loop.wall_ms or 0.0) / 1e3 - plain) / 200 * 1e6
    check.numbers["warning µs measured by the run"] = (run.result.gpu.sync_stalls or {}).get("warning_us")
    body = "for i in range(2000):  # traceml: loop\n    y = x + 1\n    z = y * 2\n    w = z - 1\n"
    off = ctx.traced("C4-lines-off", body, {"x": x}, "--no-live --lines off")
    on = ctx.traced("C4-lines-on", body, {"x": x}, "--no-live --lines on")
    check.numbers["--lines on µs a step"] = ((on.wall_ms or 0.0) - (off.wall_ms or 0.0)) / 2000 * 1e3
    check.expect(per_copy < 50, f"{per_copy:.1f} µs per timed copy")
    return [check]


SECOND_PASS: tuple[Scenario, ...] = (
    Scenario("calibration", "launch queue, event latency, elapsed_time, NVML cadence, call costs", "DR", "measured", calibration),
    Scenario("S1", "which calls warn / make the host wait (sync table)", "DR4", "as the stand-in assumes", sync_table),
    Scenario("G1", "CUDA graphs: whole-network capture; a pinned copy inside a capture", "DR1", "no exception; replays are steps", graph_capture),
    Scenario("D3", "no-allocation loops: in-place + synchronize, replay + .item()", "DR2", "GPU clock", no_allocation_loops),
    Scenario("env", "child: cudaMallocAsync training loop; CUDA_LAUNCH_BLOCKING=1 without NVML", "DR2, DR4", "GPU clock; not HOST-BOUND", child_envs),
    Scenario("N", "NVML: a 50 %-duty loop, a copy-only loop", "DR3", "host share 0.5; H2D-BOUND", nvml_loops),
    Scenario("S2", "empty_cache() every step without NVML", "DR4", "not HOST-BOUND", empty_cache_loop),
    Scenario("G2e", "a side-stream copy waited for with wait_event", "DR4", "the wait is step time", wait_event_prefetch),
    Scenario("C4", "our own host cost: per copy, per sync warning, --lines on", "DR5", "measured", own_costs),
    # CUDA graph trees keep their memory pool after the cell: what it holds is reported, not failed.
    Scenario("G3", "torch.compile(mode='reduce-overhead')", "DR1", "no exception; GPU clock", compiled_reduce_overhead, False),
)


def listed() -> list[str]:
    lines = [f"second pass: {len(SECOND_PASS)} groups, ≤ {SECOND_BUDGET_S:.0f} s (--second, or --only KEY):"]
    for s in SECOND_PASS:
        lines.append(f"  {s.key:<11} {s.title} [{s.finding}]: {s.expected}")
    return lines


def calibration_report(checks: list[Any]) -> dict[str, Any] | None:
    """What the run measured of the GPU, next to what the stand-in assumes (None: calibration
    and the sync table did not run)."""
    measured: dict[str, Any] = {}
    for check in checks:
        if check.scenario == "calibration":
            measured.update(check.numbers.get("calibration") or {})
        if check.scenario.startswith("S1 "):
            table = check.numbers.get("table") or {}
            measured["sync_table"] = table
            small = table.get("pageable 4 KB .to(non_blocking)")
            if small is not None:
                measured["pageable_4kb_non_blocking_waits"] = small["waits"]
    if not measured:
        return None
    return {"measured": measured, "stand_in": stand_in_defaults()}


def calibration_text(calibration: dict[str, Any]) -> str:
    """The calibration as lines: each measured value beside the stand-in's assumption."""
    stand_in = calibration["stand_in"]
    lines = ["calibration (measured on this GPU | the stand-in assumes):"]
    for key, value in calibration["measured"].items():
        if key == "sync_table":
            for call, row in value.items():
                want = EXPECTED_SYNCS.get(call)
                lines.append(f"  sync {call:<36} warns {row['warns']!s:<5} waits {row['waits']!s:<5} {row['ms']:>7} ms | {want}")
            continue
        lines.append(f"  {key:<36} {value!s:<24} | {stand_in.get(key, '-')}")
    return "\n".join(lines)
