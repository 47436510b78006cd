"""Two runs side by side: step time A -> B and the speed-up, data wait and compute deltas, the
verdict change, and a one-line conclusion. `compare_summaries` is the pure rule; given the runs'
per-step samples it judges the change against the noise (noise.py) and says first what makes
the runs unlike (comparable.py)."""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from .comparable import caveats as unlike
from .comparable import samples_per_step
from .noise import LEVEL, Change, ColumnChange, ColumnChangeRow, Judgement, analysed_samples, judge
from .number_text import ms as _ms
from .number_text import pct as _pct
from .resources import mib
from .summary_keys import Summary
from .verdict import VerdictLabel

# Within 5 % of each other, two runs are "about as fast": step times jitter by that much.
SAME_SPEED = 1.05
NO_VERDICT = (VerdictLabel.NO_DATA, VerdictLabel.WARMUP, VerdictLabel.TOO_SHORT)


class ComparisonRow(TypedDict):
    """A comparison as `%traceml compare --save` writes it (Comparison.to_dict)."""

    a: str
    b: str
    verdict_a: str
    verdict_b: str
    speedup: float | None
    conclusion: str
    rows: list[list[str]]
    notes: list[str]
    change: str | None
    speedup_interval: list[float | None] | None
    caveats: list[str]
    per_step: list[ColumnChangeRow]


@dataclass(frozen=True)
class Comparison:
    """Run A against run B. `speedup` > 1 means B does more work per second than A."""

    name_a: str
    name_b: str
    label_a: str
    label_b: str
    speedup: float | None
    conclusion: str
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # what, A, B, change
    notes: list[str] = field(default_factory=list)
    # Judged against the noise (from per-step samples; None from summaries alone):
    change: str | None = None  # IMPROVEMENT, REGRESSION, NO CHANGE or MIXED (noise.Change)
    speedup_low: float | None = None  # the speed-up's 95 % interval
    speedup_high: float | None = None
    caveats: list[str] = field(default_factory=list)  # what makes the runs unlike: said first
    per_step: list[ColumnChange] = field(default_factory=list)  # mean per step, A and B

    def text(self) -> str:
        """The comparison as plain text: the caveats, the conclusion, the table of medians and the
        notes."""
        lines = [f"traceml compare: {self.name_a} -> {self.name_b}"]
        lines.extend(f"  {caveat}" for caveat in self.caveats)
        lines.append(f"  {self.conclusion}")
        lines.extend(_aligned(self._table()))
        if self.per_step:
            lines.extend(_aligned(self._per_step_table()))
        lines.extend(f"  Note: {note}" for note in self.notes)
        if self.per_step:
            lines.append(f"  {NOISE_RULE}")
        return "\n".join(lines)

    def _per_step_table(self) -> list[tuple[str, str, str, str]]:
        head = ("Mean per step", self.name_a, self.name_b, f"change ({PERCENT} interval)")
        return [head, *(per_step_row(c) for c in self.per_step)]

    def _table(self) -> list[tuple[str, str, str, str]]:
        return [("", self.name_a, self.name_b, "change"), *self.rows]

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"<traceml comparison {self.name_a!r} -> {self.name_b!r}: {self.conclusion}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def _repr_html_(self) -> str:
        return comparison_html(self)

    def to_dict(self) -> ComparisonRow:
        """The comparison as JSON-ready values (what `%traceml compare` and `--save` write)."""
        return {
            "a": self.name_a,
            "b": self.name_b,
            "verdict_a": self.label_a,
            "verdict_b": self.label_b,
            "speedup": self.speedup,
            "conclusion": self.conclusion,
            "rows": [list(row) for row in self.rows],
            "notes": list(self.notes),
            "change": self.change,
            "speedup_interval": (
                None if self.speedup_low is None else [self.speedup_low, self.speedup_high]
            ),
            "caveats": list(self.caveats),
            "per_step": [c.to_dict() for c in self.per_step],
        }


PERCENT = f"{100 * LEVEL:.0f} %"
NOISE_RULE = (
    f"A change counts when its {PERCENT} interval (block bootstrap of the per-step means) "
    "excludes no change and it is 5 % or more; a part's change, 2 % of the step or more."
)


def _aligned(table: list[tuple[str, str, str, str]]) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    return [
        ("  " + "   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))).rstrip()
        for row in table
    ]


def _amount(value: float, unit: str) -> str:
    if unit == "ms":
        return _ms(value)
    return f"{value:,.4g} {unit}".rstrip()


def per_step_row(c: ColumnChange) -> tuple[str, str, str, str]:
    """One row of the mean-per-step table: A, B, and B - A with its interval and its meaning."""
    name = c.name if c.unit in ("", "ms") or c.unit in c.name else f"{c.name} ({c.unit})"
    if c.unit == "ms":
        change = f"{c.diff:+.1f} ms ({c.diff_low:+.1f} to {c.diff_high:+.1f})"
    else:
        change = f"{c.diff:+.4g} ({c.diff_low:+.4g} to {c.diff_high:+.4g})"
    if c.ratio is not None:
        change += f", {100 * (c.ratio - 1):+.0f} %"
    return name, _amount(c.a, c.unit), _amount(c.b, c.unit), f"{change}: {c.verdict}"


# -- the pure rule ------------------------------------------------------------------------------


def _delta_ms(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return ""
    text = f"{b - a:+.1f} ms"
    if a > 0:
        text += f" ({100 * (b - a) / a:+.0f} %)"
    return text


def _rate(summary: Summary) -> tuple[str, float | None]:
    """Work per second: samples/s where the batch size is known, else steps/s."""
    samples = summary.get("samples_per_s")
    if samples:
        return "samples/s", float(samples)
    steps = summary.get("steps_per_s")
    return "steps/s", float(steps) if steps else None


def speed_words(speedup: float) -> str:
    """'3.1x faster', '1.4x slower' or 'about as fast (1.02x)'."""
    if speedup >= SAME_SPEED:
        return f"{speedup:.1f}x faster"
    if speedup <= 1 / SAME_SPEED:
        return f"{1 / speedup:.1f}x slower"
    return f"about as fast ({speedup:.2f}x)"


def still_because(
    label: str, summary_b: Summary, workers_b: int | None, cpus: int | None
) -> str:
    """Why a verdict that did not change still holds, in a few words (empty when nothing to add)."""
    if label == VerdictLabel.INPUT_BOUND:
        if summary_b.get("cpu_saturated") or (workers_b and cpus and workers_b >= cpus):
            return "the CPU is now the ceiling"
        return f"data wait is still {_pct(summary_b.get('data_wait_share'))} of the step"
    if label == VerdictLabel.INPUT_STRAGGLER:
        return f"stalls still cost {_pct(summary_b.get('straggler_share'))} of the time"
    if label == VerdictLabel.COMPUTE_BOUND:
        return "the step itself is the ceiling"
    return ""


def _delta(a: float | None, b: float | None, unit: str) -> str:
    if a is None or b is None:
        return ""
    if unit == "MiB":
        text = ("+" if b >= a else "-") + mib(abs(b - a))
    else:
        text = f"{b - a:+.1f} {unit}"
    return text + (f" ({100 * (b - a) / a:+.0f} %)" if a > 0 else "")


def _resource_value(value: float | None, unit: str, summary: Summary) -> str:
    if value is None:
        return "n/a"
    if unit == "MiB":
        return mib(value)
    text = f"{value:.1f} of {summary.get('cpu_usable_cores') or 0:g}"
    return text + (" (saturated)" if summary.get("cpu_saturated") else "")


ResourceKey = Literal["gpu_mem_peak_mib", "cpu_cores", "host_rss_mib", "worker_uss_growth_mib"]
RESOURCE_ROWS: tuple[tuple[ResourceKey, str, str], ...] = (
    ("gpu_mem_peak_mib", "GPU memory peak (step)", "MiB"),
    ("cpu_cores", "CPU cores busy (process + workers)", "cores"),
    ("host_rss_mib", "Host memory (RSS, max)", "MiB"),
    ("worker_uss_growth_mib", "Worker memory growth", "MiB"),
)


def resource_rows(summary_a: Summary, summary_b: Summary) -> list[tuple[str, str, str, str]]:
    """Memory and CPU side by side (rows where either run measured them): the GPU memory peak,
    the cores busy in the process and its workers (and whether the CPU was saturated), the
    process's RSS, the growth of a worker's private memory."""
    rows = []
    for key, what, unit in RESOURCE_ROWS:
        a, b = summary_a.get(key), summary_b.get(key)
        if a is None and b is None:
            continue
        rows.append(
            (what, _resource_value(a, unit, summary_a), _resource_value(b, unit, summary_b), _delta(a, b, unit))
        )
    return rows


def mean_step(summary: Summary) -> float | None:
    """The analysed steps' mean step (stats), None where not measured."""
    stats = summary.get("stats", {}).get("step_ms")
    return stats["mean"] if stats else None


def summary_rows(
    a: tuple[Summary, str, float | None],
    b: tuple[Summary, str, float | None],
    unit: str,
    speedup: float | None,
    compute_name: str,
) -> list[tuple[str, str, str, str]]:
    """The comparison's table from the two summaries: (what, A, B, change) per row. `a`, `b`:
    each run's summary, verdict label and throughput in `unit`."""
    (summary_a, label_a, rate_a), (summary_b, label_b, rate_b) = a, b
    mean_a, mean_b = mean_step(summary_a), mean_step(summary_b)
    share_a, share_b = summary_a.get("data_wait_share"), summary_b.get("data_wait_share")
    share_change = (
        f"{100 * (share_b - share_a):+.1f} points"
        if share_a is not None and share_b is not None
        else ""
    )

    def medians(what: str, key: Literal["step_ms", "data_wait_ms", "compute_ms"]) -> tuple[str, str, str, str]:
        return (what, _ms(summary_a.get(key)), _ms(summary_b.get(key)), _delta_ms(summary_a.get(key), summary_b.get(key)))

    return [
        ("Verdict", label_a, label_b, "same" if label_a == label_b else "changed"),
        (
            f"Throughput ({unit})",
            f"{rate_a:.1f}" if rate_a else "n/a",
            f"{rate_b:.1f}" if rate_b else "n/a",
            speed_words(speedup) if speedup else "",
        ),
        medians("Step time (median)", "step_ms"),
        ("Step time (mean)", _ms(mean_a), _ms(mean_b), _delta_ms(mean_a, mean_b)),
        medians("Data wait (median)", "data_wait_ms"),
        medians(f"{compute_name} (median)", "compute_ms"),
        ("Data wait share", _pct(share_a), _pct(share_b), share_change),
        (
            "Analysed steps",
            str(summary_a.get("n_analysed", "n/a")),
            str(summary_b.get("n_analysed", "n/a")),
            "",
        ),
        *compile_rows(summary_a, summary_b),
        *resource_rows(summary_a, summary_b),
    ]


def _compiling(summary: Summary) -> str:
    seconds, share = summary.get("compile_s"), summary.get("compile_share")
    if seconds is None:
        return "none"
    steps = len(summary.get("compiling_steps") or [])
    return f"{seconds:.1f} s, {_pct(share)} of the cell, {steps} step(s)" if share is not None else f"{seconds:.1f} s"


def compile_rows(summary_a: Summary, summary_b: Summary) -> list[tuple[str, str, str, str]]:
    """torch.compile's time in each run (docs/compile.md), where either compiled."""
    a, b = summary_a.get("compile_s"), summary_b.get("compile_s")
    if a is None and b is None:
        return []
    change = f"{b - a:+.1f} s" if a is not None and b is not None else ""
    rows = [("Compiling (torch.compile)", _compiling(summary_a), _compiling(summary_b), change)]
    eager_a, eager_b = summary_a.get("eager_share"), summary_b.get("eager_share")
    if eager_a is not None or eager_b is not None:
        moved = f"{100 * (eager_b - eager_a):+.0f} points" if eager_a is not None and eager_b is not None else ""
        rows.append(("Eager between graphs (torch.compile)", _pct(eager_a), _pct(eager_b), moved))
    return rows


def _conclusion(
    label_a: str,
    label_b: str,
    summary_b: Summary,
    speedup: float,
    judgement: Judgement | None,
    workers_b: int | None,
    cpus: int | None,
) -> str:
    """The speed-up (judged against the noise when it could be) and the verdicts' change."""
    if label_a != label_b:
        verdicts = f"{label_a} -> {label_b}"
    else:
        reason = still_because(label_b, summary_b, workers_b, cpus)
        verdicts = f"still {label_b}" + (f": {reason}" if reason else "")
    if judgement is None:
        return f"{speed_words(speedup)}{':' if label_a != label_b else ';'} {verdicts}"
    return judged_words(judgement, verdicts)


def compare_summaries(
    name_a: str,
    summary_a: Summary,
    label_a: str,
    name_b: str,
    summary_b: Summary,
    label_b: str,
    workers_b: int | None = None,
    cpus: int | None = None,
    steps_a: Mapping[str, Any] | None = None,
    steps_b: Mapping[str, Any] | None = None,
    machine_a: Mapping[str, Any] | None = None,
    machine_b: Mapping[str, Any] | None = None,
) -> Comparison:
    """Compare two runs from their summaries (see `Run.summary`) and verdict labels.

    The speed-up is the ratio of throughputs (mean over the analysed steps, stalls included):
    samples/s when both batch sizes are known, else steps/s. `workers_b` (B's DataLoader
    workers) and `cpus` let the conclusion say when the CPU has become the ceiling.

    With both runs' per-step columns (`Run.steps`), the change is judged against the noise
    (noise.judge: IMPROVEMENT, REGRESSION, NO CHANGE or MIXED, with the speed-up's interval and
    each per-step quantity's change), and what makes the runs unlike is said first, from
    their summaries and `Run.machine` (None: not recorded).
    """
    unit_a, rate_a = _rate(summary_a)
    unit_b, rate_b = _rate(summary_b)
    if unit_a != unit_b:
        unit_a, rate_a = "steps/s", summary_a.get("steps_per_s")
        unit_b, rate_b = "steps/s", summary_b.get("steps_per_s")
    speedup = rate_b / rate_a if rate_a and rate_b else None
    compute_a = "GPU compute" if summary_a.get("clock") == "gpu" else "CPU compute"
    compute_b = "GPU compute" if summary_b.get("clock") == "gpu" else "CPU compute"
    compute_name = compute_a if compute_a == compute_b else "Compute"
    rows = summary_rows(
        (summary_a, label_a, rate_a), (summary_b, label_b, rate_b), unit_a, speedup, compute_name
    )
    sampled = steps_a is not None and steps_b is not None
    said_first = unlike(name_a, summary_a, machine_a, name_b, summary_b, machine_b, sampled)
    judgement = None
    if label_a not in NO_VERDICT and label_b not in NO_VERDICT and steps_a is not None and steps_b is not None:
        per_a, per_b = samples_per_step(summary_a), samples_per_step(summary_b)
        per_sample = per_a is not None and per_b is not None and per_a != per_b
        judgement = judge(
            analysed_samples(summary_a, steps_a, per_a if per_sample else None),
            analysed_samples(summary_b, steps_b, per_b if per_sample else None),
            "sample" if per_sample else "step",
            compute_name,
        )
    if label_a in NO_VERDICT or label_b in NO_VERDICT or speedup is None:
        empty = name_a if label_a in NO_VERDICT or not rate_a else name_b
        conclusion = f"No comparison: {empty} has too few analysed steps."
    else:
        conclusion = _conclusion(label_a, label_b, summary_b, speedup, judgement, workers_b, cpus)
    if judgement is None:
        return Comparison(
            name_a, name_b, label_a, label_b, speedup, conclusion, rows, [], caveats=said_first
        )
    if judgement.change == Change.NO_CHANGE and speedup:
        # the throughput row says what the conclusion says: no "1.1x faster" within the noise
        what, a, b, _ = rows[1]
        rows[1] = (what, a, b, f"{speedup:.2f}x: within noise")
    return Comparison(
        name_a,
        name_b,
        label_a,
        label_b,
        speedup,
        conclusion,
        rows,
        [],
        judgement.change.value,
        judgement.speedup_low,
        judgement.speedup_high,
        said_first,
        judgement.columns,
    )


def _times(speedup: float) -> str:
    return f"{speedup:.2f}x" if speedup < 10 else f"{speedup:.0f}x"


def judged_words(j: Judgement, verdicts: str) -> str:
    """The conclusion of a comparison judged against the noise: the label, the speed-up with its
    interval, what got slower when the step got faster, then the verdicts."""
    low, high = j.speedup_low, j.speedup_high
    per = " per sample" if j.per == "sample" else ""
    if j.change in (Change.IMPROVEMENT, Change.MIXED):
        words = f"{_times(j.speedup)} faster{per} ({PERCENT} interval {_times(low)} to {_times(high)})"
    elif j.change == Change.REGRESSION:
        words = (
            f"{_times(1 / j.speedup)} slower{per} ({PERCENT} interval {_times(1 / high)} to "
            f"{_times(1 / low)})"
        )
    else:
        words = (
            f"{_times(j.speedup)}{per}, {PERCENT} interval {_times(low)} to {_times(high)}"
        )
    if j.change == Change.MIXED:
        slower = ", ".join(
            f"{c.name} ({c.diff:+.1f} ms a step"
            + (f", {100 * (c.ratio - 1):+.0f} %)" if c.ratio is not None else ")")
            for c in j.slower_parts
        )
        words += f", but slower: {slower}"
    sure = j.how_sure
    if sure:
        words += f" ({sure})"
    label = "NO CHANGE (within noise)" if j.change == Change.NO_CHANGE else j.change.value
    return f"{label}: {words}; {verdicts}"


# -- the HTML view ------------------------------------------------------------------------------

_COLOURS = {"faster": "#1a7f37", "slower": "#b42318", "same": "#57606a", "mixed": "#a35200"}
_TONE_OF_CHANGE: dict[str, str] = {
    Change.IMPROVEMENT: "faster",
    Change.REGRESSION: "slower",
    Change.NO_CHANGE: "same",
    Change.MIXED: "mixed",
}


def comparison_html(c: Comparison) -> str:
    """Static HTML with inline CSS: survives nbconvert, nbviewer, GitHub and a page reload."""
    esc = html.escape
    tone = "same"
    if c.change is not None:
        tone = _TONE_OF_CHANGE.get(c.change, "same")
    elif c.speedup is not None and c.speedup >= SAME_SPEED:
        tone = "faster"
    elif c.speedup is not None and c.speedup <= 1 / SAME_SPEED:
        tone = "slower"
    cell = "padding:3px 10px;border-bottom:1px solid #e1e4e8;text-align:left"
    head = f"{cell};font-weight:600;background:#f6f8fa"

    def table(rows: list[tuple[str, str, str, str]], css: str) -> str:
        body = "".join(
            "<tr>"
            + f'<td style="{cell};color:#57606a">{esc(what)}</td>'
            + f'<td style="{cell}">{esc(a)}</td>'
            + f'<td style="{cell}">{esc(b)}</td>'
            + f'<td style="{cell};font-weight:600">{esc(change)}</td>'
            + "</tr>"
            for what, a, b, change in rows[1:]
        )
        heads = "".join(f'<th style="{head}">{esc(h)}</th>' for h in rows[0])
        return f'<table class="{css}" style="border-collapse:collapse;width:100%;margin-top:8px">' + (
            f"<tr>{heads}</tr>{body}</table>"
        )

    said_first = "".join(
        f'<div class="tml-caveat" style="color:#a35200;margin:2px 0">{esc(x)}</div>'
        for x in c.caveats
    )
    notes = "".join(
        f'<div style="color:#57606a;margin-top:4px">Note: {esc(note)}</div>' for note in c.notes
    )
    per_step = table(c._per_step_table(), "tml-per-step") if c.per_step else ""
    rule = (
        f'<div style="color:#57606a;margin-top:6px;font-size:12px">{esc(NOISE_RULE)}</div>'
        if c.per_step
        else ""
    )
    return (
        '<div class="traceml-compare" style="font-family:system-ui,-apple-system,sans-serif;'
        "font-size:13px;line-height:1.4;max-width:860px;border:1px solid #d0d7de;"
        'border-radius:6px;padding:10px 12px">'
        f'<div style="color:#57606a">traceml compare: <b>{esc(c.name_a)}</b> &rarr; '
        f"<b>{esc(c.name_b)}</b></div>{said_first}"
        f'<div class="tml-conclusion" style="font-size:16px;font-weight:600;margin:4px 0 0;'
        f'color:{_COLOURS[tone]}">{esc(c.conclusion)}</div>'
        f"{table(c._table(), 'tml-rows')}{per_step}{notes}{rule}</div>"
    )

