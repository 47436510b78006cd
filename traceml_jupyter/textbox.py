"""The seed-format text box: a verdict and three medians inside a 76-column border."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

WIDTH = 76


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}ms"


def _line(text: str) -> str:
    return "|" + text[:WIDTH].ljust(WIDTH) + "|"


def verdict_box(label: str, summary: Mapping[str, Any]) -> str:
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
