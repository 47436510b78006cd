"""Benchmark results as markdown tables, and the machine they were measured on."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from dataclasses import dataclass, field


@dataclass
class Table:
    """One result table: printed to the terminal and written into docs/benchmarks.md."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        out = [f"### {self.title}", ""]
        if self.rows:
            out.append("| " + " | ".join(self.headers) + " |")
            out.append("|" + "|".join(" --- " for _ in self.headers) + "|")
            out.extend("| " + " | ".join(row) + " |" for row in self.rows)
            out.append("")
        out.extend(f"- {note}" for note in self.notes)
        return "\n".join(out).rstrip() + "\n"


def show(tables: list[Table]) -> None:
    for table in tables:
        print(table.markdown(), flush=True)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    """What the numbers depend on: CPU, cores, Python and library versions, date."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
    }
    for name in ("torch", "numpy", "IPython", "ipywidgets", "bqplot"):
        try:
            module = __import__(name)
            info[name] = str(getattr(module, "__version__", "?"))
        except ImportError:
            info[name] = "not installed"
    if hasattr(os, "getloadavg"):
        info["load average (1, 5, 15 min)"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        import torch

        info["torch threads"] = str(torch.get_num_threads())
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def machine_table() -> Table:
    info = machine()
    return Table("Machine", ["what", "value"], [[k, v] for k, v in info.items()])


def spread(values: list[float]) -> tuple[float, float, float]:
    """Median, min and max of repeated measurements."""
    return statistics.median(values), min(values), max(values)


def noise_of(slopes: list[float]) -> float:
    """Half the spread of the plain loop's per-repeat slopes: a cost below twice this is not
    resolved (the benchmarks' one rule for noise)."""
    return (max(slopes) - min(slopes)) / 2


def num(value: float | None, digits: int = 1) -> str:
    if value is None or value != value:
        return "—"
    return f"{value:,.{digits}f}"


def with_range(values: list[float], digits: int = 1) -> str:
    """'median [min..max]' of the repeats, so the noise is visible next to the number."""
    if not values:
        return "—"
    med, lo, hi = spread(values)
    if len(values) == 1:
        return num(med, digits)
    return f"{num(med, digits)} [{num(lo, digits)}..{num(hi, digits)}]"


def target(ok: bool | None, what: str) -> str:
    """A target cell: met, MISSED (bold, so it is seen), or not measured."""
    if ok is None:
        return f"not measured ({what})"
    return f"met ({what})" if ok else f"**MISSED** ({what})"
