"""The Recorder keeps every step up to its cap, then a uniform sample with exact totals."""

from __future__ import annotations

import numpy as np
import pytest

from traceml_jupyter.capture.steps import recorder as recorder_module
from traceml_jupyter.capture.steps.recorder import Recorder


def fill(rec: Recorder, n: int, wait_ns: int = 1000, compute_ns: int = 3000) -> None:
    t = 0
    for _ in range(n):
        rec.add(t, t + wait_ns, t + wait_ns + compute_ns)
        t += wait_ns + compute_ns


def test_every_step_is_kept_exactly_up_to_the_cap() -> None:
    rec = Recorder()
    rec.origin_ns = 0
    n = 150_000  # more than the 100k the issue asks for, folded twice
    fill(rec, n)
    cols = rec.columns()
    assert rec.stride == 1 and len(cols["step"]) == n
    assert np.array_equal(cols["step"], np.arange(n))
    assert np.allclose(cols["data_wait_ms"], 0.001) and np.allclose(cols["step_ms"], 0.004)
    assert cols["time_s"][1] == pytest.approx(4e-6)


def test_past_the_cap_memory_is_flat_and_totals_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "CHUNK", 64)
    monkeypatch.setattr(recorder_module, "HISTORY_CAP", 256)
    rec = Recorder()
    rec.origin_ns = 0
    sizes = []
    for _ in range(8):
        fill(rec, 1000)
        sizes.append(len(rec.columns()["step"]))
    assert rec.n_steps == 8000
    assert rec.stride > 1 and max(sizes[2:]) <= 256 + 64
    cols = rec.columns()
    assert np.all(cols["step"] % rec.stride == 0)  # a uniform sample
    totals = rec.totals()
    assert totals["data_wait_ms"] == pytest.approx(8000 * 0.001)
    assert totals["compute_ms"] == pytest.approx(8000 * 0.003)


def test_tail_is_exact_across_a_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "CHUNK", 64)
    rec = Recorder()
    rec.origin_ns = 0
    fill(rec, 70)
    tail = rec.tail(20)
    assert list(tail["step"]) == list(range(50, 70))


def test_gpu_timings_arrive_late_and_in_order() -> None:
    rec = Recorder()
    rec.origin_ns = 0
    fill(rec, 3)
    rec.add_gpu(0, 1.0, 2.0)
    cols = rec.columns()
    assert cols["step_gpu_ms"][0] == 3.0 and np.isnan(cols["step_gpu_ms"][1:]).all()


def test_gpu_timings_survive_folds_and_decimation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "CHUNK", 4)
    monkeypatch.setattr(recorder_module, "HISTORY_CAP", 8)
    rec = Recorder()
    rec.origin_ns = 0
    for k in range(40):
        rec.add(k * 10, k * 10 + 2, k * 10 + 10)
        rec.add_gpu(k, 1.0, float(k))
    cols = rec.columns()
    assert rec.stride > 1 and len(cols["step"]) <= 8 + 4
    assert np.array_equal(cols["compute_gpu_ms"], cols["step"].astype(float))  # aligned to steps
    totals = rec.totals()
    assert totals["data_wait_gpu_ms"] == 40.0 and totals["compute_gpu_ms"] == sum(range(40))
    assert totals["data_wait_ms"] == pytest.approx(40 * 2e-6)


def test_gpu_timings_land_on_their_step_whatever_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "CHUNK", 4)
    rec = Recorder()
    rec.origin_ns = 0
    fill(rec, 10)  # two folds: steps 0-7 are in the kept history
    rec.add_gpu(9, 1.0, 9.0)
    rec.add_gpu(2, 1.0, 2.0)  # late, after its chunk was folded
    cols = rec.columns()
    assert cols["compute_gpu_ms"][9] == 9.0 and cols["compute_gpu_ms"][2] == 2.0
    assert np.isnan(cols["compute_gpu_ms"][[0, 1, 3, 8]]).all()


def test_merging_the_last_steps_gives_their_start_wait_and_time() -> None:
    rec = Recorder()
    rec.origin_ns = 0
    rec.add(0, 2, 10)
    rec.add(10, 13, 18)  # 2 ns of this step were kept out of it (it ended at 20)
    assert rec.pop_tail(2) == (0, 5, 18) and rec.n_steps == 0
    assert rec.pop_tail(1) is None
