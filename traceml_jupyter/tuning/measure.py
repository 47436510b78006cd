"""One candidate of `%traceml tune` measured: its start-up, its steady batches a second, its
workers' CPU time, and taking a batch at the model's pace (the model stood in for)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..analysis.tune_plan import (
    DEFAULT_PREFETCH,
    EMPTY,
    ERROR,
    NO_START,
    OK,
    STOPPED,
    TIMEOUT,
    ModelCpu,
    Row,
    Setting,
    Split,
)
from .recipe import Recipe, SplitTimer
from .sandbox import Deadlines, OutOfTime, close_workers

# A candidate stops early once its steady rate rests on this many seconds and batches.
ENOUGH_WINDOW_S = 3.0
ENOUGH_BATCHES = 30

# The candidate at the model's pace (paced()): the last PACED_SHARE of a candidate's share (more
# for a slow model), at most TAKE_S seconds, means of at least TAKE_SAMPLES calls; without the
# model's rate, pauses of this many times a batch's time at the measured rate (workers ahead).
PACE_OVER_RATE = 1.25
PACED_SHARE = 0.4
TAKE_S = 3.0
TAKE_SAMPLES = 12


def batch_length(batch: Any) -> int | None:
    """Samples in a batch: the first dimension of its first tensor (or the length of a list)."""
    for _ in range(4):
        shape = getattr(batch, "shape", None)
        if shape is not None:
            return int(shape[0]) if len(shape) else 1
        if isinstance(batch, Mapping):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, list | tuple) and batch:
            if not hasattr(batch[0], "shape") and not isinstance(batch[0], list | tuple | Mapping):
                return len(batch)
            batch = batch[0]
        else:
            return None
    return None


def steady_rate(arrivals: Sequence[float], skip: int) -> float | None:
    """Batches a second after the first `skip` (the pipeline filling: one batch per worker
    arrives at about the same time at the start)."""
    skip = min(skip, max(0, len(arrivals) - 3))
    span = arrivals[-1] - arrivals[skip] if len(arrivals) > skip else 0.0
    if len(arrivals) - 1 - skip >= 1 and span > 0:
        return (len(arrivals) - 1 - skip) / span
    return None


def one_line(exc: BaseException) -> str:
    """`ValueError: corrupt sample 7`, also for an error re-raised from a worker process
    (whose message is the worker's whole traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    name = type(exc).__name__
    if not lines:
        return name
    last = lines[-1]
    if len(lines) > 1 and ":" in last and last.split(":")[0].isidentifier():
        return last
    return f"{name}: {lines[0]}"


def workers_cpu_s(iterator: Any) -> float | None:
    """CPU seconds the iterator's worker processes have used so far (None: not readable)."""
    import psutil

    total = 0.0
    try:
        workers = list(getattr(iterator, "_workers", ()) or ())
        for worker in workers:
            times = psutil.Process(worker.pid).cpu_times()
            total += times.user + times.system
    except (psutil.Error, OSError, AttributeError, ValueError):  # a worker gone; a platform without the counters
        return None
    return total if workers else None


def burn_cpu(seconds: float) -> None:
    """`seconds` of this thread's CPU time: fixed work, which takes longer when the cores are
    shared, as a model's compute on the CPU does."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@dataclass(frozen=True)
class Paced:
    """The candidate at the model's pace (paced()): ms to take a batch, and the model's stand-in
    compute over the run's; None: not measured."""

    take_ms: float | None
    compute_ratio: float | None


def paced(
    fetch: Callable[[], bool],
    pace_s: float,
    burn: float,
    until: float,
    reference_s: float | None = None,
    most: int = 400,
) -> Paced:
    """The training loop's side with this candidate, the model stood in for: `pace_s` of the
    model's compute per batch (its CPU share `burn` as CPU time burnt, the rest a sleep, as a
    host waiting on a GPU), then `fetch()` (next(); False when it starts a new epoch), timed.

    Taking a batch holds unpickling, the shared-memory handles each worker hands over (a worker
    busy in Python answers late), the queue and the next index sent, and the wait the workers
    leave at that pace; the burnt compute takes longer when the workers' CPU work crowds the
    usable cores (its ratio to `reference_s`, the run's compute per batch). Means over the calls
    after the first third (the queue settles to the pace); None below TAKE_SAMPLES calls (a
    loader too slow for a mean of its waits)."""
    takes: list[float] = []
    walls: list[float] = []
    for _ in range(most):
        if time.perf_counter() + pace_s > until:
            break
        begin = time.perf_counter()
        if burn > 0:
            burn_cpu(burn * pace_s)
        if burn < 1:
            time.sleep((1 - burn) * pace_s)
        fetched = time.perf_counter()
        if fetch():
            walls.append(fetched - begin)
            takes.append(time.perf_counter() - fetched)
    if len(takes) < TAKE_SAMPLES:
        return Paced(None, None)
    first = len(takes) // 3
    take = 1000.0 * sum(takes[first:]) / len(takes[first:])
    wall = sum(walls[first:]) / len(walls[first:])
    return Paced(take, wall / reference_s if reference_s else None)


@dataclass
class Measured:
    """One candidate's row of the table, and (at num_workers=0) the split of its batch time."""

    row: Row
    split: Split | None = None


class Candidate:
    """One candidate's loader and iterator while it is measured: the batches' arrival times,
    the training process's CPU time at each, and the samples counted."""

    def __init__(self, recipe: Recipe, setting: Setting, deadlines: Deadlines, split: bool) -> None:
        self.setting = setting
        self.deadlines = deadlines
        self.timer = SplitTimer() if split else None
        self.pin_here = split and setting.pin_memory  # at num_workers=0, pin by hand to time it
        self.built = Setting(
            setting.num_workers,
            setting.persistent_workers,
            setting.prefetch_factor,
            setting.pin_memory and not self.pin_here,
        )
        self.recipe = recipe
        self.skip = max(1, setting.num_workers)
        self.loader: Any = None
        self.iterator: Any = None
        self.in_epoch = 0
        self.arrivals: list[float] = []
        self.cpu_marks: list[float] = []
        self.samples: int | None = 0
        self.cpu_start: float | None = None

    def start(self) -> None:
        """Build the candidate's loader and its first iterator (held: no stop while workers
        start)."""
        with self.deadlines.held(), warnings.catch_warnings():
            # The step past the CPUs is on purpose: not torch's "excessive worker creation".
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            self.loader = self.recipe.build(self.built, self.timer)
            self.iterator = iter(self.loader)
            self.deadlines.iterators.append(self.iterator)
        self.in_epoch = 0

    def next_epoch(self) -> None:
        """A new epoch's iterator (persistent workers: the same one, reset); the last one's
        workers stop."""
        self.in_epoch = 0
        with self.deadlines.held(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            fresh = iter(self.loader)  # persistent workers: the same iterator, reset
            if fresh is not self.iterator:
                self.deadlines.iterators.append(fresh)
                close_workers(self.iterator, force=False)
            self.iterator = fresh

    def steady(self, steady_end: float) -> tuple[str, str | None]:
        """Take batches until `steady_end` or a steady rate (ENOUGH_*): status and message."""
        import torch

        while True:
            try:
                batch = next(self.iterator)
            except StopIteration:
                if not self.in_epoch:
                    return EMPTY, "the loader yielded no batch"
                if time.perf_counter() >= steady_end:
                    return OK, None
                self.next_epoch()
                continue
            if self.pin_here and self.timer is not None:
                begin = time.perf_counter()
                batch = torch.utils.data._utils.pin_memory.pin_memory(batch)
                self.timer.pin_s += time.perf_counter() - begin
                self.timer.pinned += 1
            now = time.perf_counter()
            arrivals = self.arrivals
            arrivals.append(now)
            self.cpu_marks.append(time.process_time())
            self.in_epoch += 1
            n = batch_length(batch)
            self.samples = None if n is None or self.samples is None else self.samples + n
            del batch
            if self.setting.num_workers and len(arrivals) == self.skip + 1:
                self.cpu_start = workers_cpu_s(self.iterator)
            if now >= steady_end or (
                len(arrivals) - self.skip >= ENOUGH_BATCHES
                and now - arrivals[self.skip] >= ENOUGH_WINDOW_S
            ):
                return OK, None

    def fetcher(self) -> Callable[[], bool]:
        """next() for paced(): False (not a take) at an epoch's end and while the workers
        refill their queue for the next one."""
        setting = self.setting
        depth = setting.num_workers * (setting.prefetch_factor or DEFAULT_PREFETCH)
        refilling = 0

        def fetch() -> bool:
            nonlocal refilling
            try:
                next(self.iterator)
            except StopIteration:
                self.next_epoch()
                refilling = depth
                return False
            if refilling:
                refilling -= 1
                return False
            return True

        return fetch

    def row(
        self,
        status: str,
        message: str | None,
        started: float,
        force: bool,
        at_pace: Paced,
        cpu_span: tuple[float, int] | None,
    ) -> Row:
        """The candidate's row, its workers stopped (killed when they may be inside a slow
        batch). `cpu_span`: the workers' CPU seconds over that many steady batches."""
        seconds = time.perf_counter() - started
        arrivals, setting = self.arrivals, self.setting
        rate = steady_rate(arrivals, self.skip) if len(arrivals) >= 2 else None
        if rate is None or setting.num_workers / rate > 0.5:
            force = True  # a worker may be inside a slow batch: do not wait for it
        with self.deadlines.held():
            close_workers(self.iterator, force)
        if rate is None and status in (OK, TIMEOUT):
            message = f"{len(arrivals)} batch(es) in {seconds:.1f} s: too slow to measure in its share"
        startup = None
        if setting.num_workers and arrivals:
            per_batch = setting.num_workers / rate if rate else 0.0
            startup = max(0.0, arrivals[0] - started - per_batch)
        samples = self.samples if arrivals else 0
        return Row(
            setting,
            status,
            rate,
            startup,
            samples,
            len(arrivals),
            seconds,
            message,
            take_ms=at_pace.take_ms,
            compute_ratio=at_pace.compute_ratio,
            worker_cpu_ms=1000.0 * cpu_span[0] / cpu_span[1] if cpu_span and cpu_span[1] else None,
        )

    def split(self, rate: float | None) -> Split | None:
        """At num_workers=0: the batch's time split into the dataset, collate_fn and pinning,
        and the share of it that is CPU work."""
        if self.timer is None or not rate:
            return None
        arrivals, marks = self.arrivals, self.cpu_marks
        k = min(1, len(arrivals) - 1)
        wall = arrivals[-1] - arrivals[k]
        used = marks[-1] - marks[k]
        return self.timer.split(1000.0 / rate, used / wall if wall > 0 else None)


def measure(
    recipe: Recipe,
    setting: Setting,
    deadlines: Deadlines,
    soft_end: float,
    hard_end: float,
    split: bool = False,
    pace_ms: float | None = None,
    cpu: ModelCpu | None = None,
) -> Measured:
    """Iterate one candidate until its share of the budget is spent (or its rate is steady):
    start-up (iter() to the first batch) apart from the steady batches a second."""
    candidate = Candidate(recipe, setting, deadlines, split)
    # With workers, the last part of the share runs the candidate at the model's pace (paced()):
    # PACED_SHARE of it, more for a slow model (room for TAKE_SAMPLES and a few), at most 60 %.
    share = soft_end - time.perf_counter()
    paced_s = PACED_SHARE * share
    if pace_ms:
        paced_s = min(0.6 * share, max(paced_s, (TAKE_SAMPLES + 4) * pace_ms / 1000))
    steady_end = soft_end - (paced_s if setting.num_workers else 0.0)
    cpu_span: tuple[float, int] | None = None  # workers' CPU seconds over steady batches
    at_pace = Paced(None, None)
    arrivals = candidate.arrivals
    status: str = OK
    message: str | None = None
    started = time.perf_counter()
    force = False
    try:
        deadlines.arm(hard_end)
        candidate.start()
        status, message = candidate.steady(steady_end)
        if setting.num_workers and status == OK and len(arrivals) > candidate.skip + 1:
            cpu_end = workers_cpu_s(candidate.iterator)
            if candidate.cpu_start is not None and cpu_end is not None:
                cpu_span = (cpu_end - candidate.cpu_start, len(arrivals) - 1 - candidate.skip)
            at_pace = _at_pace(candidate, soft_end, pace_ms, cpu)
    except OutOfTime:
        status = TIMEOUT if arrivals else NO_START
        message = (
            "stopped at its share of the budget"
            if arrivals
            else f"no batch within {time.perf_counter() - started:.1f} s"
        )
        force = True
    except KeyboardInterrupt:
        status, message, force = STOPPED, "stopped", True
    except Exception as exc:
        status, message, force = ERROR, one_line(exc), True
    finally:
        deadlines.disarm()
    row = candidate.row(status, message, started, force, at_pace, cpu_span)
    return Measured(row, candidate.split(row.batches_per_s))


def _at_pace(
    candidate: Candidate, soft_end: float, pace_ms: float | None, cpu: ModelCpu | None
) -> Paced:
    """The candidate at the model's pace after its steady batches (paced())."""
    rate_now = steady_rate(candidate.arrivals, candidate.skip)
    if not rate_now:
        return Paced(None, None)
    now = time.perf_counter()
    until = min(max(soft_end, now + 0.2), now + TAKE_S)
    fetch = candidate.fetcher()
    if pace_ms:  # the model's compute per batch, as the stand-in replays it
        share, scale = (cpu.share, cpu.scale) if cpu is not None else (0.0, 1.0)
        return paced(fetch, scale * pace_ms / 1000, share, until, pace_ms / 1000)
    return paced(fetch, PACE_OVER_RATE / rate_now, 0.0, until)
