"""What `%traceml tune` measured and concluded (TuneResult), shown by render.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .render import result_html, result_text

# The seconds a tune takes unless told otherwise.
DEFAULT_BUDGET_S = 30.0


@dataclass
class TuneResult:
    """What `%traceml tune` measured and concluded.

    `rows`: one dict per candidate (settings, batches_per_s, startup_s, samples_measured, ...);
    `best`: the DataLoader keyword arguments to change; `code`: the line to write.
    """

    loader_label: str
    rows: list[dict[str, Any]]
    best: dict[str, Any]
    best_settings: dict[str, Any] | None
    keeps_up: bool
    model_batches_per_s: float | None
    model_source: str | None
    compute_ms: float | None
    batches_per_step: float | None
    baseline_step_ms: float | None
    predicted_step_ms: float | None
    predicted_speedup: float | None
    code: str | None
    split: dict[str, Any] | None
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stopped: bool = False
    error: str | None = None
    budget_s: float = DEFAULT_BUDGET_S
    elapsed_s: float = 0.0
    cpus: int = 1
    model_cpu_share: float | None = None  # the model's compute that is CPU work (0..1)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready values (the checklist keeps it; `--save` writes it)."""
        return {
            "loader": self.loader_label,
            "rows": [dict(r) for r in self.rows],
            "best": dict(self.best),
            "best_settings": self.best_settings,
            "keeps_up": self.keeps_up,
            "model_batches_per_s": self.model_batches_per_s,
            "model_source": self.model_source,
            "compute_ms": self.compute_ms,
            "batches_per_step": self.batches_per_step,
            "baseline_step_ms": self.baseline_step_ms,
            "predicted_step_ms": self.predicted_step_ms,
            "predicted_speedup": self.predicted_speedup,
            "code": self.code,
            "split": self.split,
            "advice": list(self.advice),
            "notes": list(self.notes),
            "stopped": self.stopped,
            "error": self.error,
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s,
            "cpus": self.cpus,
            "model_cpu_share": self.model_cpu_share,
        }

    def text(self) -> str:
        """The result as plain text (what a terminal prints)."""
        return result_text(self)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        head = f"<traceml tune {self.loader_label}: best {self.best or 'unchanged'}"
        if self.predicted_speedup is not None:
            head += f", predicted {self.predicted_speedup:.2f}x"
        return head + ">"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def _repr_html_(self) -> str:
        return result_html(self)
