"""The per-step path stamps and replays (capture/steps/stamps.py): the step model fed the stamps later,
in bulk, says exactly what it says when fed each event as it happens; and step-model bugs. A
traced cell stamped or reported: tests/integration/shell/test_stamped_steps_of_a_cell.py."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import traceml_jupyter
from traceml_jupyter import ranks
from traceml_jupyter.capture.steps.recorder import Recorder
from traceml_jupyter.capture.steps.stamps import (
    BACKWARD_DONE,
    CALL_END,
    CALL_START,
    FETCH_END,
    FETCH_START,
    FIRST_STEP,
    OTHER_STEP,
    Stamps,
)
from traceml_jupyter.capture.steps.step_model import (
    BACKWARD,
    FETCH,
    OPTIMIZER,
    Pass,
    Source,
    StepModel,
)

# -- the replay against the model fed as it happens -------------------------------------------


@dataclass
class Twin:
    """One story told twice: `now` gets each event when it happens, `later` gets the stamps the
    hooks append and replays them at random points (as the capture does: at every point where
    something is reported at once, everything stamped before is replayed first)."""

    seed: int
    sample_every: int = 0  # the sampler: on_sample every that many steps (0: never)
    flush_p: float = 0.05  # chance of a replay after each stamp
    now: StepModel = field(default_factory=lambda: StepModel(Recorder()))
    later: StepModel = field(default_factory=lambda: StepModel(Recorder()))
    stamps: Stamps = field(default_factory=Stamps)
    t: int = 1_000_000
    samples: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: {"now": [], "later": []})

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        for name, model in (("now", self.now), ("later", self.later)):
            model.recorder.origin_ns = 0
            if self.sample_every:
                model.sample_in = self.sample_every
                model.on_sample = self._sampler(name, model)

    def _sampler(self, name: str, model: StepModel) -> Any:
        def sampled(start: int, end: int) -> None:
            self.samples[name].append((start, end))
            model.sample_in = self.sample_every

        return sampled

    def tick(self, lo: int = 1, hi: int = 400) -> int:
        self.t += self.rng.randint(lo, hi)
        return self.t

    def sources(self, key: str, kind: str = "dataloader") -> tuple[Source, Source]:
        return self.now.source(key, kind, key), self.later.source(key, kind, key)

    def maybe_flush(self) -> None:
        if self.rng.random() < self.flush_p:
            self.flush()

    def flush(self) -> None:
        self.stamps.replay(self.later)
        if self.rng.random() < 0.3:  # the views' own time, kept out of the open step
            ns = self.rng.randint(1, 50)
            self.now.exclude_time(ns)
            self.later.exclude_time(ns)

    def event(self, kind: int, t: int, ref: Any) -> None:
        self.stamps.stamp(kind, t, ref)
        self.maybe_flush()

    def dataloader_fetch(self, source: Source, pass_now: Pass, stamped: Pass | None) -> tuple[int, int]:
        """A DataLoader's fetch: reported to `now` when it happens, and stamped for `later` as
        `stamped`'s (None: the caller tells `later` itself). Returns its start and end."""
        now = self.now
        a = self.tick()
        if now.level <= FETCH and not now._stack:
            now.fetch_started(source, a)
        now.fetch_begin()
        b = self.tick()
        now.fetch_end(a, b, None, pass_now, True)
        if stamped is not None:
            self.event(FETCH_START, a, stamped)
            self.event(FETCH_END, b, stamped)
        return a, b


def tell(
    twin: Twin,
    iterations: int,
    nested: bool,
    train: bool,
    second_optimizer: bool,
    calls: bool,
    validation: bool,
    looped: bool = True,
) -> None:
    """`iterations` of a training loop, the located loop's (`looped`) or a library's (its
    DataLoader's fetches and training events only)."""
    now, later = twin.now, twin.later
    loop_now, loop_later = twin.sources("loop", "loop")
    writer_now, writer_later = Pass(loop_now), Pass(loop_later)
    dl_now, dl_later = twin.sources("train")
    dpass_now, dpass_later = Pass(dl_now), Pass(dl_later)
    val_now, val_later = twin.sources("val")
    call_now, call_later = twin.sources("call", "call")
    call_now.batch_kind = call_later.batch_kind = "tuple"
    opt, opt2 = object(), object()
    twin.stamps.writer = writer_later if looped else None
    rng = twin.rng
    for i in range(iterations):
        stamped = i > 0
        if not looped:  # a library's loop: its DataLoader's fetch only
            twin.dataloader_fetch(dl_now, dpass_now, dpass_later)
        # the loop's fetch (the first one reported at once to both, as the capture does)
        s = twin.tick()
        if looped and i:
            now.iteration_end(s)
        if looped:
            now.fetch_begin()
        if not looped:
            pass
        elif stamped:
            twin.stamps.loop.append(s)
            twin.maybe_flush()
        else:
            later.fetch_begin()
        if looped and nested:  # a DataLoader fetch inside the loop's own next()
            a, b = twin.dataloader_fetch(dl_now, dpass_now, dpass_later if stamped else None)
            if not stamped:
                later.fetch_begin()
                later.fetch_end(a, b, None, dpass_later, True)
        e = twin.tick()
        if not looped:
            pass
        elif stamped:
            now.fetch_end(s, e, None, writer_now, True)
            now.in_iteration = True
            twin.stamps.loop.append(e)
            twin.maybe_flush()
        else:
            for model, writer in ((now, writer_now), (later, writer_later)):
                model.fetch_end(s, e, None, writer, True)
                model.in_iteration = True
        # the body
        if calls and rng.random() < 0.5:  # `next(it)` in the body
            a, b = twin.tick(), twin.tick()
            now.fetch_begin()
            now.fetch_end(a, b, call_now, None, True)
            twin.event(CALL_START, a, call_later)
            twin.event(CALL_END, b, call_later)
        if train and rng.random() < 0.9:
            for _ in range(rng.choice((1, 1, 1, 2))):  # sometimes two backward()s
                t = twin.tick()
                now.training_event(BACKWARD, t)
                twin.event(BACKWARD_DONE, t, None)
            if rng.random() < 0.8:
                for which in ((opt, opt2) if second_optimizer else (opt,)):
                    t = twin.tick()
                    first = later._is_first_optimizer(which)
                    now.training_event(OPTIMIZER, t, which)
                    twin.event(FIRST_STEP if first else OTHER_STEP, t, None)
        if validation and i % 7 == 3:  # a validation pass: its end is reported at once
            vnow, vlater = Pass(val_now), Pass(val_later)
            for _ in range(rng.randint(1, 4)):
                twin.dataloader_fetch(val_now, vnow, vlater)
            twin.flush()
            a, b = twin.tick(), twin.tick()
            for model, p in ((now, vnow), (later, vlater)):
                model.fetch_begin()
                model.fetch_end(a, b, None, p, False)
                model.pass_ended(p)
        twin.tick(1, 2000)
    twin.flush()
    now.close()
    later.close()


def same(twin: Twin) -> None:
    a, b = twin.now.recorder.columns(), twin.later.recorder.columns()
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key], equal_nan=True), key
    assert twin.now.recorder.totals() == twin.later.recorder.totals()
    for key, src in twin.now.sources.items():
        other = twin.later.sources[key]
        for name in ("wait_ns", "batches", "passes", "phase_wait_ns", "phase_batches", "phase_span_ns", "phase_passes"):
            assert getattr(src, name) == getattr(other, name), (key, name)
    for name in ("level", "start", "wait", "excluded", "fetch_serial", "wait_total", "iterations_are_steps", "sample_in"):
        assert getattr(twin.now, name) == getattr(twin.later, name), name
    assert twin.samples["now"] == twin.samples["later"]


@pytest.mark.parametrize("seed", range(32))
def test_the_replayed_stamps_give_the_steps_the_model_gives_online(seed: int) -> None:
    rng = random.Random(1000 + seed)
    twin = Twin(seed, sample_every=rng.choice((0, 0, 5, 40, 300)), flush_p=rng.choice((0.002, 0.05, 0.3)))
    tell(
        twin,
        iterations=rng.choice((3, 40, 600)),
        nested=rng.random() < 0.5,
        train=rng.random() < 0.6,
        second_optimizer=rng.random() < 0.3,
        calls=rng.random() < 0.3,
        validation=rng.random() < 0.3,
        looped=rng.random() < 0.75,
    )
    same(twin)


def test_a_plain_loop_is_replayed_in_bulk_and_still_the_same() -> None:
    twin = Twin(7, sample_every=500, flush_p=0.002)
    replayed = []
    real = twin.later.iterations

    def iterations(starts: np.ndarray, ends: np.ndarray, pass_: Pass) -> bool:
        done = real(starts, ends, pass_)
        replayed.append((len(starts), done))
        return done

    twin.later.iterations = iterations  # type: ignore[method-assign]
    tell(twin, iterations=3000, nested=False, train=False, second_optimizer=False, calls=False, validation=False)
    same(twin)
    assert sum(n for n, done in replayed if done) > 2500  # nearly every iteration went in bulk
    assert len(twin.samples["now"]) == (3000 - 1) // 500  # the last iteration stays open


def test_a_stamped_run_records_every_step_of_a_long_fast_loop() -> None:
    """Past the sampled first steps the hooks stamp; the steps, their order and the sampled
    parts are all there, and the loop's data wait is each fetch's."""
    model = torch.nn.Linear(4, 1)
    x = torch.ones(2, 4)
    with traceml_jupyter.trace(show=False) as run:
        for _ in run.loop(range(20_000)):
            model(x)
    cols = run.steps
    assert run.n_steps == 20_000 and np.array_equal(cols["step"], np.arange(20_000))
    assert np.all(np.diff(cols["time_s"]) > 0)
    assert np.all(cols["data_wait_ms"] <= cols["step_ms"])
    assert run.summary["parts_sampled_steps"] > 64


@pytest.mark.slow  # a live chart over a loop of about a second
def test_the_live_view_sees_steps_while_the_hooks_stamp(ip: Any) -> None:
    """The run's observers tick while the steps are stamped (at most 4 times a second), and
    each tick sees every step stamped before it."""
    seen: list[tuple[int, int | None]] = []
    with traceml_jupyter.trace(show=False) as run:
        run.observe(lambda r: seen.append((r.n_steps, r.current_step())))
        began = time.perf_counter()
        for _ in run.loop(range(400)):
            t = time.perf_counter()
            while time.perf_counter() - t < 0.004:
                pass
        elapsed = time.perf_counter() - began
    during = [(n, current) for n, current in seen if current is not None]
    assert 3 <= len(seen) <= 4 * elapsed + 3
    assert all(current == n for n, current in during)  # replayed before the observer reads
    assert [n for n, _ in seen] == sorted(n for n, _ in seen) and during[-1][0] > 200


def test_a_step_that_raised_inside_another_steps_hooks_is_forgotten() -> None:
    """A step whose post hooks never ran (it raised, and the user caught it) does not make the
    next steps look nested."""
    model = torch.nn.Linear(4, 1)

    class Flaky(torch.optim.SGD):
        fail = True

        def step(self, closure: Any = None) -> Any:
            if Flaky.fail:
                Flaky.fail = False
                raise RuntimeError("once")
            return super().step(closure)

    torch.optim.SGD(model.parameters(), lr=0.1)  # the base class made: its step is wrapped too
    opt = Flaky(model.parameters(), lr=0.1)
    with traceml_jupyter.trace(show=False) as run:
        for _ in run.loop(range(30)):
            model(torch.ones(2, 4)).sum().backward()
            try:
                opt.step()
            except RuntimeError:
                pass
    assert run.result.steps.kind == "optimizer" and run.n_steps == 29  # the step that raised ended none


def test_a_dataloader_without_a_batch_in_trace_makes_no_step() -> None:
    from torch.utils.data import DataLoader

    with traceml_jupyter.trace(show=False) as run:
        assert list(DataLoader([], batch_size=2)) == []
    assert run.n_steps == 0 and run.result.steps.kind == "none"
    with traceml_jupyter.trace(show=False) as run:  # a DataLoader that gives batches still steps
        for _ in DataLoader(list(range(8)), batch_size=2):
            pass
    assert run.result.steps.kind == "fetch" and run.n_steps >= 4


@pytest.mark.parametrize(
    ("rank", "world", "expected"),
    [("1", "2", (1, 2)), (" 0 ", "4", (0, 4)), ("x", "2", (None, 2)), ("-1", "", (None, None)), (None, None, (None, None))],
)
def test_the_rank_is_read_from_the_environment_without_a_process_group(
    monkeypatch: pytest.MonkeyPatch, rank: str | None, world: str | None, expected: tuple[int | None, int | None]
) -> None:
    for name, value in (("RANK", rank), ("WORLD_SIZE", world)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert ranks.dist_rank() == expected
    assert ranks.distributed_env() == (expected[1] is not None and expected[1] > 1)
