"""The parts of the step on training code written the way tutorials write it, through a real
shell, each judged against a plain run of the same cell whose forward (the model's calls),
`backward()` and `optimizer.step()` were timed by hand (ground_truth.py); and over the run: a
run that slows down, one that is flat with noise, and epochs whose DataLoader workers restart
or persist."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from ground_truth import Truth, hand_timed
from helpers import stop_loader_workers, traced
from test_training_code import GAN_CELL, GAN_SETUP, TOLERANCE, run
from test_training_code import SETUP as TUTORIAL_SETUP

from traceml_jupyter.run import Run

pytestmark = pytest.mark.slow  # training runs timed against the hand-timed truth

# The tutorial layout's dataset and model (test_training_code.py), and a backward of known cost.
SETUP = (
    TUTORIAL_SETUP
    + '''
import random
from torch.utils.data import TensorDataset

class SlowGrad(torch.autograd.Function):
    """Identity whose backward costs `ms`: a model of known backward cost."""
    @staticmethod
    def forward(ctx, x, ms):
        ctx.ms = ms
        return x.view_as(x)
    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.ms / 1000)
        return grad, None
'''
)

PARTS = ("forward", "backward", "optimizer", "rest")




def plain(ip: Any, cell: str, models: tuple[str, ...]) -> Truth:
    with hand_timed(models) as truth:
        run(ip, cell)
    return truth


def plain_then_traced(ip: Any, setup: str, cell: str, models: tuple[str, ...]) -> tuple[Truth, Run]:
    """The cell run plainly with its parts timed by hand, then traced, each after `setup`."""
    run(ip, setup)
    truth = plain(ip, cell, models)
    run(ip, setup)
    return truth, traced(ip, cell)


def assert_parts_match(got: Run, truth: Truth) -> dict[str, float]:
    expected = truth.part_shares()
    shares = {p: got.summary[f"{p}_share"] for p in PARTS}
    for part in PARTS:
        assert shares[part] == pytest.approx(expected[part], abs=TOLERANCE), (part, shares, expected)
    return expected


@pytest.fixture()
def shell(ip: Any) -> Iterator[Any]:
    """The shell with SETUP run, and torch on one thread for the test: on a loaded 2-core
    machine its thread pool turns a 3 ms step into 100 ms ones at random. Afterwards the
    workers of a persistent loader the test left in the shell are stopped."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run(ip, SETUP)
    try:
        yield ip
    finally:
        torch.set_num_threads(threads)
        stop_loader_workers(ip.user_ns)


def test_a_plain_loop_splits_into_forward_backward_optimizer_and_a_small_rest(shell: Any) -> None:
    setup = '''
    loader = DataLoader(Digits(160, 0.2), batch_size=8)
    model = Net(12.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    '''
    cell = '''\
    for x, y in loader:
        opt.zero_grad()
        loss = F.nll_loss(SlowGrad.apply(model(x), 16.0), y)
        loss.backward()
        opt.step()
        history.append(loss.item())
    '''
    truth, got = plain_then_traced(shell, setup, cell, ("Net",))
    expected = assert_parts_match(got, truth)
    assert expected["forward"] > 0.25 and expected["backward"] > 0.35  # the injected costs dominate
    assert got.summary["forward_modules"] == ["model (Net)"] and got.summary["forward_state"] == "found"
    text = got.text()
    assert "Parts: forward " in text and "The rest of the step" not in text


def test_heavy_logging_after_the_step_is_the_rest_and_its_line_is_named(shell: Any) -> None:
    setup = '''
    loader = DataLoader(Digits(192, 0.2), batch_size=8)
    model = Net(10.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    def log_step(i, loss):
        """What a notebook logs every step: the loss as text, a plot point, a flush."""
        history.append(f"step {i}: {loss.item():.4f}")
        time.sleep(0.014)
    '''
    cell = '''\
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        opt.step()
        log_step(i, loss)
    '''
    truth, got = plain_then_traced(shell, setup, cell, ("Net",))
    expected = assert_parts_match(got, truth)
    assert expected["rest"] > 0.3
    (severity, line), *_ = got.lines_after_verdict()
    assert severity == "critical"
    assert line.startswith("The rest of the step takes ") and "line 7 `log_step(i, loss)`" in line
    assert "Also: The rest of the step" in got.text()


def test_an_optimizer_heavy_step_gets_fused_or_foreach(shell: Any) -> None:
    setup = '''
    class Many(nn.Module):
        """600 small parameter tensors: a 4 ms forward and backward, an expensive Adam step."""
        def __init__(self, n):
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.randn(8)) for _ in range(n)])
        def forward(self, x):
            time.sleep(0.004)
            return SlowGrad.apply(torch.cat(list(self.ps)).sum() * x.mean(), 4.0)
    many = Many(600)
    adam = torch.optim.Adam(many.parameters(), lr=1e-3, foreach=False)
    batches = DataLoader(TensorDataset(torch.randn(192, 8)), batch_size=8)
    '''
    cell = '''\
    for (x,) in batches:
        adam.zero_grad()
        many(x).backward()
        adam.step()
    '''
    truth, got = plain_then_traced(shell, setup, cell, ("Many",))
    expected = assert_parts_match(got, truth)
    assert expected["optimizer"] > 0.4
    advice = [text for _, text in got.lines_after_verdict() if text.startswith("The optimizer takes")]
    assert advice and "Adam: 600 tensors, one at a time, in 1 parameter group" in advice[0]
    assert "Adam(..., fused=True) or foreach=True" in advice[0]


def test_a_gan_sums_both_models_calls_and_both_optimizers(shell: Any) -> None:
    setup, cell = GAN_SETUP.format(wait_ms=0.3, compute_ms=5.0), GAN_CELL
    truth, got = plain_then_traced(shell, setup, cell, ("Net", "Sequential"))
    expected = assert_parts_match(got, truth)
    assert expected["forward"] > 0.3  # three 5 ms calls of D a step
    s = got.summary
    assert s["forward_modules"] == ["D (Net)", "G (Sequential)"]
    assert [o["label"] for o in s["optimizers"]] == ["opt_d (Adam)", "opt_g (Adam)"]
    assert "optimizer: opt_d (Adam), opt_g (Adam)" in got.text()


def test_the_hugging_face_trainers_parts_are_found_without_a_located_loop(shell: Any) -> None:
    pytest.importorskip("transformers")
    setup = '''
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    class Tokens(Dataset):
        def __init__(self, n, ms):
            self.n, self.ms = n, ms
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            time.sleep(self.ms / 1000)
            ids = torch.randint(0, 100, (32,))
            return {"input_ids": ids, "labels": ids}
    lm = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=100, n_positions=32))
    lm.register_forward_pre_hook(lambda module, args: time.sleep(0.03))  # a model of known cost
    hf_args = TrainingArguments(
        output_dir="/tmp/traceml-hf", per_device_train_batch_size=8, max_steps=24, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tokens = Tokens(10_000, 0.5)
    '''
    cell = "Trainer(model=lm, args=hf_args, train_dataset=tokens).train()\n"
    run(shell, setup)
    truth = plain(shell, cell, ("GPT2LMHeadModel",))
    got = traced(shell, cell)
    assert got.result.loop.line is None and got.n_steps == 24
    expected = assert_parts_match(got, truth)
    assert expected["forward"] > 0.3
    assert got.summary["forward_modules"] == ["lm (GPT2LMHeadModel)"]
    assert [o["name"] for o in got.summary["optimizers"]] == ["AdamW"]


def test_lightnings_parts_are_found_and_its_closure_is_not_the_optimizer(shell: Any) -> None:
    pytest.importorskip("lightning")
    setup = '''
    import lightning as L
    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net(10.0)
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.nll_loss(SlowGrad.apply(self.net(x), 12.0), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    lit_train = DataLoader(Digits(160, 0.3), batch_size=8)
    def fit():
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_train_batches=16)
        trainer.fit(Lit(), lit_train)
    '''
    run(shell, setup)
    truth = plain(shell, "fit()\n", ("Net",))
    got = traced(shell, "fit()\n")
    assert got.result.loop.line is None and got.n_steps == 16
    expected = assert_parts_match(got, truth)
    assert expected["forward"] > 0.2 and expected["backward"] > 0.25
    assert got.summary["forward_modules"] == ["Lit.net (Net)"]
    assert got.summary["optimizer_share"] < 0.05  # the closure (forward, backward) is not SGD's


def test_a_run_whose_steps_slow_down_reports_the_trend_and_what_moved(shell: Any) -> None:
    setup = '''
    loader = DataLoader(Digits(480, 0.05), batch_size=8)
    model = Net(3.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    '''
    cell = '''\
    for i, (x, y) in enumerate(loader):
        model.ms = 3.0 + 0.45 * i  # something grows every step: 3 ms to 30 ms
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        opt.step()
    '''
    run(shell, setup)
    truth = plain(shell, cell, ("Net",))
    forward = [(t1 - t0) * 1e3 for kind, t0, t1 in truth.parts if kind == "forward"][5:]
    third = len(forward) // 3
    grew = statistics.median(forward[-third:]) - statistics.median(forward[:third])
    run(shell, setup)
    got = traced(shell, cell)
    found = got.summary["trend"]
    assert found["direction"] == "slower" and found["change"] > 0.25
    moved = found["moved"][0]
    assert moved["what"] == "forward" and moved["delta"] == pytest.approx(grew, rel=0.25)
    assert any(text.startswith("Steps got ") and "forward +" in text for _, text in got.lines_after_verdict())


def test_a_flat_run_with_noise_reports_no_trend(shell: Any) -> None:
    setup = '''
    loader = DataLoader(Digits(480, 0.05), batch_size=8)
    model = Net(3.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    noise = random.Random(7)
    '''
    cell = '''\
    for x, y in loader:
        model.ms = noise.uniform(1.0, 9.0)  # every step differs; the run does not drift
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        opt.step()
    '''
    run(shell, setup)
    got = traced(shell, cell)
    found = got.summary["trend"]
    assert found is not None and found["direction"] is None
    assert not any(text.startswith("Steps got") for _, text in got.lines_after_verdict())


EPOCHS = '''
model = Net(8.0)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def slow_start(worker_id):
    time.sleep(0.25)  # what a worker does once: imports, opening files, a tokenizer
epochs_loader = DataLoader(Digits(32, 0.2), batch_size=8, num_workers=2,
                           worker_init_fn=slow_start, persistent_workers={persistent})
'''
EPOCH_CELL = '''\
for epoch in range(5):
    for x, y in epochs_loader:
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        opt.step()
'''


@contextmanager
def iter_timed(truth: Truth) -> Iterator[None]:
    """`iter(loader)` timed by hand too (where the workers start), as fetches of key "iter"."""
    from torch.utils.data import DataLoader

    original = DataLoader.__dict__["__iter__"]
    DataLoader.__iter__ = truth.timed("iter", original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DataLoader.__iter__ = original  # type: ignore[method-assign]


def start_up_waits(truth: Truth, key: Any) -> list[float]:
    """Each epoch's hand-timed wait before its first batch (ms): the previous epoch's last
    next() (the StopIteration, where its workers are shut down), iter() and the first next()
    (an epoch: iter(), 4 batches, the StopIteration)."""
    iters = sorted((t0, t1) for k, t0, t1 in truth.fetches if k == "iter")
    nexts = sorted((t0, t1) for k, t0, t1 in truth.fetches if k == key)
    stops = [(0.0, 0.0)] + nexts[4::5]
    return [
        ((s1 - s0) + (a1 - a0) + (n1 - n0)) * 1e3
        for (s0, s1), (a0, a1), (n0, n1) in zip(stops, iters, nexts[::5], strict=False)
    ]


def test_epochs_whose_workers_restart_report_their_start_up_and_persistent_ones_do_not(shell: Any) -> None:
    from traceml_jupyter.kernel.code_facts import checklist_for

    run(shell, EPOCHS.format(persistent=False))
    # Timed by hand in the traced run itself (under the capture's own wrappers): each worker
    # start is a fork, whose time varies from run to run far more than the tool's error.
    with hand_timed() as truth, iter_timed(truth):
        got = traced(shell, EPOCH_CELL)
    restarts = start_up_waits(truth, id(shell.user_ns["epochs_loader"].dataset))
    found = got.summary["epoch_startup"]
    assert got.n_steps == 20 and found["reported"] and found["restarts"] == 4
    assert found["cause"] == "workers restart" and found["wait_ms"] > 200
    assert len(restarts) == 5
    assert found["wait_ms"] == pytest.approx(statistics.median(restarts[1:]), rel=0.3)
    line = next(text for _, text in got.lines_after_verdict() if text.startswith("Each epoch starts with"))
    assert "(workers restart, " in line and "persistent_workers=True" in line
    item = {i["key"]: i for i in checklist_for(got)}["persistent_workers"]
    assert item["status"] == "fix" and item["reason"].startswith("Each epoch starts with a")

    run(shell, EPOCHS.format(persistent=True))
    kept = traced(shell, EPOCH_CELL)
    assert kept.n_steps == 20 and not (kept.summary["epoch_startup"] or {}).get("reported")
    assert not any(text.startswith("Each epoch starts") for _, text in kept.lines_after_verdict())
    item = {i["key"]: i for i in checklist_for(kept)}["persistent_workers"]
    assert item["status"] == "ok"
