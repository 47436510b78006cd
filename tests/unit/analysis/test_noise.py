"""Whether two runs really differ: block-bootstrap intervals of the per-step means and the rule
that says IMPROVEMENT / REGRESSION / NO CHANGE / MIXED, on synthetic step columns whose truth is
known; and what makes two runs unlike, said before the ratio."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from synthetic import drifting_steps, step_columns

from traceml_jupyter.analysis.comparable import caveats
from traceml_jupyter.analysis.compare import Comparison, compare_summaries
from traceml_jupyter.analysis.noise import (
    Change,
    analysed_samples,
    block_edges,
    judge,
    replicate_means,
    widening,
)
from traceml_jupyter.analysis.summary import summarize, with_batch_size
from traceml_jupyter.analysis.verdict import diagnose

MACHINE = {"python": "3.11.7", "torch": "2.13.0", "cuda": None, "cpu": "AMD EPYC", "cpus": 2, "gpu": None}


def noisy(mean: float, n: int, seed: int, sd: float = 0.05) -> np.ndarray:
    """Step parts that jitter by `sd` of their mean, as sleeps and small kernels do."""
    return mean * (1 + np.random.default_rng(seed).normal(0.0, sd, n))


def run_of(wait: np.ndarray, compute: np.ndarray, batch: int | None = 64, **extra: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    columns = step_columns(wait, compute)
    columns.update(extra)
    summary = summarize(columns, len(wait))
    with_batch_size(summary, batch)
    return summary, columns


def compared(a: tuple[dict[str, Any], dict[str, np.ndarray]], b: tuple[dict[str, Any], dict[str, np.ndarray]], **kw: Any) -> Comparison:
    (sa, ca), (sb, cb) = a, b
    return compare_summaries(
        "A", sa, diagnose(sa).label, "B", sb, diagnose(sb).label,
        steps_a=ca, steps_b=cb, machine_a=kw.pop("machine_a", MACHINE), machine_b=kw.pop("machine_b", MACHINE), **kw,
    )


# -- the rule, on runs whose truth is known --------------------------------------------------------


def test_two_runs_of_the_same_code_are_no_change_even_when_their_means_differ_a_little() -> None:
    for seed in range(10):  # ten pairs of runs of one process: never a change
        a = run_of(noisy(30, 200, seed), noisy(10, 200, seed + 100))
        b = run_of(noisy(30, 200, seed + 200), noisy(10, 200, seed + 300))
        c = compared(a, b)
        assert c.change == "NO CHANGE", c.text()
        assert c.conclusion.startswith("NO CHANGE (within noise): ")
        throughput = next(row for row in c.rows if row[0].startswith("Throughput"))
        assert throughput[3].endswith("x: within noise")  # never "1.1x faster" within the noise
        assert c.speedup_low is not None and c.speedup_high is not None
        assert c.speedup_low <= 1.0 <= c.speedup_high or abs(c.speedup - 1) < 0.05


def test_a_2x_fix_is_an_improvement_whose_interval_excludes_1() -> None:
    a = run_of(noisy(30, 60, 1), noisy(10, 60, 2))
    b = run_of(noisy(10, 60, 3), noisy(10, 60, 4))
    c = compared(a, b)
    assert c.change == "IMPROVEMENT"
    assert c.speedup == pytest.approx(2.0, rel=0.05)
    assert c.speedup_low is not None and c.speedup_high is not None
    assert 1.0 < c.speedup_low < c.speedup < c.speedup_high
    assert c.conclusion.startswith(f"IMPROVEMENT: {c.speedup:.2f}x faster (95 % interval ")
    rows = {ch.name: ch.verdict for ch in c.per_step}
    assert rows == {"Step time": "faster", "Data wait": "faster", "CPU compute": "within noise"}
    back = compared(b, a)
    assert back.change == "REGRESSION" and back.conclusion.startswith("REGRESSION: ")


def test_a_faster_step_with_a_slower_part_is_mixed_and_names_the_part() -> None:
    # More workers: the wait is gone, but they take the CPU the step computes on.
    a = run_of(noisy(40, 80, 5), noisy(20, 80, 6))
    b = run_of(noisy(1, 80, 7), noisy(26, 80, 8))
    c = compared(a, b)
    assert c.change == "MIXED"
    assert "but slower: CPU compute (+6.0 ms a step, +30 %)" in c.conclusion
    assert c.speedup_low is not None and c.speedup_low > 1


def test_a_tiny_part_that_doubles_does_not_make_a_run_mixed() -> None:
    # data wait 0.05 -> 0.1 ms in a 30 ms step: +100 % of itself, 0.2 % of the step
    a = run_of(noisy(0.05, 80, 9), noisy(30, 80, 10, sd=0.01))
    b = run_of(noisy(0.10, 80, 11), noisy(20, 80, 12, sd=0.01))
    c = compared(a, b)
    assert c.change == "IMPROVEMENT"
    assert {ch.name: ch.verdict for ch in c.per_step}["Data wait"] == "within noise"


def test_extra_per_step_columns_both_runs_carry_are_judged_too() -> None:
    # Columns other branches add (parts of the step, memory, CPU) light up without naming them.
    n = 80
    a = run_of(noisy(30, n, 13), noisy(10, n, 14), forward_ms=noisy(3, n, 15), optimizer_ms=noisy(2, n, 16),
               gpu_mem_used_mib=noisy(1000, n, 17, 0.01))
    b = run_of(noisy(10, n, 18), noisy(10, n, 19), forward_ms=noisy(3, n, 20), optimizer_ms=noisy(5, n, 21),
               gpu_mem_used_mib=noisy(1500, n, 22, 0.01))
    c = compared(a, b)
    found = {ch.column: ch for ch in c.per_step}
    assert found["optimizer_ms"].verdict == "slower" and found["optimizer_ms"].part
    assert found["forward_ms"].verdict == "within noise"
    assert found["gpu_mem_used_mib"].verdict == "higher" and not found["gpu_mem_used_mib"].part
    assert c.change == "MIXED" and "optimizer (+3.0 ms a step" in c.conclusion
    text = c.text()
    assert "gpu mem used (MiB)" in text and "optimizer" in text
    only_a = run_of(noisy(30, n, 13), noisy(10, n, 14), forward_ms=noisy(3, n, 15))
    assert "optimizer_ms" not in {ch.column for ch in compared(only_a, b).per_step}


def test_the_speed_up_is_per_sample_when_the_batch_sizes_differ() -> None:
    a = run_of(noisy(10, 60, 23), noisy(10, 60, 24), batch=32)  # 20 ms for 32 samples
    b = run_of(noisy(10, 60, 25), noisy(20, 60, 26), batch=64)  # 30 ms for 64 samples
    c = compared(a, b)
    assert c.caveats[0].startswith("Different batch size: 32 samples a step (A) vs 64 (B)")
    assert c.speedup == pytest.approx((64 / 30) / (32 / 20), rel=0.05)
    assert c.change == "IMPROVEMENT" and "faster per sample" in c.conclusion


def test_warm_up_steps_are_left_out() -> None:
    wait = noisy(10, 50, 27)
    wait[:5] = 2000.0  # the first batches wait for workers to start
    a, b = run_of(wait, noisy(10, 50, 28)), run_of(noisy(10, 50, 29), noisy(10, 50, 30))
    assert a[0]["warmup_steps"] == 5
    assert compared(a, b).change == "NO CHANGE"


def test_runs_too_short_to_judge_are_not_judged() -> None:
    a, b = run_of(noisy(10, 40, 31), noisy(10, 40, 32)), run_of(np.array([10.0]), np.array([5.0]))
    c = compared(a, b)
    assert c.change is None and c.conclusion == "No comparison: B has too few analysed steps."


# -- the bootstrap ------------------------------------------------------------------------------------


def test_the_interval_is_the_same_every_time() -> None:
    a = {"step_ms": noisy(30, 500, 33)}
    b = {"step_ms": noisy(31, 500, 34)}
    first, second = judge(a, b), judge(a, b)
    assert first is not None and first == second


def ar1(n: int, phi: float, seed: int) -> np.ndarray:
    return drifting_steps(n, phi, np.random.default_rng(seed))


@pytest.mark.slow
def test_blocks_keep_drifting_steps_honest_where_resampling_single_steps_is_not() -> None:
    # Two runs of one process whose steps drift (correlated over ~10 steps): how often does
    # the 95 % interval of B - A exclude 0? About 5 % of pairs should; single steps resampled
    # as if independent give a far narrower interval.
    misses, misses_iid = 0, 0
    for seed in range(60):
        a, b = {"step_ms": ar1(1000, 0.9, 2 * seed)}, {"step_ms": ar1(1000, 0.9, 2 * seed + 1)}
        got = judge(a, b, replicates=400)
        assert got is not None
        step = got.columns[0]
        misses += step.diff_low > 0 or step.diff_high < 0
        rng = np.random.default_rng(seed)
        iid = [a["step_ms"][rng.integers(0, 1000, 1000)].mean() for _ in range(400)]
        iid_b = [b["step_ms"][rng.integers(0, 1000, 1000)].mean() for _ in range(400)]
        low, high = np.percentile(np.subtract(iid_b, iid), [2.5, 97.5])
        misses_iid += low > 0 or high < 0
    assert misses <= 9, misses  # ~5 % of 60 (a binomial 95 % bound)
    assert misses_iid >= 25, misses_iid  # i.i.d. resampling calls most of them a change


def test_blocks_are_about_the_cube_root_and_at_most_16() -> None:
    assert len(block_edges(64)) - 1 == 16
    assert len(block_edges(300)) - 1 == 15  # blocks of 20 steps
    assert len(block_edges(100_000)) - 1 == 16
    assert len(block_edges(3)) - 1 == 3
    assert widening(16) == pytest.approx(1.123, abs=0.01)
    assert widening(10) == pytest.approx(1.215, abs=0.01)


def test_a_long_run_costs_a_fixed_number_of_blocks() -> None:
    # 131072 kept steps (the recorder's cap): the replicates are sums over 16 blocks.
    values = {"step_ms": noisy(30, 131_072, 35), "data_wait_ms": noisy(3, 131_072, 36)}
    means = replicate_means(values, np.random.default_rng(0), replicates=2000)
    assert means["step_ms"].shape == (2000,)
    assert np.std(means["step_ms"]) < 0.05  # the mean of 10^5 steps barely moves


def test_missing_values_are_left_out_of_their_block() -> None:
    values = noisy(20, 100, 37)
    with_gaps = values.copy()
    with_gaps[::3] = np.nan
    summary, columns = run_of(noisy(10, 100, 38), noisy(10, 100, 39), extra_ms=with_gaps)
    samples = analysed_samples(summary, columns)
    assert np.isnan(samples["extra_ms"]).any()
    got = judge(samples, samples)
    assert got is not None
    extra = next(c for c in got.columns if c.column == "extra_ms")
    assert extra.a == pytest.approx(np.nanmean(with_gaps[summary["warmup_steps"]:]))
    assert extra.verdict == "within noise"


# -- like for like ------------------------------------------------------------------------------------


def test_what_makes_the_runs_unlike_is_said_first() -> None:
    a = run_of(noisy(10, 60, 40), noisy(10, 60, 41))
    b = run_of(noisy(10, 60, 42), noisy(10, 60, 43))
    b[0]["step_kind"], b[0]["step_definition"] = "backward", "a step = one `backward()`"
    a[0]["step_kind"], a[0]["step_definition"] = "optimizer", "a step = one `optimizer.step()` of SGD"
    other = {**MACHINE, "gpu": "NVIDIA T4", "torch": "2.4.0"}
    mine = {**MACHINE, "gpu": "NVIDIA A100"}
    c = compared(a, b, machine_a=mine, machine_b=other)
    assert c.caveats == [
        "Different hardware: GPU: NVIDIA A100 (A) vs NVIDIA T4 (B).",
        "Different versions: torch: 2.13.0 (A) vs 2.4.0 (B).",
        "Different step definition: a step = one `optimizer.step()` of SGD (A) vs a step = one "
        "`backward()` (B).",
    ]
    lines = c.text().splitlines()
    assert lines[1:4] == [f"  {x}" for x in c.caveats] and lines[4].startswith("  NO CHANGE")
    assert 'class="tml-caveat"' in c._repr_html_()


def test_a_run_saved_without_its_machine_says_so() -> None:
    s = run_of(noisy(10, 60, 44), noisy(10, 60, 45))[0]
    said = caveats("old", s, None, "new", s, MACHINE)
    assert said == [
        "Hardware and versions not checked: old was saved without them (by an older traceml_jupyter)."
    ]
    assert caveats("a", s, MACHINE, "b", s, dict(MACHINE)) == []
    assert caveats("a", s, None, "b", s, None, check_machines=False) == []


def test_the_comparison_as_json_holds_the_intervals() -> None:
    c = compared(run_of(noisy(30, 60, 46), noisy(10, 60, 47)), run_of(noisy(10, 60, 48), noisy(10, 60, 49)))
    saved = c.to_dict()
    assert saved["change"] == "IMPROVEMENT"
    assert saved["speedup_interval"] == [c.speedup_low, c.speedup_high]
    step = saved["per_step"][0]
    assert step["name"] == "Step time" and step["verdict"] == "faster"
    assert step["diff_interval"][1] < 0 and step["ratio_interval"][1] < 1
    assert Change("NO CHANGE") is Change.NO_CHANGE
