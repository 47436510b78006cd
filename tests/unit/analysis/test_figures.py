"""Headline figures that add up, patterns told from stragglers, and claims held to their noise
(pure functions on synthetic step columns)."""

from __future__ import annotations

import numpy as np
import pytest
from synthetic import drifting_steps, step_columns

from traceml_jupyter.analysis.data_sources import input_next, loader_facts, straggler_next
from traceml_jupyter.analysis.noise import judge
from traceml_jupyter.analysis.step_parts import trend, trend_sentence
from traceml_jupyter.analysis.step_pattern import ordinal, step_pattern
from traceml_jupyter.analysis.summary import summarize
from traceml_jupyter.analysis.verdict import diagnose
from traceml_jupyter.analysis.verdict_box import WIDTH, verdict_box


def analysed(summary: dict, columns: dict, pass_steps: tuple[int, ...] = (), workers: int | None = None) -> dict:
    """The summary as run_summary.analyse completes it: the steps' pattern and the loader's facts."""
    mask = columns["step"] >= summary["warmup_steps"]
    summary["step_pattern"] = step_pattern(columns, mask, "cpu", pass_steps, workers)
    loader = {"num_workers": workers, "persistent_workers": False} if workers is not None else None
    summary.update(loader_facts(loader, pass_steps or (0,)))
    summary["data_source_kind"] = "dataloader" if workers is not None else None
    return summary


# -- headline figures ---------------------------------------------------------------------------


def test_two_workers_in_lockstep_box_figures_add_up_to_the_loop() -> None:
    # The steps alternate: 28 ms waiting for the next round of two batches, 1.7 ms not waiting.
    rng = np.random.default_rng(5)
    n = 41
    wait = np.array([28.0 if i % 2 else 0.05 for i in range(n)])
    compute = rng.uniform(1.5, 1.9, n)
    cols = step_columns(wait, compute)
    s = summarize(cols, n)
    loop = float((wait + compute).sum())
    assert s["mean_data_wait_ms"] + s["mean_compute_ms"] == pytest.approx(s["mean_step_ms"])
    assert n * s["mean_step_ms"] == pytest.approx(loop) and s["loop_ms"] == pytest.approx(loop)
    # The medians stay, as medians, and fall far from the loop's time per step.
    assert abs(s["step_ms"] - loop / n) > 5.0
    box = verdict_box("INPUT-BOUND", analysed(s, cols, workers=2))
    assert f"Step time: {loop / n:.1f}ms" in box
    assert "every 2nd step waits 28.0ms" in box
    assert {len(line) for line in box.splitlines()} == {WIDTH + 2}


def test_a_checkpoint_every_4th_step_is_in_the_mean_and_named_beside_it() -> None:
    compute = np.array([33.0 if i % 4 == 3 else 3.0 for i in range(80)])
    cols = step_columns(np.full(80, 0.01), compute)
    s = analysed(summarize(cols, 80), cols)
    assert s["mean_step_ms"] == pytest.approx(compute.mean() + 0.01)
    assert s["step_ms"] == pytest.approx(3.01)  # the median alone would say 3 ms
    pattern = s["step_pattern"]
    assert (pattern["period"], pattern["slow_in"], pattern["steady_wait"]) == (4, "compute", False)
    assert pattern["text"] == "typical step 3.0 ms; every 4th step takes 33.0 ms"


def test_the_warm_up_and_time_between_steps_get_their_own_line_when_they_matter() -> None:
    wait = np.r_[[300.0], np.full(99, 0.5)]
    cols = step_columns(wait, np.full(100, 9.5))
    # Each step starts where the last ended (time_s: its start), but for 200 ms in no step.
    starts = np.r_[0.0, np.cumsum(wait + 9.5)[:-1]] / 1000
    cols["time_s"] = starts + np.r_[0.0, np.full(99, 0.2)]
    s = summarize(cols, 100)
    assert s["warmup_ms"] == pytest.approx(309.5 + 4 * 10.0)
    assert s["outside_steps_ms"] == pytest.approx(200.0)
    box = verdict_box("COMPUTE-BOUND", s).splitlines()
    assert "Warm-up (first 5 steps, not in the verdict): 349.5ms of 1299.5ms" in box[3]
    assert "200.0ms between the steps" in box[4]


def test_a_run_saved_before_the_means_shows_its_medians() -> None:
    old = {"clock": "cpu", "data_wait_ms": 1.0, "compute_ms": 2.0, "step_ms": 3.0}
    assert "Data wait: 1.0ms | CPU compute: 2.0ms | Step time: 3.0ms" in verdict_box("MIXED", old)


# -- patterns before stragglers -----------------------------------------------------------------


def test_waits_with_the_period_of_the_workers_are_input_bound_not_a_straggler() -> None:
    # Four workers at 40 ms a batch feed a 4 ms step: every 4th fetch waits for the next round.
    rng = np.random.default_rng(7)
    n = 100
    wait = np.array([140.0 + rng.normal(0, 5) if i % 4 == 0 else 0.1 for i in range(n)])
    cols = step_columns(wait, rng.uniform(3.8, 4.5, n))
    plain = summarize(cols, n)
    assert diagnose(plain).label == "INPUT STRAGGLER"  # without the pattern: the old story
    s = analysed(summarize(cols, n), cols, pass_steps=(0,), workers=4)
    v = diagnose(s)
    assert v.label == "INPUT-BOUND" and v.severity == "critical"
    assert "every 4th step waits" in v.why and "the 4 workers deliver a round" in v.why
    assert "persistent" not in v.next and "pinned" not in v.next  # one pass, CPU clock
    assert "more DataLoader workers" in v.next


def test_each_pass_s_first_batch_stays_a_straggler_with_its_fix() -> None:
    wait = [400.0 if i % 25 == 0 else 0.5 for i in range(100)]
    cols = step_columns(wait, [20.0] * 100)
    s = analysed(summarize(cols, 100, warmup=0), cols, pass_steps=(0, 25, 50, 75), workers=2)
    assert s["step_pattern"]["at_pass_starts"] and not s["step_pattern"]["steady_wait"]
    v = diagnose(s)
    assert v.label == "INPUT STRAGGLER"
    assert v.next.startswith("Keep workers alive between epochs (persistent_workers=True)")


def test_frequent_stalls_at_no_fixed_period_are_the_loader_s_pace() -> None:
    # Four workers drifted out of lockstep on a busy machine: a third of the fetches wait
    # 10-30 ms, at no fixed period, over a single pass.
    rng = np.random.default_rng(3)
    n = 150
    wait = np.where(rng.random(n) < 0.33, rng.uniform(10.0, 30.0, n), rng.uniform(0.0, 2.0, n))
    cols = step_columns(wait, rng.uniform(4.0, 6.0, n))
    assert diagnose(summarize(cols, n)).label == "INPUT STRAGGLER"  # the spike rule alone
    s = analysed(summarize(cols, n), cols, pass_steps=(0,), workers=4)
    v = diagnose(s)
    assert v.label == "INPUT-BOUND" and "fetches wait long" in v.why, v.why
    assert "persistent" not in v.next


def test_each_pass_s_first_batches_from_restarted_workers_stay_a_straggler() -> None:
    # Two workers restart at each pass of 10 batches: the first two batches of a pass stall.
    wait = [300.0 if i % 10 in (0, 1) else 0.5 for i in range(60)]
    cols = step_columns(wait, [20.0] * 60)
    starts = tuple(range(0, 60, 10))
    s = analysed(summarize(cols, 60, warmup=0), cols, pass_steps=starts, workers=2)
    assert not s["step_pattern"]["steady_wait"]
    assert diagnose(s).label == "INPUT STRAGGLER"


def test_the_next_line_never_contradicts_what_the_run_saw_of_the_loader() -> None:
    one_pass = {**loader_facts({"num_workers": 2, "persistent_workers": False}, [0]), "clock": "cpu"}
    assert "persistent" not in straggler_next(one_pass) and "persistent" not in input_next(one_pass)
    no_workers = {**loader_facts({"num_workers": 0, "persistent_workers": False}, [0, 10]), "clock": "cpu"}
    assert straggler_next(no_workers).startswith("Load in DataLoader workers (num_workers > 0)")
    assert "persistent workers" in input_next(no_workers)  # several passes: worth keeping them
    kept = {**loader_facts({"num_workers": 2, "persistent_workers": True}, [0, 10]), "clock": "gpu"}
    assert "persistent" not in straggler_next(kept) and "persistent" not in input_next(kept)
    assert "pinned memory" in input_next(kept)
    unknown = {"data_source_kind": None, **loader_facts(None, []), "clock": "cpu"}
    assert "worker" not in input_next(unknown) or "a DataLoader with workers" in input_next(unknown)
    assert "DataLoader workers" not in input_next(unknown) and "persistent" not in straggler_next(unknown)
    generator = {"data_source_kind": "loop", "data_source_type": "generator", "data_source": "`g()` on line 2",
                 **loader_facts(None, [])}
    assert "worker" not in straggler_next(generator).lower() and "DataLoader workers" not in straggler_next(generator)


def test_steps_drawn_from_one_to_ten_ms_have_no_pattern() -> None:
    for seed in range(20):
        steps = np.random.default_rng(seed).uniform(1.0, 10.0, 60)
        cols = step_columns(np.zeros(60), steps)
        p = step_pattern(cols, np.ones(60, dtype=bool), "cpu")
        assert p is not None and p["shape"] != "two humps", seed


def test_ordinals() -> None:
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd"]


# -- claims held to their noise -----------------------------------------------------------------


def test_a_flat_run_of_steps_from_one_to_ten_ms_claims_no_trend() -> None:
    for seed in range(100):
        steps = np.random.default_rng(seed).uniform(1.0, 10.0, 60)
        found = trend(step_columns(np.zeros(60), steps), np.ones(60, dtype=bool), "cpu")
        assert found is not None and found["direction"] is None, (seed, trend_sentence(found))


def test_a_change_inside_twice_its_noise_is_not_claimed_a_real_ramp_is() -> None:
    # Thirds of 10 steps that halve but scatter widely: "63 % faster, noise ±53.3 %" was claimed.
    rng = np.random.default_rng(0)
    first, last = rng.normal(58.0, 30.0, 10).clip(5), rng.normal(29.0, 15.0, 10).clip(5)
    steps = np.r_[first, rng.normal(40.0, 20.0, 10).clip(5), last]
    found = trend(step_columns(np.zeros(30), steps), np.ones(30, dtype=bool), "cpu")
    assert found is not None and found["direction"] is None and abs(found["change"]) < 2 * found["noise"]
    ramp = np.linspace(10.0, 12.0, 60) + np.random.default_rng(1).normal(0.0, 0.3, 60)
    found = trend(step_columns(np.zeros(60), ramp), np.ones(60, dtype=bool), "cpu")
    assert found is not None and found["direction"] == "slower"


def test_compare_a_short_run_with_itself_never_gives_a_negative_bound() -> None:
    for seed in range(10):
        rng = np.random.default_rng(seed)
        steps = rng.uniform(1.0, 4.0, 10)
        steps[rng.integers(10)] = 40.0  # one stall in a short run: a skewed bootstrap
        run = {"step_ms": steps, "data_wait_ms": steps / 2, "compute_ms": steps / 2}
        j = judge(run, run)
        assert j is not None and j.change.value == "NO CHANGE"
        assert 0 < j.speedup_low <= 1.0 <= j.speedup_high
        step = j.columns[0]
        assert step.a + step.diff_low >= 0  # B's mean never below 0 inside the interval
        assert j.how_sure is not None and "from 10 and 10 steps" in j.how_sure


def test_enough_steady_steps_compare_without_a_caveat() -> None:
    rng = np.random.default_rng(2)
    a = drifting_steps(300, 0.3, rng, mean=40.0, sd=1.0)
    b = drifting_steps(300, 0.3, rng, mean=20.0, sd=0.5)
    j = judge({"step_ms": a}, {"step_ms": b})
    assert j is not None and j.change.value == "IMPROVEMENT" and j.how_sure is None


def test_a_verdict_over_few_or_noisy_steps_says_how_sure_it_is() -> None:
    few = step_columns([50.0] * 8, list(np.random.default_rng(0).uniform(40.0, 60.0, 8)))
    v = diagnose(summarize(few, 8, warmup=0))
    assert v.label == "INPUT-BOUND" and "Over 8 steps the mean step is known to ±" in v.why
    steady = step_columns([1.0] * 200, [99.0] * 200)
    assert "known to" not in diagnose(summarize(steady, 200)).why
