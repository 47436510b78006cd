"""The live chart's lanes inside the DataLoader in a real kernel (nbclient): a traced loop over a
loader with 2 forked workers grows a lane per worker, sent through the kernel's comms and saved
with the notebook — a bar per batch each worker made, as the dataset counts them itself."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from jupyter_harness import (
    KERNEL_NAME,
    ensure_python3_kernel,
    model_arrays,
    notebook,
    widget_models,
)

from traceml_jupyter.views.live_lanes import STAGES, bars_per_lane

nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.kernel

# 48 batches of 4 samples of 25 ms over 2 workers: about 2.4 s, the chart's widgets come about
# a second in. Each sample notes which worker made it (the test's own count).
LOADER = """\
import json, os, tempfile, time, torch
from torch.utils.data import DataLoader, Dataset, get_worker_info
LOG = tempfile.mkdtemp()

class Slow(Dataset):
    def __len__(self):
        return 192

    def __getitem__(self, i):
        time.sleep(0.025)
        with open(os.path.join(LOG, f"{get_worker_info().id}.txt"), "a") as f:
            f.write(f"{i}\\n")
        return torch.randn(16), i % 2

loader = DataLoader(Slow(), batch_size=4, num_workers=2, multiprocessing_context="fork")"""
TRACED = """\
%%traceml --name lanes
for x, y in loader:
    x.sum()"""
OWN_COUNT = """\
own = {}
for name in os.listdir(LOG):
    with open(os.path.join(LOG, name)) as f:
        own[name.split(".")[0]] = sum(1 for line in f if line.strip()) // 4
print(json.dumps(own))"""


def test_a_two_worker_loader_saves_a_lane_per_worker_with_a_bar_per_batch() -> None:
    ensure_python3_kernel()
    nb = notebook("%load_ext traceml_jupyter", LOADER, TRACED, OWN_COUNT)
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TRACEML_LIVE", raising=False)  # the kernel detects its front-end itself
        nbclient.NotebookClient(nb, timeout=120, startup_timeout=60, kernel_name=KERNEL_NAME).execute()
    own = {int(k): n for k, n in json.loads(nb.cells[3].outputs[0]["text"]).items()}
    assert sorted(own) == [0, 1] and sum(own.values()) == 48
    assert not [o for o in nb.cells[2].outputs if o["output_type"] == "error"]
    models = widget_models(nb)
    lanes: list[dict[str, Any]] = [
        m for m in models.values() if m["model_name"] == "LinesModel" and m["state"].get("labels") == list(STAGES)
    ]
    assert len(lanes) == 1, [m["model_name"] for m in models.values()]
    y = model_arrays(lanes[0])["y"]
    assert y.shape[0] == len(STAGES)
    assert bars_per_lane(np.asarray(y)) == own
    headers = [m["state"].get("value", "") for m in models.values() if m["model_name"] == "HTMLModel"]
    assert any(all(f"worker {w}: {n} batches" in h for w, n in own.items()) for h in headers)
