"""The parts of the step as the capture takes them (capture/inside/step_parts.py, model_calls.py,
part_store.py): which steps are sampled, what forward, backward and optimizer are when
several models, optimizers, a closure or gradient accumulation are in play, what cannot be
found, and that nothing of it changes the user's objects or code. Through a traced cell:
tests/integration/shell/test_step_parts_of_a_cell.py."""

from __future__ import annotations

import copy
import inspect
import pickle
import threading
from typing import Any

import numpy as np
import pytest
import torch
from sleepy_model import Sleepy
from torch import nn

import traceml_jupyter
from traceml_jupyter.capture.inside.line_costs import FULL_STEPS
from traceml_jupyter.capture.inside.part_store import FORWARD_OK, OPTIMIZER_OK, PartStore
from traceml_jupyter.run import Run


def parts(run: Run) -> dict[str, np.ndarray]:
    cols = run.steps
    return {k: cols[k] for k in ("forward_ms", "backward_ms", "optimizer_ms", "rest_ms", "compute_ms")}


def test_every_early_step_is_sampled_then_a_fraction_at_random_gaps() -> None:
    model = Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(2, 4)
    with traceml_jupyter.trace(show=False) as run:
        for _ in run.loop(range(600)):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    cols = parts(run)
    sampled = np.isfinite(cols["backward_ms"])
    assert run.n_steps == 600 and sampled[:FULL_STEPS].all()
    later = int(sampled[FULL_STEPS:].sum())
    assert 1 <= later < (600 - FULL_STEPS) // 8  # steps this short: one in 64 or 256
    gaps = np.diff(np.flatnonzero(sampled[FULL_STEPS:]))
    assert len(set(gaps.tolist())) > 1 or later < 3  # random gaps, no fixed stride
    assert run.summary["forward_state"] == "found" and run.summary["forward_modules"] == ["Sleepy"]
    assert run.summary["parts_sampled_steps"] == int(sampled.sum())


def test_nothing_stays_on_the_model_class_the_optimizer_or_autograd() -> None:
    model = Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    backward = torch.autograd.backward
    with traceml_jupyter.trace(show=False) as run:
        for _ in run.loop(range(20)):
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
    assert "__call__" not in Sleepy.__dict__ and "__call__" not in vars(model)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert torch.autograd.backward is backward
    assert np.isfinite(run.steps["forward_ms"][5:]).all()


def test_copies_pickles_and_signatures_of_the_model_inside_a_sampled_step_are_the_models() -> None:
    model = Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(3, 4)
    seen: list[Any] = []
    with traceml_jupyter.trace(show=False) as run:
        for _ in run.loop(range(4)):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            deep, shallow = copy.deepcopy(model), copy.copy(model)
            loaded = pickle.loads(pickle.dumps(model))
            assert not pickle.loads(pickle.dumps(opt))._optimizer_step_pre_hooks
            seen.append((deep(x), shallow(x), loaded(x), model(x), inspect.signature(model.forward)))
    assert run.summary["parts_sampled_steps"] == 4  # the parts were measured on every step
    for deep, shallow, loaded, own, signature in seen:
        assert torch.equal(deep, own) and torch.equal(shallow, own) and torch.equal(loaded, own)
        assert list(signature.parameters) == ["x", "extra_ms"]
    assert "__call__" not in Sleepy.__dict__


def test_a_closure_passed_to_step_is_not_the_optimizer_and_its_forward_and_backward_are_found() -> None:
    """Lightning's automatic optimisation: forward and backward run inside optimizer.step()."""
    model = Sleepy(ms=4.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(2, 4)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    with traceml_jupyter.trace(show=False) as run:
        for _ in run.loop(range(12)):
            opt.step(closure)
    s = run.summary
    assert s["forward_state"] == "found"
    assert s["forward_ms"] == pytest.approx(4.0, abs=3.0)
    assert s["optimizer_ms"] < 1.5  # not the 4 ms forward nor the backward inside the closure
    assert s["forward_ms"] + s["backward_ms"] + s["optimizer_ms"] + s["rest_ms"] <= s["compute_ms"] * 1.05


def test_gradient_accumulation_without_a_located_loop_sums_each_parts_calls() -> None:
    """A library's loop (no located loop): four forward/backward per optimizer step."""
    model = Sleepy(ms=2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = torch.utils.data.DataLoader(torch.ones(64, 4), batch_size=2)

    def fit() -> None:
        for i, x in enumerate(batches):
            model(x).sum().backward()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad()

    with traceml_jupyter.trace(show=False) as run:
        fit()
    assert run.n_steps == 8 and run.result.steps.batches_per_step == pytest.approx(4.0)
    forward, compute = run.steps["forward_ms"][1:], run.steps["compute_ms"][1:]
    assert 6.0 < np.nanmedian(forward) < np.nanmedian(compute)  # four 2 ms calls, not one


def test_a_model_called_on_another_thread_is_not_this_steps_forward() -> None:
    model = Sleepy(ms=2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(1, 4)
    with traceml_jupyter.trace(show=False) as run:
        for _ in run.loop(range(8)):
            worker = threading.Thread(target=model, args=(x, 30.0))
            worker.start()
            worker.join()
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert np.nanmedian(run.steps["forward_ms"][1:]) < 15.0  # the 2 ms call, not the 32 ms one


def test_a_failure_of_ours_turns_the_parts_off_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    from traceml_jupyter.capture.inside import part_store

    def broken(self: Any, *args: Any) -> None:
        raise RuntimeError("store broke")

    monkeypatch.setattr(part_store.PartStore, "record", broken)
    model = Sleepy()
    with traceml_jupyter.trace(show=False) as run:
        for _ in run.loop(range(6)):
            model(torch.ones(1, 4)).sum().backward()
    assert run.n_steps == 6
    assert any("parts of the step were turned off" in n and "store broke" in n for n in run.notes)
    assert "__call__" not in Sleepy.__dict__


def trained_losses(steps: int) -> list[float]:
    """The losses of a small deterministic training loop, as the user's cell computes them."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(8, 4)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("inner", ["_exit", "_hook_optimizer", "_optimizer_ended"])
def test_a_failure_in_our_bookkeeping_stops_at_the_parts_edge_and_the_training_is_the_same(
    monkeypatch: pytest.MonkeyPatch, inner: str
) -> None:
    """A failure inside a part's end (forward, backward), our optimizer pre hook or the global
    post hook's bookkeeping: the edge turns the parts off with a note; the user's losses are
    those of the same loop without the magic, and nothing of ours stays on their classes."""
    from traceml_jupyter.capture.inside.step_parts import StepParts

    expected = trained_losses(6)

    def broken(self: Any, *args: Any) -> None:
        raise RuntimeError("our bookkeeping broke")

    monkeypatch.setattr(StepParts, inner, broken)
    with traceml_jupyter.trace(show=False) as run:
        got = trained_losses(6)
    assert got == expected
    assert run.n_steps == 6
    # Off with a note: by the parts' own edge, or (an optimizer already in the notebook's
    # namespace is hooked as the capture starts) by the capture's guard around that start.
    edges = ("parts of the step were turned off", "traceml failed timing the parts of the step")
    assert any("our bookkeeping broke" in n and any(e in n for e in edges) for n in run.notes)
    assert "__call__" not in nn.Linear.__dict__


def test_the_store_keeps_a_bounded_uniform_history_of_sampled_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    from traceml_jupyter.capture.inside import part_store

    monkeypatch.setattr(part_store, "KEPT_CAP", 64)
    store = PartStore()
    for step in range(0, 2000, 3):
        store.kind.extend([0, 1, 2])
        store.t0.extend([step, step, step])
        store.own.extend([1_000_000, 2_000_000, 500_000])
        store.record(step, FORWARD_OK | OPTIMIZER_OK, None)
        if len(store.rec_step) > 50:
            store.fold(len(store.rec_step))
    steps, values = store.per_step()
    assert len(steps) <= 64 + 50 and steps[0] == 0 and steps[-1] >= 1900
    assert np.allclose(values[0], 1.0) and np.allclose(values[1], 2.0) and np.allclose(values[2], 0.5)
    cols = store.columns({"step": np.array([0, 1, 1998]), "compute_ms": np.array([5.0, 5.0, 5.0])})
    assert cols["rest_ms"][0] == pytest.approx(1.5) and np.isnan(cols["forward_ms"][1])
    assert store.nbytes() < 64 * 64 + 50 * 64


def test_a_forked_ranks_steps_carry_their_parts_to_the_kernel() -> None:
    """ranks/wire.py's format: forward, optimizer and the rest of sampled steps (NaN elsewhere)
    travel with each rank's steps; the kernel keeps their medians per rank and shows them."""
    from traceml_jupyter import ranks

    n = 12
    rows = np.full((len(ranks.ROWS), n), np.nan)
    rows[0] = np.arange(n)
    rows[1] = np.arange(n) * 0.02
    rows[2], rows[3], rows[4], rows[5] = 1.0, 19.0, 20.0, 8.0
    sampled = np.arange(n) % 2 == 0
    for name, value in (("forward_ms", 6.0), ("optimizer_ms", 2.0), ("rest_ms", 3.0)):
        rows[ranks.ROWS.index(name)] = np.where(sampled, value, np.nan)
    stream = ranks.Stream(None, 0, 0)  # type: ignore[arg-type]
    for kind, meta, got in ranks.read_frames(bytearray(ranks.frame(ranks.STEPS, {"rank": 1, "world": 2}, rows))):
        stream.apply(kind, meta, got)
    summary = stream.summary(warmup=2)
    assert (summary["forward_ms"], summary["optimizer_ms"], summary["rest_ms"]) == (6.0, 2.0, 3.0)
    cols = stream.parts.columns({"step": np.arange(n)})
    assert np.array_equal(np.isfinite(cols["forward_ms"]), sampled) and cols["backward_ms"][0] == 8.0


def test_the_json_carries_each_steps_parts_nullable_and_the_trend() -> None:
    import json

    model = Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with traceml_jupyter.trace(show=False) as run:
        for _ in run.loop(range(200)):
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
    saved = json.loads(json.dumps(run.to_dict(), allow_nan=False))
    steps = saved["steps"]
    for name in ("forward_ms", "backward_ms", "optimizer_ms", "rest_ms", "forward_gpu_ms"):
        assert len(steps[name]) == 200
    assert all(v is not None for v in steps["backward_ms"][:FULL_STEPS])
    assert any(v is None for v in steps["backward_ms"][FULL_STEPS:])  # not sampled: null, not 0
    assert all(v is None for v in steps["forward_gpu_ms"])  # no GPU: null
    summary = saved["summary"]
    assert summary["parts_clock"] == "cpu" and summary["forward_modules"] == ["Sleepy"]
    assert summary["parts_sampled_steps"] == run.summary["parts_sampled_steps"]
    assert saved["trend"] == summary["trend"] and saved["trend"]["steps"] > 0
    assert saved["epoch_startup"] is None  # no DataLoader: no pass to start


@pytest.mark.slow
def test_compiled_modules_are_timed_whole_and_never_recompiled() -> None:
    """torch.compile(model) and model.compile(): called from the step's code, each is a forward;
    patching their classes for sampled steps only causes no recompilation."""
    compiles = 0

    def backend(graph: Any, inputs: Any) -> Any:
        nonlocal compiles
        compiles += 1
        return graph.forward

    wrapped, inplace = torch.compile(Sleepy(), backend=backend), Sleepy()
    inplace.compile(backend=backend)
    opt = torch.optim.SGD([*wrapped.parameters(), *inplace.parameters()], lr=0.01)
    x = torch.ones(2, 4)
    (wrapped(x).sum() + inplace(x).sum()).backward()  # compiled once each, before the run
    compiled = compiles
    with traceml_jupyter.trace(show=False) as run:
        for _ in run.loop(range(150)):  # sampled and unsampled steps
            opt.zero_grad()
            (wrapped(x).sum() + inplace(x).sum()).backward()
            opt.step()
    assert compiles == compiled
    assert run.summary["forward_state"] == "found"
    assert sorted(run.summary["forward_modules"]) == ["OptimizedModule", "Sleepy"]
    assert "__call__" not in type(wrapped).__dict__ or type(wrapped).__dict__["__call__"].__module__.startswith("torch")


def test_the_walk_looks_again_only_at_the_names_bound_since_the_run_began() -> None:
    """The notebook's namespace is looked at once, when the run begins; the walk at the first
    backward() takes from it only what is new or rebound since (a long session's globals are
    thousands of values)."""
    from traceml_jupyter.capture.inside.model_calls import frame_values

    ns: dict[str, Any] = {"kept": [object()], "rebound": [object()]}
    seen = dict(ns)
    exec("import sys\nthe_frame = sys._getframe()\n", ns)  # a module-level frame, as a cell's
    old_rebound = id(ns["rebound"])  # (an id: a local holding the list would be looked at)
    ns["rebound"], ns["new"] = [object()], [object()]
    values = frame_values(ns["the_frame"], None, seen)
    ids = {id(v) for v in values}
    assert id(ns["rebound"]) in ids and id(ns["new"]) in ids and id(ns["the_frame"]) in ids
    assert id(ns["kept"]) not in ids and old_rebound not in ids
    assert id(ns["kept"]) in {id(v) for v in frame_values(ns["the_frame"], None)}  # without `seen`: all
    marker = [object()]  # a local of this test's frame, above the module-level one: not looked at
    assert id(marker) not in {id(v) for v in frame_values(ns["the_frame"], None)}


def test_a_scan_looks_inside_containers_up_to_a_budget_the_first_values_first() -> None:
    from traceml_jupyter.capture.inside.model_calls import MAX_INNER, MAX_SCAN, instances_in

    model = nn.Linear(1, 1)
    big = [list(range(MAX_SCAN)) for _ in range(MAX_INNER // MAX_SCAN)]  # a long session's lists
    assert instances_in([[model], *big], nn.Module) == [model]  # the cell's names come first
    assert instances_in([*big, [model]], nn.Module) == []  # past the budget
    assert instances_in([{"m": model}, (model,), model, 3], (nn.Module, torch.optim.Optimizer)) == [model] * 3
