"""The teaching scenarios under `%%traceml` in a real shell, with the plain training loop a user
would write: a library trainer's steps, the scenarios' pieces, and on a GPU each scenario's
verdict (on the CPU, the demo notebook's test judges them in a real kernel)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from traceml_jupyter import demo, kernel_state
from traceml_jupyter.run import Run

# Fewer batches than the notebook: the verdicts hold with these (see demo.data_costs).
TEST_BATCHES = {"fast": 30, "slow": 15, "fixed": 15, "collate": 15, "spiky": 10, "h2d": 20}



pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]


def traced(ip: Any, scenario: str) -> Run:
    """Set the scenario up in the user namespace and train it under %%traceml."""
    ip.user_ns["demo"] = demo
    result = ip.run_cell(
        f"loader, model, opt, loss_fn, device = demo.setup({scenario!r}, "
        f"batches={TEST_BATCHES[scenario]})"
    )
    assert result.error_in_exec is None
    cell = demo.training_loop(scenario)
    ip.run_cell_magic("traceml", f"--name {scenario} --no-live", cell)
    run = kernel_state.RUNS[-1]
    assert run.name == scenario and run.result.loop.where == "this cell"
    return run


@pytest.fixture
def clean_namespace(ip: Any) -> Iterator[None]:
    yield
    for name in ("demo", "loader", "model", "opt", "loss_fn", "device", "x", "y", "loss", "epoch"):
        ip.user_ns.pop(name, None)


# Each CPU scenario's verdict and the slow -> fixed comparison are judged where a user meets
# them: the demo notebook run in a real kernel (tests/integration/kernel/test_notebooks.py,
# test_the_dataloader_story_holds). Here: a library trainer, the pieces, and the GPU scenarios.


def test_a_library_trainer_is_timed_through_its_optimizer_steps(ip: Any, clean_namespace: None) -> None:
    ip.user_ns["demo"] = demo
    ip.run_cell("loader, model, opt, loss_fn, device = demo.setup('slow', batches=12)")
    ip.run_cell_magic(
        "traceml", "--name library", "demo.library_fit(loader, model, opt, loss_fn, device, 2)"
    )
    run = kernel_state.RUNS[-1]
    assert run.name == "library" and run.result.loop.line is None and run.n_steps == 24
    assert run.result.steps.kind == "optimizer" and "optimizer.step()` of SGD" in run.result.steps.definition
    assert run.result.data.loader is not None and run.result.data.loader["num_workers"] == 0
    assert run.verdict == "INPUT-BOUND", run.text()


# -- the pieces ---------------------------------------------------------------------------------


def test_data_costs_follow_the_measured_step() -> None:
    sizes = demo.sizes_for("slow", on_cuda=False)
    slow = demo.data_costs("slow", sizes, step_ms=20.0, workers=2)
    assert slow.decode_ms * sizes.batch_size == pytest.approx(30.0)  # 1.5 steps a batch
    assert demo.data_costs("fixed", sizes, 20.0, 2) == slow  # the same data, fixed
    collate = demo.data_costs("collate", sizes, 20.0, 2)
    assert collate.collate_ms * sizes.batch_size == pytest.approx(60.0)
    spiky_sizes = demo.sizes_for("spiky", on_cuda=False)
    assert demo.data_costs("spiky", spiky_sizes, 20.0, 2).worker_start_s == pytest.approx(0.72)
    assert demo.data_costs("spiky", spiky_sizes, 1.0, 2).worker_start_s == 0.3
    assert demo.data_costs("spiky", spiky_sizes, 500.0, 2).worker_start_s == 3.0


def test_sizes_adapt_to_the_device() -> None:
    cpu, gpu = demo.sizes_for("slow", on_cuda=False), demo.sizes_for("slow", on_cuda=True)
    assert gpu.batch_size > cpu.batch_size and gpu.hidden > cpu.hidden
    assert demo.sizes_for("fixed", False, cpus=2).workers == 2
    assert demo.sizes_for("fixed", False, cpus=16).workers == 4
    assert demo.sizes_for("fixed", False, cpus=1).workers == 2
    assert demo.sizes_for("spiky", False, batches=7).batches == 7
    with pytest.raises(ValueError, match="known: fast, slow"):
        demo.sizes_for("nope", False)


def test_h2d_needs_a_gpu() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        demo.setup("h2d", device="cpu")


def test_small_costs_add_up_instead_of_sleeping_each_time() -> None:
    assert demo.spend(0.004) == 0.004  # under a piece: owed, no sleep
    assert demo.spend(0.006) <= 0.0  # slept at least what was owed


@pytest.mark.parametrize("scenario", ["fixed", "collate", "spiky"])
def test_workers_start_under_forkserver(scenario: str) -> None:
    """Python 3.14 starts workers with forkserver: the dataset, collate_fn and worker_init_fn
    must be importable from the package, not defined in __main__."""
    loader = demo.setup(scenario, batches=2, device="cpu").loader
    assert pickle.loads(pickle.dumps(loader.dataset)).__class__ is loader.dataset.__class__
    again = DataLoader(
        loader.dataset,
        batch_size=4,
        num_workers=1,
        collate_fn=loader.collate_fn,
        worker_init_fn=demo.OpenShards(0.0),
        multiprocessing_context="forkserver",
    )
    x, y = next(iter(again))
    assert x.shape == (4, *demo.IMAGE_SHAPE) and x.dtype == torch.float32 and y.shape == (4,)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scenario", ["fast", "slow", "collate", "spiky"])
def test_the_same_verdicts_on_a_gpu(ip: Any, clean_namespace: None, scenario: str) -> None:
    run = traced(ip, scenario)
    assert run.clock == "gpu"
    assert run.verdict == demo.INTENDED_VERDICT[scenario], run.text()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_large_unpinned_batches_are_h2d_bound(ip: Any, clean_namespace: None) -> None:
    run = traced(ip, "h2d")
    assert run.summary["data_wait_share"] < 0.1  # the batches are ready: the copy is the step
    assert run.verdict == "H2D-BOUND", run.text()
