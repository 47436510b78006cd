"""CPU OVERSUBSCRIBED (pure): torch's intra-op threads in the training process, beside DataLoader
workers that each keep a core busy, want more cores than the process may use.

torch runs an operator on `torch.get_num_threads()` threads (by default one per core), and each
worker that computes (decodes, augments) keeps a core of its own busy. When threads x (1 + busy
workers) > usable cores they take turns: an operator's threads wait for a core a worker holds,
and the same step's compute takes 1 ms in one step and 9 ms in the next. The finding gives the
figures (threads, busy workers, cores, how unstable compute was: its p90 against its median) and
the fix: fewer torch threads in the training process (`torch.set_num_threads(N)`, N the cores
the workers leave), or fewer workers. A machine with spare cores gets nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .findings import Finding, Label
from .summary_keys import Oversubscription, Summary

BUSY_WORKER_CORES = 0.5  # a worker that keeps at least half a core busy holds a core
UNSTABLE_RATIO = 1.5  # compute's p90 this many times its median: the turns show (warn, else info)
MIN_STEPS = 6  # analysed steps before compute's spread is told


def busy_workers(workers: Sequence[Mapping[str, Any]], loader: int | None = None) -> int:
    """The workers (of the training loader, where known) that kept >= half a core busy between
    their first and last sample."""
    mine = [w for w in workers if loader is None or w.get("loader") in (None, loader)] or list(workers)
    busy = 0
    for w in mine:
        first, last, cpu = w.get("first_s"), w.get("last_s"), w.get("cpu_s")
        if first is None or last is None or cpu is None or last <= first:
            continue
        busy += float(cpu) / (float(last) - float(first)) >= BUSY_WORKER_CORES
    return busy


def compute_spread(columns: Mapping[str, np.ndarray], warmup: int) -> tuple[float | None, float | None, float | None]:
    """(p50, p90, p90 / p50) of the analysed steps' compute (ms); Nones with too few steps."""
    if "compute_ms" not in columns or "step" not in columns:
        return None, None, None
    values = np.asarray(columns["compute_ms"], dtype=np.float64)[np.asarray(columns["step"]) >= warmup]
    values = values[np.isfinite(values)]
    if len(values) < MIN_STEPS:
        return None, None, None
    p50, p90 = (float(v) for v in np.percentile(values, [50, 90]))
    return p50, p90, (p90 / p50 if p50 > 0 else None)


def oversubscription(
    host: Mapping[str, Any] | None,
    columns: Mapping[str, np.ndarray],
    warmup: int,
    loader: int | None = None,
) -> tuple[Summary, list[Finding]]:
    """The summary's `cpu_torch_threads` and `cpu_oversubscription` (the figures, None when the
    cores suffice or were not measured), and the finding."""
    host = host or {}
    threads, cores = host.get("torch_threads"), host.get("usable_cores")
    out: Summary = {"cpu_torch_threads": threads, "cpu_oversubscription": None}
    if not isinstance(threads, int) or threads < 1 or not cores:
        return out, []
    busy = busy_workers(host.get("workers") or [], loader)
    cores = float(cores)
    wanted = threads * (1 + busy)
    if wanted <= cores + 1e-9:
        return out, []
    p50, p90, ratio = compute_spread(columns, warmup)
    suggested = max(1, math.floor(cores) - busy)
    figures: Oversubscription = {
        "threads": threads,
        "busy_workers": busy,
        "usable_cores": cores,
        "wanted_cores": wanted,
        "compute_p50_ms": p50,
        "compute_p90_ms": p90,
        "compute_p90_p50": ratio,
        "suggested_threads": suggested,
        "suggested_workers": max(0, math.floor(cores) - 1) if busy + 1 > cores else None,
    }
    out["cpu_oversubscription"] = figures
    severity = "warn" if ratio is not None and ratio >= UNSTABLE_RATIO else "info"
    return out, [Finding(Label.OVERSUBSCRIBED, severity, sentence(figures), fix(figures))]


def _cores(value: float) -> str:
    return f"{value:g}"


def sentence(f: Oversubscription) -> str:
    """"torch's 2 intra-op threads and 2 DataLoader workers that keep a core busy each want
    2 x (1 + 2) = 6 cores; 2 are usable: compute's p90 is 3.4x its median (9.0 ms against 2.6 ms).\""""
    busy = int(f["busy_workers"])
    workers = f"{busy} DataLoader worker{'' if busy == 1 else 's'} that keep{'s' if busy == 1 else ''} a core busy"
    text = (
        f"torch's {f['threads']} intra-op thread{'' if f['threads'] == 1 else 's'} in the training process"
        + (f" and {workers}" if busy else "")
        + f" want {f['threads']} x (1 + {busy}) = {f['wanted_cores']} cores; {_cores(float(f['usable_cores']))} "
        + ("is" if float(f["usable_cores"]) == 1 else "are")
        + " usable, so they take turns"
    )
    if f.get("compute_p90_p50") is not None:
        text += (
            f": compute's p90 is {f['compute_p90_p50']:.1f}x its median ({f['compute_p90_ms']:.1f} ms "
            f"against {f['compute_p50_ms']:.1f} ms)"
        )
    return text + "."


def fix(f: Oversubscription) -> str:
    """What to change: torch's threads in the training process, or fewer workers."""
    text = (
        f"Call `torch.set_num_threads({f['suggested_threads']})` in the training process (before the loop), "
        "so that its threads and the busy workers fit the cores"
    )
    if f.get("suggested_workers") is not None:
        text += f", and use fewer DataLoader workers (`num_workers={f['suggested_workers']}`): each busy one holds a core"
    else:
        text += ", or use fewer DataLoader workers"
    return text + "."
