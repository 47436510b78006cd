"""Accuracy: known per-batch input delays and a known compute cost, against what `%%traceml`
(and traceml-ai, when it runs) measures.

    .venv/bin/python tests/benchmarks/bench_accuracy.py [--device cuda] [--no-traceml-ai]

Each batch of a DataLoader (num_workers=0, batch_size=1) takes an injected delay (a sleep,
then a spin to the exact deadline; the time really spent is recorded, so the injected value
is known to the microsecond), and the loop body spins for a fixed compute time. The medians
of the run's summary are compared with the medians of the injected times. With
num_workers=2 the true wait per step is lower than the per-batch cost; a hand-timed loop
gives the truth and each tool says what it saw.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import Table, num, show, target  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

DELAYS_MS = [0.5, 2.0, 8.0, 32.0, 128.0]
COMPUTE_MS = 3.0


@dataclass(frozen=True)
class WorkersCase:
    """num_workers > 0: each batch costs more than the loop truly waits for it."""

    per_batch_ms: float = 20.0
    compute_ms: float = 4.0
    steps: int = 60
    num_workers: int = 2


WORKERS_CASE = WorkersCase()
REL_TOL, ABS_TOL_MS = 0.03, 0.2


def wait_exactly(ms: float) -> int:
    """Block for `ms` (sleep most of it, spin the rest); returns the ns really spent."""
    start = time.perf_counter_ns()
    end = start + int(ms * 1e6)
    if ms > 1.0:
        time.sleep((ms - 1.0) / 1e3)
    while time.perf_counter_ns() < end:
        pass
    return time.perf_counter_ns() - start


def spin(ms: float) -> int:
    """Busy for `ms` of CPU work; returns the ns really spent."""
    start = time.perf_counter_ns()
    end = start + int(ms * 1e6)
    while time.perf_counter_ns() < end:
        pass
    return time.perf_counter_ns() - start


class DelayedDataset(Dataset[Any]):
    """A map-style dataset whose every item takes `delay_ms` (the injected input cost).

    With `exact` the delay is a sleep plus a spin to the deadline and the real durations are
    logged (num_workers=0); without, it only sleeps (worker processes must not hog the cores)."""

    def __init__(self, n: int, delay_ms: float, exact: bool = True) -> None:
        self.n, self.delay_ms, self.exact = n, delay_ms, exact
        self.spent_ns: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        if self.exact:
            self.spent_ns.append(wait_exactly(self.delay_ms))
        else:
            time.sleep(self.delay_ms / 1e3)
        return torch.zeros(1)


class Body:
    """The loop body: a known compute cost, on the CPU (a spin) or the GPU (`torch.cuda._sleep`)."""

    def __init__(self, compute_ms: float, device: str) -> None:
        self.compute_ms, self.device = compute_ms, device
        self.spent_ns: list[int] = []
        self.cycles = gpu_cycles_per_ms() * compute_ms if device == "cuda" else 0
        if device == "cuda":  # a tensor on the device: the run then counts as GPU work
            import torch

            self.anchor = torch.zeros(1, device="cuda")

    def __call__(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda._sleep(int(self.cycles))
        else:
            self.spent_ns.append(spin(self.compute_ms))


@functools.lru_cache(maxsize=1)
def gpu_cycles_per_ms() -> float:
    """`torch.cuda._sleep` cycles per ms of GPU time, measured with events."""
    import torch

    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(cycles // 10)  # warm-up
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return float(cycles / a.elapsed_time(b))


def steps_for(delay_ms: float) -> int:
    """About 1.2 s per case, never fewer than 15 steps or more than 150."""
    return max(15, min(150, int(1200 / (delay_ms + COMPUTE_MS))))


def median_ms(ns: list[int], skip: int = 0) -> float:
    return statistics.median(ns[skip:] or ns) / 1e6


def within(measured: float | None, truth: float) -> bool | None:
    if measured is None:
        return None
    return abs(measured - truth) <= max(REL_TOL * truth, ABS_TOL_MS)


class HandTimed:
    """Wraps the loader the loop iterates and times each next() by hand: the truth of what the
    loop waited, step by step, measured in the very run the tool measures."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.waits_ns: list[int] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        it = iter(self.loader)
        clock, waits = time.perf_counter_ns, self.waits_ns
        while True:
            t0 = clock()
            try:
                item = next(it)
            except StopIteration:
                return
            waits.append(clock() - t0)
            yield item


# -- ours, through a real shell ---------------------------------------------------------------
def measure_ours(device: str) -> dict[str, Any]:
    import numpy as np
    import torch
    from shell_cells import run_cell, shell
    from torch.utils.data import DataLoader

    import traceml_jupyter

    ns = shell().user_ns
    cases = []
    sync = "\ntorch.cuda.synchronize()" if device == "cuda" else ""
    cell = "%%traceml --no-live --name '{name}'\nfor x in loader:\n    body()" + sync + "\n"
    for delay in DELAYS_MS:
        n = steps_for(delay)
        ds = DelayedDataset(n, delay)
        body = Body(COMPUTE_MS, device)
        loader = HandTimed(DataLoader(ds, batch_size=None, num_workers=0))
        ns.update(loader=loader, body=body, torch=torch)
        run_cell(cell.format(name=f"delay {delay} ms"))
        run = traceml_jupyter.last()
        assert run is not None and run.n_steps == n, "the run did not record every step"
        s = run.summary
        skip = s["warmup_steps"]
        tool = run.steps["data_wait_ms"][skip:]
        hand = np.array(loader.waits_ns[skip:]) / 1e6
        cases.append({
            "delay_ms": delay,
            "steps": n,
            "clock": s["clock"],
            "injected_wait_ms": median_ms(ds.spent_ns, skip),
            "hand_wait_ms": float(np.median(hand)),
            "tool_minus_hand_ms": float(np.median(tool - hand)),
            "injected_compute_ms": COMPUTE_MS if device == "cuda" else median_ms(body.spent_ns, skip),
            "wait_ms": s["data_wait_ms"],
            "compute_ms": s["compute_ms"],
            "wait_cpu_ms": float(np.median(tool)),
        })
    w = WORKERS_CASE
    loader = HandTimed(DataLoader(DelayedDataset(w.steps, w.per_batch_ms, exact=False), batch_size=1, num_workers=w.num_workers))
    ns.update(loader=loader, body=Body(w.compute_ms, device))
    run_cell(cell.format(name="workers"))
    run = traceml_jupyter.last()
    assert run is not None
    skip = run.summary["warmup_steps"]
    return {
        "cases": cases,
        "workers": {
            "truth_ms": median_ms(loader.waits_ns, skip),
            "wait_ms": run.summary["data_wait_ms"],
            "compute_ms": run.summary["compute_ms"],
        },
    }


# -- traceml-ai, in a worker process of its own ---------------------------------------------
def worker(args: list[str]) -> None:
    """Inside the traceml-ai worker: the same cases under `trace_step`; prints one RESULT line."""
    import torch
    import traceml_ai_peer as peer
    from torch.utils.data import DataLoader

    device = json.loads(args[0])["device"]
    traceml = peer.init_in_worker()
    model = torch.nn.Linear(1, 1)
    cases: list[dict[str, Any]] = []

    def run_case(ds: DelayedDataset, body: Body, num_workers: int) -> None:
        loader = HandTimed(DataLoader(ds, batch_size=None if num_workers == 0 else 1, num_workers=num_workers))
        first = peer.current_step() + 1
        for _ in loader:
            with traceml.trace_step(model):
                body()
        if device == "cuda":
            torch.cuda.synchronize()
        skip = max(1, len(loader.waits_ns) // 10)
        cases.append({
            "first": first, "last": peer.current_step(), "skip": skip,
            "hand_ns": loader.waits_ns,
            "injected_wait_ms": median_ms(ds.spent_ns, skip) if ds.spent_ns else None,
            "injected_compute_ms": COMPUTE_MS if device == "cuda" else (median_ms(body.spent_ns, skip) if body.spent_ns else None),
        })

    for delay in DELAYS_MS:
        run_case(DelayedDataset(steps_for(delay), delay), Body(COMPUTE_MS, device), 0)
    w = WORKERS_CASE
    run_case(DelayedDataset(w.steps, w.per_batch_ms, exact=False), Body(w.compute_ms, device), w.num_workers)
    try:
        traceml.summary(timeout_sec=30)  # the aggregator has every step once this returns
    except Exception as exc:
        print(f"traceml.summary() failed: {exc}", file=sys.stderr)
    events = peer.step_events(cases[0]["first"], cases[-1]["last"])
    out = []
    for c in cases:
        steps = list(range(c["first"] + c["skip"], c["last"] + 1))
        waits = [events.get(k, {}).get("dataloader_next") for k in steps]
        pairs = [(wt, c["hand_ns"][k - c["first"]] / 1e6) for k, wt in zip(steps, waits, strict=True) if wt is not None]
        step_ms = [events[k]["step_time"] for k in steps if "step_time" in events.get(k, {})]
        out.append({
            "steps": c["last"] - c["first"] + 1,
            "recorded": sum(1 for k in range(c["first"], c["last"] + 1) if k in events),
            "injected_wait_ms": c["injected_wait_ms"],
            "injected_compute_ms": c["injected_compute_ms"],
            "hand_wait_ms": median_ms(c["hand_ns"], c["skip"]),
            "wait_ms": statistics.median([p[0] for p in pairs]) if pairs else None,
            "tool_minus_hand_ms": statistics.median([p[0] - p[1] for p in pairs]) if pairs else None,
            "step_ms": statistics.median(step_ms) if step_ms else None,
        })
    print("RESULT " + json.dumps({"cases": out}), flush=True)


def measure_traceml_ai(device: str, allow_install: bool) -> tuple[dict[str, Any] | None, str | None]:
    import traceml_ai_peer as peer

    why = peer.ensure_installed(allow_install)
    if why:
        return None, why
    try:
        with tempfile.TemporaryDirectory(prefix="traceml-ai-bench-") as logs:
            with peer.aggregator(Path(logs), "accuracy") as (env, _pid):
                return peer.run_worker(os.path.abspath(__file__), [json.dumps({"device": device})], env, 600), None
    except Exception as exc:
        return None, f"traceml-ai did not run: {type(exc).__name__}: {str(exc).splitlines()[0]}"


# -- the tables ---------------------------------------------------------------------------------
def error_cell(measured: float | None, truth: float | None) -> str:
    if measured is None or measured != measured or truth is None:
        return "—"
    err = measured - truth
    mark = "ok" if within(measured, truth) else "**MISSED**"
    return f"{err:+.3f} ms ({100 * err / truth:+.1f} %) {mark}" if truth else f"{err:+.3f} ms {mark}"


def per_step_cell(diff_ms: float | None, truth_ms: float | None) -> str:
    """The median per-step difference to the hand-timed wait, marked against the tolerance."""
    if diff_ms is None or truth_ms is None:
        return "—"
    mark = "ok" if within(truth_ms + diff_ms, truth_ms) else "**MISSED**"
    return f"{diff_ms * 1e3:+,.0f} µs {mark}"


def build_tables(ours: dict[str, Any], peer: dict[str, Any] | None, peer_why: str | None, device: str) -> list[Table]:
    gpu = device == "cuda"
    rows = []
    vs_injected, vs_hand = True, True
    for c in ours["cases"]:
        # On the GPU clock, data wait is the time the GPU starved: the fetch minus the queued work.
        wait_truth = max(0.0, c["injected_wait_ms"] - c["injected_compute_ms"]) if c["clock"] == "gpu" else c["injected_wait_ms"]
        rows.append([
            f"{c['delay_ms']:g} ms × {c['steps']}",
            num(c["injected_wait_ms"], 3), num(c["hand_wait_ms"], 3), num(c["wait_ms"], 3),
            error_cell(c["wait_ms"], wait_truth), per_step_cell(c["tool_minus_hand_ms"], c["hand_wait_ms"]),
            num(c["injected_compute_ms"], 3), num(c["compute_ms"], 3),
            error_cell(c["compute_ms"], c["injected_compute_ms"]),
        ])
        compute_ok = bool(within(c["compute_ms"], c["injected_compute_ms"]))
        vs_injected = vs_injected and compute_ok and bool(within(c["wait_ms"], wait_truth))
        hand_ok = within(c["hand_wait_ms"] + c["tool_minus_hand_ms"], c["hand_wait_ms"])
        vs_hand = vs_hand and compute_ok and bool(hand_ok if c["clock"] == "cpu" else True)
    table = Table(
        f"Accuracy of `%%traceml` ({device}): medians over the analysed steps vs the injected times",
        ["injected delay × steps", "injected wait ms", "hand-timed next() ms", "data wait ms",
         "error vs injected", "− hand-timed, per step", "injected compute ms",
         f"{'GPU' if gpu else 'CPU'} compute ms", "error vs injected"],
        rows,
    )
    table.notes += [
        f"Tolerance: {REL_TOL * 100:g} % or {ABS_TOL_MS:g} ms, whichever is larger. A DataLoader "
        "with batch_size=None (no collate) and num_workers=0; each item sleeps, then spins to its deadline, and the "
        "time really spent is the injected value. The body spins for "
        f"{COMPUTE_MS:g} ms{' of GPU time (torch.cuda._sleep)' if gpu else ''}.",
        "`%%traceml --no-live` through a real InteractiveShell; `traceml_jupyter.last().summary` "
        "medians (warm-up steps excluded). The loop iterates a wrapper that times each next() by "
        "hand: 'hand-timed' is what the loop really waited, DataLoader work included (its sampler "
        "and collate add tens of µs to the injected delay, more when other processes hold the "
        "cores), and '− hand-timed' is the median per-step difference: the tool's own error.",
    ]
    if gpu:
        table.notes.append(
            "GPU clock: data wait is the time the GPU had nothing to do during the fetch, so the "
            "truth is max(0, injected wait − queued GPU compute)."
        )
    tables = [table]
    if peer:
        p_rows = []
        for c, p in zip(ours["cases"], peer["cases"][: len(ours["cases"])], strict=True):
            p_rows.append([
                f"{c['delay_ms']:g} ms × {p['steps']} ({p['recorded']} recorded)",
                num(p["injected_wait_ms"], 3), num(p["hand_wait_ms"], 3), num(p["wait_ms"], 3),
                error_cell(p["wait_ms"], p["injected_wait_ms"]), per_step_cell(p["tool_minus_hand_ms"], p["hand_wait_ms"]),
                num(p["injected_compute_ms"], 3), num(p["step_ms"], 3),
                error_cell(p["step_ms"], p["injected_compute_ms"]),
            ])
        tables.append(Table(
            f"Accuracy of traceml-ai ({device}), the same cases",
            ["injected delay × steps", "injected wait ms", "hand-timed next() ms",
             "input wait ms (dataloader_next)", "error vs injected", "− hand-timed, per step",
             "injected compute ms", "step ms (trace_step)", "error vs injected"],
            p_rows,
            ["Medians of its per-step `dataloader_next` and `step_time` records, read from its "
             "aggregator's telemetry database, first tenth of each case skipped; `with "
             "traceml.trace_step(model):` around the same body, in a process of its own."],
        ))
    elif peer_why:
        table.notes.append(f"traceml-ai not measured: {peer_why}")
    w = WORKERS_CASE
    wr = ours["workers"]
    w_rows = [["hand-timed next() (the truth, same run)", num(wr["truth_ms"], 2), "—"],
              ["ours (`%%traceml`)", num(wr["wait_ms"], 2), num(wr["compute_ms"], 2)]]
    if peer:
        p = peer["cases"][-1]
        w_rows.append(["hand-timed next() in the traceml-ai run", num(p["hand_wait_ms"], 2), "—"])
        w_rows.append(["traceml-ai (`trace_step`)", num(p["wait_ms"], 2), num(p["step_ms"], 2) + " (step)"])
    elif peer_why:
        w_rows.append(["traceml-ai", "not run", "—"])
    w_rows.append(["a tool that charged the per-batch cost", num(w.per_batch_ms, 2), "—"])
    tables.append(Table(
        f"num_workers={w.num_workers} ({device}): {w.per_batch_ms:g} ms per batch, "
        f"{w.compute_ms:g} ms compute, {w.steps} steps",
        ["who", "data wait ms (median)", "compute ms (median)"],
        w_rows,
        [f"Two workers deliver a batch every ~{w.per_batch_ms / w.num_workers:g} ms, so on an idle "
         f"machine the loop waits about {w.per_batch_ms / w.num_workers - w.compute_ms:g} ms per "
         "step, not the per-batch cost; the hand-timed rows are the truth of each run."],
    ))
    excess = [c["hand_wait_ms"] - c["injected_wait_ms"] for c in ours["cases"]]
    tables.append(Table(
        f"Accuracy targets ({device}): within {REL_TOL * 100:g} % or {ABS_TOL_MS:g} ms, every delay",
        ["target", "result"],
        [
            ["ours vs what the loop really waited (hand-timed next(), same steps) and the injected compute",
             target(vs_hand, "the tool's own error")],
            ["ours vs the injected delay and compute",
             target(vs_injected, "includes the DataLoader's own per-batch work")],
        ],
        [f"Without any tool, the DataLoader's own work per batch added {min(excess) * 1e3:,.0f} to "
         f"{max(excess) * 1e3:,.0f} µs to the injected delay here (hand-timed next() minus the "
         "time spent in the dataset): that is real data wait, which a tool must count."],
    ))
    return tables


def measure(device: str = "cpu", with_traceml_ai: bool = True, allow_install: bool = True) -> list[Table]:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return [Table("Accuracy (CUDA)", [], notes=["skipped: no CUDA device on this machine"])]
    peer: dict[str, Any] | None = None
    why: str | None = "not requested (--no-traceml-ai)"
    if with_traceml_ai:
        print("  traceml-ai worker ...", file=sys.stderr, flush=True)
        peer, why = measure_traceml_ai(device, allow_install)
    print("  ours ...", file=sys.stderr, flush=True)
    ours = measure_ours(device)
    return build_tables(ours, peer, why, device)


def main(argv: list[str] | None = None) -> list[Table]:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--traceml-ai-worker":
        worker(argv[1:])
        return []
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--no-traceml-ai", action="store_true", help="skip the traceml-ai peer")
    parser.add_argument("--no-install", action="store_true", help="never install traceml-ai")
    args = parser.parse_args(argv)
    tables = measure(args.device, not args.no_traceml_ai, not args.no_install)
    show(tables)
    return tables


if __name__ == "__main__":
    main()
