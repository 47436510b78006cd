"""A bounded buffer of timed samples (NVML's, psutil's): written by a sampler thread, read
(copied) by the main thread; when full, every other sample goes (a StepHistory of numbered
samples). Its storage grows with the samples (a short run, or a sampler that never samples,
holds next to nothing)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from ...failures import never_raise
from ..steps.step_history import StepHistory


class SampleBuffer:
    """Rows of `columns` (the first is the time in s since the run's origin), at most
    `capacity` of them: when full, every other row is dropped (`stride` doubles, so a sampler
    can halve its rate with it)."""

    def __init__(self, columns: Sequence[str], capacity: int) -> None:
        self.names = tuple(columns)
        self.capacity = int(capacity)
        self._lock = threading.Lock()
        self._rows = StepHistory(self.capacity, "d" * len(self.names), every_step=True)

    @property
    def stride(self) -> int:
        """1 until the buffer was first full; doubled each time it was."""
        return self._rows.stride

    @property
    def decimations(self) -> int:
        """How often the kept samples were halved (and the sampling rate with them)."""
        return self._rows.stride.bit_length() - 1

    def add_row(self, values: Sequence[float]) -> None:
        """One sample (a value per column); when the buffer is full, every other sample goes first."""
        with self._lock:
            self._rows.append(*(float(v) for v in values))

    def __len__(self) -> int:
        return len(self._rows)

    def nbytes(self) -> int:
        """The memory the samples hold, in bytes."""
        return self._rows.nbytes()

    def last_row(self) -> dict[str, float] | None:
        """The newest row by column name, None before any."""
        with self._lock:
            row = self._rows.last()
        return None if row is None else dict(zip(self.names, row, strict=True))

    def columns(self) -> dict[str, np.ndarray]:
        """A copy of the samples kept, one array per column, by name."""
        with self._lock:
            return {name: self._rows.column(i) for i, name in enumerate(self.names)}


class Sampler:
    """A sampler's thread ("traceml-host", "traceml-nvml") and its life cycle, the same for
    every sampler: `start_thread()` and `stop_thread()` (which joins) run on the main thread; on
    the sampler's thread, `begin()`, then a sample each `period_s` (times the buffer's stride:
    the rate halves when the kept samples do) until stopped, then `last_sample()`; `end()` in
    any case. The thread is the edge: whatever a sample raises becomes the sampler's note
    (`failed`), never an error of the user's cell."""

    def __init__(self, thread_name: str, samples: SampleBuffer, period_s: float) -> None:
        self.thread_name = thread_name
        self.samples = samples
        self.period_s = period_s
        self._stop = threading.Event()
        self._wake = threading.Event()  # sample now (new workers), or stop
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """The sampler's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start_thread(self) -> None:
        """Start the sampler's thread (a daemon: it never keeps the kernel from exiting)."""
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop_thread(self) -> None:
        """Stop the thread (it takes its last sample) and join it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def wake(self) -> None:
        """Take the next sample now."""
        self._wake.set()

    # -- on the sampler's thread: what each sampler does ----------------------------------
    def begin(self) -> bool:
        """Before the first period (open a device, take a first sample); False: nothing to
        sample (the note says why)."""
        return True

    def sample_once(self) -> None:
        """One sample into `samples`."""
        raise NotImplementedError

    def last_sample(self) -> None:
        """After the stop, before `end` (the host's last private-memory reads)."""

    def end(self) -> None:
        """Let go of what `begin` opened; runs also after a failure."""

    def failed(self, error: Exception) -> None:
        """A sample raised: the sampler stops and says why in its note."""
        raise NotImplementedError

    def _run(self) -> None:
        with never_raise() as guard:  # the sampler thread is the edge: a failure is its note
            self._sample_until_stopped()
        if guard.error is not None:
            self.failed(guard.error)
        self.end()

    def _sample_until_stopped(self) -> None:
        if not self.begin():
            return
        while True:
            self._wake.wait(self.period_s * self.samples.stride)
            self._wake.clear()
            if self._stop.is_set():
                break
            self.sample_once()
        self.last_sample()
