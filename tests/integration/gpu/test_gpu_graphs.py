"""CUDA graphs on the stand-in GPU (tests/fake_gpu.py), the first way a real GPU would prove us
wrong (../shared/reviews/gpu-double-review.md): inside `torch.cuda.graph(...)` a query or a
wait of ours invalidates the user's capture. A captured step never raises, is no step, and its
replays are steps timed on the GPU clock. First the stand-in's capture rules, each against what
CUDA does; then the documentation's whole-network capture, a pinned copy inside a capture and
torch.compile(mode="reduce-overhead")'s pattern, through the magic."""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fake_gpu import CudaError, FakeGpu, FakeGraph, FakeTensor, reduce_overhead
from helpers import gpu_fixture, traced
from IPython.utils.capture import capture_output
from stand_in_cells import machine

from traceml_jupyter.capture.gpu import cuda_graphs
from traceml_jupyter.capture.gpu.cuda_clock import CudaStepClock, Marks
from traceml_jupyter.capture.steps.recorder import Recorder

# -- the stand-in's capture rules -------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_tensors_left() -> Iterator[None]:
    yield
    FakeTensor.gpu = None


def test_work_issued_in_a_capture_is_recorded_not_run_and_replay_runs_it_on_the_current_stream() -> None:
    gpu = machine()
    g = gpu.module.CUDAGraph()
    x = FakeTensor(1000, device="cuda")
    with gpu.module.graph(g):
        assert gpu.module.is_current_stream_capturing()
        x.work(5.0)
    assert not gpu.module.is_current_stream_capturing()
    assert gpu.clock() == 0 and gpu.current_stream().free_at == 0  # nothing ran
    g.replay()
    assert gpu.current_stream().free_at == 5_000_000  # one launch of the graph's 5 ms


def test_a_query_during_a_global_capture_raises_and_invalidates_the_capture_from_any_thread() -> None:
    """cudaErrorStreamCaptureUnsupported, then cudaErrorStreamCaptureInvalidated at capture_end
    (torch.cuda.graph's default mode "global" forbids it from every thread)."""
    gpu = machine()
    done = gpu.event()
    done.record()
    errors: list[BaseException] = []
    g = gpu.module.CUDAGraph()
    with pytest.raises(CudaError, match="previous error during capture"), gpu.module.graph(g):
        t = threading.Thread(target=lambda: _catch(errors, done.query))
        t.start()
        t.join()
    assert errors and "not permitted when stream is capturing" in str(errors[0])
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()


def test_thread_local_capture_forbids_only_the_capturing_thread() -> None:
    """torch.compile's CUDA graph trees capture with capture_error_mode="thread_local"."""
    gpu = machine()
    done = gpu.event()
    done.record()
    errors: list[BaseException] = []
    g = gpu.module.CUDAGraph()
    with gpu.module.graph(g, capture_error_mode="thread_local"):
        t = threading.Thread(target=lambda: _catch(errors, done.query))
        t.start()
        t.join()
    assert not errors and g.ready
    with pytest.raises(CudaError, match="previous error"), gpu.module.graph(g, capture_error_mode="thread_local"):
        with pytest.raises(CudaError):
            done.query()  # the capturing thread's own query invalidates it


def test_an_event_recorded_in_a_capture_cannot_be_queried_even_after_it() -> None:
    """cudaErrorCapturedEvent, until the event is recorded again outside a capture."""
    gpu = machine()
    ev = gpu.event()
    g = gpu.module.CUDAGraph()
    with gpu.module.graph(g):
        ev.record()
    with pytest.raises(CudaError, match="last recorded in a capturing stream"):
        ev.query()
    ev.record()
    assert ev.query()


def test_the_old_gpu_clock_inside_a_capture_breaks_the_users_capture() -> None:
    """What the review found, on the stand-in: a step closed inside the documentation's
    whole-network capture (its optimizer.step()) polls events, and the capture is lost."""
    gpu = machine()
    steps = CudaStepClock(Recorder(), 0, Marks(gpu.event, lambda: gpu.current_stream(0), lambda ev, on: ev.record(on)))
    steps.open(0)
    steps.step_closed(0, 0)  # a step before the capture, still pending
    gpu.launch(5.0)
    g = gpu.module.CUDAGraph()
    with pytest.raises(CudaError, match="previous error during capture"), gpu.module.graph(g):
        FakeTensor(10, device="cuda").work(1.0)
        with pytest.raises(CudaError):
            steps.step_closed(1, 0)  # optimizer.step() inside the capture: a record, then a poll


def _catch(errors: list[BaseException], call: Any) -> None:
    try:
        call()
    except BaseException as exc:
        errors.append(exc)


# -- through the magic --------------------------------------------------------------------------

SETUP = """
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
static_input = FakeTensor(4_000, device="cuda")
def train_step(x, gpu_ms):
    '''forward, backward and the optimizer step: GPU work queued, one real backward and step'''
    x.work(gpu_ms)
    opt.zero_grad()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
"""


gpu = gpu_fixture(SETUP)


WHOLE_NETWORK = """\
s = cuda.Stream()
s.wait_stream(cuda.current_stream())
with cuda.stream(s):
    for i in range(3):  # warm-up on a side stream, as the documentation requires
        train_step(static_input, 6.0)
cuda.current_stream().wait_stream(s)
g = cuda.CUDAGraph()
opt.zero_grad(set_to_none=True)
with cuda.graph(g):
    train_step(static_input, 6.0)
for batch in DataLoader(Slow(24, 1.0), batch_size=None):
    x = batch.to("cuda", non_blocking=True)
    g.replay()
    v = static_input.item()
"""


@pytest.mark.slow
def test_the_documentations_whole_network_capture_never_raises_and_each_replay_is_a_step(ip: Any, gpu: FakeGpu) -> None:
    run = traced(ip, WHOLE_NETWORK)
    assert gpu.graphs_captured == 1 and ip.user_ns["g"].ready  # the user's capture is intact
    assert run.result.loop.line == 12  # the replay loop, not the warm-up loop before the capture
    graphs = run.result.gpu.cuda_graphs
    assert graphs["captures"] == 1 and graphs["replays"] == 24 and graphs["invalidated"] == 0
    assert graphs["training_events_in_captures"] == 2  # backward and the optimizer step: recorded
    assert run.result.steps.kind == "optimizer" and run.n_steps == 3 + 24  # the warm-up, then each replay
    assert run.clock == "gpu" and run.result.gpu.cuda_device == 0
    assert run.summary["compute_ms"] == pytest.approx(6.0, rel=0.25)  # the replay, on the GPU clock
    assert any(n.startswith("CUDA graphs in use") for n in run.notes)
    assert run.to_dict()["cuda_graphs"]["replays"] == 24


@pytest.mark.slow
def test_a_graph_captured_in_an_earlier_cell_is_replayed_as_the_step(ip: Any, gpu: FakeGpu) -> None:
    """The usual notebook: capture in one cell, the replay loop traced in the next. A
    no-allocation loop that syncs every step (`.item()`): still a GPU loop."""
    with capture_output():
        cell = WHOLE_NETWORK.split("for batch in")[0]
        assert ip.run_cell(textwrap.dedent(cell)).error_in_exec is None
    allocations = gpu.devices[0].allocations
    run = traced(
        ip,
        """\
        for step in range(20):  # traceml: loop
            g.replay()
            v = static_input.item()
        """,
    )
    assert gpu.devices[0].allocations == allocations  # the loop allocates nothing
    assert run.result.gpu.cuda_device == 0 and run.clock == "gpu"
    assert run.n_steps == 20 and run.summary["step_ms"] == pytest.approx(6.0, rel=0.25)
    assert run.result.gpu.cuda_graphs["replays"] == 20 and run.result.gpu.cuda_graphs["captures"] == 0


@pytest.mark.slow
def test_capture_inside_the_loop_at_step_0_then_replays(ip: Any, gpu: FakeGpu) -> None:
    """gpu_check's J: a forward captured in the first step, replayed after."""
    run = traced(
        ip,
        """\
        for i in range(30):  # traceml: loop
            if i == 0:
                g = cuda.CUDAGraph()
                with cuda.graph(g):
                    static_input.work(4.0)
            g.replay()
        """,
    )
    assert ip.user_ns["g"].ready and run.clock == "gpu"
    assert run.summary["compute_ms"] == pytest.approx(4.0, rel=0.25)


@pytest.mark.slow
def test_a_pinned_non_blocking_copy_inside_a_capture_is_left_to_the_replay(ip: Any, gpu: FakeGpu) -> None:
    run = traced(
        ip,
        """\
        pinned = FakeTensor(8_000_000, pinned=True)
        for i in range(20):  # traceml: loop
            if i == 5:  # the loop runs on the GPU by now: copies are watched
                g = cuda.CUDAGraph()
                with cuda.graph(g):
                    xg = pinned.to("cuda", non_blocking=True)
                    xg.work(2.0)
            if i >= 5:
                g.replay()
            else:
                pinned.to("cuda", non_blocking=True).work(2.0)
            v = static_input.item()
        """,
    )
    assert ip.user_ns["g"].ready and run.clock == "gpu"
    copied = run.steps["h2d_bytes"]
    assert copied[2:5].tolist() == [8_000_000] * 3  # the loop's own copies (watched from its decision)
    assert not copied[5:].any()  # the one in the capture is not run there, and replays run it in the graph
    assert run.result.gpu.h2d["sites"][0]["timed"] == run.result.gpu.h2d["copies"]
    assert run.result.gpu.cuda_graphs["calls_skipped_during_capture"] >= 1


@pytest.mark.slow
def test_torch_compile_reduce_overhead_pattern_never_raises(ip: Any, gpu: FakeGpu) -> None:
    """CUDA graph trees: warm-up call, then a "thread_local" capture on their own stream
    replayed at once, then replays, inside the user's steps."""
    ip.user_ns["compiled_forward"] = reduce_overhead(lambda x: x.work(3.0), gpu)
    run = traced(
        ip,
        """\
        for batch in DataLoader(Slow(24, 0.5), batch_size=None):
            x = batch.to("cuda", non_blocking=True)
            y = compiled_forward(static_input)
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            v = y.item()
        """,
        "--no-live --lines on",
    )
    assert gpu.graphs_captured == 1
    assert run.n_steps == 24 and run.clock == "gpu"
    assert run.result.gpu.cuda_graphs["replays"] == 23  # every call after the warm-up
    assert run.summary["compute_ms"] == pytest.approx(3.0, rel=0.3)


@pytest.mark.slow
def test_nothing_of_ours_stays_patched_on_the_graph_class(ip: Any, gpu: FakeGpu) -> None:
    cls = gpu.module.CUDAGraph
    before = {n: cls.__dict__.get(n) for n in ("capture_begin", "capture_end", "replay")}
    traced(ip, "for i in range(3):  # traceml: loop\n    static_input.work(1.0)\n")
    assert {n: cls.__dict__.get(n) for n in before} == before
    assert cuda_graphs._STATE.active == 0


@pytest.mark.slow
def test_steps_closed_inside_a_capture_have_no_gpu_timings_and_break_nothing(ip: Any, gpu: FakeGpu) -> None:
    """A located loop whose iterations run inside one capture: each step closes while the
    capture is under way (no event may be recorded): unknown GPU timings, the capture intact."""
    run = traced(
        ip,
        """\
        g = cuda.CUDAGraph()
        with cuda.graph(g):
            for i in range(4):  # traceml: loop
                static_input.work(1.0)
        for i in range(3):
            g.replay()
        """,
    )
    assert ip.user_ns["g"].ready and gpu.graphs_captured == 1
    assert run.n_steps == 4 and run.clock == "cpu"  # no GPU timing for a step that ran nothing


@pytest.mark.slow
def test_a_capture_begun_outside_cudagraph_is_seen_once_a_step(ip: Any, gpu: FakeGpu) -> None:
    """A capture begun without torch.cuda.CUDAGraph (the C++ API, another library): the step's
    close asks `is_current_stream_capturing()`, and every later check of the cell asks it too."""
    ip.user_ns["raw"] = FakeGraph(gpu)
    run = traced(
        ip,
        """\
        side = cuda.Stream()
        for i in range(12):  # traceml: loop
            if i == 6:
                cuda.set_stream(side)
                gpu.begin_capture(raw, "global")
            x = FakeTensor(4_000, pinned=True).to("cuda", non_blocking=True)
            x.work(1.0)
            if i == 8:
                gpu.end_capture(raw)
                cuda.set_stream(cuda.default_stream())
        """,
    )
    assert ip.user_ns["raw"].ready  # not invalidated by anything of ours
    assert run.result.gpu.cuda_graphs is not None and run.result.gpu.cuda_graphs["capture_outside_cudagraph"]
    assert cuda_graphs._STATE.foreign is False  # reset for the next cell
