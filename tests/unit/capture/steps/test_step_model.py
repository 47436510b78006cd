"""The step model on synthetic event sequences: what a step is, where data wait goes, phases."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from traceml_jupyter.capture.steps.recorder import Recorder
from traceml_jupyter.capture.steps.step_model import (
    BACKWARD,
    ITERATION,
    OPTIMIZER,
    Pass,
    Source,
    StepModel,
)


@dataclass
class Story:
    """Drives a StepModel on a fake clock (ms): fetch(), work(), backward(), step(), iterations."""

    model: StepModel = field(default_factory=lambda: StepModel(Recorder()))
    t: int = 0

    def __post_init__(self) -> None:
        self.model.recorder.origin_ns = 0

    def work(self, ms: float) -> None:
        self.t += int(ms * 1e6)

    def source(self, name: str, kind: str = "dataloader") -> Source:
        return self.model.source(name, kind, name)

    def fetch(self, p: Pass | Source, ms: float, batch: bool = True, inner: Pass | None = None, inner_ms: float = 0.0) -> None:
        m = self.model
        t0 = self.t
        m.fetch_begin()
        if inner is not None:
            self.fetch(inner, inner_ms)
        self.work(ms)
        if isinstance(p, Pass):
            m.fetch_end(t0, self.t, None, p, batch)
        else:
            m.fetch_end(t0, self.t, p, None, batch)

    def event(self, level: int, opt: object = None) -> None:
        self.model.training_event(level, self.t, opt)

    def columns(self) -> dict[str, np.ndarray]:
        return self.model.recorder.columns()


OPT, OPT2 = object(), object()


def test_a_plain_training_loop_one_optimizer_step_per_batch() -> None:
    s = Story()
    loader = s.source("train")
    p = Pass(loader)
    for _ in range(5):
        s.fetch(p, 2)
        s.model.in_iteration = True
        s.work(7)
        s.event(BACKWARD)
        s.work(1)
        s.event(OPTIMIZER, OPT)
        s.work(1)  # logging after opt.step() belongs to the same step
        s.model.iteration_end(s.t)
    cols = s.columns()
    assert len(cols["step"]) == 5 and s.model.level == OPTIMIZER
    assert np.allclose(cols["data_wait_ms"], 2.0) and np.allclose(cols["step_ms"], 11.0)
    assert loader.batches == 5 and loader.wait_ns == 5 * 2_000_000


def test_gradient_accumulation_four_batches_make_one_step() -> None:
    s = Story()
    p = Pass(s.source("train"))
    for _step in range(3):
        for _ in range(4):
            s.fetch(p, 3)
            s.work(5)
            s.event(BACKWARD)  # no loop: each backward would end a step until the optimizer shows
        s.event(OPTIMIZER, OPT)
    cols = s.columns()
    assert len(cols["step"]) == 3
    assert np.allclose(cols["data_wait_ms"], 12.0) and np.allclose(cols["step_ms"], 32.0)


def test_a_second_optimizer_in_the_same_step_does_not_end_it() -> None:
    s = Story()
    p = Pass(s.source("train"))
    for _ in range(4):
        s.fetch(p, 1)
        s.work(3)
        s.event(BACKWARD)
        s.event(OPTIMIZER, OPT)  # the discriminator
        s.work(3)
        s.event(BACKWARD)
        s.event(OPTIMIZER, OPT2)  # the generator
    cols = s.columns()
    assert len(cols["step"]) == 4  # one per step of the first optimizer seen
    # The first step starts with the first fetch; then each runs D's end to D's end.
    assert np.allclose(cols["step_ms"], [4.0, 7.0, 7.0, 7.0])


def test_a_validation_pass_between_steps_is_a_phase_kept_out() -> None:
    s = Story()
    train, val = s.source("train_loader"), s.source("val_loader")
    p = Pass(train)
    for i in range(6):
        s.fetch(p, 1)
        s.work(4)
        s.event(OPTIMIZER, OPT)
        if i == 2:
            v = Pass(val)
            for _ in range(10):
                s.fetch(v, 5)
                s.work(1)
            s.fetch(v, 0.5, batch=False)  # StopIteration
            s.model.pass_ended(v)
    cols = s.columns()
    assert len(cols["step"]) == 6 and np.allclose(cols["step_ms"], 5.0)
    assert np.allclose(cols["data_wait_ms"], 1.0)
    assert val.phase_passes == 1 and val.phase_batches == 10 and val.batches == 0
    assert val.phase_span_ns == pytest.approx(60.5e6)
    assert train.batches == 6 and train.phase_passes == 0


def test_an_abandoned_validation_pass_is_kept_out_when_training_resumes() -> None:
    s = Story()
    train, val = s.source("train"), s.source("val")
    p = Pass(train)
    s.fetch(p, 1)
    s.event(OPTIMIZER, OPT)
    v = Pass(val)
    for _ in range(3):  # `break` after 3 batches: no StopIteration
        s.fetch(v, 10)
    s.fetch(p, 1)
    s.work(2)
    s.event(OPTIMIZER, OPT)
    cols = s.columns()
    assert np.allclose(cols["step_ms"], [1.0, 3.0]) and np.allclose(cols["data_wait_ms"], 1.0)
    assert val.phase_batches == 3


def test_zip_of_two_loaders_both_feed_the_step_and_the_slow_one_waits_most() -> None:
    s = Story()
    slow, fast, loop = s.source("slow"), s.source("fast"), s.source("loop", "loop")
    ps, pf, pl = Pass(slow), Pass(fast), Pass(loop)
    for _ in range(4):
        m = s.model
        t0 = s.t
        m.fetch_begin()  # the loop's next() on zip(...)
        s.fetch(ps, 9)
        s.fetch(pf, 1)
        m.fetch_end(t0, s.t, None, pl, True)
        m.in_iteration = True
        s.work(5)
        s.event(OPTIMIZER, OPT)
        m.iteration_end(s.t)
    cols = s.columns()
    assert np.allclose(cols["data_wait_ms"], 10.0)  # counted once, not 9 + 1 + 10
    assert slow.wait_ns > fast.wait_ns and loop.wait_ns == 0
    assert slow.phase_passes == fast.phase_passes == 0


def test_iterations_are_steps_without_training_events() -> None:
    s = Story()
    p = Pass(s.source("loader"))
    for _ in range(3):
        s.fetch(p, 2)
        s.model.in_iteration = True
        s.work(3)
        s.model.iteration_end(s.t)
    assert s.model.level == ITERATION and len(s.columns()["step"]) == 3


def test_two_steps_in_one_iteration_end_where_they_happen() -> None:
    s = Story()
    p = Pass(s.source("loader"))
    s.model.in_iteration = True  # an epoch loop marked as the loop: many steps an iteration
    for _ in range(4):
        s.fetch(p, 1)
        s.work(2)
        s.event(OPTIMIZER, OPT)
    cols = s.columns()
    assert len(cols["step"]) == 4 and np.allclose(cols["step_ms"], 3.0)
    assert np.allclose(cols["data_wait_ms"], 1.0)


def test_without_loop_or_training_each_dataloader_fetch_starts_a_step() -> None:
    s = Story()
    src = s.source("loader")
    p = Pass(src)
    for _ in range(4):
        s.model.fetch_started(src, s.t)
        s.fetch(p, 2)
        s.work(6)
    cols = s.columns()
    assert len(cols["step"]) == 3 and np.allclose(cols["step_ms"], 8.0)
    assert np.allclose(cols["data_wait_ms"], 2.0)


def test_the_views_own_time_is_kept_out_of_the_step() -> None:
    s = Story()
    p = Pass(s.source("loader"))
    s.fetch(p, 1)
    s.event(OPTIMIZER, OPT)
    s.work(5)  # the live view refreshes
    s.model.exclude_time(5_000_000)
    s.fetch(p, 1)
    s.work(2)
    s.event(OPTIMIZER, OPT)
    assert np.allclose(s.columns()["step_ms"], [1.0, 3.0])
