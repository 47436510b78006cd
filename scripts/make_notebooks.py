"""Write the demo notebooks in notebooks/ from this script, so they stay tidy: no outputs,
stable cell ids, the python3 kernelspec. `--check` fails when a notebook differs.

    python scripts/make_notebooks.py          # write notebooks/*.ipynb
    python scripts/make_notebooks.py --check  # exit 1 if a notebook is not what this writes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import nbformat
from nbformat.notebooknode import NotebookNode

from traceml_jupyter.demo import FIXED_SPEEDUP, training_loop

v4: Any = nbformat.v4  # nbformat has no type hints

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
# Placeholder: the repository's public URL, used by the Colab, Kaggle and Binder links.
REPO = "traceml-jupyter/traceml_jupyter"
BRANCH = "main"

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}

INSTALL = """\
# On Colab or Kaggle, install traceml-jupyter first (elsewhere this cell does nothing).
import os
import sys

if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
    %pip install -q traceml-jupyter"""


def badges(name: str) -> str:
    path = f"notebooks/{name}"
    github = f"https://github.com/{REPO}/blob/{BRANCH}/{path}"
    colab = f"https://colab.research.google.com/github/{REPO}/blob/{BRANCH}/{path}"
    kaggle = f"https://kaggle.com/kernels/welcome?src={github}"
    binder = f"https://mybinder.org/v2/gh/{REPO}/{BRANCH}?urlpath=lab/tree/{path}"
    return (
        f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab}) "
        f"[![Open In Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]({kaggle}) "
        f"[![Binder](https://mybinder.org/badge_logo.svg)]({binder})"
    )


def loop(scenario: str) -> str:
    return f"%%traceml --name {scenario}\n" + training_loop(scenario).rstrip("\n")


def notebook(cells: list[tuple[str, str]]) -> NotebookNode:
    nb: NotebookNode = v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, source) in enumerate(cells):
        make = v4.new_markdown_cell if kind == "md" else v4.new_code_cell
        cell = make(source.strip("\n"))
        cell["id"] = f"cell-{i:02d}"  # stable ids: regenerating changes nothing
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def dataloader_bottleneck() -> NotebookNode:
    name = "dataloader_bottleneck.ipynb"
    return notebook(
        [
            (
                "md",
                f"""
# Is your DataLoader starving your GPU?

{badges(name)}

`%%traceml` on top of a training cell times every step of its loop: how long the loop
**waited for the next batch** (data wait) and how long the step itself took (compute). While
the cell runs a live chart shows both; when it ends a report says what bounds the loop.

This notebook tells the usual story in six steps on a plain CPU (two minutes or so):
a fast loader, a slow loader, the report, measuring the fix before applying it, the fix, and
a comparison. Then two more bottlenecks to recognise. On a GPU the same cells run, with the GPU's own clock.
""",
            ),
            ("code", INSTALL),
            (
                "code",
                """
%load_ext traceml_jupyter
import traceml_jupyter
import traceml_jupyter.demo as demo
""",
            ),
            (
                "md",
                """
## 1. A fast loader: the images are already in memory

`demo.setup("fast")` builds a real `TensorDataset` of images, a `DataLoader`, a small
image classifier, an optimizer and a loss. The loop below is the plain loop you would write.
Expect **COMPUTE-BOUND**: the batches are ready the moment the loop asks for them.
""",
            ),
            (
                "code",
                'loader, model, opt, loss_fn, device = demo.setup("fast")\n'
                "print(len(loader.dataset), 'images in a', type(loader.dataset).__name__, 'on', device)",
            ),
            ("code", loop("fast")),
            (
                "md",
                """
## 2. A slow loader: every image is decoded when it is read

Now each image is stored encoded and decoded in `__getitem__`, in the training process
itself (`num_workers=0`), as many first versions of a dataset do. The model and the loop are
the same. Watch the data wait in the chart.
""",
            ),
            (
                "code",
                'loader, model, opt, loss_fn, device = demo.setup("slow")\n'
                "print(type(loader.dataset).__name__, 'num_workers =', loader.num_workers)",
            ),
            ("code", loop("slow")),
            (
                "md",
                """
## 3. Read the report

The verdict is **INPUT-BOUND**: the loop spends a large share of every step waiting in
`next()` for the batch, while the model sits idle. The numbers are in the box, and the
checklist reads them off this `DataLoader`: `num_workers=0`, no persistent workers, (on a GPU)
no pinned memory and no `non_blocking` copies.

The run is also a Python object:
""",
            ),
            (
                "code",
                """
run = traceml_jupyter.last()
print(run.verdict, "- data wait is", f"{run.summary['data_wait_share']:.0%}", "of a step")
print(run.verdict_detail.next)
""",
            ),
            (
                "md",
                """
## 4. Measure the fix before you apply it

How many workers does this loader need? `%traceml tune` answers in seconds, without training:
it iterates the loader alone (no model, no optimizer) at `num_workers=0, 1, 2, ...`, measures
the batches a second each setting makes, and sets them against the rate at which the model
took batches in the run above. The smallest setting that makes batches 1.2x faster than the
model takes them keeps it fed; the step is then the compute plus what taking each batch from
the workers costs the training process (tune times that too), and the speed-up follows.
It measures each setting for a few seconds and stops at its budget (here 15 s, by default
30 s); the chart fills in as it goes.
""",
            ),
            ("code", "tuned = %traceml tune --budget 15\ntuned"),
            (
                "md",
                """
`tuned.best` is what to change on the `DataLoader`, `tuned.code` the line to write, and
`tuned.predicted_speedup` what to expect. The table also says where a batch's time goes at
`num_workers=0`: here almost all of it in the dataset's `__getitem__` (the decode).
""",
            ),
            (
                "code",
                'print("change:", tuned.best)\n'
                'print(f"predicted: {tuned.predicted_speedup:.1f}x faster")',
            ),
            (
                "md",
                """
## 5. Apply the fix

The same data, with the checklist applied: worker processes decode batches while the model
trains (`num_workers`, one per core: at least 2, at most 4; compare with what tune found),
they stay alive between epochs (`persistent_workers=True`), and on a GPU batches are pinned
(`pin_memory=True`) and copied with `non_blocking=True`.
""",
            ),
            (
                "code",
                'loader, model, opt, loss_fn, device = demo.setup("fixed")\n'
                "print('num_workers =', loader.num_workers, '| persistent_workers =', "
                "loader.persistent_workers, '| pin_memory =', loader.pin_memory)",
            ),
            ("code", loop("fixed")),
            (
                "md",
                f"""
## 6. Compare

`%traceml compare A B` puts two runs side by side. Expect the fixed loop to be
**at least {FIXED_SPEEDUP:g}x faster** than the slow one, with most of its data wait gone
(COMPUTE-BOUND). On a busy machine the workers can still fall behind now and then; the
verdict then names what is left: a smaller INPUT-BOUND share, or a few stalls (INPUT
STRAGGLER). On a machine with few cores the workers also take CPU from the model: the
comparison then says MIXED — faster, but compute slower — which is the price of the fix
(the Resources part of the report shows the cores it uses).
""",
            ),
            ("code", "%traceml compare slow fixed"),
            ("md", "What tune predicted, against what the fixed run measured:"),
            (
                "code",
                """
slow, fixed = [r for r in traceml_jupyter.runs() if r.name in ("slow", "fixed")][-2:]
measured = slow.summary["step_ms"] / fixed.summary["step_ms"]
print(f"tune predicted {tuned.predicted_speedup:.1f}x, the fixed run measured {measured:.1f}x")
""",
            ),
            (
                "md",
                """
## Two more bottlenecks to recognise

**An expensive `collate_fn`.** The dataset is cheap, but the function that builds each
batch augments every sample in Python. The time still lands in `next()`: **INPUT-BOUND**,
and the checklist points at the custom `collate_fn`.
""",
            ),
            ("code", 'loader, model, opt, loss_fn, device = demo.setup("collate")'),
            ("code", loop("collate")),
            (
                "md",
                """
**Workers that restart every epoch.** Worker processes keep up once they run, but with
`persistent_workers=False` they are started again at every epoch, and each opens its shards
first. Most steps are fast; the first batch of each epoch stalls: **INPUT STRAGGLER**.
""",
            ),
            ("code", 'loader, model, opt, loss_fn, device = demo.setup("spiky")'),
            ("code", loop("spiky")),
            (
                "md",
                """
Every run of this kernel, oldest first:
""",
            ),
            (
                "code",
                "for r in traceml_jupyter.runs():\n"
                "    print(f\"{r.name:8} {r.verdict:16} {r.summary['step_ms']:7.1f} ms a step\")",
            ),
        ]
    )


def loops_in_functions() -> NotebookNode:
    name = "loops_in_functions.ipynb"
    return notebook(
        [
            (
                "md",
                f"""
# `%%traceml` finds the loop where it is

{badges(name)}

Training loops often live in a function defined in another cell, or in a trainer class.
`%%traceml` follows the call from the traced cell into code defined in this notebook and
times the loop there. When the loop is out of sight (library code), steps are what the
training does: each `optimizer.step()`, with the time blocked in every `DataLoader` fetch as
data wait. All three runs below use the slow loader, so all three say **INPUT-BOUND**.
""",
            ),
            ("code", INSTALL),
            (
                "code",
                """
%load_ext traceml_jupyter
import traceml_jupyter
import traceml_jupyter.demo as demo

loader, model, opt, loss_fn, device = demo.setup("slow", batches=10)
""",
            ),
            ("md", "## A loop inside a function defined in another cell"),
            (
                "code",
                """
def train(loader, model, opt, loss_fn, device, epochs=1):
    for epoch in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
""",
            ),
            (
                "code",
                "%%traceml --name function\ntrain(loader, model, opt, loss_fn, device, epochs=2)",
            ),
            ("md", "## A trainer class that owns its loop"),
            (
                "code",
                """
class Trainer:
    def __init__(self, model, opt, loss_fn, device):
        self.model, self.opt, self.loss_fn, self.device = model, opt, loss_fn, device

    def fit(self, loader, epochs=1):
        for epoch in range(epochs):
            for x, y in loader:
                x, y = x.to(self.device), y.to(self.device)
                self.opt.zero_grad()
                loss = self.loss_fn(self.model(x), y)
                loss.backward()
                self.opt.step()
        return self


trainer = Trainer(model, opt, loss_fn, device)
""",
            ),
            ("code", "%%traceml --name trainer\ntrainer.fit(loader, epochs=2)"),
            (
                "md",
                """
## A library trainer whose loop the magic cannot see

`demo.library_fit` is library code: it pulls batches with `next()` in a `while` loop, in a
module the notebook did not define. `%%traceml` cannot rewrite that loop and does not need to:
a step is one `optimizer.step()` (the same hook sees the optimizers inside Hugging Face's
`Trainer`, Lightning or fastai), and every `DataLoader` fetch is data wait.
""",
            ),
            (
                "code",
                "%%traceml --name library\ndemo.library_fit(loader, model, opt, loss_fn, device, epochs=2)",
            ),
            ("md", "Where each loop was found, or what a step was:"),
            (
                "code",
                'for r in traceml_jupyter.runs():\n    print(f"{r.name:8} {r.verdict:12} {r.result.loop.where or r.result.steps.definition}")',
            ),
        ]
    )


BUILDERS = {
    "dataloader_bottleneck.ipynb": dataloader_bottleneck,
    "loops_in_functions.ipynb": loops_in_functions,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    stale = []
    for name, build in BUILDERS.items():
        path = NOTEBOOKS / name
        text = nbformat.writes(build()) + "\n"  # type: ignore[no-untyped-call]
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"not what scripts/make_notebooks.py writes: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
