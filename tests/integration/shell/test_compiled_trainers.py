"""A model that a library's trainer compiles, traced in a real shell: Lightning with the model
`torch.compile`d in the LightningModule (in `__init__`, or in `configure_model`, which `fit()`
calls), and Hugging Face's `Trainer` with `TrainingArguments(torch_compile=True)` (accelerate
compiles the model inside `train()`). Each trains plainly, then under `%%traceml`, each after
`torch._dynamo.reset()` and the same seed: torch's own counters (compilations,
recompilations, graphs, graph breaks, frames) are the same, the losses bit for bit the same,
the steps are the trainer's optimizer steps, and the report's compile facts are torch's: the
frames it compiled, its graph breaks, the compile time in the first step. (They skip where
the library is not installed: CI installs `.[test]` only.)"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch
from helpers import run, traced
from test_compiled_cells import Compiled, assert_as_plain, fresh_dynamo

from traceml_jupyter.analysis.compile import read_compile
from traceml_jupyter.capture.session import COMPILED_MODEL_NOTE, COMPILING_NOTE
from traceml_jupyter.result import lines_after_verdict

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # each compiles: seconds

LIGHTNING = """
import time
import torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        if WHERE == "__init__":
            self.net = torch.compile(self.net, backend="eager")
        self.losses, self.hand = [], []
    def configure_model(self):
        if WHERE == "configure_model" and not isinstance(self.net, torch._dynamo.eval_frame.OptimizedModule):
            self.net = torch.compile(self.net, backend="eager")
    def on_train_batch_start(self, batch, batch_idx):
        self.t0 = time.perf_counter()
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.hand.append(time.perf_counter() - self.t0)  # the step by the module's own stopwatch
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1)
batches = DataLoader(TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g)), batch_size=4)
lit = Lit()
trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
"""
LIGHTNING_CELL = "trainer.fit(lit, batches)\n"
LIGHTNING_STEPS = 30

HUGGING_FACE = """
import torch, transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
transformers.utils.logging.warning_once.cache_clear()  # (its warnings are frames Dynamo looks at)
torch.manual_seed(0)
lm = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
g = torch.Generator().manual_seed(1)
tokens = [dict(input_ids=ids, labels=ids) for ids in torch.randint(0, 64, (96, 16), generator=g)]
hf_args = TrainingArguments(
    output_dir="/tmp/traceml-hf-compile", per_device_train_batch_size=4, max_steps=STEPS, torch_compile=True,
    torch_compile_backend="eager", report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
    disable_tqdm=True, dataloader_num_workers=0,
)
"""
HUGGING_FACE_CELL = "out = Trainer(model=lm, args=hf_args, train_dataset=tokens).train()\n"
HUGGING_FACE_STEPS = 12


def trained(ip: Any, setup: str, cell: str, *, magic: bool) -> tuple[Compiled, Any]:
    """`setup` then `cell`, plainly or traced, from a fresh Dynamo: what torch counted (the
    losses: the LightningModule's, or Trainer's mean loss), and the traced run."""
    fresh_dynamo()
    run(ip, setup, check=True)
    got = traced(ip, cell) if magic else run(ip, cell, check=True)
    ns = ip.user_ns
    if "lit" in ns:
        losses, model = torch.stack(ns["lit"].losses), ns["lit"]
    else:
        losses, model = torch.tensor([ns["out"].training_loss], dtype=torch.float64), ns["lm"]
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return Compiled.now(losses, weights), (got if magic else None)


def assert_compile_facts_are_torchs(result: Any, counts: Compiled) -> None:
    """The report's compile facts are what torch recorded in the traced run: a record per
    frame it compiled, its recompilations and graph breaks; the compile time in the first
    step, said on the report's compile line."""
    facts = result.compiled
    assert facts is not None
    assert len(facts["frames"]) == counts.compiles
    assert sum(f["recompile_reason"] is not None for f in facts["frames"]) == counts.recompiles
    assert facts["graph_breaks"] == counts.graph_breaks
    reading = read_compile(facts, result.steps.columns, result.loop.wall_ms)
    assert reading is not None and reading.per_step[0] > 0
    assert 0 in result.summary["compiling_steps"]
    assert any(line.startswith("compiling: ") and "step 1" in line for _, line in lines_after_verdict(result))
    # every break torch counted is said: at its line, or (in a library's code, where torch
    # compiled nothing after it) by its reason and count
    said = [line for _, line in lines_after_verdict(result) if line.startswith("graph break")]
    placed = sum(1 for b in reading.breaks) + sum(n for _, n in reading.unplaced)
    assert (placed >= 1) == (counts.graph_breaks > 0) and len(said) == len(reading.breaks) + len(reading.unplaced)


@pytest.mark.parametrize("where", ["__init__", "configure_model"])
def test_a_lightning_module_with_a_compiled_model_trains_as_without_the_magic(ip: Any, where: str) -> None:
    pytest.importorskip("lightning")
    setup = LIGHTNING.replace("WHERE", repr(where)).replace("STEPS", str(LIGHTNING_STEPS))
    plain, _ = trained(ip, setup, LIGHTNING_CELL, magic=False)
    assert plain.compiles >= 1 and len(plain.losses) == LIGHTNING_STEPS
    with_magic, got = trained(ip, setup, LIGHTNING_CELL, magic=True)
    assert_as_plain(plain, with_magic)
    result = got.result
    assert result.steps.kind == "optimizer" and result.steps.n_steps == LIGHTNING_STEPS
    assert_compile_facts_are_torchs(result, with_magic)
    # compiled in __init__: the module the cell names holds the compiled model; in
    # configure_model: torch's compile start during fit() tells. No parts, and the note says why.
    assert (COMPILED_MODEL_NOTE if where == "__init__" else COMPILING_NOTE) in result.notes
    assert result.summary["parts_sampled_steps"] == 0
    # The compile time lies inside the first step by the module's own stopwatch, and is most of
    # its extra time: the rest (50 ms of 300 here) is Dynamo's first-run work outside torch's
    # compile callbacks; an eager module's first step is 1 ms longer than the others.
    hand = ip.user_ns["lit"].hand
    first = hand[0] - statistics.median(hand[2:])
    reading = read_compile(result.compiled, result.steps.columns, result.loop.wall_ms)
    assert reading is not None and 0.5 * first <= reading.per_step[0] <= hand[0], (reading.per_step, hand[:3])


def test_the_hugging_face_trainer_with_torch_compile_trains_as_without_the_magic(ip: Any) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    setup = HUGGING_FACE.replace("STEPS", str(HUGGING_FACE_STEPS))
    plain, _ = trained(ip, setup, HUGGING_FACE_CELL, magic=False)
    assert plain.compiles >= 1  # accelerate compiled the model
    with_magic, got = trained(ip, setup, HUGGING_FACE_CELL, magic=True)
    assert_as_plain(plain, with_magic)
    result = got.result
    assert result.steps.kind == "optimizer" and result.steps.n_steps == HUGGING_FACE_STEPS
    assert_compile_facts_are_torchs(result, with_magic)
    assert COMPILING_NOTE in result.notes and result.summary["parts_sampled_steps"] == 0
