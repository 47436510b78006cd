"""A bounded buffer of timed samples (NVML's, psutil's): written by a sampler thread, read
(copied) by the main thread; when full, every other sample goes. Its storage grows with the
samples (a short run, or a sampler that never samples, holds next to nothing)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

FIRST_ROWS = 64  # rows allocated at the first sample; the storage doubles up to the capacity


class SampleBuffer:
    """Rows of `columns` (the first is the time in s since the run's origin), at most
    `capacity` of them: when full, every other row is dropped (`decimations` counts how often,
    so a sampler can halve its rate with it)."""

    def __init__(self, columns: Sequence[str], capacity: int) -> None:
        self.names = tuple(columns)
        self.capacity = int(capacity)
        self._lock = threading.Lock()
        self._data = np.empty((len(self.names), 0))
        self._n = 0
        self.decimations = 0  # each one halved the kept samples (and the sampling rate)

    def add_row(self, values: Sequence[float]) -> None:
        """One sample (a value per column); when the buffer is full, every other sample goes first."""
        with self._lock:
            rows = self._data.shape[1]
            full = self._n == rows
            if full and rows < self.capacity:  # room to grow: double (at most the capacity)
                grown = np.full((len(self.names), min(self.capacity, max(FIRST_ROWS, 2 * rows))), np.nan)
                grown[:, :rows] = self._data
                self._data = grown
            elif full:  # at the capacity: every other sample goes
                half = self._data[:, ::2].copy()
                self._data[:] = np.nan
                self._data[:, : half.shape[1]] = half
                self._n = half.shape[1]
                self.decimations += 1
            self._data[:, self._n] = values
            self._n += 1

    def __len__(self) -> int:
        return self._n

    def last_row(self) -> dict[str, float] | None:
        """The newest row by column name, None before any."""
        with self._lock:
            if not self._n:
                return None
            return {name: float(self._data[i, self._n - 1]) for i, name in enumerate(self.names)}

    def columns(self) -> dict[str, np.ndarray]:
        """A copy of the samples kept, one array per column, by name."""
        with self._lock:
            return {name: self._data[i, : self._n].copy() for i, name in enumerate(self.names)}
