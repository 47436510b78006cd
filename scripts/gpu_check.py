"""What only a CUDA machine can show, in one command: each scenario runs as a `%%traceml` cell
in a real IPython shell, and its verdict and GPU timings are checked against what was injected
(a sleeping dataset for data wait, `torch.cuda._sleep` for a known GPU time, known copy sizes).

    .venv/bin/python scripts/gpu_check.py            # prints a table; exit 1 if a check fails

Without a CUDA device it prints "no CUDA: skipped" and exits 0. tests/test_gpu.py runs the
same checks under pytest (skipped without CUDA).

Scenarios: the demo's fast, slow, fixed and h2d (traceml_jupyter.demo; small loops of our own
if it is missing), data wait and GPU compute against injected delays (with and without a sync
at the end of the step), a known GPU time with its line's GPU cost, host-to-device copies from
pageable and from pinned memory, a loop of tiny kernels (HOST-BOUND), and `.item()` every step.
"""

from __future__ import annotations

import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOLERANCE = 0.05  # timings within 5 % of the injected value ...
FLOOR_MS = 0.5  # ... or 0.5 ms, whichever is larger


@dataclass
class Check:
    """One scenario: what it should show, what it showed, and what did not match."""

    scenario: str
    expected: str
    verdict: str = "-"
    numbers: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def expect(self, condition: bool, problem: str) -> None:
        if not condition:
            self.problems.append(problem)

    def near(self, name: str, got: float | None, want: float) -> None:
        """`got` within TOLERANCE of `want` or FLOOR_MS, whichever is larger."""
        if got is None:
            self.problems.append(f"{name}: not measured (want {want:.1f} ms)")
            return
        allowed = max(TOLERANCE * want, FLOOR_MS)
        if abs(got - want) > allowed:
            self.problems.append(f"{name} {got:.2f} ms, want {want:.2f} ± {allowed:.2f} ms")


def cuda_available() -> bool:
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


def traced(shell: Any, name: str, cell: str, names: dict[str, Any], options: str = "") -> Any:
    """Run `cell` under `%%traceml --name NAME` with `names` defined; the run it made. The
    cell's first line is line 2 (the %%traceml line is line 1)."""
    from IPython.utils.capture import capture_output

    import traceml_jupyter

    shell.user_ns.update(names)
    with capture_output():
        source = textwrap.dedent(cell).lstrip("\n")
        result = shell.run_cell(f"%%traceml --name {name} {options}\n" + source)
    if result.error_in_exec is not None:
        raise result.error_in_exec
    run = traceml_jupyter.last()
    assert run is not None and run.name == name
    return run


def sleep_cycles_per_ms() -> float:
    """How many `torch.cuda._sleep` cycles make a millisecond on this GPU."""
    import torch

    rates: list[float] = []
    for _ in range(3):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call, unused-ignore]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call, unused-ignore]
        start.record()
        torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call, unused-ignore]
        end.record()
        end.synchronize()
        rates.append(20_000_000 / float(start.elapsed_time(end)))
    return float(statistics.median(rates))


def describe(check: Check, run: Any) -> None:
    s = run.summary
    check.verdict = f"{run.verdict} ({run.severity}, {run.clock})"
    check.numbers = {
        "wait": s["data_wait_ms"],
        "compute": s["compute_ms"],
        "step": s["step_ms"],
        "h2d": s.get("h2d_ms"),
        "backlog": s.get("gpu_backlog_ms"),
        "syncs": s.get("sync_calls"),
        "util": s.get("gpu_busy_share"),
    }
    check.expect(run.clock == "gpu", f"clock is {run.clock}, want gpu")


# -- scenarios ---------------------------------------------------------------------------------

DEMO_CELL = """
for epoch in range(2):
    for x, y in loader:
        x, y = x.to(device{nb}), y.to(device{nb})
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
"""


def demo_scenarios(shell: Any) -> list[Check]:
    """fast, slow, fixed and h2d from traceml_jupyter.demo, with their intended verdicts."""
    try:
        from traceml_jupyter import demo
    except ImportError:
        return own_demo_scenarios(shell)
    intended = dict(getattr(demo, "INTENDED_VERDICT", {}))
    checks, steps = [], {}
    for name in ("fast", "slow", "fixed", "h2d"):
        want = intended.get(name, "faster than slow" if name == "fixed" else "?")
        check = Check(f"demo {name}", want)
        try:
            loader, model, opt, loss_fn, device = demo.setup(name, device="cuda")
            nb = ", non_blocking=True" if name == "fixed" else ""
            names = {"loader": loader, "model": model, "opt": opt, "loss_fn": loss_fn, "device": device}
            run = traced(shell, f"demo-{name}", DEMO_CELL.format(nb=nb), names)
        except Exception as exc:
            check.problems.append(f"{type(exc).__name__}: {exc}")
            checks.append(check)
            continue
        describe(check, run)
        steps[name] = run.summary["step_ms"]
        if name in intended:
            check.expect(run.verdict == intended[name], f"verdict {run.verdict}, want {intended[name]}")
        if name == "h2d":
            check.expect((run.summary.get("h2d_bytes") or 0) > 0, "no copy measured")
        if name == "fixed" and "slow" in steps and steps.get("slow"):
            want = float(getattr(demo, "FIXED_SPEEDUP", 1.5))
            speedup = steps["slow"] / run.summary["step_ms"]
            check.numbers["speedup"] = speedup
            check.expect(speedup >= want, f"fixed is {speedup:.2f}x faster than slow, want {want}x")
        checks.append(check)
    return checks


def own_demo_scenarios(shell: Any) -> list[Check]:
    """Without the demo module: an in-memory loader (fast) and a sleeping one (slow)."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Sleepy(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> torch.Tensor:
            time.sleep(0.02)
            return torch.randn(256, 512)

    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cell = """
    for x in loader:
        x = x.to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    """
    checks = []
    fast = [torch.randn(256, 512) for _ in range(60)]
    for name, loader, want in (("fast", fast, "COMPUTE-BOUND"), ("slow", DataLoader(Sleepy(), batch_size=None), "INPUT-BOUND")):
        check = Check(f"own {name}", want)
        run = traced(shell, f"own-{name}", cell, {"loader": loader, "model": model, "opt": opt, "device": "cuda"})
        describe(check, run)
        check.expect(run.verdict == want, f"verdict {run.verdict}, want {want}")
        checks.append(check)
    return checks


def injected_delays(shell: Any, cycles_per_ms: float) -> list[Check]:
    """20 ms per batch in the dataset, 10 ms of GPU work per step. With `.item()` at the end of
    the step the GPU waits the whole fetch; without, it hides 10 ms of it behind its work."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    class SleepyBatches(Dataset[torch.Tensor]):
        """Every item is a whole batch that takes `ms` to make (num_workers=0)."""

        def __init__(self, n: int, ms: float) -> None:
            self.n, self.ms = n, ms

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> torch.Tensor:
            time.sleep(self.ms / 1000)
            return torch.ones(256)

    checks = []
    for synced, want_wait in ((True, 20.0), (False, 10.0)):
        loader: DataLoader[torch.Tensor] = DataLoader(SleepyBatches(40, 20.0), batch_size=None)
        cell = """
        for x in loader:
            x = x.to(device)
            torch.cuda._sleep(CYCLES)
            s = (x * 2).sum()
            {sync}
        """.format(sync="v = s.item()" if synced else "pass")
        check = Check(f"delays {'item' if synced else 'async'}", f"wait {want_wait:.0f} ms, GPU 10 ms")
        names = {"loader": loader, "device": "cuda", "torch": torch, "CYCLES": int(10 * cycles_per_ms)}
        run = traced(shell, f"delays-{'item' if synced else 'async'}", cell, names)
        describe(check, run)
        check.expect(run.verdict == "INPUT-BOUND", f"verdict {run.verdict}, want INPUT-BOUND")
        check.near("data wait (GPU)", run.summary["data_wait_ms"], want_wait)
        check.near("GPU compute", run.summary["compute_ms"], 10.0)
        check.near("data wait (CPU)", float(_median(run.steps["data_wait_ms"][5:])), 20.0)
        checks.append(check)
    return checks


def _median(values: Any) -> float:
    import numpy as np

    return float(np.median(values))


def known_gpu_time(shell: Any, cycles_per_ms: float) -> Check:
    """8 ms of GPU work per step from an in-memory, pinned loader: COMPUTE-BOUND, GPU compute
    8 ms, the GPU always behind the host (backlog), and the sleeping line costs the GPU 8 ms."""
    import torch

    batches = [torch.ones(256).pin_memory() for _ in range(100)]
    cell = """
    for x in batches:
        x = x.to(device, non_blocking=True)
        torch.cuda._sleep(CYCLES)
        s = (x * 2).sum()
    """
    check = Check("known GPU time", "COMPUTE-BOUND, 8 ms")
    names = {"batches": batches, "device": "cuda", "torch": torch, "CYCLES": int(8 * cycles_per_ms)}
    run = traced(shell, "known", cell, names)
    describe(check, run)
    check.expect(run.verdict == "COMPUTE-BOUND", f"verdict {run.verdict}, want COMPUTE-BOUND")
    check.near("GPU compute", run.summary["compute_ms"], 8.0)
    backlog = run.summary.get("gpu_backlog_ms")
    check.expect(backlog is not None and backlog >= 0.1 * 8.0, f"backlog {backlog}, want >= 0.8 ms")
    costs = run.line_costs or {}
    gpu_lines = costs.get("gpu_ms_per_step") or {}
    check.numbers["gpu line 4"] = gpu_lines.get(4)
    check.near("GPU ms of line 4 (torch.cuda._sleep)", gpu_lines.get(4), 8.0)
    return check


def copies(shell: Any) -> list[Check]:
    """64 MiB per step copied from pageable memory with a blocking .to(device), then from pinned
    memory with non_blocking=True: both H2D-BOUND (nothing else to do), with the bytes, the
    pinning and the line right, and pinned copies faster."""
    import torch

    checks, rates = [], {}
    for kind in ("pageable", "pinned"):
        big = torch.ones(16 * 2**20)  # 64 MiB of float32
        if kind == "pinned":
            big = big.pin_memory()
        nb = ", non_blocking=True" if kind == "pinned" else ""
        cell = f"""
        for i in range(30):  # traceml: loop
            x = big.to(device{nb})
            s = x[:1024].sum()
        """
        check = Check(f"h2d {kind}", "H2D-BOUND, 64 MiB")
        run = traced(shell, f"h2d-{kind}", cell, {"big": big, "device": "cuda"})
        describe(check, run)
        s = run.summary
        check.expect(run.verdict == "H2D-BOUND", f"verdict {run.verdict}, want H2D-BOUND")
        check.expect(s.get("h2d_bytes") == 64 * 2**20, f"bytes per step {s.get('h2d_bytes')}")
        check.expect(s.get("h2d_lines") == [3], f"copy lines {s.get('h2d_lines')}, want [3]")
        pinned = 1.0 if kind == "pinned" else 0.0
        check.expect(s.get("h2d_pinned_share") == pinned, f"pinned share {s.get('h2d_pinned_share')}")
        check.expect(s.get("h2d_non_blocking_share") == pinned, f"non_blocking share {s.get('h2d_non_blocking_share')}")
        rates[kind] = s.get("h2d_gbps") or 0.0
        check.numbers["GB/s"] = rates[kind]
        check.expect(0.5 <= rates[kind] <= 1000, f"{rates[kind]:.1f} GB/s is not a copy rate")
        checks.append(check)
    checks[-1].expect(rates["pinned"] > rates["pageable"], "pinned copies are not faster")
    return checks


def tiny_kernels(shell: Any) -> Check:
    """200 tiny kernels a step: the GPU waits on Python's launches: HOST-BOUND."""
    import torch

    batches = [torch.ones(1024).pin_memory() for _ in range(60)]
    cell = """
    for x in batches:  # traceml: loop
        x = x.to(device, non_blocking=True)
        for _ in range(200):
            x = torch.sin(x) * 1.0001
        total = x.sum()
    """
    check = Check("tiny kernels", "HOST-BOUND")
    run = traced(shell, "tiny", cell, {"batches": batches, "device": "cuda", "torch": torch})
    describe(check, run)
    check.expect(run.verdict == "HOST-BOUND", f"verdict {run.verdict}, want HOST-BOUND")
    backlog = run.summary.get("gpu_backlog_ms")
    check.expect(backlog is not None and backlog < 0.1 * run.summary["step_ms"], f"backlog {backlog}")
    return check


def item_every_step(shell: Any, cycles_per_ms: float) -> Check:
    """5 ms of GPU work, then `loss.item()`: one sync a step, named on its line; the host waits
    there for the GPU, which is busy: COMPUTE-BOUND, not HOST-BOUND."""
    import torch

    batches = [torch.ones(256).pin_memory() for _ in range(40)]
    cell = """
    for x in batches:
        x = x.to(device, non_blocking=True)
        torch.cuda._sleep(CYCLES)
        loss = (x * 2).sum()
        value = loss.item()
    """
    check = Check(".item() every step", "COMPUTE-BOUND, sync on line 6")
    names = {"batches": batches, "device": "cuda", "torch": torch, "CYCLES": int(5 * cycles_per_ms)}
    run = traced(shell, "item", cell, names)
    describe(check, run)
    check.expect(run.verdict == "COMPUTE-BOUND", f"verdict {run.verdict}, want COMPUTE-BOUND")
    sites = (run.sync_stalls or {}).get("sites") or []
    top = sites[0] if sites else {}
    check.numbers["sync share"] = top.get("share")
    check.expect(top.get("line") == 6 and top.get("call") == "loss.item()", f"top sync {top}")
    check.expect(bool(top.get("every_step")), "the .item() line does not sync every step")
    check.expect((top.get("share") or 0) > 0.5, f"the host waits {top.get('share')} of the step there")
    check.expect(run.summary.get("sync_calls") == 1.0, f"syncs per step {run.summary.get('sync_calls')}")
    return check


# -- running them --------------------------------------------------------------------------------


def run_all(shell: Any | None = None, only: Callable[[str], bool] | None = None) -> list[Check]:
    shell = shell or new_shell()
    rate = sleep_cycles_per_ms()
    groups: list[tuple[str, Callable[[], list[Check]]]] = [
        ("demo", lambda: demo_scenarios(shell)),
        ("delays", lambda: injected_delays(shell, rate)),
        ("known", lambda: [known_gpu_time(shell, rate)]),
        ("h2d", lambda: copies(shell)),
        ("tiny", lambda: [tiny_kernels(shell)]),
        ("item", lambda: [item_every_step(shell, rate)]),
    ]
    checks: list[Check] = []
    for name, group in groups:
        if only is not None and not only(name):
            continue
        try:
            checks.extend(group())
        except Exception as exc:
            failed = Check(name, "runs")
            failed.problems.append(f"{type(exc).__name__}: {exc}")
            checks.append(failed)
    return checks


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def table(checks: list[Check]) -> str:
    cols = ("wait", "compute", "step", "h2d", "backlog", "syncs", "util")
    head = f"{'scenario':<20} {'expected':<30} {'verdict':<34} " + " ".join(f"{c:>8}" for c in cols)
    lines = [head, "-" * len(head)]
    for c in checks:
        nums = " ".join(f"{_cell(c.numbers.get(k)):>8}" for k in cols)
        lines.append(f"{c.scenario:<20} {c.expected:<30} {c.verdict:<34} {nums}  {'ok' if c.ok else 'FAIL'}")
        extra = {k: v for k, v in c.numbers.items() if k not in cols}
        if extra:
            lines.append(" " * 21 + ", ".join(f"{k}: {_cell(v)}" for k, v in extra.items()))
        lines.extend(" " * 21 + "! " + p for p in c.problems)
    return "\n".join(lines)


def main() -> int:
    if not cuda_available():
        print("no CUDA: skipped")
        return 0
    import torch

    print(f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__}")
    t0 = time.perf_counter()
    checks = run_all()
    print(table(checks))
    failed = [c for c in checks if not c.ok]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks ok in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
