"""The seed-format text box: a verdict and three medians inside a 76-column border (and, for
several processes, the per-rank table under it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .number_text import ms

WIDTH = 76


def _ms(value: float | None) -> str:
    return ms(value, unit="ms")


def _line(text: str) -> str:
    return "|" + text[:WIDTH].ljust(WIDTH) + "|"


def verdict_box(label: str, summary: Mapping[str, Any]) -> str:
    """The text box printed under a traced cell: the verdict's label, data wait, compute and step
    time."""
    compute_name = "GPU compute" if summary.get("clock") == "gpu" else "CPU compute"
    numbers = (
        f"  - Data wait: {_ms(summary.get('data_wait_ms'))} | "
        f"{compute_name}: {_ms(summary.get('compute_ms'))} | "
        f"Step time: {_ms(summary.get('step_ms'))}"
    )
    border = "+" + "-" * WIDTH + "+"
    return "\n".join([border, _line(f"  Step Time: {label}"), _line(numbers), border])


def report_text(name: str, label: str, why: str, next_step: str, summary: Mapping[str, Any]) -> str:
    """The box, then Why and Next, as a terminal shows it."""
    return f"{name}\n{verdict_box(label, summary)}\nWhy: {why}\nNext: {next_step}"


def rank_table(ranks: Sequence[Mapping[str, Any]], straggler: Mapping[str, Any] | None, notes: Sequence[str] = ()) -> str:
    """Several processes: one line per rank (medians per step), the straggler marked with `*`,
    then what the ranks' numbers alone do not say (failures, uneven data)."""
    late = straggler.get("rank") if straggler else None
    columns = ("data wait", "compute", "forward", "backward", "optimizer", "step time")
    keys = ("data_wait_ms", "compute_ms", "forward_ms", "backward_ms", "optimizer_ms", "step_ms")
    head = f"  {'rank':>4}  {'steps':>6}  " + "  ".join(f"{c:>10}" for c in columns) + "  status"
    lines = ["Ranks (median per step; * holds the others back):", head]
    for r in ranks:
        mark = "*" if r.get("rank") == late else " "
        numbers = "  ".join(f"{_ms(r.get(k)):>10}" for k in keys)
        lines.append(f"{mark} {r.get('rank')!s:>4}  {r.get('n_steps') or 0:>6}  {numbers}  {r.get('status') or 'finished'}")
    lines.extend(f"Ranks: {note}" for note in notes)
    return "\n".join(lines)
