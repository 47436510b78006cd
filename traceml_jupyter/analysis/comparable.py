"""Whether two runs compare like for like: what differs between them that changes what their
ratio means (the hardware, torch, the batch size, what a step is, the clock), said before the
ratio."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .summary_keys import Summary

# Machine facts (Run.machine) whose difference changes what a ratio means, as users name them.
HARDWARE = (("gpu", "GPU"), ("cpu", "CPU"), ("cpus", "usable CPUs"))
VERSIONS = (("torch", "torch"), ("cuda", "CUDA"), ("python", "Python"))


def samples_per_step(summary: Summary) -> float | None:
    """Samples a step trains on (batch size x batches per step), when the batch size is known."""
    batch = summary.get("batch_size")
    return float(batch) * float(summary.get("batches_per_step") or 1.0) if batch else None


def _differs(name_a: str, a: Any, name_b: str, b: Any, what: str) -> str | None:
    if a is None and b is None or a == b:
        return None
    shown_a = "unknown" if a is None else str(a)
    shown_b = "unknown" if b is None else str(b)
    return f"{what}: {shown_a} ({name_a}) vs {shown_b} ({name_b})"


def caveats(
    name_a: str,
    summary_a: Summary,
    machine_a: Mapping[str, Any] | None,
    name_b: str,
    summary_b: Summary,
    machine_b: Mapping[str, Any] | None,
    check_machines: bool = True,
) -> list[str]:
    """What differs between the runs that changes what their ratio means, one sentence each;
    empty when they compare like for like. A machine of None: the run carries no record of it
    (a file saved by an older version); `check_machines` False: summaries alone are compared."""
    out = []
    hardware = []
    if not check_machines:
        pass
    elif machine_a is None or machine_b is None:
        older = ", ".join(n for n, m in ((name_a, machine_a), (name_b, machine_b)) if m is None)
        out.append(
            f"Hardware and versions not checked: {older} was saved without them "
            "(by an older traceml_jupyter)."
        )
    else:
        for key, what in HARDWARE:
            found = _differs(name_a, machine_a.get(key), name_b, machine_b.get(key), what)
            if found:
                hardware.append(found)
        if hardware:
            out.append("Different hardware: " + "; ".join(hardware) + ".")
        versions = [
            found
            for key, what in VERSIONS
            if (found := _differs(name_a, machine_a.get(key), name_b, machine_b.get(key), what))
        ]
        if versions:
            out.append("Different versions: " + "; ".join(versions) + ".")
    per_a, per_b = samples_per_step(summary_a), samples_per_step(summary_b)
    if per_a != per_b:
        if per_a and per_b:
            out.append(
                f"Different batch size: {per_a:g} samples a step ({name_a}) vs {per_b:g} "
                f"({name_b}): time per sample is compared, not time per step."
            )
        else:
            out.append(
                f"Batch size unknown for {name_a if not per_a else name_b}: steps are compared "
                "as if they did the same work."
            )
    kind_a, kind_b = summary_a.get("step_kind"), summary_b.get("step_kind")
    if kind_a != kind_b:
        out.append(
            f"Different step definition: {summary_a.get('step_definition') or kind_a} "
            f"({name_a}) vs {summary_b.get('step_definition') or kind_b} ({name_b})."
        )
    if summary_a.get("clock") != summary_b.get("clock"):
        out.append(
            f"{name_a} was timed on the {str(summary_a.get('clock')).upper()} clock and "
            f"{name_b} on the {str(summary_b.get('clock')).upper()} clock."
        )
    return out
