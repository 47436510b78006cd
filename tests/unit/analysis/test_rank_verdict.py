"""The rank verdict on synthetic per-rank numbers and steps: the rank that arrives last at
backward's all-reduce step after step holds the others back, for the reason its numbers show;
balanced ranks get the usual verdict on their medians, even when their medians differ; what the
numbers alone do not say is said."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from traceml_jupyter.analysis.rank_evidence import paired_evidence
from traceml_jupyter.analysis.rank_verdict import (
    backward_median,
    compare_ranks,
    holds_back,
    rank_notes,
    straggler_sentence,
    with_ranks,
)
from traceml_jupyter.analysis.summary import summarize
from traceml_jupyter.analysis.verdict_box import rank_table


def rank(r: int, wait: float, compute: float, backward: float | None, step: float | None = None, n: int = 40, **more: Any) -> dict[str, Any]:
    step = wait + compute if step is None else step
    out = {
        "rank": r,
        "n_steps": n,
        "n_analysed": n - 4,
        "warmup_steps": 4,
        "data_wait_ms": wait,
        "compute_ms": compute,
        "step_ms": step,
        "backward_ms": backward,
        "h2d_ms": None,
        "data_wait_share": wait / step,
        "compute_share": compute / step,
        "straggler_share": 0.0,
        "status": "finished",
    }
    out.update(more)
    return out


def stepped(ranks: list[dict[str, Any]], jitter: float = 0.2, seed: int = 0) -> list[dict[str, Any]]:
    """`ranks` with per-step evidence: each rank's steps scatter (uniformly, +-jitter ms) about
    its medians, step by step, as a rank's stream would carry them."""
    rng = np.random.default_rng(seed)
    columns = {}
    for r in ranks:
        n = int(r["n_steps"])

        def around(value: float | None, n: int = n) -> np.ndarray:
            return np.full(n, np.nan) if value is None else value + rng.uniform(-jitter, jitter, n)

        columns[r["rank"]] = {
            "step": np.arange(n),
            "sync_ms": around(r["backward_ms"]),
            "data_wait_ms": around(r["data_wait_ms"]),
            "compute_ms": around(r["compute_ms"]),
            "step_ms": np.full(n, r["step_ms"]),
        }
    evidence = paired_evidence(columns, 4)
    return [{**r, "paired": evidence[r["rank"]]} for r in ranks]


def own_summary(wait: float, compute: float, n: int = 40) -> dict[str, Any]:
    """A rank's full summary (what the run shows), from steady synthetic steps."""
    steps = np.arange(n)
    waits, computes = np.full(n, wait), np.full(n, compute)
    cols = {
        "step": steps,
        "time_s": steps * (wait + compute) / 1e3,
        "data_wait_ms": waits,
        "compute_ms": computes,
        "step_ms": waits + computes,
        "data_wait_gpu_ms": np.full(n, np.nan),
        "compute_gpu_ms": np.full(n, np.nan),
        "step_gpu_ms": np.full(n, np.nan),
    }
    return summarize(cols, n)


def test_the_rank_that_waits_for_data_holds_the_others_back() -> None:
    # rank 1 waits 38 ms for data; ranks 0, 2, 3 then wait for it in backward (all-reduce).
    ranks = stepped([rank(0, 0.5, 46.0, 40.0), rank(1, 38.0, 8.5, 2.0), rank(2, 0.6, 46.0, 40.1), rank(3, 0.4, 46.1, 39.9)])
    found = compare_ranks(ranks)
    assert found is not None
    assert found["rank"] == 1 and found["cause"] == "input"
    assert found["waiting"] == [0, 2, 3]
    assert found["score"] == pytest.approx(38.0 / 46.5, rel=0.02)
    assert found["evidence"]["last_share"] == 1.0 and found["evidence"]["last_p"] < 1e-6
    assert straggler_sentence(found).startswith("ranks 0, 2, 3 wait for rank 1 in backward: it waits 37.")

    summary, verdict = with_ranks(own_summary(0.5, 46.0), ranks)
    assert verdict.label == "RANK STRAGGLER" and verdict.severity == "critical"
    straggler = summary["straggler"]
    assert {k: straggler[k] for k in ("rank", "cause")} == {"rank": 1, "cause": "input"}
    assert straggler["score"] == pytest.approx(found["score"])
    assert straggler["n_paired"] == 36 and straggler["last_share"] == 1.0 and straggler["last_p"] < 1e-6
    assert 37.5 < straggler["gap_low_ms"] <= straggler["gap_ms"] <= straggler["gap_high_ms"] < 38.5
    assert "Step by step, rank 1 was last in 36 of 36 steps (100 %; 25 % expected" in verdict.why
    assert summary["data_wait_ms"] == 38.0  # the headline is the straggler's own
    assert "Feed rank 1 faster" in verdict.next


def test_a_rank_that_computes_more_is_a_compute_straggler() -> None:
    # rank 0's forward is 20 ms slower: it waits least in backward, its data wait is the same.
    ranks = stepped([rank(0, 1.0, 50.0, 5.0), rank(1, 1.0, 50.0, 25.0)])
    found = compare_ranks(ranks)
    assert found is not None and found["rank"] == 0 and found["cause"] == "compute" and holds_back(found)
    assert "outside backward" in straggler_sentence(found)


def test_copies_explain_a_gap_only_when_measured_on_every_rank() -> None:
    ranks = stepped([rank(0, 1.0, 50.0, 5.0, h2d_ms=21.0), rank(1, 1.0, 50.0, 25.0, h2d_ms=1.0)])
    found = compare_ranks(ranks)
    assert found is not None and found["cause"] == "h2d"
    ranks[1]["h2d_ms"] = None
    assert compare_ranks(ranks)["cause"] == "compute"  # type: ignore[index]


def test_no_phase_explains_the_gap_cause_unknown() -> None:
    ranks = [rank(0, 1.0, 50.0, 25.0), rank(1, 1.0, 50.0, 5.0)]
    ranks[1]["compute_ms"] = 50.0  # same body, same wait: only the arrival differs
    ranks[0]["compute_ms"] = 70.0
    found = compare_ranks(stepped(ranks))
    assert found is not None and found["rank"] == 1 and found["cause"] == "unknown"


def test_balanced_ranks_get_the_usual_verdict_on_their_medians() -> None:
    ranks = stepped([rank(0, 30.0, 12.0, 5.0), rank(1, 31.0, 12.0, 5.3)])
    summary, verdict = with_ranks(own_summary(30.0, 12.0), ranks)
    assert summary["straggler"] is None
    assert verdict.label == "INPUT-BOUND"
    assert summary["data_wait_ms"] == pytest.approx(30.5)  # the median over the ranks


@pytest.mark.parametrize(("gap", "severity"), [(2.0, None), (6.0, "warn"), (12.0, "critical")])
def test_score_is_the_gap_as_a_share_of_the_step(gap: float, severity: str | None) -> None:
    ranks = stepped([rank(0, 0.0, 50.0, 10.0 + gap), rank(1, gap, 50.0 - gap, 10.0, step=50.0)])
    _, verdict = with_ranks(own_summary(0.0, 50.0), ranks)
    if severity is None:
        assert verdict.label != "RANK STRAGGLER"
    else:
        assert verdict.label == "RANK STRAGGLER" and verdict.severity == severity


def test_without_backward_the_step_body_stands_in() -> None:
    found = compare_ranks(stepped([rank(0, 0.0, 40.0, None), rank(1, 30.0, 10.0, None)]))
    assert found is not None and found["rank"] == 1 and found["cause"] == "input" and holds_back(found)
    assert found["phase"] == "the step"


def test_one_rank_or_too_few_steps_is_no_comparison() -> None:
    assert compare_ranks([rank(0, 1.0, 10.0, 2.0)]) is None
    assert compare_ranks([rank(0, 1.0, 10.0, 2.0), rank(1, 9.0, 2.0, 1.0, n=5, n_analysed=1)]) is None


def test_uneven_step_counts_failures_and_loaders_are_said() -> None:
    uneven = [rank(0, 1.0, 10.0, 2.0, n=40), rank(1, 1.0, 10.0, 2.0, n=32)]
    assert any("different numbers of steps (rank 0 40, rank 1 32): uneven data" in n for n in rank_notes(uneven))

    failed = [
        rank(0, 1.0, 10.0, 2.0, n=7, status="stopped"),
        rank(1, 1.0, 10.0, 2.0, n=6, status="failed", error="ValueError: boom"),
    ]
    notes = rank_notes(failed)
    assert "Rank 1 failed after 6 steps: ValueError: boom." in notes
    assert any(n.startswith("Rank 0 was stopped") for n in notes)
    assert not any("different numbers" in n for n in notes)  # a failure explains the counts

    loaders = [
        rank(0, 1.0, 10.0, 2.0, loader={"num_workers": 2, "batch_size": 8, "sampler": "DistributedSampler", "samples": 80}),
        rank(1, 1.0, 10.0, 2.0, loader={"num_workers": 0, "batch_size": 8, "sampler": "DistributedSampler", "samples": 80}),
    ]
    assert "The ranks' DataLoaders differ: num_workers 2 on rank 0, 0 on rank 1." in rank_notes(loaders)


def test_unsynchronised_ranks_with_different_step_times_are_said() -> None:
    notes = rank_notes([rank(0, 0.0, 10.0, 5.0), rank(1, 40.0, 10.0, 5.0)])
    assert any("do not synchronise each step" in n for n in notes)


def test_backward_median_reads_the_analysed_steps_only() -> None:
    steps = np.arange(10)
    values = np.array([100.0, 100.0, 1.0, 2.0, 3.0, np.nan, 2.0, 2.0, 2.0, 2.0])
    assert backward_median(steps, values, 2) == 2.0
    assert backward_median(steps, np.full(10, np.nan), 2) is None


def test_text_table_marks_the_straggler() -> None:
    ranks = [rank(0, 0.5, 46.0, 40.0), rank(1, 38.0, 8.5, 2.0)]
    table = rank_table(ranks, {"rank": 1, "cause": "input", "score": 0.8}, ["A note."])
    lines = table.splitlines()
    assert lines[0].startswith("Ranks (median per step")
    assert lines[3].startswith("*") and "38.0ms" in lines[3]
    assert not lines[2].startswith("*")
    assert lines[-1] == "Ranks: A note."
