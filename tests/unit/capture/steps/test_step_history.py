"""StepHistory, the one "halve when full" rule: judged against the steps each test keeps itself
in a plain list. A long run keeps a uniform sample of its steps in at most `cap` rows."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from traceml_jupyter.capture.steps.step_history import StepHistory


def smallest_stride(steps: list[int], cap: int) -> int:
    """The smallest power of two whose multiples among `steps` fit in `cap` rows."""
    stride = 1
    while sum(1 for s in steps if s % stride == 0) > cap:
        stride *= 2
    return stride


@pytest.mark.parametrize("n", [1, 99, 100, 101, 1000, 4097])
def test_consecutive_steps_keep_the_multiples_of_the_smallest_stride_that_fits(n: int) -> None:
    history = StepHistory(100, "d")
    for step in range(n):
        history.add(step, 2.0 * step)
        assert len(history) <= 100
    added = list(range(n))
    stride = smallest_stride(added, 100)
    assert history.stride == stride
    assert history.steps_from().tolist() == [s for s in added if s % stride == 0]
    assert history.column(0).tolist() == [2.0 * s for s in added if s % stride == 0]  # values follow steps


def test_sparse_steps_keep_a_uniform_sample_of_what_was_added() -> None:
    rng = random.Random(7)
    history = StepHistory(64, "dq")
    added: list[int] = []
    step = 0
    for _ in range(3000):
        step += rng.randint(1, 5)  # a tally that saw some steps only
        history.add(step, float(step), step * 3)
        added.append(step)
        assert len(history) <= 64
    stride = history.stride
    kept = [s for s in added if s % stride == 0]
    assert history.steps_from().tolist() == kept
    assert history.column(1).tolist() == [3 * s for s in kept]
    assert stride == smallest_stride(added, 64)  # halved no more often than the cap asked
    assert history.steps.typecode == "q" and history.columns[1].typecode == "q"


def test_rows_added_in_batches_are_the_rows_added_one_by_one() -> None:
    one_by_one, batched = StepHistory(50, "d"), StepHistory(50, "d")
    for start in range(0, 2000, 137):
        steps = np.arange(start, min(start + 137, 2000))
        for s in steps:
            one_by_one.add(int(s), float(s))
        batched.extend(steps, steps.astype(float))
    assert batched.stride == one_by_one.stride
    assert batched.steps_from().tolist() == one_by_one.steps_from().tolist()
    assert batched.column(0).tolist() == one_by_one.column(0).tolist()


def test_numbered_samples_halve_when_full_and_keep_every_new_one() -> None:
    history = StepHistory(10, "d", every_step=True)
    kept: list[float] = []
    for i in range(250):
        if len(kept) == 10:
            kept = kept[::2]  # every other one goes, the newest always stays
        kept.append(float(i))
        history.append(float(i))
    assert history.column(0).tolist() == kept
    assert history.stride == 2 ** round(math.log2(history.stride)) > 1
    assert history.steps_from().tolist() == [history.stride * i for i in range(len(kept))]


def test_memory_stays_within_the_cap_and_starts_empty() -> None:
    history = StepHistory(1000, "qqdd")
    assert history.nbytes() == 0
    most = 0
    for step in range(20_000):
        history.add(step, step, step, 0.5, 0.5)
        most = max(most, history.nbytes())
    assert most <= 1000 * 5 * 8  # the step and four 8-byte values a row, at most `cap` rows


def test_halving_keeps_the_same_arrays_and_a_later_column_starts_with_its_fill() -> None:
    history = StepHistory(4, "d")
    steps, values = history.steps, history.columns[0]
    for step in range(4):
        history.add(step, 1.0)
    gpu = history.add_column("d", float("nan"))
    history.add(4, 1.0, 7.0)  # full: stride 2, steps 0, 2, 4
    assert history.steps is steps and history.columns[0] is values
    assert steps.tolist() == [0, 2, 4] and np.isnan(history.column(gpu)[:2]).all() and history.column(gpu)[2] == 7.0
    assert history.index(2) == 1 and history.index(3) is None and history.index(6) is None


def test_merged_steps_are_forgotten_and_come_again() -> None:
    history = StepHistory(100, "d")
    for step in range(10):
        history.add(step, 1.0)
    history.drop_from(6)
    assert history.steps_from().tolist() == list(range(6))
    assert history.add(6, 4.0) and history.last() == [4.0]
    numbered = StepHistory(100, "d", every_step=True)
    for i in range(5):
        numbered.append(float(i))
    numbered.drop_from(3)
    assert numbered.column(0).tolist() == [0.0, 1.0, 2.0]


def test_a_step_the_stride_leaves_out_is_not_kept() -> None:
    history = StepHistory(2, "d")
    assert history.add(0, 0.0) and history.add(1, 1.0)
    assert history.add(2, 2.0) and history.stride == 2  # full: steps 0 and 2
    assert not history.add(3, 3.0) and history.steps_from().tolist() == [0, 2]
    with pytest.raises(ValueError):
        StepHistory(1)
