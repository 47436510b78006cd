"""The eager share read off a profile (capture/compiled/eager_share.py), from canned events as
torch's profiler gives them: the time inside compiled code and outside its graphs, plus the
backward of what ran there, over the whole steps inside the regions the sample saw whole. A
backend that marks no graph gives no figure; Kineto's start and stop lines never reach the
cell's stderr."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest

from traceml_jupyter.capture.compiled.eager_share import (
    BACKWARD_NODE,
    MIN_STEPS,
    EagerSampler,
    Event,
    cuda_untouched,
    graph_time,
    minus,
    share_of_steps,
    union,
)

REGION = "Torch-Compiled Region: 0/0"
RESUME = "Torch-Compiled Region: 1/0"


def step_events(t: float) -> list[Event]:
    """One step of a model with a graph break, from t (µs): forward 0-100 with Dynamo's bytecode
    2-6 before its graph 10-40 (0-10: the compiled code's preparation), an eager section 40-60
    (an op of sequence number t, whose backward node runs 150-170), the resume region 60-100
    with its bytecode 61-63 and a graph 65-100; the compiled backwards 110-140 and 175-190;
    optimizer and data after it. The step: 200 µs, of which 20 + 20 eager."""
    seq = int(t)
    return [
        Event(REGION, t, t + 100),
        Event("Pregraph bytecode", t + 2, t + 6),
        Event("CompiledFunction", t + 10, t + 40, sequence_nr=seq - 1),
        Event("aten::mm", t + 42, t + 58, sequence_nr=seq),
        Event(RESUME, t + 60, t + 100),
        Event("Pregraph bytecode", t + 61, t + 63),
        Event("CompiledFunction", t + 65, t + 100, sequence_nr=seq + 1),
        Event(BACKWARD_NODE + "CompiledFunctionBackward", t + 110, t + 140, sequence_nr=seq + 1),
        Event(BACKWARD_NODE + "MmBackward0", t + 150, t + 170, sequence_nr=seq),
        Event(BACKWARD_NODE + "CompiledFunctionBackward", t + 175, t + 190, sequence_nr=seq - 1),
    ]


def test_intervals_merge_and_subtract() -> None:
    assert union([(5, 6), (0, 2), (1, 3)]) == [(0, 3), (5, 6)]
    assert minus([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]


def test_eager_is_the_time_between_graphs_inside_compiled_code_and_its_backward() -> None:
    events = [e for k in range(4) for e in step_events(1000.0 + 200 * k)]
    read = graph_time(events, stop=2000.0)
    assert read.marked and read.span == (1000.0, 1700.0)
    # each step: 40-60 between the graphs (the region less its graphs and the pre-graph
    # bytecode), and the eager op's backward 150-170; nothing else of the step
    assert sum(b - a for a, b in read.eager) == pytest.approx(4 * 40.0)
    # the run's clock: µs to s; the steps: one every 200 µs from 1000
    cols = {"step": np.arange(10, 14), "time_s": 1e-6 * np.array([1000.0, 1200, 1400, 1600]), "step_ms": np.full(4, 0.2)}
    steps, eager_s, graphs_s, steps_s = share_of_steps(read, lambda us: us / 1e6, cols) or ([], 0, 0, 0)
    assert steps == [10, 12]  # the last step ends after the last whole region's end: not whole
    assert eager_s / steps_s == pytest.approx(40.0 / 200.0)
    assert graphs_s > 0


def test_a_region_the_stop_cut_and_a_backend_that_marks_no_graph() -> None:
    events = step_events(0.0) + [Event(REGION, 200.0, 260.0)]  # still open when the profiler stopped
    assert graph_time(events, stop=260.0).span == (0.0, 100.0)
    eager_backend = [Event(REGION, 0.0, 100.0), Event("aten::mm", 10.0, 90.0, sequence_nr=3)]
    assert not graph_time(eager_backend, stop=500.0).marked
    # a break before any graph (a print first): the time up to the resume region is eager
    print_first = [Event(REGION, 0.0, 100.0), Event(RESUME, 30.0, 100.0), Event("Pregraph bytecode", 31.0, 33.0),
                   Event("CompiledFunction", 35.0, 100.0)]  # fmt: skip
    assert graph_time(print_first, stop=500.0).eager == [(0.0, 30.0)]


class Recording:
    """What the sampler reads of a run at its ticks."""

    def __init__(self, source: str = "") -> None:
        self.cell_source, self.loop_cell_source, self.finished = source, "", False
        self.n = 0
        outer = self

        class Recorder:
            @property
            def n_steps(self) -> int:
                return outer.n

            def tail(self, k: int) -> dict[str, Any]:
                return {"step": np.arange(outer.n - k, outer.n)}

        self.recorder = Recorder()


def test_the_sampler_starts_once_steady_and_never_beside_a_profiler_of_the_cell() -> None:
    torch = pytest.importorskip("torch")
    compiles = [1]
    sampler = EagerSampler(lambda: True, lambda: compiles[0], lambda: False)
    run = Recording()
    for run.n in (2, MIN_STEPS + 1, MIN_STEPS + 2):  # too early; steady since the last tick: start
        sampler(run)
    assert sampler.running and torch.autograd.profiler._is_profiler_enabled
    run.n += 3
    sampler(run)  # fewer than WINDOW_STEPS later: on
    compiles[0] += 1  # a recompile inside the sample: discarded, tried again
    run.n += 10
    sampler(run)
    assert not sampler.running and not sampler.done and sampler.tries == 2
    assert not torch.autograd.profiler._is_profiler_enabled
    profiling_cell = EagerSampler(lambda: True, lambda: 1, lambda: False)
    run = Recording("with torch.profiler.profile() as prof:\n    train()")
    for run.n in (MIN_STEPS, MIN_STEPS + 1):
        profiling_cell(run)
    assert profiling_cell.done and not profiling_cell.running
    assert "profiler of its own" in (profiling_cell.read(0) or {}).get("note", "")


def test_kinetos_lines_never_reach_the_cells_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    sampler = EagerSampler(lambda: True, lambda: 1, lambda: False)
    run = Recording()
    for run.n in (MIN_STEPS, MIN_STEPS + 1):
        sampler(run)
    sampler.stop(run)
    sys.stderr.write("the cell's own line\n")
    os.write(2, b"")
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_st" not in err and "the cell's own line" in err


def test_on_a_cuda_torch_the_sampler_waits_for_the_cells_own_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler's library could initialise the CUDA driver: never before the cell did."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert cuda_untouched()
    sampler = EagerSampler(lambda: True, lambda: 1, lambda: False)
    run = Recording()
    for run.n in (MIN_STEPS, MIN_STEPS + 1):
        sampler(run)
    assert not sampler.running and "CUDA is not initialised" in (sampler.read(0) or {}).get("note", "")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not cuda_untouched()


def test_the_raw_events_are_the_profilers_own_events() -> None:
    """Kineto's raw events (read fast) and the profiler's public FunctionEvents (a torch without
    the raw ones) give the same events, the same lengths, the same sequence numbers."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    from traceml_jupyter.capture.compiled.eager_share import MARK, profiled_events

    with profile(activities=[ProfilerActivity.CPU]) as p:
        with record_function(MARK):
            pass
        a = torch.ones(3, requires_grad=True)
        (a * 2).sum().backward()

    class Public:  # the profile without its raw results
        def events(self) -> Any:
            return p.events()

    raw, public = profiled_events(p), profiled_events(Public())
    assert [e.name for e in raw] == [e.name for e in public] and any(e.name == MARK for e in raw)
    assert [e.sequence_nr for e in raw] == [e.sequence_nr for e in public]
    assert [round(e.end - e.start, 1) for e in raw] == pytest.approx([round(e.end - e.start, 1) for e in public], abs=0.2)
    backward = [e for e in raw if e.name.startswith(BACKWARD_NODE) and e.sequence_nr >= 0]
    forward = {(e.thread, e.sequence_nr) for e in raw if not e.name.startswith(BACKWARD_NODE) and e.sequence_nr >= 0}
    assert backward and all((e.fwd_thread, e.sequence_nr) in forward for e in backward)
