"""What a step was, and the phases kept out of the steps, in words (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .data_sources import phase_remedy
from .number_text import pct


def step_definition(
    kind: str,
    optimizer: str | None,
    batches_per_step: float | None,
    loop_line: int | None = None,
    loop_where: str | None = None,
) -> str:
    """What a step was, in words ("a step = one `optimizer.step()` of SGD")."""
    if kind == "optimizer":
        text = f"a step = one `optimizer.step()` of {optimizer or 'the optimizer'}"
        if batches_per_step is not None and batches_per_step >= 1.5:
            near = round(batches_per_step)
            count = f"{near}" if abs(batches_per_step - near) < 0.1 else f"{batches_per_step:.1f}"
            text += f"; {count} batches per step: gradient accumulation"
        return text
    if kind == "backward":
        return "a step = one `backward()` (no optimizer step was seen)"
    if kind == "iteration":
        where = f" on line {loop_line}" if loop_line is not None else ""
        if where and loop_where and loop_where != "this cell":
            where += f" of {loop_where}"
        return "a step = one iteration of the loop" + where
    if kind == "fetch":
        return "a step = the time between two batches of the DataLoader (no loop, `backward()` or optimizer step was seen)"
    return "no step ran"


def phase_sentence(phase: Mapping[str, Any]) -> str:
    """"validation: 1.1 s, 48.0 % of the cell, 95.0 % of it waiting for `val_loader`"."""
    seconds = (phase.get("time_ms") or 0.0) / 1e3
    text = f"{phase['kind']}: {seconds:.3g} s"
    if phase.get("share_of_cell") is not None:
        text += f", {pct(phase['share_of_cell'])} of the cell"
    if phase.get("wait_share") is not None:
        text += f", {pct(phase['wait_share'])} of it waiting for {phase['label']}"
    passes, batches = phase.get("passes") or 0, phase.get("batches") or 0
    text += f" ({passes} pass{'es' if passes != 1 else ''}, {batches} batches"
    workers = phase.get("num_workers")
    if workers is not None:
        text += f", num_workers={workers}"
    return text + ")"


PHASE_SLOW_SHARE = 0.30  # a phase this share of the cell makes the cell slow on its own


def phase_verdict(phases: Sequence[Mapping[str, Any]]) -> str | None:
    """A line of its own for the phase that makes the cell slow (>= 30 % of it), else None."""
    slow = [p for p in phases if (p.get("share_of_cell") or 0.0) >= PHASE_SLOW_SHARE]
    if not slow:
        return None
    p = max(slow, key=lambda q: q["share_of_cell"])
    kind = str(p["kind"]).capitalize()
    text = f"{kind} takes {pct(p['share_of_cell'])} of the cell"
    wait = p.get("wait_share")
    if wait is not None and wait >= 0.5:
        workers = p.get("num_workers")
        seen = f" (num_workers={workers})" if workers is not None else ""
        return (
            f"{text}, {pct(wait)} of it waiting for {p['label']}{seen}: feed it faster too "
            f"({phase_remedy(p.get('source_kind'))}), or run it less often or on fewer batches."
        )
    return f"{text}: run it less often, or on fewer batches, to train faster."


