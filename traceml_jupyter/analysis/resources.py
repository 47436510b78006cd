"""Resources in words (pure): GPU memory per step, the host's CPU and memory, the DataLoader
workers' memory, what earlier cells hold, an out-of-memory error: the summary's numbers and the
findings beside the verdict.

Thresholds, and why:
- HIGH PRESSURE: the largest per-step peak is >= 92 % of the device's memory (critical >= 97 %):
  the caching allocator needs headroom (fragmentation; a longer sequence or the last, odd-sized
  batch), so a run this close fails on the first larger step.
- GPU memory RISING: allocated-at-step-end (median of the last third of the steps against the
  first third) grew by >= 1 MiB and >= 0.5 % of its level. A steady loop ends every step holding
  the same tensors (the allocator counts them exactly), so any rise is something kept; the floor
  keeps variable-length batches out. CREEP: at the rate seen (MiB a step times the run's steps,
  warm-up included; not the thirds' growth, which shrinks with the warm-up and the unread steps) a
  run 10x as long (often a traced cell is a slice of the training) would use up the memory the
  peak leaves free (critical: one more run as long would).
- CPU SATURATED: the process and its workers keep >= 90 % of the usable cores busy; or the
  machine leaves less CPU idle (usable cores minus busy cores, other processes counted) than one
  of the workers uses, while the process and its workers use >= 10 % of the cores and its workers
  compute: found running or waiting for a CPU (not sleeping) in half the samples. Another worker
  would find no CPU to run on (on 2 cores, 2 workers burning 0.6 core each leave 0.2 idle: 1.8
  busy, 90 % only just missed). Workers that wait (I/O, sleep) are found sleeping: more of them
  overlap more waiting, whatever else runs on the machine.
- Worker memory growth: a worker's private memory (USS) grew by >= 64 MiB from its first read to
  its last (prefetched batches live in shared memory once sent; 64 MiB is above a worker's own
  steady buffers), and the dataset holds a Python list/dict of many objects (or it grew >= 256 MiB).
- Host memory RISING: the process's RSS (last third against first third of the samples in the
  loop) grew >= 64 MiB and >= 5 % (allocator caches move RSS by tens of MiB); CREEP as on the GPU,
  against the memory the machine had available.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from .findings import Finding, Label
from .number_text import pct
from .summary_keys import Summary, measured
from .threads import oversubscription

PRESSURE_WARN = 0.92
PRESSURE_CRITICAL = 0.97
RISE_MIB = 1.0
RISE_SHARE = 0.005
CREEP_RUNS = 10.0  # a run this many times as long would use up the free memory: CREEP
MIN_STEPS_FOR_TREND = 6
SATURATED_SHARE = 0.90
OWN_SHARE = 0.10
RUNNING_WORKERS = 0.5  # workers found running (or waiting for a CPU) in half the samples compute
WORKER_GROWTH_MIB = 64.0
WORKER_GROWTH_ALONE_MIB = 256.0
HOST_RISE_MIB = 64.0
HOST_RISE_SHARE = 0.05
HELD_SHARE = 0.10  # earlier cells' memory worth a line of its own (always with OOM or pressure)
BATCH_HEADROOM = 0.90  # a larger batch may fill the device up to this share


@dataclass(frozen=True)
class ResourceFacts:
    """What the resource findings read (the run gathers it; every part may be missing)."""

    columns: Mapping[str, np.ndarray] = field(default_factory=dict)  # the run's step columns
    warmup: int = 0
    gpu_memory: Mapping[str, Any] | None = None  # gpu_memory.GpuMemory.result()
    host: Mapping[str, Any] | None = None  # host.HostSampler.result() (+ available_mib)
    kept: Sequence[Mapping[str, Any]] = ()  # kept_graph.KeptGraph.to_dict() of the loop body
    python_objects: Sequence[Mapping[str, Any]] = ()  # dataset attributes of many Python objects
    loader_name: str | None = None
    training_loader: int | None = None  # id() of the training DataLoader (its workers' key)
    held: Mapping[str, Any] | None = None  # gpu_memory.held_before()
    oom: Mapping[str, Any] | None = None  # gpu_memory.oom_facts() + "step"
    device: int | None = None  # the loop's CUDA device


# -- figures as words ------------------------------------------------------------------------------


def mib(value: float | None) -> str:
    """"812 MiB", "1.25 GiB"."""
    if value is None or value != value:
        return "n/a"
    if abs(value) >= 1024:
        return f"{value / 1024:.2f} GiB"
    if abs(value) >= 10:
        return f"{value:.0f} MiB"
    return f"{value:.1f} MiB"


def _signed(value: float) -> str:
    return ("+" if value >= 0 else "-") + mib(abs(value))


def _finite(values: Any) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    return a[np.isfinite(a)]


def thirds(values: np.ndarray) -> tuple[float, float] | None:
    """Medians of the first and the last third, None with too few values for a trend."""
    n = len(values)
    if n < MIN_STEPS_FOR_TREND:
        return None
    k = n // 3
    return float(np.median(values[:k])), float(np.median(values[-k:]))


def _rising(first: float, last: float, floor: float, share: float) -> bool:
    growth = last - first
    return growth >= floor and growth >= share * max(first, 0.0)


def _creep(run_growth: float, free: float | None, runs: float = CREEP_RUNS) -> bool:
    """Whether `runs` runs as long, each growing `run_growth` (the rate times the run's length), use up `free`."""
    return free is not None and free > 0 and run_growth * runs >= free


def kept_sentence(kept: Sequence[Mapping[str, Any]]) -> str:
    """" Likely cause: line 7 keeps every step's graph (...): use ..." or ""."""
    if not kept:
        return ""
    first = kept[0]
    more = f" (and line{'s' if len(kept) > 2 else ''} {', '.join(str(k['line']) for k in kept[1:])})" if len(kept) > 1 else ""
    return f" Likely cause: {first['sentence']}{more}."


# -- GPU memory ------------------------------------------------------------------------------------


def gpu_memory_summary(facts: ResourceFacts) -> tuple[Summary, list[Finding]]:
    """GPU memory's summary keys and findings (out of memory, high pressure, creeping up)."""
    out: Summary = {}
    found: list[Finding] = []
    cols = facts.columns
    capacity = (facts.gpu_memory or {}).get("capacity_mib")
    out["gpu_mem_capacity_mib"] = capacity
    if "gpu_mem_peak_mib" not in cols or "step" not in cols:
        return out, found
    analysed = np.asarray(cols["step"]) >= facts.warmup
    peak = _finite(np.asarray(cols["gpu_mem_peak_mib"])[analysed])
    alloc_all = np.asarray(cols["gpu_mem_allocated_mib"], dtype=np.float64)[analysed]
    steps = np.asarray(cols["step"], dtype=np.float64)[analysed]
    ok = np.isfinite(alloc_all)
    alloc, alloc_steps = alloc_all[ok], steps[ok]
    reserved = _finite(np.asarray(cols["gpu_mem_reserved_mib"])[analysed])
    if not len(peak):
        return out, found
    top = float(peak.max())
    end = float(np.median(alloc)) if len(alloc) else None
    share = top / capacity if capacity else None
    out["gpu_mem_peak_mib"], out["gpu_mem_peak_share"] = top, share
    out["gpu_mem_reserved_mib"] = float(reserved.max()) if len(reserved) else None
    out["gpu_mem_end_mib"] = end
    if capacity and end is not None and top > end:
        out["gpu_batch_room"] = max(0.0, (BATCH_HEADROOM * capacity - end) / (top - end))
    if share is not None and share >= PRESSURE_WARN:
        found.append(
            Finding(
                Label.HIGH_PRESSURE,
                "critical" if share >= PRESSURE_CRITICAL else "warn",
                f"the largest step peak is {mib(top)} of the GPU's {mib(capacity)} ({pct(share)}): a "
                "larger batch, a longer sequence or an odd-sized batch will run out of memory.",
                "Make room: mixed precision (torch.autocast), activation checkpointing, or a smaller "
                "batch with gradient accumulation; free what earlier cells hold.",
            )
        )
    trend = thirds(alloc)
    if trend is not None:
        first, last = trend
        growth = last - first
        k = len(alloc) // 3
        span_steps = float(np.median(alloc_steps[-k:]) - np.median(alloc_steps[:k])) or 1.0
        out["gpu_mem_growth_mib"] = growth
        out["gpu_mem_growth_per_step_mib"] = growth / span_steps
        if _rising(first, last, RISE_MIB, RISE_SHARE):
            free = capacity - top if capacity else None
            all_steps = np.asarray(cols["step"], dtype=np.float64)
            run_growth = growth / span_steps * float(all_steps.max() - all_steps.min() + 1)
            creep = _creep(run_growth, free) if free is not None else run_growth >= 0.10 * max(first, 1.0)
            severity = "critical" if free is not None and run_growth >= free else ("warn" if creep else "info")
            text = (
                f"allocated memory at the end of each step grew from {mib(first)} (first third of the "
                f"steps) to {mib(last)} (last third): {_signed(growth)}, {_signed(growth / span_steps)} a step"
            )
            if free is not None and growth > 0:
                more = free / (growth / span_steps)
                text += f"; at this rate the {mib(free)} the peak leaves free last about {more:,.0f} more steps"
            text += "." + kept_sentence(facts.kept)
            found.append(
                Finding(
                    Label.MEMORY_CREEP if creep else Label.MEMORY_RISING,
                    severity,
                    text,
                    "Keep numbers, not tensors, across steps (`loss.item()`), or `.detach()` what you keep.",
                    int(facts.kept[0]["line"]) if facts.kept else None,
                )
            )
    return out, found


# -- the host: CPU ----------------------------------------------------------------------------------


def loop_span(cols: Mapping[str, np.ndarray], warmup: int) -> tuple[float, float] | None:
    """From the first analysed step's start to the last step's end (s since the run's origin)."""
    if "time_s" not in cols or not len(cols["time_s"]):
        return None
    steps = np.asarray(cols["step"])
    t = np.asarray(cols["time_s"], dtype=np.float64)
    ends = t + np.asarray(cols["step_ms"], dtype=np.float64) / 1e3
    analysed = steps >= warmup
    if not analysed.any():
        analysed = np.ones(len(t), dtype=bool)
    return float(np.nanmin(t[analysed])), float(np.nanmax(ends))


def cpu_summary(facts: ResourceFacts) -> tuple[Summary, list[Finding]]:
    """The CPU's summary keys (usable cores, how busy) and findings (the CPU saturated)."""
    host = facts.host or {}
    usable = host.get("usable_cores")
    out: Summary = {"cpu_usable_cores": usable}
    samples = host.get("samples") or {}
    span = loop_span(facts.columns, facts.warmup)
    if not samples or span is None or not len(samples.get("time_s", ())):
        return out, []
    t = np.asarray(samples["time_s"], dtype=np.float64)
    # A sample describes the interval before it: those whose interval ended inside the loop.
    inside = (t > span[0]) & (t <= span[1] + 0.5)
    proc = np.asarray(samples["process_cores"], dtype=np.float64)[inside]
    workers = np.asarray(samples["workers_cores"], dtype=np.float64)[inside]
    machine = np.asarray(samples["machine_cores"], dtype=np.float64)[inside]
    ok = np.isfinite(proc) & np.isfinite(workers)
    if ok.sum() < 2:
        return out, []
    family = proc[ok] + workers[ok]
    out["cpu_cores"] = float(np.median(family))
    out["cpu_process_cores"] = float(np.median(proc[ok]))
    out["cpu_workers_cores"] = float(np.median(workers[ok]))
    busy_all = machine[ok & np.isfinite(machine)]
    out["cpu_machine_cores"] = float(np.median(busy_all)) if len(busy_all) >= 2 else None
    n_workers = np.asarray(samples.get("workers", np.zeros(len(t))), dtype=np.float64)[inside][ok]
    running = np.asarray(samples.get("workers_running", np.zeros(len(t))), dtype=np.float64)[inside][ok]
    out["cpu_workers"] = float(np.median(n_workers)) if len(n_workers) else None
    out["cpu_workers_running"] = float(running.sum() / n_workers.sum()) if n_workers.sum() > 0 else None
    if not usable:
        return out, []
    saturated = saturated_cpu(out, usable)
    out["cpu_saturated"] = saturated
    if not saturated:
        return out, []
    return out, [Finding(Label.CPU_SATURATED, "warn", cpu_sentence(out), SATURATED_NEXT)]


def saturated_cpu(s: Summary, usable: float) -> bool:
    """The process and its workers use (nearly) every usable core; or the machine (other
    processes too) leaves less CPU idle than one worker uses, while the process and its workers
    use a good part of the cores and its workers compute rather than wait (found running or
    waiting for a CPU, not sleeping, in half the samples): another worker would find no CPU."""
    family, machine = measured(s["cpu_cores"]), s.get("cpu_machine_cores")
    if family >= SATURATED_SHARE * usable:
        return True
    workers, running = s.get("cpu_workers"), s.get("cpu_workers_running")
    if machine is None or not workers or running is None or family < OWN_SHARE * usable:
        return False
    one_worker = measured(s["cpu_workers_cores"]) / float(workers)
    idle = usable - float(machine)
    return idle < max(one_worker, (1.0 - SATURATED_SHARE) * usable) and running >= RUNNING_WORKERS


SATURATED_NEXT = (
    "More DataLoader workers won't help: make per-sample work cheaper, cache decoded samples, or "
    "move the work to the GPU."
)


def _cores(value: float) -> str:
    return f"{value:.1f}"


def cpu_sentence(summary: Summary) -> str:
    """"the training process and its DataLoader workers keep 1.9 of the 2 usable cores busy (the
    process 0.3, the workers 1.6)."; when other processes fill the rest, says so."""
    usable = measured(summary["cpu_usable_cores"])
    ours = (
        f"the training process and its DataLoader workers keep {_cores(measured(summary['cpu_cores']))} of the "
        f"{usable:g} usable cores busy (the process {_cores(measured(summary['cpu_process_cores']))}, the "
        f"workers {_cores(measured(summary['cpu_workers_cores']))})"
    )
    machine, running = summary.get("cpu_machine_cores"), summary.get("cpu_workers_running")
    if machine is None or measured(summary["cpu_cores"]) >= SATURATED_SHARE * usable:
        return ours + "."
    text = ours + f"; counting other processes, {_cores(machine)} are busy"
    if running is not None:
        text += f", and the workers compute (running or waiting for a core in {pct(running, 0)} of the samples)"
    return text + "."


# -- the host: memory --------------------------------------------------------------------------------


def host_memory_summary(facts: ResourceFacts) -> tuple[Summary, list[Finding]]:
    """The host memory's summary keys (the training process's and the workers' memory over the loop)
    and its findings (memory creeping up, workers' memory growing)."""
    host = facts.host or {}
    samples = host.get("samples") or {}
    out: Summary = {}
    found: list[Finding] = []
    span = loop_span(facts.columns, facts.warmup)
    if not samples or not len(samples.get("time_s", ())):
        return out, found
    t = np.asarray(samples["time_s"], dtype=np.float64)
    rss_all = np.asarray(samples["process_rss_mib"], dtype=np.float64)
    out["host_rss_mib"] = float(np.nanmax(rss_all)) if np.isfinite(rss_all).any() else None
    if span is not None:
        inside = (t >= span[0]) & (t <= span[1] + 0.5) & np.isfinite(rss_all)
        rss, when = rss_all[inside], t[inside]
        trend = thirds(rss)
        if trend is not None:
            first, last = trend
            growth = last - first
            out["host_rss_growth_mib"] = growth
            if _rising(first, last, HOST_RISE_MIB, HOST_RISE_SHARE):
                k = len(rss) // 3
                seconds = float(np.median(when[-k:]) - np.median(when[:k])) or 1.0
                steps = _steps_between(facts.columns, float(np.median(when[:k])), float(np.median(when[-k:])))
                available = host.get("available_mib")
                start, end = loop_span(facts.columns, 0) or span  # the whole run, its warm-up too
                creep = _creep(growth / seconds * (end - start), available) if available else growth >= 0.25 * first
                rate = f", {_signed(growth / steps)} a step" if steps else f", {_signed(growth / seconds)} a second"
                text = (
                    f"the training process's memory (RSS) grew from {mib(first)} to {mib(last)} over "
                    f"the loop: {_signed(growth)}{rate}"
                )
                if available:
                    text += f"; the machine had {mib(available)} available"
                text += "." + kept_sentence(facts.kept)
                found.append(
                    Finding(
                        Label.HOST_MEMORY_CREEP if creep else Label.HOST_MEMORY_RISING,
                        "warn" if creep else "info",
                        text,
                        "Keep numbers, not tensors, across steps (`loss.item()`); `.detach()` and move "
                        "to the CPU only what you must keep.",
                        int(facts.kept[0]["line"]) if facts.kept else None,
                    )
                )
    workers = [w for w in host.get("workers") or [] if w.get("uss_reads", 0) >= 2]
    if facts.training_loader is not None and any(w.get("loader") == facts.training_loader for w in workers):
        workers = [w for w in workers if w.get("loader") == facts.training_loader]
    out["workers_seen"] = len(host.get("workers") or []) or None
    if workers:
        growth_of = {w["pid"]: float(w["uss_last_mib"]) - float(w["uss_first_mib"]) for w in workers}
        pid = max(growth_of, key=lambda p: growth_of[p])
        top = growth_of[pid]
        out["worker_uss_growth_mib"] = top
        holders = list(facts.python_objects)
        if top >= WORKER_GROWTH_MIB and (holders or top >= WORKER_GROWTH_ALONE_MIB):
            w = next(x for x in workers if x["pid"] == pid)
            grew = sum(1 for g in growth_of.values() if g >= WORKER_GROWTH_MIB)
            text = (
                f"a DataLoader worker's private memory grew from {mib(w['uss_first_mib'])} to "
                f"{mib(w['uss_last_mib'])} ({_signed(top)}; {grew} of {len(workers)} workers grew "
                f"{mib(WORKER_GROWTH_MIB)} or more), while its RSS moved {_signed(float(w['rss_last_mib'] or 0) - float(w['rss_first_mib'] or 0))}: "
                "reading Python objects in a forked worker writes their reference counts, which copies "
                "the pages they sit on (copy-on-read, pytorch/pytorch#13246), once per worker."
            )
            if holders:
                h = holders[0]
                owner = f"{facts.loader_name}.dataset" if facts.loader_name else "the dataset"
                text += (
                    f" `{owner}.{h['attribute']}` holds a {h['kind']} of {h['length']:,} {h['items']} objects."
                )
                fix = (
                    f"Store `{h['attribute']}` as numpy arrays or tensors (one object per column, not "
                    "per sample), or Arrow/pandas columns; strings as one numpy array of bytes with offsets."
                )
            else:
                fix = "Look for Python lists or dicts of many objects the dataset reads; store them as numpy arrays or tensors."
            found.append(Finding(Label.WORKER_MEMORY, "warn", text, fix))
    return out, found


def _steps_between(cols: Mapping[str, np.ndarray], t0: float, t1: float) -> float:
    if "time_s" not in cols:
        return 0.0
    t = np.asarray(cols["time_s"], dtype=np.float64)
    steps = np.asarray(cols["step"], dtype=np.float64)
    inside = (t >= t0) & (t <= t1)
    if inside.sum() < 2:
        return 0.0
    return float(steps[inside].max() - steps[inside].min())


# -- what earlier cells hold; out of memory ------------------------------------------------------------


def _held_device(held: Mapping[str, Any] | None, device: int | None) -> Mapping[str, Any] | None:
    devices = list((held or {}).get("devices") or [])
    if not devices:
        return None
    if device is not None:
        for d in devices:
            if d.get("device") == device:
                return d  # type: ignore[no-any-return]
        return None
    return max(devices, key=lambda d: float(d.get("allocated_mib") or 0.0))  # type: ignore[no-any-return]


def holders_text(d: Mapping[str, Any]) -> str:
    """"old_model 1.20 GiB, outputs 800 MiB"."""
    return ", ".join(f"{h['name']} {mib(h['mib'])}" for h in d.get("holders") or [])


def held_sentence(d: Mapping[str, Any]) -> str:
    """What earlier cells hold on the GPU as this cell starts, with its biggest holders."""
    text = f"earlier cells hold {mib(d['allocated_mib'])} on cuda:{d['device']} when this cell starts"
    if d.get("capacity_mib"):
        text += f" ({pct(float(d['allocated_mib']) / float(d['capacity_mib']))} of {mib(d['capacity_mib'])})"
    names = holders_text(d)
    if names:
        text += f"; the biggest holders: {names}"
        unnamed = float(d["allocated_mib"]) - float(d.get("named_mib") or 0.0)
        if unnamed >= 0.1 * float(d["allocated_mib"]) and unnamed >= 1.0:
            text += f" ({mib(unnamed)} held by no name found: a variable of a function, a reference cycle, `_`)"
    return text + "."


HELD_NEXT = "Free what you no longer need: `del NAME`, then `gc.collect()` and `torch.cuda.empty_cache()`."


def held_summary(facts: ResourceFacts, pressing: bool) -> tuple[Summary, list[Finding]]:
    """What earlier cells held on the GPU (a summary key), a finding when it weighs."""
    d = _held_device(facts.held, facts.device)
    if d is None:
        return {"gpu_held_before_mib": None}, []
    out: Summary = {"gpu_held_before_mib": float(d["allocated_mib"])}
    share = float(d["allocated_mib"]) / float(d["capacity_mib"]) if d.get("capacity_mib") else None
    if pressing or (share is not None and share >= HELD_SHARE):
        severity = "warn" if pressing else "info"
        names = [h["name"] for h in d.get("holders") or []][:3]
        fix = f"Free what you no longer need: `del {', '.join(names)}`, then `gc.collect()` and `torch.cuda.empty_cache()`." if names else HELD_NEXT
        return out, [Finding(Label.HELD_BY_EARLIER_CELLS, severity, held_sentence(d), fix)]
    return out, []


def oom_finding(facts: ResourceFacts) -> Finding | None:
    """The finding for a CUDA out-of-memory error: the step it happened in and what held the memory;
    None when there was none."""
    oom = facts.oom
    if not oom:
        return None
    step, done = oom.get("step"), oom.get("completed_steps")
    where = f"in step {step}" if step is not None else "in the cell"
    if done is not None:
        where += f" (after {done} completed step{'s' if done != 1 else ''})"
    device = oom.get("device")
    text = f"CUDA ran out of memory {where}"
    if oom.get("requested_mib") is not None:
        text += f": it tried to allocate {mib(oom['requested_mib'])}"
        text += f" on GPU {device}" if device is not None else ""
    said = (("capacity {}", "capacity_mib"), ("{} free", "free_mib"), ("{} allocated by tensors", "allocated_mib"),
            ("{} reserved by PyTorch", "reserved_mib"), ("peak {}", "peak_mib"))  # the figures the error gave
    parts = [words.format(mib(oom[key])) for words, key in said if oom.get(key) is not None]
    if parts:
        text += " (" + ", ".join(parts) + ")"
    text += "."
    held = _held_device(facts.held, device if device is not None else facts.device)
    if held is not None:
        text += " Before it, " + held_sentence(held)
    text += kept_sentence(facts.kept)
    fix = "Free what earlier cells hold (`del NAME`, `gc.collect()`, `torch.cuda.empty_cache()`), then "
    fix += "lower the batch size (with gradient accumulation), use mixed precision (torch.autocast) or activation checkpointing."
    return Finding(Label.OUT_OF_MEMORY, "critical", text, fix, int(facts.kept[0]["line"]) if facts.kept else None)


# -- all of it ---------------------------------------------------------------------------------------

RESOURCE_KEYS = (
    "gpu_mem_capacity_mib",  # the loop's device's memory (MiB)
    "gpu_mem_peak_mib",  # the largest per-step peak allocated (analysed steps)
    "gpu_mem_peak_share",  # gpu_mem_peak_mib / gpu_mem_capacity_mib
    "gpu_mem_reserved_mib",  # the most the caching allocator reserved at a step's end
    "gpu_mem_end_mib",  # median allocated at a step's end
    "gpu_mem_growth_mib",  # allocated at step end: last third's median - first third's
    "gpu_mem_growth_per_step_mib",
    "gpu_batch_room",  # how many times the batch's activations fit in 90 % of the device
    "gpu_held_before_mib",  # allocated on the loop's device when the cell started
    "cpu_usable_cores",  # affinity, capped by the cgroup quota
    "cpu_cores",  # median cores busy in the process and its workers during the loop
    "cpu_process_cores",
    "cpu_workers_cores",
    "cpu_machine_cores",  # median cores busy on the usable CPUs, every process
    "cpu_workers",  # median live DataLoader workers during the loop
    "cpu_workers_running",  # share of the workers' samples found running or waiting for a CPU
    "cpu_saturated",  # True / False; None when not measured
    "cpu_torch_threads",  # torch's intra-op threads in the training process (None: torch not imported)
    "cpu_oversubscription",  # threads x (1 + busy workers) > usable cores: the figures (else None)
    "host_rss_mib",  # the process's largest RSS
    "host_rss_growth_mib",  # RSS in the loop: last third's median - first third's
    "workers_seen",  # DataLoader worker processes sampled
    "worker_uss_growth_mib",  # the largest growth of a worker's private memory
    "resource_findings",  # list of Finding.to_dict()
)


def resource_summary(facts: ResourceFacts) -> Summary:
    """The summary's resource keys (RESOURCE_KEYS; None when not measured) and the findings,
    most serious first."""
    out = cast(Summary, dict.fromkeys(RESOURCE_KEYS))
    found: list[Finding] = []
    oom = oom_finding(facts)
    if oom is not None:
        found.append(oom)
    gpu, gpu_found = gpu_memory_summary(facts)
    cpu, cpu_found = cpu_summary(facts)
    host, host_found = host_memory_summary(facts)
    pressing = oom is not None or any(f.label is Label.HIGH_PRESSURE for f in gpu_found)
    held, held_found = held_summary(facts, pressing)
    threads, threads_found = oversubscription(facts.host, facts.columns, facts.warmup, facts.training_loader)
    for part in (gpu, cpu, host, held, threads):
        out.update(part)
    found += gpu_found + cpu_found + threads_found + host_found + held_found
    carried = any(f.label in (Label.MEMORY_CREEP, Label.MEMORY_RISING, Label.HOST_MEMORY_CREEP, Label.HOST_MEMORY_RISING, Label.OUT_OF_MEMORY) for f in found)
    if facts.kept and not carried:
        k = facts.kept[0]
        found.append(
            Finding(
                Label.KEPT_GRAPH,
                "info",
                f"{k['sentence']}: memory grows by a step's graph every step (no growth large enough "
                "to measure in this run).",
                "",
                int(k["line"]),
            )
        )
    order = {"critical": 0, "warn": 1, "info": 2}
    found.sort(key=lambda f: order.get(f.severity, 3))
    out["resource_findings"] = [f.to_dict() for f in found]
    return out


def finding_lines(summary: Summary) -> list[str]:
    """The findings as the text box's "Also:" lines."""
    return [
        f"{f['label']}: {f['text']} {f['next']}".strip()
        for f in summary.get("resource_findings") or []
    ]


def saturation_text(summary: Summary) -> str | None:
    """CPU SATURATED in a sentence (what the verdict, the checklist and tune quote), else None."""
    if not summary.get("cpu_saturated"):
        return None
    return "The CPU is saturated: " + cpu_sentence(summary)
