"""What keeps `%traceml tune`'s side effects inside it: the hard budget (SIGALRM) and the stop
button held while workers start or stop, the random states put back, and every worker process
it started stopped."""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..failures import read_or


class OutOfTime(BaseException):
    """A candidate's hard deadline passed (raised by the SIGALRM handler). A BaseException, so
    that a dataset's `except Exception` cannot swallow it."""


# -- signals: the hard budget and the stop button -------------------------------------------------


class Deadlines:
    """The tune's deadlines and stop button, and every iterator it made. SIGALRM raises
    OutOfTime at the armed deadline; both it and the stop button (SIGINT) are held while worker
    processes start or stop, so that no process is started without the tune knowing it. Off
    the main thread (or without setitimer) deadlines are soft: checked between batches."""

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

    def __enter__(self) -> Deadlines:
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
        raise OutOfTime()

    def _on_stop(self, signum: int, frame: Any) -> None:
        if self.holding:
            self.pending_stop = True
            return
        raise KeyboardInterrupt()

    def arm(self, deadline: float) -> None:
        """Raise OutOfTime at `deadline` (perf_counter seconds), unless held then."""
        if not self.hard:
            return
        self.pending_alarm = False
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, max(0.001, deadline - time.perf_counter()))

    def disarm(self) -> None:
        """No deadline any more; an alarm that fires meanwhile is ignored or, if it came just
        before, its OutOfTime is swallowed here."""
        while True:
            try:
                self.armed = False
                self.pending_alarm = False
                if self.hard:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                return
            except OutOfTime:
                continue

    def close_all(self) -> None:
        """Stop the workers of every iterator the tune made (those a candidate closed already
        are skipped)."""
        with self.held():
            for iterator in self.iterators:
                close_workers(iterator, force=True)
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
                    raise OutOfTime()


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
        """The random states now, and those of `loader`'s generators."""
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
        """Put every saved random state back."""
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


def child_pids() -> set[int]:
    """The pids of this process's live multiprocessing children."""
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def reap(before: set[int]) -> None:
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


def close_workers(iterator: Any, force: bool) -> None:
    """Stop an iterator's workers. Forced (the candidate was cut short, or its batches are
    slow): kill them first, after taking their pids off torch's SIGCHLD watch, which would
    otherwise report the kills as worker failures in the training process."""
    if iterator is None or getattr(iterator, "_shutdown", False):
        return
    workers = list(getattr(iterator, "_workers", ()) or ())
    if not workers:
        return
    if force:
        read_or(None, _unwatch_workers, iterator)
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
    read_or(None, iterator._shutdown_workers)  # the user's loader's iterator (a subclass may differ)


def _unwatch_workers(iterator: Any) -> None:
    """Take the iterator's workers off torch's SIGCHLD watch (a private API of the user's
    loader's iterator: it may be gone or raise, hence read_or at the call)."""
    from torch.utils.data._utils import signal_handling

    if getattr(iterator, "_worker_pids_set", False):
        signal_handling._remove_worker_pids(id(iterator))  # type: ignore[attr-defined]
        iterator._worker_pids_set = False


