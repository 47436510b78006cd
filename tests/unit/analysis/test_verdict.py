"""Each verdict rule at its thresholds, from synthetic step columns (pure functions)."""

from __future__ import annotations

import numpy as np
import pytest
from synthetic import step_columns

from traceml_jupyter.analysis.summary import auto_warmup, straggler_share, summarize
from traceml_jupyter.analysis.verdict import diagnose
from traceml_jupyter.analysis.verdict_box import verdict_box

columns = step_columns


def verdict_of(wait_ms: float, compute_ms: float, n: int, warmup: int = 0) -> tuple[str, str]:
    cols = columns([wait_ms] * n, [compute_ms] * n)
    v = diagnose(summarize(cols, n, warmup))
    return v.label, v.severity


def test_input_bound_starts_at_ten_percent() -> None:
    assert verdict_of(9.9, 90.1, 30) == ("COMPUTE-BOUND", "info")
    assert verdict_of(10.0, 90.0, 30) == ("INPUT-BOUND", "warn")


def test_critical_starts_at_twenty_percent() -> None:
    assert verdict_of(19.9, 80.1, 30) == ("INPUT-BOUND", "warn")
    assert verdict_of(20.0, 80.0, 30) == ("INPUT-BOUND", "critical")


def test_critical_needs_twenty_analysed_steps() -> None:
    assert verdict_of(50.0, 50.0, 19) == ("INPUT-BOUND", "warn")
    assert verdict_of(50.0, 50.0, 20) == ("INPUT-BOUND", "critical")


def test_one_step_is_warmup_two_steps_get_a_verdict() -> None:
    assert verdict_of(50.0, 50.0, 1) == ("WARMUP", "info")
    assert verdict_of(50.0, 50.0, 2) == ("INPUT-BOUND", "warn")


def test_no_steps_is_no_data() -> None:
    assert verdict_of(0.0, 0.0, 0) == ("NO DATA", "info")


def test_warmup_steps_are_kept_out_of_the_verdict() -> None:
    # The first five steps wait long (workers starting); the rest are compute-bound.
    wait = [500.0] * 5 + [1.0] * 95
    s = summarize(columns(wait, [99.0] * 100), 100)
    assert s["warmup_steps"] == 5 and s["n_analysed"] == 95
    assert diagnose(s).label == "COMPUTE-BOUND"
    assert diagnose(summarize(columns(wait, [99.0] * 100), 100, warmup=0)).label != "WARMUP"


def test_auto_warmup_is_a_few_steps_never_more_than_a_tenth() -> None:
    assert [auto_warmup(n) for n in (0, 9, 10, 30, 1000)] == [0, 0, 1, 3, 5]


def test_spiky_data_wait_is_an_input_straggler() -> None:
    # Each 25th fetch stalls 400 ms (a new epoch's workers); the median fetch is fast.
    wait = [400.0 if i % 25 == 0 else 0.5 for i in range(100)]
    s = summarize(columns(wait, [20.0] * 100), 100, warmup=0)
    v = diagnose(s)
    assert v.label == "INPUT STRAGGLER" and v.severity == "critical"
    assert s["straggler_steps"] == 4
    assert "4 of 100 fetches stall" in v.why


def test_when_the_loop_both_waits_and_stalls_the_larger_loss_names_the_verdict() -> None:
    # Workers restart each epoch (a 1 s stall every 10 steps) while taking each ready batch
    # from them costs a loaded machine 6 of a 50 ms step: the stalls are the finding.
    wait = [1000.0 if i % 10 == 0 else 6.0 for i in range(40)]
    s = summarize(columns(wait, [44.0] * 40), 40, warmup=0)
    assert s["data_wait_share"] > 0.10 and s["straggler_share"] > s["data_wait_share"]
    v = diagnose(s)
    assert v.label == "INPUT STRAGGLER"
    assert v.why.endswith("besides, a typical step waits 12.0 % of its time."), v.why
    # Most of every step waits and a few fetches stall a little more: INPUT-BOUND.
    wait = [300.0 if i % 10 == 0 else 60.0 for i in range(40)]
    s = summarize(columns(wait, [40.0] * 40), 40, warmup=0)
    assert 0.10 <= s["straggler_share"] < s["data_wait_share"]
    assert diagnose(s).label == "INPUT-BOUND"


def test_straggler_share_threshold() -> None:
    base = [1.0] * 99
    # one spike whose excess over the median wait is 9.9 % vs 10 % of the total time
    for excess, label in ((0.099, "COMPUTE-BOUND"), (0.101, "INPUT STRAGGLER")):
        compute = [99.0] * 100
        total_without = 100 * 100.0
        spike = 1.0 + excess * total_without / (1 - excess)
        cols = columns(base + [spike], compute)
        lost, n = straggler_share(cols["data_wait_ms"], cols["step_ms"])
        assert n == 1 and lost == pytest.approx(excess, rel=1e-6)
        assert diagnose(summarize(cols, 100, warmup=0)).label == label


def test_gpu_clock_needs_every_analysed_step_timed_and_gpu_work() -> None:
    cols = columns([1.0] * 10, [9.0] * 10)
    cols["data_wait_gpu_ms"] = np.full(10, 5.0)
    cols["compute_gpu_ms"] = np.full(10, 5.0)
    cols["step_gpu_ms"] = np.full(10, 10.0)
    assert summarize(cols, 10, 0, gpu_used=True)["clock"] == "gpu"
    assert diagnose(summarize(cols, 10, 0, gpu_used=True)).label == "INPUT-BOUND"
    assert summarize(cols, 10, 0, gpu_used=False)["clock"] == "cpu"
    cols["step_gpu_ms"][3] = np.nan
    assert summarize(cols, 10, 0, gpu_used=True)["clock"] == "cpu"


def test_unmeasured_is_none_not_zero() -> None:
    s = summarize(columns([], []), 0)
    assert s["data_wait_ms"] is None and s["data_wait_share"] is None and s["host_ms"] is None
    assert "n/a" in verdict_box("NO DATA", s)


def test_box_keeps_the_seed_shape() -> None:
    s = {"clock": "gpu", "data_wait_ms": 531.8, "compute_ms": 31.0, "step_ms": 563.3}
    assert verdict_box("INPUT-BOUND", s) == "\n".join(
        [
            "+----------------------------------------------------------------------------+",
            "|  Step Time: INPUT-BOUND                                                    |",
            "|  - Data wait: 531.8ms | GPU compute: 31.0ms | Step time: 563.3ms           |",
            "+----------------------------------------------------------------------------+",
        ]
    )
    s["clock"] = "cpu"
    assert "CPU compute: 31.0ms" in verdict_box("INPUT-BOUND", s)
