"""The samplers' bounded buffer: its storage grows with the samples, up to the capacity."""

from __future__ import annotations

import numpy as np

from traceml_jupyter.capture.resources.samples import FIRST_ROWS, SampleBuffer


def test_a_buffer_holds_no_storage_before_its_first_sample_and_grows_with_them() -> None:
    buffer = SampleBuffer(("time_s", "value"), capacity=2048)
    assert buffer._data.nbytes == 0 and buffer.last_row() is None
    for i in range(FIRST_ROWS + 1):
        buffer.add_row([float(i), 2.0 * i])
    assert buffer._data.shape[1] == 2 * FIRST_ROWS  # doubled once, far below the capacity
    cols = buffer.columns()
    assert cols["time_s"].tolist() == [float(i) for i in range(FIRST_ROWS + 1)]
    assert cols["value"].tolist() == [2.0 * i for i in range(FIRST_ROWS + 1)]
    assert buffer.decimations == 0


def test_a_full_buffer_keeps_every_other_sample_and_never_outgrows_its_capacity() -> None:
    buffer = SampleBuffer(("time_s",), capacity=100)  # not a power of two: the last growth is capped
    for i in range(1000):
        buffer.add_row([float(i)])
    assert buffer._data.shape[1] == 100 and len(buffer) <= 100 and buffer.decimations >= 3
    t = buffer.columns()["time_s"]
    assert t[0] == 0.0 and np.all(np.diff(t) > 0) and t[-1] == 999.0
