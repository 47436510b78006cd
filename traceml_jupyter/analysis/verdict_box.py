"""The seed-format text box: a verdict and the three headline means inside a 76-column border
(docs/verdicts.md, "Which figure is which"), and, for several processes, the per-rank table under
it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .number_text import ms
from .summary_keys import Summary

WIDTH = 76


def _ms(value: float | None) -> str:
    return ms(value, unit="ms")


def _line(text: str) -> str:
    return "|" + text[:WIDTH].ljust(WIDTH) + "|"


def headline_ms(summary: Summary, key: str) -> float | None:
    """The box's figure for `key` ("data_wait_ms", "compute_ms", "step_ms"): the mean over every
    step (they add up, and steps x step is the loop's time); the median for a run saved before."""
    means = {
        "data_wait_ms": summary.get("mean_data_wait_ms"),
        "compute_ms": summary.get("mean_compute_ms"),
        "step_ms": summary.get("mean_step_ms"),
    }
    medians = {"data_wait_ms": summary.get("data_wait_ms"), "compute_ms": summary.get("compute_ms"), "step_ms": summary.get("step_ms")}
    return means[key] if summary.get("mean_step_ms") is not None else medians[key]


# The warm-up gets its own line in the box when it holds this share of the loop's time or more;
# the time between the steps (in no step: a stopwatch around the loop counts it) from this one.
WARMUP_LINE_SHARE = 0.05
OUTSIDE_LINE_SHARE = 0.02


def box_notes(summary: Summary) -> list[str]:
    """The lines under the box's numbers: the steps' shape where one figure does not describe them
    ("typical step 1.7ms; every 2nd step waits 28.0ms"), a warm-up that holds a share of the
    loop's time that the verdict does not read, and time between the steps that no step holds."""
    notes = []
    text = (summary.get("step_pattern") or {}).get("text")
    if text:
        notes.append(str(text).replace(" ms", "ms"))
    warm, loop, n = summary.get("warmup_ms"), summary.get("loop_ms"), summary.get("warmup_steps")
    if warm and loop and n and warm >= WARMUP_LINE_SHARE * loop:
        steps = f"first {n} steps" if n > 1 else "the first step"
        kind = "compiling" if summary.get("compiling_steps") else "warm-up"  # docs/compile.md
        notes.append(f"{kind} ({steps}, not in the verdict): {_ms(warm)} of {_ms(loop)}")
    outside = summary.get("outside_steps_ms")
    if outside and loop and outside >= OUTSIDE_LINE_SHARE * loop:
        notes.append(f"{_ms(outside)} between the steps (phases, traceml's own set-up)")
    return notes


def verdict_box(label: str, summary: Summary) -> str:
    """The text box printed under a traced cell: the verdict's label, then the mean data wait,
    compute and step time over every step (they add up, and steps x step time is the loop's
    time), and a line for the steps' shape or the warm-up where the means alone mislead."""
    compute_name = "GPU compute" if summary.get("clock") == "gpu" else "CPU compute"
    numbers = (
        f"  - Data wait: {_ms(headline_ms(summary, 'data_wait_ms'))} | "
        f"{compute_name}: {_ms(headline_ms(summary, 'compute_ms'))} | "
        f"Step time: {_ms(headline_ms(summary, 'step_ms'))}"
    )
    border = "+" + "-" * WIDTH + "+"
    notes = [_line(f"  - {note[0].upper()}{note[1:]}") for note in box_notes(summary)]
    return "\n".join([border, _line(f"  Step Time: {label}"), _line(numbers), *notes, border])


def report_text(name: str, label: str, why: str, next_step: str, summary: Summary) -> str:
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
