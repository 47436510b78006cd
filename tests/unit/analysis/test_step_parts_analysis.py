"""Inside the step and over the run, as pure functions of synthetic columns
(analysis/step_parts.py): the split, the advice by the part that dominates, the rest's own line,
the trend against its noise band, and each epoch's start-up wait."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from traceml_jupyter.analysis.step_parts import (
    also_lines,
    epoch_startup,
    part_lines,
    parts_sentence,
    parts_summary,
    rest_line,
    rest_verdict,
    startup_sentence,
    trend,
    trend_sentence,
)


def columns(n: int, wait: Any, fwd: Any, bwd: Any, opt: Any, rest: Any, sampled_every: int = 1) -> dict[str, np.ndarray]:
    """Step columns with the parts known on every `sampled_every`-th step (NaN elsewhere)."""
    arr = [np.broadcast_to(np.asarray(v, dtype=np.float64), (n,)).copy() for v in (wait, fwd, bwd, opt, rest)]
    wait_, fwd_, bwd_, opt_, rest_ = arr
    compute = fwd_ + bwd_ + opt_ + rest_
    cols = {
        "step": np.arange(n),
        "data_wait_ms": wait_,
        "compute_ms": compute,
        "step_ms": wait_ + compute,
    }
    hole = np.arange(n) % sampled_every != 0
    for name, v in (("forward_ms", fwd_), ("backward_ms", bwd_), ("optimizer_ms", opt_), ("rest_ms", rest_)):
        cols[name] = np.where(hole, np.nan, v)
    return cols


def summary_of(cols: dict[str, np.ndarray], **facts: Any) -> dict[str, Any]:
    analysed = np.ones(len(cols["step"]), dtype=bool)
    s = parts_summary(cols, analysed, "cpu")
    s.update(
        step_ms=float(np.median(cols["step_ms"])),
        compute_ms=float(np.median(cols["compute_ms"])),
        n_analysed=len(cols["step"]),
        forward_state="found",
        forward_modules=["model (Net)"],
        optimizers=[{"name": "AdamW", "label": "opt (AdamW)", "foreach": None, "fused": None, "param_groups": 12, "tensors": 148}],
    )
    s.update(facts)
    return s


def test_the_split_is_the_median_of_each_part_and_its_share_of_the_step() -> None:
    cols = columns(40, 2.0, 4.0, 8.0, 1.0, 5.0, sampled_every=4)
    s = summary_of(cols)
    assert s["parts_steps"] == 10
    assert (s["forward_ms"], s["backward_ms"], s["optimizer_ms"], s["rest_ms"]) == (4.0, 8.0, 1.0, 5.0)
    assert s["forward_share"] == pytest.approx(0.2) and s["rest_share"] == pytest.approx(0.25)
    text = parts_sentence(s)
    assert text is not None and text.startswith("forward 4.0 ms (20.0 %), backward 8.0 ms")
    assert "median of 10 sampled steps; forward: model (Net)" in text


def test_the_rest_gets_its_own_line_warn_from_10_and_critical_from_20_percent() -> None:
    warn = summary_of(columns(40, 0.0, 5.0, 10.0, 1.0, 2.0))  # 11 %
    crit = summary_of(columns(40, 0.0, 5.0, 10.0, 1.0, 6.0))  # 27 %
    calm = summary_of(columns(40, 0.0, 5.0, 10.0, 1.0, 1.0))  # 6 %
    assert rest_verdict(warn, None)[0] == "warn"  # type: ignore[index]
    severity, text = rest_verdict(crit, None)  # type: ignore[misc]
    assert severity == "critical" and "usually logging every step" in text and "27.3 %" in text
    assert rest_verdict(calm, None) is None


def test_with_line_costs_the_rest_names_its_line_and_not_the_parts_lines() -> None:
    cell = [
        "%%traceml",
        "for x, y in loader:",
        "    opt.zero_grad()",
        "    loss = crit(model(x), y)",
        "    loss.backward()",
        "    opt.step()",
        "    history.append(loss.item()); print(f'{loss.item():.3f}')",
    ]
    costs = {
        "statements": [
            {"line": 3, "end_line": 3, "text": "opt.zero_grad()", "ms_per_step": 0.1},
            {"line": 4, "end_line": 4, "text": "loss = crit(model(x), y)", "ms_per_step": 6.0},
            {"line": 5, "end_line": 5, "text": "loss.backward()", "ms_per_step": 9.0},
            {"line": 6, "end_line": 6, "text": "opt.step()", "ms_per_step": 1.0},
            {"line": 7, "end_line": 7, "text": cell[6].strip(), "ms_per_step": 5.5},
        ]
    }
    assert part_lines(costs["statements"], cell, ["model (Net)"], ["opt (AdamW)"]) == {4, 5, 6}
    s = summary_of(columns(40, 0.0, 5.0, 9.0, 1.0, 6.0))
    named = rest_line(s, costs, cell)
    assert named == {"line": 7, "text": cell[6].strip(), "ms_per_step": 5.5}
    lines = also_lines(s, costs, cell)
    assert lines[0][0] == "critical" and "line 7" in lines[0][1] and "takes 5.5 ms a step" in lines[0][1]


def test_an_optimizer_heavy_step_gets_fused_or_foreach_and_fewer_groups() -> None:
    s = summary_of(columns(40, 0.0, 3.0, 6.0, 8.0, 0.5))
    text = " ".join(t for _, t in also_lines(s))
    assert "The optimizer takes 45.7 % of the compute" in text
    assert "AdamW(..., fused=True)" in text and "foreach=True" in text
    assert "fewer parameter groups (12 now" in text and "148 tensors" in text
    fused = summary_of(columns(40, 0.0, 3.0, 6.0, 8.0, 0.5), optimizers=[{"name": "AdamW", "fused": True, "param_groups": 1}])
    text = " ".join(t for _, t in also_lines(fused))
    assert "fused=True" not in text and "step less often" in text


def test_a_backward_far_above_twice_the_forward_gets_its_usual_causes() -> None:
    heavy = summary_of(columns(40, 0.0, 2.0, 9.0, 0.5, 0.5))
    usual = summary_of(columns(40, 0.0, 4.0, 8.0, 0.5, 0.5))
    assert any("Backward takes 4.5x the forward" in t and "checkpointing" in t for _, t in also_lines(heavy))
    assert not any("Backward takes" in t for _, t in also_lines(usual))
    waits = summary_of(columns(40, 0.0, 2.0, 9.0, 0.5, 0.5), straggler={"rank": 1, "cause": "input", "score": 0.8})
    assert any("it holds the all-reduce's wait for rank 1" in t for _, t in also_lines(waits))


def test_a_run_whose_steps_slow_down_has_a_trend_with_what_moved() -> None:
    rng = np.random.default_rng(0)
    n = 90
    fwd = np.linspace(4.0, 8.0, n) + rng.normal(0, 0.3, n)  # the forward doubles
    cols = columns(n, 1.0 + rng.normal(0, 0.05, n), fwd, 6.0 + rng.normal(0, 0.3, n), 1.0, 1.0, sampled_every=3)
    found = trend(cols, np.ones(n, dtype=bool), "cpu")
    assert found is not None and found["direction"] == "slower"
    assert found["change"] == pytest.approx(0.25, abs=0.08)
    assert [m["what"] for m in found["moved"]] == ["forward"]
    text = trend_sentence(found)
    assert text is not None and text.startswith("Steps got 2") and "% slower over the run" in text
    assert "forward +" in text and "noise ±" in text


def test_a_flat_noisy_run_has_no_trend() -> None:
    rng = np.random.default_rng(1)
    n = 120
    cols = columns(n, rng.uniform(0, 3, n), rng.uniform(2, 8, n), rng.uniform(4, 10, n), 1.0, rng.uniform(0, 2, n))
    found = trend(cols, np.ones(n, dtype=bool), "cpu")
    assert found is not None and found["direction"] is None and trend_sentence(found) is None
    assert found["noise"] > 0.0


def test_a_change_past_the_noise_but_under_ten_percent_is_no_trend_and_few_steps_none() -> None:
    n = 300
    cols = columns(n, 0.0, np.linspace(10.0, 10.6, n), 1.0, 1.0, 1.0)  # +5 %, noiseless
    assert trend(cols, np.ones(n, dtype=bool), "cpu")["direction"] is None  # type: ignore[index]
    short = columns(12, 0.0, 1.0, 1.0, 1.0, 1.0)
    assert trend(short, np.ones(12, dtype=bool), "cpu") is None


def test_each_epochs_start_up_wait_is_counted_apart_with_its_share_of_the_run() -> None:
    n, per_pass = 50, 10
    wait = np.full(n, 0.5)
    starts = list(range(0, n, per_pass))
    wait[starts] = 400.0  # workers restart: 0.4 s at each pass's first batch
    cols = columns(n, wait, 5.0, 10.0, 1.0, 1.0)
    loader = {"num_workers": 2, "persistent_workers": False}
    total = float(cols["step_ms"].sum())
    found = epoch_startup(cols, starts, total, loader)
    assert found is not None and found["reported"] and found["restarts"] == 4
    assert found["wait_ms"] == pytest.approx(399.5) and found["share"] == pytest.approx(4 * 399.5 / total)
    text = startup_sentence(found)
    assert text is not None and text.startswith("Each epoch starts with a 0.4 s wait (workers restart,")
    assert "persistent_workers=True keeps the 2 workers alive" in text
    kept = epoch_startup(cols, starts, total, {"num_workers": 2, "persistent_workers": True})
    assert kept is not None and "sampler" in kept["cause"]


def test_a_small_first_batch_wait_or_a_single_pass_is_not_reported() -> None:
    n, per_pass = 50, 10
    wait = np.full(n, 0.5)
    starts = list(range(0, n, per_pass))
    wait[starts] = 2.0  # persistent workers: one batch's load at each epoch start
    cols = columns(n, wait, 5.0, 10.0, 1.0, 1.0)
    found = epoch_startup(cols, starts, float(cols["step_ms"].sum()), {"num_workers": 2, "persistent_workers": True})
    assert found is not None and not found["reported"] and startup_sentence(found) is None
    assert epoch_startup(cols, [0], 100.0, None) is None


def rank_row(r: int, compute: float, backward: float, forward: float, optimizer: float, rest: float) -> dict[str, Any]:
    return {
        "rank": r, "n_steps": 40, "n_analysed": 36, "warmup_steps": 4, "data_wait_ms": 0.5,
        "compute_ms": compute, "step_ms": compute + 0.5, "backward_ms": backward, "h2d_ms": None,
        "forward_ms": forward, "optimizer_ms": optimizer, "rest_ms": rest, "status": "finished",
    }


def test_a_compute_straggler_is_split_into_its_parts_and_the_rank_table_shows_them() -> None:
    from traceml_jupyter.analysis.rank_verdict import compare_ranks, straggler_sentence
    from traceml_jupyter.analysis.verdict_box import rank_table

    # Rank 1's forward is 10 ms slower: it arrives late at the all-reduce; the others wait there.
    ranks = [rank_row(0, 30.0, 20.0, 6.0, 2.0, 1.5), rank_row(1, 30.0, 9.0, 16.5, 2.2, 1.8)]
    found = compare_ranks(ranks)
    assert found is not None and found["rank"] == 1 and found["cause"] == "compute"
    assert found["part_excess_ms"]["forward"] == pytest.approx(10.5)
    text = straggler_sentence(found)
    assert "its step takes 11.0 ms more outside backward (forward +10.5 ms, the rest +0.3 ms, optimizer +0.2 ms)" in text
    table = rank_table(ranks, {"rank": 1}).splitlines()
    assert table[1].split() == ["rank", "steps", "data", "wait", "compute", "forward", "backward", "optimizer", "step", "time", "status"]
    assert table[3].split()[:8] == ["*", "1", "40", "0.5ms", "30.0ms", "16.5ms", "9.0ms", "2.2ms"]


def test_a_gpu_that_throttles_shows_in_what_moved() -> None:
    n = 90
    slow = np.linspace(0.0, 1.0, n)
    cols = columns(n, 0.5, 4.0 + 3.0 * slow, 8.0 + 6.0 * slow, 1.0, 1.0)
    cols["gpu_clock_mhz"] = 1980.0 - 600.0 * slow  # the SM clock falls as the GPU heats up
    cols["gpu_temp_c"] = 60.0 + 25.0 * slow
    found = trend(cols, np.ones(n, dtype=bool), "cpu")
    assert found is not None and found["direction"] == "slower"
    text = trend_sentence(found)
    assert text is not None and "GPU clock 1882 -> 1478 MHz" in text and "backward +4.0 ms" in text


def test_the_share_of_later_slower_pairs_is_counted_without_the_table_of_pairs() -> None:
    """later_share (the trend's test that the last third is slower than the first) gives what
    the n x n table of pairs gives, ties half, for any lengths."""
    from traceml_jupyter.analysis.step_parts import later_share

    rng = np.random.default_rng(7)
    for _ in range(100):
        first = rng.integers(0, 12, rng.integers(1, 40)).astype(float)
        last = rng.integers(0, 12, rng.integers(1, 40)).astype(float)
        table = (last[:, None] > first[None, :]).mean() + 0.5 * (last[:, None] == first[None, :]).mean()
        assert later_share(first, last) == pytest.approx(float(table), abs=1e-12)
    assert later_share(np.array([1.0, 2.0]), np.array([3.0, 4.0])) == 1.0
