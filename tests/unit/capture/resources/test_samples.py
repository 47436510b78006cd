"""The samplers' bounded buffer: its storage grows with the samples, up to the capacity."""

from __future__ import annotations

from traceml_jupyter.capture.resources.samples import SampleBuffer


def test_a_buffer_holds_no_storage_before_its_first_sample_and_grows_with_them() -> None:
    buffer = SampleBuffer(("time_s", "value"), capacity=2048)
    assert buffer.nbytes() == 0 and buffer.last_row() is None
    for i in range(65):
        buffer.add_row([float(i), 2.0 * i])
    assert buffer.nbytes() == 65 * 2 * 8  # two float columns, far below the capacity
    cols = buffer.columns()
    assert cols["time_s"].tolist() == [float(i) for i in range(65)]
    assert cols["value"].tolist() == [2.0 * i for i in range(65)]
    assert buffer.last_row() == {"time_s": 64.0, "value": 128.0}
    assert buffer.decimations == 0 and buffer.stride == 1


def test_a_full_buffer_keeps_every_other_sample_and_never_outgrows_its_capacity() -> None:
    buffer = SampleBuffer(("time_s",), capacity=100)  # not a power of two
    kept: list[float] = []  # the rule written out: when full, every other one goes, then the new one
    for i in range(1000):
        if len(kept) == 100:
            kept = kept[::2]
        kept.append(float(i))
        buffer.add_row([float(i)])
        assert len(buffer) <= 100
    t = buffer.columns()["time_s"]
    assert t.tolist() == kept and t[0] == 0.0 and t[-1] == 999.0
    assert buffer.decimations >= 3 and buffer.stride == 2**buffer.decimations
