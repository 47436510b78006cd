"""`%traceml tune`: the DataLoader alone under candidate worker settings, against the model's rate.

    result = traceml_jupyter.tune(loader, budget=30)     # or: %traceml tune loader
    result.best       # {"num_workers": 2, "persistent_workers": True}
    result.code       # DataLoader(train_set, batch_size=64, num_workers=2, persistent_workers=True)

recipe.py rebuilds the user's loader per candidate; sandbox.py keeps the side effects inside
(budget, stop button, random states, worker processes); measure.py times one candidate;
model_rate.py reads the model's side; sweep.py runs the candidates; result.py, render.py and
progress.py hold and show what was measured.
"""

from __future__ import annotations

from .result import DEFAULT_BUDGET_S, TuneResult
from .sweep import TuneError, tune

__all__ = ["DEFAULT_BUDGET_S", "TuneError", "TuneResult", "tune"]
