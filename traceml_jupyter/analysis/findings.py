"""What the resource findings are (pure): a label and a Finding, shared by resources.py and the
findings beside it (threads.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TypedDict


class Label(str, Enum):
    """The labels of resource findings (OUT OF MEMORY, HIGH PRESSURE, CPU SATURATED, ...)."""

    OUT_OF_MEMORY = "OUT OF MEMORY"
    HIGH_PRESSURE = "HIGH PRESSURE"
    MEMORY_CREEP = "MEMORY CREEP"
    MEMORY_RISING = "MEMORY RISING"
    CPU_SATURATED = "CPU SATURATED"
    WORKER_MEMORY = "WORKER MEMORY GROWTH"
    HOST_MEMORY_CREEP = "HOST MEMORY CREEP"
    HOST_MEMORY_RISING = "HOST MEMORY RISING"
    HELD_BY_EARLIER_CELLS = "HELD BY EARLIER CELLS"
    KEPT_GRAPH = "KEPT GRAPH"
    OVERSUBSCRIBED = "CPU OVERSUBSCRIBED"


class FindingRow(TypedDict):
    """A finding as the summary's `resource_findings` and the JSON hold it."""

    label: str
    severity: str
    text: str
    next: str
    line: int | None


@dataclass(frozen=True)
class Finding:
    """One resource finding: a label, how serious, what was seen, what to do, and the cell
    line to change (None: none)."""

    label: Label
    severity: str  # "info", "warn" or "critical"
    text: str
    next: str
    line: int | None = None

    def sentence(self) -> str:
        """The finding in one line: its label, what was seen and what to do."""
        return f"{self.label.value}: {self.text} {self.next}".strip()

    def to_dict(self) -> FindingRow:
        """The finding as JSON-ready values."""
        return {
            "label": self.label.value,
            "severity": self.severity,
            "text": self.text,
            "next": self.next,
            "line": self.line,
        }
