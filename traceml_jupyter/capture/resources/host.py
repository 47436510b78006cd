"""The host while a loop runs: the cores this process may use (affinity and cgroup quota), and
a low-rate sampler thread ("traceml-host") of the training process and its DataLoader workers
(CPU time, RSS, and the workers' private memory), never on the per-step path.

Why a thread rather than the run's ticks: a tick comes only when a step closes, and a step can
last seconds; and the figure that shows a worker's copy-on-read growth, its private memory (USS,
one read of /proc/PID/smaps_rollup; psutil's memory_full_info where it is absent), costs the
kernel a walk of the worker's page tables: 13 ms for a worker that holds a 1-million-item list,
26 ms at 3 million (psutil 7.2 reads the same file: the walk, not the parsing, is the cost). One
cheap sample of the process and two workers (CPU times and RSS) costs about 0.13 ms. On the
thread, at 4 Hz the cheap samples take 0.05 % of a core, and the private-memory reads are spaced
so that they take at most USS_BUDGET of a core; a worker whose minor page faults (a copy-on-write
copy is one; /proc/PID/stat, microseconds) grew by GROWTH_FAULTS since its last read is read
again as soon as USS_GROWTH_BUDGET allows, so a growth of two seconds is read while it grows,
before the worker exits at the end of its pass. The kernel's walk runs with the GIL released.

CPU: the process's own time (all its threads), plus its reaped children's (psutil's
children_user/children_system: workers of a finished epoch), plus the live workers' own time;
cores busy = the growth of that sum over the wall time between two samples. The machine's busy
cores on the CPUs this process may use (every process's, from the per-CPU times) say whether a
core was left idle; each worker's state (running or waiting for a CPU, against sleeping) says
whether it computes or waits, whatever share of a core the other processes leave it. Memory: RSS of the process; RSS and USS of each worker (after fork a worker's
RSS counts the parent's pages it maps and barely moves, while the pages that reading Python
objects copies show in its USS).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...facts.resources import HostFacts, WorkerFacts
from ...failures import failure_text
from ..steps.step_history import StepHistory
from .samples import SampleBuffer, Sampler

SAMPLE_PERIOD_S = 0.25  # the run's tick rate: 4 samples a second
CAPACITY = 2048  # samples kept; when full, every other one goes and the period doubles
THREAD_NAME = "traceml-host"
USS_BUDGET = 0.02  # the workers' private-memory reads take at most 2 % of one core
USS_GROWTH_BUDGET = 0.05  # ... or 5 % of one core for a worker whose page faults say it grew
USS_MIN_PERIOD_S = 0.5
GROWTH_FAULTS = 4096  # minor page faults (16 MiB of 4 KiB pages) since a worker's last USS read
MIB = 2**20
USS_KEPT = 64  # private-memory reads kept per worker (first and last always)

HOST_COLUMNS = (
    "time_s",
    "process_cores",  # cores busy in the training process (every thread), since the last sample
    "workers_cores",  # cores busy in its DataLoader workers (and other children)
    "machine_cores",  # cores busy, any process, on the CPUs this process may use (NaN: unknown)
    "process_rss_mib",
    "workers_rss_mib",  # the live workers' RSS, summed
    "workers_uss_mib",  # the live workers' private memory (USS, latest read of each), summed
    "workers",  # live workers
    "workers_running",  # of them, those running or waiting for a CPU (not sleeping) right now
)


# -- the cores this process may use -----------------------------------------------------------


def affinity_cpus() -> set[int] | None:
    """The CPUs the scheduler lets this process run on (None where the OS does not say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def cgroup_quota(cgroup_text: str, read: Callable[[str], str | None], root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in cores (quota / period; the smallest along its
    path up to the root), None without a quota. `cgroup_text` is /proc/self/cgroup; `read(path)`
    a file's text or None. cgroup v2: `cpu.max` ("max 100000" or "150000 100000"); v1: the `cpu`
    controller's cpu.cfs_quota_us (-1: none) and cpu.cfs_period_us."""
    found: list[float] = []
    for line in cgroup_text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        names = controllers.split(",") if controllers else []
        if not controllers:  # v2 (unified)
            bases = [root]
        elif "cpu" in names:
            bases = [f"{root}/{c}" for c in ("cpu", "cpu,cpuacct", "cpuacct,cpu")]
        else:
            continue
        for base in bases:
            found.extend(_quotas_up(base, path, read, v2=not controllers))
    return min(found) if found else None


def _quotas_up(base: str, path: str, read: Callable[[str], str | None], v2: bool) -> list[float]:
    """The quotas of `path` and its parents under the mount `base` (a container sees its own
    cgroup at the mount's root, so the root counts too)."""
    out: list[float] = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        directory = "/".join([base, *parts[:depth]])
        if v2:
            text = read(f"{directory}/cpu.max")
            fields = (text or "").split()
            if len(fields) == 2 and fields[0] != "max":
                out.append(_ratio(fields[0], fields[1]))
        else:
            quota, period = read(f"{directory}/cpu.cfs_quota_us"), read(f"{directory}/cpu.cfs_period_us")
            if quota is not None and period is not None and quota.strip() not in ("", "-1"):
                out.append(_ratio(quota, period))
    return [q for q in out if q > 0]


def _ratio(quota: str, period: str) -> float:
    try:
        return float(quota) / float(period)
    except (ValueError, ZeroDivisionError):
        return 0.0


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


def usable_cores() -> float:
    """How many cores this process may use: its CPU affinity, capped by its cgroup's CPU quota
    (a container limited to 1.5 CPUs on a 64-core host: 1.5)."""
    cpus = affinity_cpus()
    n = float(len(cpus)) if cpus else float(os.cpu_count() or 1)
    quota = cgroup_quota(_read_text("/proc/self/cgroup") or "", _read_text)
    return min(n, quota) if quota else n


def usable_cpus() -> int:
    """usable_cores() as a whole number of CPUs (at least 1): what worker counts are sized by."""
    return max(1, int(usable_cores()))


# -- the sampler ------------------------------------------------------------------------------


@dataclass
class Worker:
    """What the sampler saw of one DataLoader worker process."""

    pid: int
    loader: int  # id() of the DataLoader whose iterator started it
    first_s: float | None = None  # run time of its first and last sample
    last_s: float | None = None
    cpu_s: float = 0.0  # CPU seconds while sampled
    rss_mib: list[float] = field(default_factory=list)  # first, last, max
    # (run time, MiB) of its private-memory reads; when full, every other one goes
    uss: StepHistory = field(default_factory=lambda: StepHistory(USS_KEPT, "dd", every_step=True))
    exited: bool = False
    proc: Any = None
    cpu_last: float | None = None
    uss_due: float = 0.0  # run time from which a grown worker's USS may be read again
    faults_at_uss: int | None = None  # its minor page faults at its last USS read

    def to_dict(self) -> WorkerFacts:
        """The worker's figures as JSON-ready values: pid, when it was seen, CPU seconds, memory
        first and last, its DataLoader."""
        uss = self.uss.column(1).tolist()
        return {
            "pid": self.pid,
            "first_s": self.first_s,
            "last_s": self.last_s,
            "cpu_s": self.cpu_s,
            "rss_first_mib": self.rss_mib[0] if self.rss_mib else None,
            "rss_last_mib": self.rss_mib[1] if self.rss_mib else None,
            "rss_max_mib": self.rss_mib[2] if self.rss_mib else None,
            "uss_first_mib": uss[0] if uss else None,
            "uss_last_mib": uss[-1] if uss else None,
            "uss_max_mib": max(uss) if uss else None,
            "uss_reads": len(uss),
            "exited": self.exited,
            "loader": self.loader,
        }


def _keep_reading(worker: Worker, cpu: float, rss: float, run_s: float) -> None:
    """A worker's running totals after one reading: CPU seconds since the last, when first and
    last seen, its RSS now, first and at peak."""
    if worker.cpu_last is not None:
        worker.cpu_s += max(0.0, cpu - worker.cpu_last)
    worker.cpu_last = cpu
    worker.first_s = worker.first_s if worker.first_s is not None else run_s
    worker.last_s = run_s
    worker.rss_mib = [rss, rss, rss] if not worker.rss_mib else [
        worker.rss_mib[0], rss, max(worker.rss_mib[2], rss)
    ]


def private_mib(pid: int) -> float | None:
    """A process's private memory (USS, MiB) from one read of /proc/PID/smaps_rollup (its
    Private_* lines); None where it cannot be read (absent, gone, denied): then psutil's
    memory_full_info says which."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read()
    except OSError:
        return None
    kib = 0
    found = False
    for line in text.splitlines():
        if line.startswith(b"Private_"):  # Private_Clean, Private_Dirty, Private_Hugetlb (kB)
            kib += int(line.split()[1])
            found = True
    return kib / 1024 if found else None


def minor_faults(pid: int) -> int | None:
    """A process's minor page faults so far (/proc/PID/stat; a copy-on-write copy is one):
    a few microseconds to read; None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
        return int(text[text.rindex(b")") + 2 :].split()[7])
    except (OSError, ValueError, IndexError):
        return None


def torch_threads() -> int | None:
    """torch's intra-op threads in this process (torch.get_num_threads(): the CPU's thread pool,
    never CUDA); None when the process has not imported torch."""
    torch = sys.modules.get("torch")
    try:
        return int(torch.get_num_threads()) if torch is not None else None
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


class HostSampler(Sampler):
    """Samples the training process and the DataLoader workers the capture tells it of
    (`add_workers`, on a pass's iter()), on a thread named "traceml-host". `start()` and
    `stop()` (joins) run on the main thread; `sample_once()` is one reading (tests call it)."""

    def __init__(
        self,
        origin_ns: int | None = None,
        period_s: float = SAMPLE_PERIOD_S,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        super().__init__(THREAD_NAME, SampleBuffer(HOST_COLUMNS, CAPACITY), period_s)
        self.clock = clock
        self.origin_ns = origin_ns if origin_ns is not None else clock()
        self.workers: dict[int, Worker] = {}
        self.notes: list[str] = []
        self.usable_cores = usable_cores()
        cpus = affinity_cpus()
        # Busy cores of the machine are those of our CPUs, unless a quota caps us below them
        # (then other processes' use of those CPUs says nothing of our share).
        self.cpus = sorted(cpus) if cpus and self.usable_cores >= len(cpus) - 1e-9 else None
        self.uss_cost_s = 0.0  # the last round of private-memory reads
        self._pending: list[tuple[int, int]] = []  # (pid, loader id), appended by the main thread
        self._psutil: Any = None
        self._me: Any = None
        self._last: tuple[float, float, float, float, Any] | None = None
        self._offset = 0.0  # CPU of workers that ran before the sampler could see them
        self._departed = 0.0  # CPU of workers gone but not yet reaped (not in children's yet)
        self._children = 0.0
        self._uss_at = 0.0
        self._live = 0  # live workers at the current sample (the growth reads share their budget)

    def add_workers(self, pids: Iterable[int], loader: int) -> None:
        """Worker processes of a DataLoader iterator (called on the main thread, once a pass)."""
        for pid in pids:
            self._pending.append((int(pid), loader))
        self.wake()  # sample now: their memory before they read

    def start(self) -> bool:
        """Start the thread; False (with a note) without psutil."""
        try:
            import psutil
        except ImportError:
            self.notes.append("CPU and memory were not sampled: psutil is not installed (pip install psutil).")
            return False
        self._psutil = psutil
        try:
            self._me = psutil.Process()
            self.sample_once()  # the baseline: CPU use is counted from here
        except (psutil.Error, OSError) as exc:
            self.notes.append(f"CPU and memory were not sampled: {failure_text(exc)}")
            return False
        self.start_thread()
        return True

    def stop(self) -> None:
        """Stop the sampler (its last sample taken, the thread joined) and let go of the workers'
        handles."""
        self.stop_thread()
        for worker in self.workers.values():
            worker.proc = None  # no psutil handle outlives the run

    def last_sample(self) -> None:
        """The end of the run: workers still alive (persistent ones) get a last private-memory
        read, unless they had one in the last USS_MIN_PERIOD_S."""
        self.sample_once(uss=True, spaced=False)

    def failed(self, error: Exception) -> None:
        """A sample raised: sampling stops, and a note says why."""
        self.notes.append(f"CPU and memory sampling stopped: {failure_text(error)}")

    # -- one sample --------------------------------------------------------------------------
    def _adopt(self, now_wall: float, since: float | None) -> None:
        """Workers registered since the last sample: a psutil handle each. A worker that
        started before the previous sample ran before we could count it: its CPU so far is
        not this interval's."""
        psutil = self._psutil
        while self._pending:
            pid, loader = self._pending.pop(0)
            if pid in self.workers and not self.workers[pid].exited:
                continue
            worker = Worker(pid, loader)
            self.workers[pid] = worker
            try:
                proc = psutil.Process(pid)
                if since is not None and proc.create_time() < since:
                    times = proc.cpu_times()
                    self._offset += times.user + times.system
                worker.proc = proc
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                worker.exited = True
            except psutil.AccessDenied:
                worker.exited = True
                self._denied(pid)

    def _gone(self, worker: Worker) -> None:
        worker.exited = True
        worker.proc = None
        if worker.cpu_last is not None:
            self._departed += worker.cpu_last

    def _denied(self, pid: int) -> None:
        note = "A DataLoader worker could not be read (access denied): its CPU and memory are left out."
        if note not in self.notes:
            self.notes.append(note)

    def sample_once(self, uss: bool = True, spaced: bool = True) -> None:
        """One sample of the process and its live workers; `uss`: read the workers' private
        memory when due (`spaced`: by the budget; else any not read in USS_MIN_PERIOD_S)."""
        now = self.clock()
        wall = time.time()
        run_s = (now - self.origin_ns) / 1e9
        since = self._last[4] if self._last is not None else None
        self._adopt(wall, since)
        with self._me.oneshot():
            times = self._me.cpu_times()
            rss = self._me.memory_info().rss / MIB
        own = times.user + times.system
        children = getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)
        others = children
        live = running = 0
        workers_rss = workers_uss = 0.0
        any_uss = False
        due = uss and (run_s >= self._uss_at or not spaced)
        uss_cost = 0.0
        self._live = sum(1 for w in self.workers.values() if not w.exited and w.proc is not None)
        for worker in self.workers.values():
            if worker.exited or worker.proc is None:
                continue
            read = self._read_worker(worker, run_s, due, spaced)
            if read is None:
                continue
            cpu, w_rss, runnable, cost = read
            uss_cost += cost
            live += 1
            running += runnable
            others += cpu
            _keep_reading(worker, cpu, w_rss, run_s)
            workers_rss += w_rss
            if worker.uss:
                workers_uss += worker.uss.columns[1][-1]
                any_uss = True
        if due:
            self.uss_cost_s = uss_cost
            self._uss_at = run_s + max(USS_MIN_PERIOD_S, uss_cost / USS_BUDGET)
        # A worker that ended is counted at its last sample until the process reaps it (then
        # its whole time is in the children's): the sum never drops, nor counts it twice.
        self._departed -= min(self._departed, max(0.0, children - self._children))
        self._children = children
        machine = self._machine_busy()
        others += self._departed - self._offset
        process_cores = workers_cores = machine_cores = float("nan")
        if self._last is not None:
            t0, own0, others0, machine0, _ = self._last
            span = run_s - t0
            if span > 0:
                process_cores = max(0.0, own - own0) / span
                workers_cores = max(0.0, others - others0) / span
                if machine is not None and machine0 == machine0:
                    machine_cores = max(0.0, machine - machine0) / span
        self._last = (run_s, own, others, machine if machine is not None else float("nan"), wall)
        self.samples.add_row(
            (
                run_s,
                process_cores,
                workers_cores,
                machine_cores,
                rss,
                workers_rss if live else 0.0,
                workers_uss if any_uss else float("nan"),
                float(live),
                float(running),
            )
        )

    def _read_worker(
        self, worker: Worker, run_s: float, due: bool, spaced: bool
    ) -> tuple[float, float, bool, float] | None:
        """One live worker's CPU seconds, RSS (MiB), whether it runs, and the seconds its USS
        read took (read when due, or never read yet); None when it is gone or unreadable."""
        psutil = self._psutil
        cost = 0.0
        try:
            with worker.proc.oneshot():
                t = worker.proc.cpu_times()
                w_rss = worker.proc.memory_info().rss / MIB
                runnable = worker.proc.status() == psutil.STATUS_RUNNING
            recent = bool(worker.uss) and run_s - worker.uss.columns[0][-1] < USS_MIN_PERIOD_S
            faults = minor_faults(worker.pid)
            grown = (
                faults is not None
                and worker.faults_at_uss is not None
                and faults - worker.faults_at_uss >= GROWTH_FAULTS
                and run_s >= worker.uss_due
            )
            if (due and not (not spaced and recent)) or not worker.uss or grown:
                began = time.perf_counter()
                value = private_mib(worker.pid)
                if value is None:
                    value = worker.proc.memory_full_info().uss / MIB
                cost = time.perf_counter() - began
                worker.uss.append(run_s, value)
                worker.faults_at_uss = faults
                # The budget is shared: every live worker may be read as often as this one.
                worker.uss_due = run_s + max(USS_MIN_PERIOD_S, cost * max(1, self._live) / USS_GROWTH_BUDGET)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            self._gone(worker)  # its CPU moves to the reaped children's once joined
            return None
        except psutil.AccessDenied:
            self._gone(worker)
            self._denied(worker.pid)
            return None
        return t.user + t.system, w_rss, bool(runnable), cost

    def _machine_busy(self) -> float | None:
        """CPU seconds every process has spent on our CPUs so far (None: not known)."""
        if self.cpus is None:
            return None
        per_cpu = self._psutil.cpu_times(percpu=True)
        if max(self.cpus) >= len(per_cpu):  # a CPU brought online since the run started
            return None
        busy = 0.0
        for i in self.cpus:
            t = per_cpu[i]
            busy += sum(t) - t.idle - getattr(t, "iowait", 0.0)
        return busy

    # -- what views and the run read ---------------------------------------------------------
    def latest(self) -> dict[str, float] | None:
        """The newest sample (see HOST_COLUMNS), None before the second one (CPU use needs two)."""
        row = self.samples.last_row()
        if row is None or not np.isfinite(row["process_cores"]):
            return None
        return row

    def result(self) -> HostFacts:
        """What the run keeps: the samples (numpy columns), each worker, the usable cores, and
        the memory the machine had available at the end."""
        available = None
        if self._psutil is not None:
            available = float(self._psutil.virtual_memory().available) / MIB
        return {
            "available_mib": available,
            "samples": self.samples.columns(),
            "workers": [w.to_dict() for w in self.workers.values()],
            "usable_cores": self.usable_cores,
            "machine_cpus": len(self.cpus) if self.cpus is not None else None,
            "uss_cost_ms": self.uss_cost_s * 1e3,
            "torch_threads": torch_threads(),
            "notes": list(self.notes),
        }
