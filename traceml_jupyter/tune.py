"""`%traceml tune`: the DataLoader alone (no model) under candidate settings, against the model's
measured rate: which setting keeps the model fed, and the predicted step and speed-up.

    result = traceml_jupyter.tune(loader, budget=30)     # or: %traceml tune loader
    result.best       # {"num_workers": 2, "persistent_workers": True}
    result.code       # DataLoader(train_set, batch_size=64, num_workers=2, persistent_workers=True)

Each candidate is a new DataLoader over the user's dataset with the user's batching, collate_fn,
worker_init_fn, generator and start method; the user's loader is never iterated or changed.
Side effects stay inside `tune()`: every worker process it starts is gone when it returns, the
random states are put back, and the time budget is a hard bound (SIGALRM on the main thread).
The arithmetic is in tune_plan.py; this module measures and shows.
"""

from __future__ import annotations

import copy
import html
import inspect
import random
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from .analysis.figures import ms as _ms
from .analysis.resources import saturation_text
from .analysis.tune_plan import (
    DEEPER_PREFETCH,
    DEFAULT_PREFETCH,
    EMPTY,
    ERROR,
    NO_START,
    OK,
    STOPPED,
    TIMEOUT,
    ModelCpu,
    ModelRate,
    Row,
    Setting,
    Split,
    code_line,
    conclude,
    is_waiting,
    model_cpu,
    rate_text,
    sweep_done,
    worker_counts,
)
from .capture.host import usable_cpus

DEFAULT_BUDGET_S = 30.0
# A candidate stops early once its steady rate rests on this many seconds and batches.
ENOUGH_WINDOW_S = 3.0
ENOUGH_BATCHES = 30
# Kept back from the budget to stop the last candidate's workers and build the result.
RESERVE_S = 0.3
# A candidate may overrun its share by this much (one slow batch) before it is stopped hard.
GRACE_SHARE = 0.25
MIN_SHARE_S = 0.5
# The candidate at the model's pace (paced()): the last PACED_SHARE of a candidate's share (more
# for a slow model), at most TAKE_S seconds, means of at least TAKE_SAMPLES calls; without the
# model's rate, pauses of this many times a batch's time at the measured rate (workers ahead).
PACE_OVER_RATE = 1.25
PACED_SHARE = 0.4
TAKE_S = 3.0
TAKE_SAMPLES = 12

Progress = Callable[[Mapping[str, Any]], None]


class TuneError(ValueError):
    """What tune cannot work with (not a DataLoader, no loader to tune): one line for the user."""


class _OutOfTime(BaseException):
    """A candidate's hard deadline passed (raised by the SIGALRM handler). A BaseException, so
    that a dataset's `except Exception` cannot swallow it."""


# -- the user's loader, rebuilt with other settings ----------------------------------------------


@dataclass
class Recipe:
    """How to build the user's loader again with other worker settings: the same dataset,
    batching, sampler kind, collate_fn, drop_last, worker_init_fn, generator and start method."""

    dataset: Any
    kwargs: dict[str, Any]  # everything but num_workers, persistent, prefetch and pin_memory
    iterable: bool  # an IterableDataset
    batch_text: str  # how the code line writes the batching
    current: dict[str, Any]  # the user's num_workers, persistent_workers, prefetch, pin_memory

    def build(self, setting: Setting, probe: Probe | None = None) -> Any:
        from torch.utils.data import DataLoader

        kwargs = dict(self.kwargs)
        dataset = self.dataset
        if probe is not None:
            dataset = probe.wrap_dataset(dataset, self.iterable)
            kwargs["collate_fn"] = probe.wrap_collate(kwargs["collate_fn"])
        kwargs["sampler"] = _fresh(kwargs.get("sampler"), dataset)
        kwargs["batch_sampler"] = _fresh(kwargs.get("batch_sampler"), dataset)
        return DataLoader(dataset, **kwargs, **setting.kwargs())


def _fresh(sampler: Any, dataset: Any) -> Any:
    """A sampler of the same kind for one candidate: a new RandomSampler (same generator,
    replacement, num_samples), or a shallow copy of a custom one, so that a sampler that counts
    epochs or keeps state counts them on the copy, not on the user's."""
    if sampler is None:
        return None
    from torch.utils.data import RandomSampler

    if type(sampler) is RandomSampler:
        return RandomSampler(
            dataset,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=sampler.generator,
        )
    try:
        return copy.copy(sampler)
    except Exception:
        return sampler


def _accepts(name: str) -> bool:
    from torch.utils.data import DataLoader

    return name in inspect.signature(DataLoader.__init__).parameters


def recipe_of(loader: Any, names: Mapping[str, Any] | None = None) -> Recipe:
    """Read the user's loader (without iterating it): what each candidate is built from."""
    from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler

    dataset = loader.dataset
    iterable = isinstance(dataset, IterableDataset)
    kwargs: dict[str, Any] = {
        "collate_fn": loader.collate_fn,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "timeout": loader.timeout,
    }
    if _accepts("in_order"):
        kwargs["in_order"] = getattr(loader, "in_order", True)
    batch_size = loader.batch_size
    batch_sampler = loader.batch_sampler
    sampler = loader.sampler
    custom_batches = batch_size is None and batch_sampler is not None
    if iterable:
        kwargs.update(batch_size=batch_size, drop_last=loader.drop_last)
        batch_text = f"batch_size={batch_size}"
    elif custom_batches:
        kwargs["batch_sampler"] = batch_sampler
        batch_text = f"batch_sampler={_name_of(batch_sampler, names) or 'batch_sampler'}"
    else:
        kwargs.update(batch_size=batch_size, drop_last=loader.drop_last)
        batch_text = f"batch_size={batch_size}"
        if type(sampler) is RandomSampler:
            kwargs["sampler"] = sampler
            batch_text += ", shuffle=True"
        elif type(sampler) is not SequentialSampler:
            kwargs["sampler"] = sampler
            batch_text += f", sampler={_name_of(sampler, names) or 'sampler'}"
        if loader.drop_last:
            batch_text += ", drop_last=True"
    collate = loader.collate_fn
    if not str(getattr(collate, "__module__", "")).startswith("torch."):
        label = _name_of(collate, names) or getattr(collate, "__name__", None) or "collate_fn"
        batch_text = f"{batch_text}, collate_fn={label}"
    current = {
        "num_workers": int(loader.num_workers or 0),
        "persistent_workers": bool(loader.persistent_workers),
        "prefetch_factor": loader.prefetch_factor if loader.num_workers else None,
        "pin_memory": bool(loader.pin_memory),
    }
    return Recipe(dataset, kwargs, iterable, batch_text, current)


def _name_of(obj: Any, names: Mapping[str, Any] | None) -> str | None:
    """A name the user's namespace binds to `obj` (public names first)."""
    if names is None:
        return None
    found = sorted(k for k, v in list(names.items()) if v is obj and k.isidentifier())
    public = [k for k in found if not k.startswith("_")]
    return (public or found)[0] if found else None


# -- the split at num_workers=0 -------------------------------------------------------------------


class Probe:
    """Times the dataset and the collate_fn of one num_workers=0 candidate, through wrappers
    given to that candidate only (the user's objects are not touched)."""

    def __init__(self) -> None:
        self.getitem_s = 0.0
        self.samples = 0
        self.collate_s = 0.0
        self.batches = 0
        self.pin_s = 0.0
        self.pinned = 0
        self.source = "__getitem__"

    def wrap_dataset(self, dataset: Any, iterable: bool) -> Any:
        from torch.utils.data import Dataset, IterableDataset

        probe = self
        if iterable:
            self.source = "the dataset's iterator"

            class TimedStream(IterableDataset):  # type: ignore[type-arg]
                def __iter__(self) -> Iterator[Any]:
                    items = iter(dataset)
                    while True:
                        start = time.perf_counter()
                        try:
                            item = next(items)
                        except StopIteration:
                            return
                        finally:
                            probe.getitem_s += time.perf_counter() - start
                        probe.samples += 1
                        yield item

            return TimedStream()

        class TimedDataset(Dataset):  # type: ignore[type-arg]
            def __len__(self) -> int:
                return len(dataset)

            def __getitem__(self, index: Any) -> Any:
                start = time.perf_counter()
                try:
                    return dataset[index]
                finally:
                    probe.getitem_s += time.perf_counter() - start
                    probe.samples += 1

            def __getitems__(self, indices: Sequence[Any]) -> Any:
                # One timing a batch: the fetcher calls this when batching, as it would call
                # the dataset's own __getitems__, or __getitem__ once per index.
                start = time.perf_counter()
                try:
                    own = getattr(dataset, "__getitems__", None)
                    return own(indices) if own else [dataset[i] for i in indices]
                finally:
                    probe.getitem_s += time.perf_counter() - start
                    probe.samples += len(indices)

        if getattr(dataset, "__getitems__", None):
            self.source = "__getitems__"
        return TimedDataset()

    def wrap_collate(self, collate: Callable[[Any], Any]) -> Callable[[Any], Any]:
        probe = self

        def timed_collate(samples: Any) -> Any:
            start = time.perf_counter()
            try:
                return collate(samples)
            finally:
                probe.collate_s += time.perf_counter() - start
                probe.batches += 1

        return timed_collate

    def split(self, batch_ms: float, cpu_share: float | None) -> Split:
        n = max(1, self.batches)
        return Split(
            batch_ms=batch_ms,
            samples_per_batch=self.samples / n if self.samples else None,
            getitem_ms=1000.0 * self.getitem_s / n if self.batches else None,
            collate_ms=1000.0 * self.collate_s / n if self.batches else None,
            pin_ms=1000.0 * self.pin_s / self.pinned if self.pinned else None,
            cpu_share=cpu_share,
            source=self.source,
        )


# -- signals: the hard budget and the stop button -------------------------------------------------


class Guard:
    """For the whole tune: SIGALRM raises _OutOfTime at the armed deadline, and both it and the
    stop button (SIGINT) are held while worker processes start or stop, so that no process is
    started without the tune knowing it. Off the main thread (or without setitimer) deadlines
    are soft: checked between batches."""

    def __init__(self) -> None:
        self.hard = threading.current_thread() is threading.main_thread() and hasattr(
            signal, "setitimer"
        )
        self.armed = False
        self.holding = 0
        self.pending_alarm = False
        self.pending_stop = False
        self.iterators: list[Any] = []  # every iterator the tune made: all closed at the end
        self._old_alarm: Any = None
        self._old_int: Any = None
        self._old_timer: tuple[float, float] = (0.0, 0.0)

    def __enter__(self) -> Guard:
        if not self.hard:
            return self
        self._old_timer = signal.getitimer(signal.ITIMER_REAL)
        if self._old_timer[0] > 0:  # someone else's alarm runs: leave it alone
            self.hard = False
            return self
        self._old_alarm = signal.signal(signal.SIGALRM, self._on_alarm)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._old_int = signal.signal(signal.SIGINT, self._on_stop)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.hard:
            return
        self.disarm()
        signal.signal(signal.SIGALRM, self._old_alarm)
        if self._old_int is not None:
            signal.signal(signal.SIGINT, self._old_int)

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if not self.armed:
            return
        if self.holding:
            self.pending_alarm = True
            return
        self.armed = False
        raise _OutOfTime()

    def _on_stop(self, signum: int, frame: Any) -> None:
        if self.holding:
            self.pending_stop = True
            return
        raise KeyboardInterrupt()

    def arm(self, deadline: float) -> None:
        if not self.hard:
            return
        self.pending_alarm = False
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, max(0.001, deadline - time.perf_counter()))

    def disarm(self) -> None:
        """No deadline any more; an alarm that fires meanwhile is ignored or, if it came just
        before, its _OutOfTime is swallowed here."""
        while True:
            try:
                self.armed = False
                self.pending_alarm = False
                if self.hard:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                return
            except _OutOfTime:
                continue

    def close_all(self) -> None:
        """Stop the workers of every iterator the tune made (those a candidate closed already
        are skipped)."""
        with self.held():
            for iterator in self.iterators:
                _close(iterator, force=True)
            self.iterators.clear()

    @contextmanager
    def held(self) -> Iterator[None]:
        """No stop and no deadline in here; what came meanwhile is raised on the way out."""
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
            if not self.holding:
                if self.pending_stop:
                    self.pending_stop = False
                    raise KeyboardInterrupt()
                if self.pending_alarm and self.armed:
                    self.pending_alarm = False
                    self.armed = False
                    raise _OutOfTime()


# -- random states, worker processes --------------------------------------------------------------


@dataclass
class RandomStates:
    """Python's, NumPy's and torch's random states (CUDA's only where CUDA is initialised),
    and the torch generators of the loader and its samplers."""

    python: Any
    numpy: Any
    torch: Any
    cuda: Any
    generators: list[tuple[Any, Any]]

    @classmethod
    def save(cls, loader: Any) -> RandomStates:
        import torch

        np_state = None
        if "numpy" in sys.modules:
            np_state = sys.modules["numpy"].random.get_state()
        cuda = None
        if torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state_all()
        gens = []
        for gen in _generators(loader):
            gens.append((gen, gen.get_state()))
        return cls(random.getstate(), np_state, torch.get_rng_state(), cuda, gens)

    def restore(self) -> None:
        import torch

        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        for gen, state in self.generators:
            gen.set_state(state)


def _generators(loader: Any) -> list[Any]:
    """torch.Generator objects of the loader, its sampler and batch sampler (one level deep)."""
    import torch

    found: list[Any] = []
    holders = [loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
    holders.append(getattr(holders[2], "sampler", None))
    for holder in holders:
        if holder is None:
            continue
        try:
            values = list(vars(holder).values())
        except TypeError:
            continue
        for value in values:
            if isinstance(value, torch.Generator) and all(value is not g for g in found):
                found.append(value)
    return found


def _children() -> set[int]:
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def _reap(before: set[int]) -> None:
    """End any process started by multiprocessing during the tune that is still alive (an
    iterator whose start was cut short never listed its workers)."""
    import multiprocessing

    for proc in multiprocessing.active_children():
        if proc.pid not in before:
            proc.terminate()
            proc.join(timeout=1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1.0)


def _close(iterator: Any, force: bool) -> None:
    """Stop an iterator's workers. Forced (the candidate was cut short, or its batches are
    slow): kill them first, after taking their pids off torch's SIGCHLD watch, which would
    otherwise report the kills as worker failures in the training process."""
    if iterator is None or getattr(iterator, "_shutdown", False):
        return
    workers = list(getattr(iterator, "_workers", ()) or ())
    if not workers:
        return
    if force:
        try:
            from torch.utils.data._utils import signal_handling

            if getattr(iterator, "_worker_pids_set", False):
                signal_handling._remove_worker_pids(id(iterator))  # type: ignore[attr-defined]
                iterator._worker_pids_set = False
        except Exception:
            pass
        thread = getattr(iterator, "_pin_memory_thread", None)
        if thread is not None:
            iterator._pin_memory_thread_done_event.set()
            iterator._worker_result_queue.put((None, None))
            thread.join(timeout=1.0)
            if not thread.is_alive():
                del iterator._pin_memory_thread  # joined: _shutdown_workers must not wait on it
        for w in workers:
            if w.is_alive():
                w.terminate()
        for w in workers:
            w.join(timeout=1.0)
    try:
        iterator._shutdown_workers()
    except Exception:
        pass


# -- measuring one candidate ------------------------------------------------------------------------


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
    except Exception:  # a worker that is gone, psutil missing a platform's counters
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
    row: Row
    split: Split | None = None


def measure(
    recipe: Recipe,
    setting: Setting,
    guard: Guard,
    soft_end: float,
    hard_end: float,
    split: bool = False,
    pace_ms: float | None = None,
    cpu: ModelCpu | None = None,
) -> Measured:
    """Iterate one candidate until its share of the budget is spent (or its rate is steady):
    start-up (iter() to the first batch) apart from the steady batches a second."""
    import torch

    probe = Probe() if split else None
    pin_here = split and setting.pin_memory  # at num_workers=0, pin by hand to time it
    built = Setting(
        setting.num_workers,
        setting.persistent_workers,
        setting.prefetch_factor,
        setting.pin_memory and not pin_here,
    )
    skip = max(1, setting.num_workers)
    # With workers, the last part of the share runs the candidate at the model's pace (paced()):
    # PACED_SHARE of it, more for a slow model (room for TAKE_SAMPLES and a few), at most 60 %.
    share = soft_end - time.perf_counter()
    paced_s = PACED_SHARE * share
    if pace_ms:
        paced_s = min(0.6 * share, max(paced_s, (TAKE_SAMPLES + 4) * pace_ms / 1000))
    steady_end = soft_end - (paced_s if setting.num_workers else 0.0)
    cpu_start: float | None = None
    cpu_span: tuple[float, int] | None = None  # workers' CPU seconds over steady batches
    at_pace = Paced(None, None)
    arrivals: list[float] = []
    cpu_marks: list[float] = []
    samples: int | None = 0
    status, message = OK, None
    iterator: Any = None
    started = time.perf_counter()
    force = False
    try:
        guard.arm(hard_end)
        with guard.held(), warnings.catch_warnings():
            # The step past the CPUs is on purpose: not torch's "excessive worker creation".
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            loader = recipe.build(built, probe)
            iterator = iter(loader)
            guard.iterators.append(iterator)
        in_epoch = 0

        def next_epoch() -> None:
            nonlocal iterator, in_epoch
            in_epoch = 0
            with guard.held(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="This DataLoader will create")
                fresh = iter(loader)  # persistent workers: the same iterator, reset
                if fresh is not iterator:
                    guard.iterators.append(fresh)
                    _close(iterator, force=False)
                iterator = fresh

        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                if not in_epoch:
                    status, message = EMPTY, "the loader yielded no batch"
                    break
                if time.perf_counter() >= steady_end:
                    break
                next_epoch()
                continue
            if pin_here and probe is not None:
                begin = time.perf_counter()
                batch = torch.utils.data._utils.pin_memory.pin_memory(batch)
                probe.pin_s += time.perf_counter() - begin
                probe.pinned += 1
            now = time.perf_counter()
            arrivals.append(now)
            cpu_marks.append(time.process_time())
            in_epoch += 1
            n = batch_length(batch)
            samples = None if n is None or samples is None else samples + n
            del batch
            if setting.num_workers and len(arrivals) == skip + 1:
                cpu_start = workers_cpu_s(iterator)
            if now >= steady_end or (
                len(arrivals) - skip >= ENOUGH_BATCHES and now - arrivals[skip] >= ENOUGH_WINDOW_S
            ):
                break
        if setting.num_workers and status == OK and len(arrivals) > skip + 1:
            cpu_end = workers_cpu_s(iterator)
            if cpu_start is not None and cpu_end is not None:
                cpu_span = (cpu_end - cpu_start, len(arrivals) - 1 - skip)
            rate_now = steady_rate(arrivals, skip)

            depth = setting.num_workers * (setting.prefetch_factor or DEFAULT_PREFETCH)
            refilling = 0

            def fetch() -> bool:
                """next(); False (not a take) at an epoch's end and while the workers refill
                their queue for the next one."""
                nonlocal refilling
                try:
                    next(iterator)
                except StopIteration:
                    next_epoch()
                    refilling = depth
                    return False
                if refilling:
                    refilling -= 1
                    return False
                return True

            if rate_now:
                now = time.perf_counter()
                until = min(max(soft_end, now + 0.2), now + TAKE_S)
                if pace_ms:  # the model's compute per batch, as the stand-in replays it
                    share, scale = (cpu.share, cpu.scale) if cpu is not None else (0.0, 1.0)
                    at_pace = paced(fetch, scale * pace_ms / 1000, share, until, pace_ms / 1000)
                else:
                    at_pace = paced(fetch, PACE_OVER_RATE / rate_now, 0.0, until)
    except _OutOfTime:
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
        guard.disarm()
    seconds = time.perf_counter() - started
    rate = steady_rate(arrivals, skip) if len(arrivals) >= 2 else None
    if rate is None or setting.num_workers / rate > 0.5:
        force = True  # a worker may be inside a slow batch: do not wait for it
    with guard.held():
        _close(iterator, force)
    if rate is None and status in (OK, TIMEOUT):
        message = f"{len(arrivals)} batch(es) in {seconds:.1f} s: too slow to measure in its share"
    startup = None
    if setting.num_workers and arrivals:
        per_batch = setting.num_workers / rate if rate else 0.0
        startup = max(0.0, arrivals[0] - started - per_batch)
    row = Row(
        setting,
        status,
        rate,
        startup,
        samples if arrivals else 0,
        len(arrivals),
        seconds,
        message,
        take_ms=at_pace.take_ms,
        compute_ratio=at_pace.compute_ratio,
        worker_cpu_ms=1000.0 * cpu_span[0] / cpu_span[1] if cpu_span and cpu_span[1] else None,
    )
    result = Measured(row)
    if probe is not None and rate:
        k = min(1, len(arrivals) - 1)
        wall = arrivals[-1] - arrivals[k]
        used = cpu_marks[-1] - cpu_marks[k]
        result.split = probe.split(1000.0 / rate, used / wall if wall > 0 else None)
    return result


# -- the result ---------------------------------------------------------------------------------------


@dataclass
class TuneResult:
    """What `%traceml tune` measured and concluded.

    `rows`: one dict per candidate (settings, batches_per_s, startup_s, samples_measured, ...);
    `best`: the DataLoader keyword arguments to change; `code`: the line to write.
    """

    loader_label: str
    rows: list[dict[str, Any]]
    best: dict[str, Any]
    best_settings: dict[str, Any] | None
    keeps_up: bool
    model_batches_per_s: float | None
    model_source: str | None
    compute_ms: float | None
    batches_per_step: float | None
    baseline_step_ms: float | None
    predicted_step_ms: float | None
    predicted_speedup: float | None
    code: str | None
    split: dict[str, Any] | None
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stopped: bool = False
    error: str | None = None
    budget_s: float = DEFAULT_BUDGET_S
    elapsed_s: float = 0.0
    cpus: int = 1
    model_cpu_share: float | None = None  # the model's compute that is CPU work (0..1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "loader": self.loader_label,
            "rows": [dict(r) for r in self.rows],
            "best": dict(self.best),
            "best_settings": self.best_settings,
            "keeps_up": self.keeps_up,
            "model_batches_per_s": self.model_batches_per_s,
            "model_source": self.model_source,
            "compute_ms": self.compute_ms,
            "batches_per_step": self.batches_per_step,
            "baseline_step_ms": self.baseline_step_ms,
            "predicted_step_ms": self.predicted_step_ms,
            "predicted_speedup": self.predicted_speedup,
            "code": self.code,
            "split": self.split,
            "advice": list(self.advice),
            "notes": list(self.notes),
            "stopped": self.stopped,
            "error": self.error,
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s,
            "cpus": self.cpus,
            "model_cpu_share": self.model_cpu_share,
        }

    def text(self) -> str:
        lines = [
            f"traceml tune: {self.loader_label}, {len(self.rows)} setting(s) in "
            f"{self.elapsed_s:.1f} s (budget {self.budget_s:g} s)"
        ]
        if self.stopped:
            lines.append("  Stopped: the table has what was measured before the stop.")
        if self.error:
            lines.append(f"  Error: {self.error}")
        if self.model_batches_per_s is not None:
            lines.append(
                f"  model: {rate_text(self.model_batches_per_s)} batches/s "
                f"({_ms(self.compute_ms)} compute a step, {self.batches_per_step or 1:g} "
                f"batch(es) a step; {self.model_source})"
            )
        else:
            lines.append("  model: rate unknown (no %%traceml run of this loader, no compute_ms=)")
        lines.extend(
            "  " + line
            for line in table_lines(self.rows, self.model_batches_per_s, self.best_settings)
        )
        lines.extend(f"  {a}" for a in self.advice)
        if self.code:
            lines.append(f"  Write: {self.code}")
        if self.split is not None and not any(
            a.startswith("At num_workers=0") for a in self.advice
        ):
            lines.append("  " + _split_text(self.split))
        lines.extend(f"  Note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        head = f"<traceml tune {self.loader_label}: best {self.best or 'unchanged'}"
        if self.predicted_speedup is not None:
            head += f", predicted {self.predicted_speedup:.2f}x"
        return head + ">"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def _repr_html_(self) -> str:
        return result_html(self)


def _split_text(split: Mapping[str, Any]) -> str:
    from .analysis.tune_plan import split_sentence

    return split_sentence(
        Split(
            split["batch_ms"],
            split["samples_per_batch"],
            split["getitem_ms"],
            split["collate_ms"],
            split["pin_ms"],
            split["cpu_share"],
            split["source"],
        )
    )


def _fed(row: Mapping[str, Any], model: float | None) -> str:
    from .analysis.tune_plan import required_rate

    rate = row.get("batches_per_s")
    if model is None or rate is None:
        return ""
    return "yes" if rate >= required_rate(row["settings"]["num_workers"], model) else "no"


def table_lines(
    rows: Sequence[Mapping[str, Any]], model: float | None, best: Mapping[str, Any] | None
) -> list[str]:
    """The rows as a plain text table; the best one marked with *."""
    head = ("setting", "batches/s", "x model", "fed", "start-up", "samples")
    body = []
    for row in rows:
        rate = row.get("batches_per_s")
        startup = row.get("startup_s")
        cells = (
            str(row["label"]),
            rate_text(rate) if rate is not None else "-",
            f"{rate / model:.2f}" if rate is not None and model else "-",
            _fed(row, model) or "-",
            f"{startup:.2f} s" if startup is not None else "-",
            f"{row['samples_measured']:,}" if row.get("samples_measured") is not None else "?",
        )
        if row.get("status") not in (OK, TIMEOUT):
            cells = (*cells[:5], f"{cells[5]}  {row.get('status')}: {row.get('message')}")
        body.append((row.get("settings") == best, cells))
    widths = [max([len(head[i])] + [len(c[i]) for _, c in body]) for i in range(5)]
    widths.append(max([len(head[5])] + [len(c[5].split("  ")[0]) for _, c in body]))

    def fmt(mark: str, cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        count, _, status = cells[5].partition("  ")
        rest = "  ".join(c.rjust(w) for c, w in zip((*cells[1:5], count), widths[1:], strict=True))
        return f"{mark} {first}  {rest}  {status}".rstrip()

    return [fmt(" ", head)] + [fmt("*" if is_best else " ", cells) for is_best, cells in body]


BAR = "#4e79a7"
BEST = "#59a14f"
MODEL = "#e15759"


CELL = "padding:2px 8px;text-align:right"


def _td(content: str, left: bool = False) -> str:
    style = CELL.replace("right", "left") if left else CELL
    return f"<td style='{style}'>{content}</td>"


def result_html(result: TuneResult) -> str:
    e = html.escape
    model = result.model_batches_per_s
    top = max([r.get("batches_per_s") or 0.0 for r in result.rows] + [model or 0.0]) or 1.0
    body = []
    for row in result.rows:
        rate = row.get("batches_per_s")
        is_best = row.get("settings") == result.best_settings
        width = 100.0 * (rate or 0.0) / top
        bar = (
            f'<div style="position:relative;height:12px;width:220px;background:rgba(127,127,127,.15)">'
            f'<div style="height:12px;width:{width:.1f}%;background:{BEST if is_best else BAR}"></div>'
        )
        if model:
            bar += (
                f'<div style="position:absolute;top:-2px;left:{100.0 * model / top:.1f}%;'
                f'height:16px;border-left:2px solid {MODEL}"></div>'
            )
        bar += "</div>"
        status = row.get("status")
        note = "" if status in (OK, TIMEOUT) else f"{status}: {row.get('message')}"
        startup = row.get("startup_s")
        name = e(str(row["label"]))
        samples = row.get("samples_measured")
        cells = [
            f"<b>{name}</b>" if is_best else name,
            e(rate_text(rate)) if rate is not None else "-",
            bar,
            e(_fed(row, model) or "-"),
            f"{startup:.2f} s" if startup is not None else "-",
            f"{samples:,}" if samples is not None else "?",
            e(note),
        ]
        body.append("<tr>" + "".join(_td(c, i in (0, 6)) for i, c in enumerate(cells)) + "</tr>")
    head = "".join(
        f"<th style='{CELL.replace('right', 'left') if h == 'setting' else CELL}'>{h}</th>"
        for h in ("setting", "batches/s", "", "fed", "start-up", "samples", "")
    )
    model_line = (
        f"model: <b>{e(rate_text(model))}</b> batches/s ({e(_ms(result.compute_ms))} compute a "
        f"step, {result.batches_per_step or 1:g} batch(es) a step; {e(str(result.model_source))})"
        f' <span style="color:{MODEL}">&#9474;</span>'
        if model is not None
        else "model: rate unknown (no %%traceml run of this loader, no compute_ms=)"
    )
    parts = [
        '<div class="traceml-tune" style="font-family:var(--jp-ui-font-family,sans-serif);'
        'font-size:13px;line-height:1.5">',
        f"<div><b>traceml tune</b> {e(result.loader_label)}: {len(result.rows)} setting(s) in "
        f"{result.elapsed_s:.1f} s (budget {result.budget_s:g} s)</div>",
    ]
    if result.stopped:
        parts.append("<div><b>Stopped</b>: the table has what was measured before the stop.</div>")
    if result.error:
        parts.append(f"<div><b>Error</b>: {e(result.error)}</div>")
    parts.append(f"<div>{model_line}</div>")
    parts.append(
        f"<table style='border-collapse:collapse;margin:4px 0'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )
    parts.extend(f"<div>{e(a)}</div>" for a in result.advice)
    if result.code:
        parts.append(
            "<pre style='margin:4px 0;padding:4px 8px;background:rgba(127,127,127,.12)'>"
            f"{e(result.code)}</pre>"
        )
    if result.split is not None and not any(
        a.startswith("At num_workers=0") for a in result.advice
    ):
        parts.append(f"<div>{e(_split_text(result.split))}</div>")
    parts.extend(f"<div><i>Note</i>: {e(n)}</div>" for n in result.notes)
    parts.append("</div>")
    return "".join(parts)


# -- showing it while it measures ---------------------------------------------------------------------


class TextView:
    """A terminal: one line per candidate as it ends."""

    def start(self, label: str, budget: float, model: float | None) -> None:
        rate = f"; the model takes {rate_text(model)} batches/s" if model else ""
        print(f"traceml tune: {label}, at most {budget:g} s{rate} (interrupt to stop)", flush=True)

    def candidate(self, setting: Setting, index: int, total: int) -> None:
        pass

    def measured(self, row: Row, rows: Sequence[Row]) -> None:
        rate = f"{rate_text(row.batches_per_s)} batches/s" if row.batches_per_s else "no rate"
        extra = f" ({row.status}: {row.message})" if row.status not in (OK, TIMEOUT) else ""
        print(f"  {row.setting.label()}: {rate}{extra}", flush=True)

    def finish(self, result: TuneResult) -> None:
        pass


class HtmlView:
    """A kernel without widgets: one HTML display, updated through its handle."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.label = ""
        self.model: float | None = None

    def _show(self, text: str, html_body: str) -> None:
        from IPython.display import display

        from .views.live import HtmlStatus

        status = HtmlStatus(text, html_body)
        if self.handle is None:
            self.handle = display(status, display_id=True)
        else:
            self.handle.update(status)

    def start(self, label: str, budget: float, model: float | None) -> None:
        self.label, self.model = label, model
        self._show(f"traceml tune: {label}", f"<b>traceml tune</b> {html.escape(label)}: starting")

    def candidate(self, setting: Setting, index: int, total: int) -> None:
        self._show(
            f"traceml tune: measuring {setting.label()}",
            f"<b>traceml tune</b> {html.escape(self.label)}: measuring "
            f"<code>{html.escape(setting.label())}</code> ({index} of about {total})",
        )

    def measured(self, row: Row, rows: Sequence[Row]) -> None:
        text = "\n".join(table_lines([r.to_dict() for r in rows], self.model, None))
        self._show(text, f"<pre>{html.escape(text)}</pre>")

    def finish(self, result: TuneResult) -> None:
        head = f"traceml tune: done in {result.elapsed_s:.1f} s" + (
            " (stopped)" if result.stopped else ""
        )
        text = "\n".join(table_lines(result.rows, self.model, result.best_settings))
        self._show(f"{head}\n{text}", f"<b>{html.escape(head)}</b><pre>{html.escape(text)}</pre>")


class WidgetView:
    """A notebook front-end: a header and a bqplot bar chart of batches/s per setting, with the
    model's rate as a line."""

    def __init__(self) -> None:
        import ipywidgets as widgets
        from bqplot import Axis, Bars, Figure, LinearScale, Lines, OrdinalScale

        from .views.live import vertical_axis

        self.header = widgets.HTML(value="<b>traceml tune</b>: starting")
        x, y = OrdinalScale(), LinearScale(min=0.0)
        self.bars = Bars(x=[], y=[], scales={"x": x, "y": y}, colors=[BAR], padding=0.3)
        self.model_line = Lines(
            x=[0.0, 1.0],
            y=[0.0, 0.0],
            scales={"x": LinearScale(min=0.0, max=1.0), "y": y},
            colors=[MODEL],
            stroke_width=2,
            visible=False,
        )
        self.figure = Figure(
            marks=[self.bars, self.model_line],
            axes=[
                Axis(scale=x, label="num_workers"),
                Axis(scale=y, label="batches/s", tick_format=".3~g", **vertical_axis()),
            ],
            layout=widgets.Layout(width="100%", height="220px"),
            fig_margin={"top": 10, "bottom": 40, "left": 60, "right": 20},
            animation_duration=0,
        )
        self.box = widgets.VBox([self.header, self.figure])
        self.label = ""

    def start(self, label: str, budget: float, model: float | None) -> None:
        from IPython.display import display

        from .views.environment import enable_custom_widget_manager_once
        from .views.live import WidgetDisplay

        enable_custom_widget_manager_once()
        self.label = label
        if model:
            self.model_line.y = [model, model]
            self.model_line.visible = True
        line = f" &middot; model {html.escape(rate_text(model))} batches/s" if model else ""
        self.header.value = (
            f"<b>traceml tune</b> {html.escape(label)}: up to {budget:g} s{line}"
            f' <span style="color:{MODEL}">&#9472;</span>'
        )
        display(WidgetDisplay(self.box, f"traceml tune: {label} (live chart)"))

    def candidate(self, setting: Setting, index: int, total: int) -> None:
        self.header.value = (
            f"<b>traceml tune</b> {html.escape(self.label)}: measuring "
            f"<code>{html.escape(setting.label())}</code> ({index} of about {total})"
        )

    def measured(self, row: Row, rows: Sequence[Row]) -> None:
        done = [r for r in rows if r.batches_per_s is not None]
        with self.bars.hold_sync():
            self.bars.x = [r.setting.short() for r in done]
            self.bars.y = [float(r.batches_per_s or 0.0) for r in done]

    def finish(self, result: TuneResult) -> None:
        self.header.value = (
            f"<b>traceml tune</b> {html.escape(self.label)}: done in {result.elapsed_s:.1f} s"
            + (" (stopped)" if result.stopped else "")
        )


def _view(show: bool) -> Any:
    if not show:
        return None
    from .views.environment import ipython_shell, live_mode

    mode = live_mode(ipython_shell())
    try:
        if mode == "widget":
            return WidgetView()
        if mode == "html":
            return HtmlView()
    except Exception:  # a view must never stop the tune
        pass
    return TextView()


class _Views:
    """The view and the caller's progress callback, told the same events. A broken view is
    dropped; the callback's exceptions (KeyboardInterrupt included) are the caller's."""

    def __init__(self, view: Any, progress: Progress | None) -> None:
        self.view, self.progress = view, progress

    def _call(self, name: str, *args: Any) -> None:
        if self.view is not None:
            try:
                getattr(self.view, name)(*args)
            except Exception:
                self.view = None

    def start(self, label: str, budget: float, model: float | None) -> None:
        self._call("start", label, budget, model)

    def candidate(self, setting: Setting, index: int, total: int) -> None:
        self._call("candidate", setting, index, total)
        if self.progress is not None:
            self.progress(
                {"event": "start", "setting": setting.kwargs(), "index": index, "total": total}
            )

    def measured(self, row: Row, rows: Sequence[Row]) -> None:
        self._call("measured", row, rows)
        if self.progress is not None:
            self.progress({"event": "measured", "row": row.to_dict(), "index": len(rows)})

    def finish(self, result: TuneResult) -> None:
        self._call("finish", result)


# -- the model's rate ---------------------------------------------------------------------------------


def _run_loader(run: Any) -> Any:
    ref = getattr(run, "loader_ref", None)
    try:
        return ref() if ref is not None else None
    except Exception:
        return None


def model_rate(
    loader: Any, run: Any, compute_ms: float | None
) -> tuple[ModelRate | None, list[str]]:
    """The model's rate: from `compute_ms`, else from the last run when it trained on this
    loader (or on one with the same dataset and batch size)."""
    notes: list[str] = []
    summary: Mapping[str, Any] = {}
    same = False
    if run is not None:
        trained = _run_loader(run)
        same = trained is loader or (
            trained is not None
            and getattr(trained, "dataset", None) is getattr(loader, "dataset", object())
            and getattr(trained, "batch_size", None) == getattr(loader, "batch_size", None)
        )
        if trained is None and loader is not None:
            same = True
            notes.append(
                f"The model's rate is run {run.name!r}'s; its loader is gone, so the same "
                "batches are assumed."
            )
        if same:
            try:
                summary = run.summary
            except Exception:
                summary = {}
        elif compute_ms is None:
            notes.append(
                f"The last run ({run.name!r}) trained on another loader: pass compute_ms= "
                "(compute per step, ms) to predict the step."
            )
    per_step = summary.get("batches_per_step")
    batches = float(per_step) if per_step else 1.0
    # The speed-up's base is the run's time per step (its mean step): what an epoch takes. A
    # loader whose workers deliver in bursts gives many short steps and a few long ones, and
    # the median step would miss the long ones.
    step = ((summary.get("stats") or {}).get("step_ms") or {}).get("mean") or summary.get("step_ms")
    if compute_ms is not None:
        return ModelRate(float(compute_ms), batches, f"compute_ms={compute_ms:g}", step), notes
    compute = summary.get("compute_ms")
    if compute is None or not compute > 0:
        return None, notes
    return ModelRate(float(compute), batches, f"run {run.name!r}", step), notes


# -- the last tune of each loader (the checklist quotes it) --------------------------------------------


def _remember(loader: Any, result: TuneResult) -> None:
    """Keep the result for the checklist, and refresh the checklist of the last run that trained
    on this loader: its num_workers item now quotes the rates measured."""
    from .run import remember_tune, runs, tuned_for
    from .views.code_facts import keep_checklist

    remember_tune(loader, result.to_dict())
    for run in reversed(runs()):
        ref = run.loader_ref
        if ref is not None and tuned_for(ref()) is not None:
            keep_checklist(run)
            break


# -- tune ---------------------------------------------------------------------------------------------


def _check_loader(loader: Any, label: str) -> None:
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader):
        raise TuneError(f"tune needs a torch DataLoader; {label} is a {type(loader).__name__}")


def tune(
    loader: Any = None,
    budget: float = DEFAULT_BUDGET_S,
    compute_ms: float | None = None,
    workers: Sequence[int] | None = None,
    show: bool = True,
    progress: Progress | None = None,
    label: str | None = None,
) -> TuneResult:
    """Measure `loader` alone (default: the training loader of the last `%%traceml` run) under
    candidate settings for at most `budget` seconds, and say which keeps the model fed.

    The model's rate is the last run's (median compute per step x batches per step) or
    `compute_ms` (compute per step, ms). `workers` replaces the num_workers tried (default: 0
    up to the usable CPUs, and one more when samples wait on I/O). `progress` is called with
    a dict per event. The stop button ends it early with what was measured.
    """
    from .run import last

    if not budget > 0:
        raise TuneError(f"the budget must be a positive number of seconds, got {budget!r}")
    if compute_ms is not None and not compute_ms > 0:
        raise TuneError(f"compute_ms must be a positive number of ms, got {compute_ms!r}")
    if workers is not None and (not list(workers) or min(workers) < 0):
        raise TuneError(f"workers must be counts of 0 or more, like [0, 1, 2, 4]; got {workers!r}")
    run = last()
    if loader is None:
        if run is None:
            raise TuneError(
                "tune needs a DataLoader: pass one (%traceml tune LOADER), or run the "
                "training cell under %%traceml first"
            )
        loader = _run_loader(run)
        if loader is None:
            raise TuneError(
                f"the training loader of run {run.name!r} is gone (or was not a DataLoader): "
                "name one, %traceml tune LOADER"
            )
        label = label or "the training loader of run " + repr(run.name)
    _check_loader(loader, label or "it")
    from .views.environment import ipython_shell

    shell = ipython_shell()
    names = getattr(shell, "user_ns", None)
    loader_name = _name_of(loader, names)
    label = label or loader_name or "the loader"
    recipe = recipe_of(loader, names)
    model, notes = model_rate(loader, run, compute_ms)
    cpus = usable_cpus()
    return _tune(
        loader,
        recipe,
        model,
        notes,
        budget,
        workers,
        cpus,
        label,
        loader_name,
        names,
        _Views(_view(show), progress),
        run,
    )


def _tune(
    loader: Any,
    recipe: Recipe,
    model: ModelRate | None,
    notes: list[str],
    budget: float,
    workers: Sequence[int] | None,
    cpus: int,
    label: str,
    loader_name: str | None,
    names: Mapping[str, Any] | None,
    views: _Views,
    run: Any,
) -> TuneResult:
    import torch

    started = time.perf_counter()
    deadline = started + budget
    reserve = min(RESERVE_S, 0.1 * budget)
    on_cuda = torch.cuda.is_initialized()  # pinning only where the user's code uses CUDA
    # The model's compute burns the training process's CPU when it ran on the CPU clock (or,
    # given as compute_ms=, when the code uses no GPU); on a GPU the host mostly waits.
    model_on_cpu = (
        (run.summary.get("clock") == "cpu")
        if model is not None and model.source.startswith("run")
        else not on_cuda
    )
    rows: list[Row] = []
    split: Split | None = None
    cpu = _model_cpu(run, model, None, model_on_cpu)  # refined once num_workers=0 is measured
    stopped = False
    error: str | None = None
    explicit = sorted(set(workers)) if workers is not None else None
    # Before num_workers=0 is measured, the sweep's length is a guess (the CPUs, and maybe
    # one more); each candidate's share is what is left over the candidates still expected.
    queue = [Setting(n, n > 0, None, on_cuda) for n in (explicit or [0])]
    phase = "explicit" if explicit is not None else "first"
    expected = len(worker_counts(cpus, False)) + 1
    before = _children()
    states = RandomStates.save(loader)
    model_rate_value = model.batches_per_s if model is not None else None
    with Guard() as guard:
        try:
            views.start(label, budget, model_rate_value)
            while queue:
                setting = queue.pop(0)
                now = time.perf_counter()
                left = deadline - reserve - now
                if left <= 0.05:
                    break
                remaining = {"first": expected, "sweep": len(queue) + 2}.get(phase, len(queue) + 1)
                share = max(left / remaining, min(MIN_SHARE_S, left))
                soft_end = now + share
                hard_end = min(soft_end + max(0.25, GRACE_SHARE * share), deadline - reserve)
                views.candidate(setting, len(rows) + 1, len(rows) + remaining)
                got = measure(
                    recipe,
                    setting,
                    guard,
                    soft_end,
                    hard_end,
                    split=setting.num_workers == 0,
                    pace_ms=model.compute_ms / model.batches_per_step if model else None,
                    cpu=cpu,
                )
                rows.append(got.row)
                split = got.split or split
                views.measured(got.row, rows)
                if got.row.status == STOPPED:
                    stopped = True
                    break
                if got.row.status in (ERROR, EMPTY):
                    error = f"{setting.label()}: {got.row.message}"
                    break
                if phase == "first":
                    cpu = _model_cpu(run, model, split, model_on_cpu)
                    waiting = is_waiting(split.cpu_share if split is not None else None)
                    queue = [
                        Setting(n, True, None, on_cuda) for n in worker_counts(cpus, waiting)[1:]
                    ]
                    phase = "sweep"
                elif phase == "sweep" and (not queue or sweep_done(rows, model_rate_value)):
                    queue = _deeper_queue(rows, model_rate_value, on_cuda)
                    phase = "deeper"
        except KeyboardInterrupt:
            stopped = True
        finally:
            with guard.held():
                guard.close_all()
                states.restore()
                _reap(before)
    rows_out = rows
    current = recipe.current
    if model is not None:
        model = replace(model, cpu_share=cpu.share)
    from_run = run is not None and model is not None and model.source.startswith("run")
    saturated = saturation_text(run.summary) if from_run else None
    verdict = conclude(rows_out, model, current, cpus, split, model_on_cpu, saturated)
    dataset_name = _name_of(recipe.dataset, names) or (
        f"{loader_name}.dataset" if loader_name else "dataset"
    )
    code = (
        code_line(dataset_name, recipe.batch_text, verdict.changes, current)
        if verdict.best is not None and verdict.changes
        else None
    )
    if recipe.iterable and any(r.setting.num_workers > 1 for r in rows_out):
        notes.append(
            "An IterableDataset: with several workers each one yields the whole stream unless "
            "the dataset splits it with get_worker_info(); the rates count every batch delivered."
        )
    result = TuneResult(
        loader_label=label,
        rows=[r.to_dict() for r in rows_out],
        best=verdict.changes,
        best_settings=verdict.best.setting.kwargs() if verdict.best is not None else None,
        keeps_up=verdict.keeps_up,
        model_batches_per_s=model_rate_value,
        model_source=model.source if model is not None else None,
        compute_ms=model.compute_ms if model is not None else None,
        batches_per_step=model.batches_per_step if model is not None else None,
        baseline_step_ms=model.step_ms if model is not None else None,
        predicted_step_ms=verdict.predicted_step_ms,
        predicted_speedup=verdict.predicted_speedup,
        code=code,
        split=split.to_dict() if split is not None else None,
        advice=list(verdict.advice) if verdict.best is not None or error is None else [],
        notes=notes + verdict.notes,
        stopped=stopped,
        error=error,
        budget_s=budget,
        elapsed_s=time.perf_counter() - started,
        cpus=cpus,
        model_cpu_share=cpu.share if model is not None else None,
    )
    views.finish(result)
    _remember(loader, result)
    return result


def _model_cpu(run: Any, model: ModelRate | None, split: Split | None, on_cpu: bool) -> ModelCpu:
    """How the model's stand-in replays its compute (paced()): the run's measured CPU work
    (model_cpu), else all of it burnt on the CPU clock and all of it slept on a GPU."""
    found = None
    if model is not None and model.source.startswith("run") and run is not None:
        try:
            import numpy as np

            steps = run.steps
            loading = None
            if split is not None and split.cpu_share is not None:
                loading = split.cpu_share * split.batch_ms  # CPU ms a batch at num_workers=0
            found = model_cpu(
                run.process_cpu_ms,
                float(np.nansum(steps["compute_ms"])),
                len(steps["compute_ms"]) * model.batches_per_step,
                loading,
                float(np.nansum(steps["data_wait_ms"])),
                run.thread_cpu_ms,
                run.thread_wait_ms,
            )
        except Exception:
            found = None
    return found if found is not None else ModelCpu(1.0 if on_cpu else 0.0)


def _deeper_queue(rows: Sequence[Row], model: float | None, on_cuda: bool) -> list[Setting]:
    """After the sweep: the chosen worker count with a deeper prefetch queue, measured only when
    that count does not already keep the model fed with room to spare."""
    from .analysis.tune_plan import choose, keeps_up

    best, _ = choose(rows, model)
    if best is None or best.setting.num_workers == 0 or keeps_up(best, model):
        return []
    return [Setting(best.setting.num_workers, True, DEEPER_PREFETCH, on_cuda)]
