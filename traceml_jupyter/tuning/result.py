"""What `%traceml tune` measured and concluded (TuneResult), as text and HTML around the tune
table (render.py)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..analysis.number_text import ms as _ms
from ..analysis.tune_plan import rate_text
from ..analysis.tune_rows import CandidateRow, LoaderSettings, SplitRow
from .render import MODEL, split_text, table_html, table_lines

# The seconds a tune takes unless told otherwise.
DEFAULT_BUDGET_S = 30.0


class TuneRow(TypedDict):
    """A tune's result as its JSON holds it (TuneResult.to_dict; the checklist reads it)."""

    loader: str
    rows: list[CandidateRow]
    best: LoaderSettings
    best_settings: LoaderSettings | None
    keeps_up: bool
    model_batches_per_s: float | None
    model_source: str | None
    compute_ms: float | None
    batches_per_step: float | None
    baseline_step_ms: float | None
    predicted_step_ms: float | None
    predicted_speedup: float | None
    code: str | None
    split: SplitRow | None
    advice: list[str]
    notes: list[str]
    stopped: bool
    error: str | None
    budget_s: float
    elapsed_s: float
    cpus: int
    model_cpu_share: float | None


@dataclass
class TuneResult:
    """What `%traceml tune` measured and concluded.

    `rows`: one dict per candidate (settings, batches_per_s, startup_s, samples_measured, ...);
    `best`: the DataLoader keyword arguments to change; `code`: the line to write.
    """

    loader_label: str
    rows: list[CandidateRow]
    best: LoaderSettings
    best_settings: LoaderSettings | None
    keeps_up: bool
    model_batches_per_s: float | None
    model_source: str | None
    compute_ms: float | None
    batches_per_step: float | None
    baseline_step_ms: float | None
    predicted_step_ms: float | None
    predicted_speedup: float | None
    code: str | None
    split: SplitRow | None
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stopped: bool = False
    error: str | None = None
    budget_s: float = DEFAULT_BUDGET_S
    elapsed_s: float = 0.0
    cpus: int = 1
    model_cpu_share: float | None = None  # the model's compute that is CPU work (0..1)

    def to_dict(self) -> TuneRow:
        """The result as JSON-ready values (the checklist keeps it; `--save` writes it)."""
        return {
            "loader": self.loader_label,
            "rows": [r.copy() for r in self.rows],
            "best": self.best.copy(),
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


def result_text(result: TuneResult) -> str:
    """The result as plain text: the model's rate, the table, the advice, the line to write."""
    lines = [
        f"traceml tune: {result.loader_label}, {len(result.rows)} setting(s) in "
        f"{result.elapsed_s:.1f} s (budget {result.budget_s:g} s)"
    ]
    if result.stopped:
        lines.append("  Stopped: the table has what was measured before the stop.")
    if result.error:
        lines.append(f"  Error: {result.error}")
    if result.model_batches_per_s is not None:
        lines.append(
            f"  model: {rate_text(result.model_batches_per_s)} batches/s "
            f"({_ms(result.compute_ms)} compute a step, {result.batches_per_step or 1:g} "
            f"batch(es) a step; {result.model_source})"
        )
    else:
        lines.append("  model: rate unknown (no %%traceml run of this loader, no compute_ms=)")
    lines.extend(
        "  " + line
        for line in table_lines(result.rows, result.model_batches_per_s, result.best_settings)
    )
    lines.extend(f"  {a}" for a in result.advice)
    if result.code:
        lines.append(f"  Write: {result.code}")
    if result.split is not None and not any(
        a.startswith("At num_workers=0") for a in result.advice
    ):
        lines.append("  " + split_text(result.split))
    lines.extend(f"  Note: {n}" for n in result.notes)
    return "\n".join(lines)


def result_html(result: TuneResult) -> str:
    """The result as HTML: a bar per setting against the model's rate, the advice, the line to
    write."""
    e = html.escape
    model = result.model_batches_per_s
    model_line = (
        f"model: <b>{e(rate_text(model))}</b> batches/s ({e(_ms(result.compute_ms))} compute a "
        f"step, {result.batches_per_step or 1:g} batch(es) a step; {e(str(result.model_source))})"
        f' <span style="color:{MODEL}">&#9474;</span>'
        if model is not None
        else "model: rate unknown (no %%traceml run of this loader, no compute_ms=)"
    )
    parts = [
        '<div class="traceml-tune" style="font-family:var(--jp-ui-font-family,sans-serif);'
        'font-size:13px;line-height:1.5">',
        f"<div><b>traceml tune</b> {e(result.loader_label)}: {len(result.rows)} setting(s) in "
        f"{result.elapsed_s:.1f} s (budget {result.budget_s:g} s)</div>",
    ]
    if result.stopped:
        parts.append("<div><b>Stopped</b>: the table has what was measured before the stop.</div>")
    if result.error:
        parts.append(f"<div><b>Error</b>: {e(result.error)}</div>")
    parts.append(f"<div>{model_line}</div>")
    parts.append(table_html(result.rows, model, result.best_settings))
    parts.extend(f"<div>{e(a)}</div>" for a in result.advice)
    if result.code:
        parts.append(
            "<pre style='margin:4px 0;padding:4px 8px;background:rgba(127,127,127,.12)'>"
            f"{e(result.code)}</pre>"
        )
    if result.split is not None and not any(
        a.startswith("At num_workers=0") for a in result.advice
    ):
        parts.append(f"<div>{e(split_text(result.split))}</div>")
    parts.extend(f"<div><i>Note</i>: {e(n)}</div>" for n in result.notes)
    parts.append("</div>")
    return "".join(parts)


