"""Run-to-run noise: whether two runs really differ. Block-bootstrap intervals of the per-step
means of both runs, and the rule that calls the change IMPROVEMENT, REGRESSION, NO CHANGE or
MIXED, for the step and for every part or resource column both runs measured.

Why means: throughput is one over the mean step (stalls count: a fix that removes each epoch's
start-up wait changes the mean, not the median), and means add up, so the parts explain the
step. Why blocks: step times are serially correlated (they drift as a machine warms, a loader
slows between epochs); resampling single steps as if independent would shrink the interval.
Each run is cut into consecutive blocks (about n^(1/3) steps, at most MAX_BLOCKS blocks, so a
long run's drift stays inside the interval) and the blocks are resampled. A block's sum and
count are computed once, so a replicate costs MAX_BLOCKS additions whatever the run's length:
10^5 kept steps cost the same as 10^3. Seeded: the same runs always give the same interval.

Why a floor: two runs of the same unchanged code differ by more than either run's own
step-to-step spread says (other processes, the allocator's state, the CPU's clock), which no
single pair of runs can measure. A change counts when its interval excludes "no change" and it
is at least SAME_SPEED (5 %); a part's change also has to move the step by PART_OF_STEP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypedDict

import numpy as np

from .summary_keys import Summary

REPLICATES = 2000
LEVEL = 0.95
SEED = 21
MAX_BLOCKS = 16
SAME_SPEED = 1.05  # a change under 5 % is within what two runs of the same code differ by
PART_OF_STEP = 0.02  # a part's change counts for MIXED when it moves the step by 2 % or more
MIN_STEPS = 2  # analysed steps a run needs for an interval
SURE_STEPS = 20  # with fewer analysed steps in either run, the conclusion says it is rough
SURE_SPAN = 1.5  # ... and when the speed-up's interval spans more than this factor

# Columns every run has (compared as the step, data wait and compute on the run's clock) and
# bookkeeping: not compared as extra columns.
STEP_COLUMNS = ("data_wait_ms", "compute_ms", "step_ms")
GPU_OF = {"data_wait_ms": "data_wait_gpu_ms", "compute_ms": "compute_gpu_ms", "step_ms": "step_gpu_ms"}
NOT_EXTRA = frozenset({"step", "time_s", *STEP_COLUMNS, *GPU_OF.values()})
NOT_A_PART = frozenset({"gpu_backlog_ms"})  # time measured at a step, not time the step spent
UNITS = {"_ms": "ms", "_mib": "MiB", "_bytes": "B", "_pct": "%", "_share": ""}


class Change(str, Enum):
    """What changed from run A to run B, with the noise taken into account."""

    IMPROVEMENT = "IMPROVEMENT"
    REGRESSION = "REGRESSION"
    NO_CHANGE = "NO CHANGE"
    MIXED = "MIXED"  # the step got faster, a part of it slower


class ColumnChangeRow(TypedDict):
    """A per-step quantity's change as a comparison's JSON holds it (ColumnChange.to_dict)."""

    name: str
    column: str
    unit: str
    a: float
    b: float
    diff: float
    diff_interval: list[float]
    ratio: float | None
    ratio_interval: list[float | None] | None
    verdict: str
    part: bool


@dataclass(frozen=True)
class ColumnChange:
    """One per-step quantity in both runs: its mean per step in A and B, B - A and B / A with
    their intervals, and what that means ("faster", "slower", "higher", "lower", "within
    noise"). `part`: a time the step spends (it can make a faster step MIXED)."""

    name: str  # as users read it: "Step time", "Data wait", "forward"
    column: str  # the per-step column: "step_ms", "forward_ms", "gpu_mem_used_mib"
    unit: str
    a: float
    b: float
    diff: float
    diff_low: float
    diff_high: float
    ratio: float | None  # None when A's mean is 0
    ratio_low: float | None
    ratio_high: float | None
    verdict: str
    part: bool

    @property
    def counts(self) -> bool:
        """The change is beyond run-to-run noise (faster or slower)."""
        return self.verdict != "within noise"

    def to_dict(self) -> ColumnChangeRow:
        """The change as JSON-ready values."""
        return {
            "name": self.name,
            "column": self.column,
            "unit": self.unit,
            "a": self.a,
            "b": self.b,
            "diff": self.diff,
            "diff_interval": [self.diff_low, self.diff_high],
            "ratio": self.ratio,
            "ratio_interval": None if self.ratio is None else [self.ratio_low, self.ratio_high],
            "verdict": self.verdict,
            "part": self.part,
        }


@dataclass(frozen=True)
class Judgement:
    """The change from A to B: its label, the speed-up (work per second, B over A) with its
    interval, and each per-step quantity's change (the step first)."""

    change: Change
    speedup: float
    speedup_low: float
    speedup_high: float
    per: str  # "step" or "sample" (the batch sizes differ: time per sample is compared)
    columns: list[ColumnChange] = field(default_factory=list)
    steps: tuple[int, int] = (0, 0)  # the analysed steps of A and of B

    @property
    def how_sure(self) -> str | None:
        """"from 8 and 9 steps: a rough interval; run both longer to narrow it" when either run
        has fewer than SURE_STEPS analysed steps or the speed-up's interval spans more than
        SURE_SPAN (its high bound over its low), else None."""
        few = min(self.steps) < SURE_STEPS
        wide = self.speedup_low > 0 and self.speedup_high / self.speedup_low > SURE_SPAN
        if not (few or wide):
            return None
        why = f"from {self.steps[0]} and {self.steps[1]} steps" if few else "the steps vary a lot"
        return f"{why}: a rough interval; run both longer to narrow it"

    @property
    def slower_parts(self) -> list[ColumnChange]:
        """The parts of the step (data wait, compute, ...) that got slower beyond noise."""
        return [c for c in self.columns[1:] if c.part and c.verdict == "slower"]


# -- per-step samples -------------------------------------------------------------------------


def column_label(column: str) -> tuple[str, str]:
    """A column's name as users read it and its unit: 'forward_ms' -> ('forward', 'ms'),
    'gpu_mem_used_mib' -> ('gpu mem used', 'MiB')."""
    for suffix, unit in UNITS.items():
        if column.endswith(suffix):
            return column[: -len(suffix)].replace("_", " "), unit
    return column.replace("_", " "), ""


def analysed_samples(
    summary: Summary, columns: Mapping[str, Any], per_sample: float | None = None
) -> dict[str, np.ndarray]:
    """The analysed steps' values (after the warm-up, on the run's clock): step_ms, data_wait_ms,
    compute_ms, then every other numeric per-step column. Times are divided by `per_sample`
    (samples a step) when given, so runs of different batch sizes compare per sample."""
    steps = np.asarray(columns.get("step", ()), dtype=np.float64)
    analysed = steps >= float(summary.get("warmup_steps") or 0)
    on_gpu = summary.get("clock") == "gpu"
    out: dict[str, np.ndarray] = {}
    names = [GPU_OF[c] if on_gpu else c for c in ("step_ms", "data_wait_ms", "compute_ms")]
    names += sorted(str(c) for c in columns if c not in NOT_EXTRA)
    for name, key in zip(("step_ms", "data_wait_ms", "compute_ms"), names[:3], strict=True):
        values = _column(columns.get(key), len(steps))
        if values is not None:
            out[name] = values[analysed] / (per_sample or 1.0)
    for key in names[3:]:
        values = _column(columns.get(key), len(steps))
        if values is not None:
            scale = per_sample if per_sample and key.endswith("_ms") else 1.0
            out[key] = values[analysed] / scale
    return out


def _column(values: Any, n: int) -> np.ndarray | None:
    """A per-step column as float64 (None for missing values: NaN), or None when it is not one."""
    if values is None:
        return None
    try:
        array = np.asarray(values, dtype=np.float64)  # JSON's null becomes NaN
    except (TypeError, ValueError):
        return None
    return array if array.ndim == 1 and len(array) == n else None


# -- the block bootstrap ------------------------------------------------------------------------


def block_edges(n: int) -> np.ndarray:
    """Where the blocks of a run of n analysed steps start (and the end): about n^(1/3) steps a
    block, at most MAX_BLOCKS blocks."""
    length = max(1, round(n ** (1 / 3)), math.ceil(n / MAX_BLOCKS))
    count = max(1, n // length)
    return np.linspace(0, n, count + 1).round().astype(np.int64)


def replicate_means(
    samples: Mapping[str, np.ndarray], rng: np.random.Generator, replicates: int = REPLICATES
) -> dict[str, np.ndarray]:
    """Each column's mean per step in `replicates` block-bootstrap resamples of one run (the
    same blocks drawn for every column, so parts and step stay consistent); NaN values are left
    out of their block."""
    n = len(next(iter(samples.values()), ()))
    if n < MIN_STEPS:
        return {}
    edges = block_edges(n)
    draws = rng.integers(0, len(edges) - 1, size=(replicates, len(edges) - 1))
    out = {}
    for name, values in samples.items():
        ok = np.isfinite(values)
        sums = np.add.reduceat(np.where(ok, values, 0.0), edges[:-1])
        counts = np.add.reduceat(ok.astype(np.float64), edges[:-1])
        with np.errstate(invalid="ignore", divide="ignore"):
            out[name] = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    return out


def widening(blocks: int) -> float:
    """How much wider than the bootstrap's own percentiles an interval is drawn when it rests on
    few blocks: the bootstrap's spread of a mean of k blocks is sqrt((k-1)/k) of the true one,
    and a mean of k values has Student's t tails (k-1 degrees of freedom), not the normal's
    (with 10 blocks: 1.22x; with 16: 1.12x)."""
    if blocks < 2:
        return 1.0
    nu = blocks - 1
    return math.sqrt(blocks / nu) * student_t975(nu) / Z975


Z975 = 1.959963984540054  # the normal's 97.5 % point (LEVEL)


def student_t975(nu: int) -> float:
    """Student's t 97.5 % point with `nu` degrees of freedom: the table's up to 4, then the
    Cornish-Fisher expansion (2.56 for 5 against 2.571, 2.26 for 9)."""
    z = Z975
    if nu < 1:
        return math.inf
    t = z + (z**3 + z) / (4 * nu) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
    if nu < 5:  # the expansion is far off with so few: the table's values
        return (12.706, 4.303, 3.182, 2.776)[nu - 1]
    return t


def _interval(values: np.ndarray, centre: float, widen: float = 1.0) -> tuple[float, float]:
    """The LEVEL percentile interval of the replicates, widened about `centre` by `widen`."""
    tail = 100 * (1 - LEVEL) / 2
    finite = values[np.isfinite(values)]
    if not len(finite):
        return math.nan, math.nan
    low, high = np.percentile(finite, [tail, 100 - tail])
    return centre - (centre - float(low)) * widen, centre + (float(high) - centre) * widen


def ratio_interval(rep_a: np.ndarray, rep_b: np.ndarray, ratio: float, widen: float) -> tuple[float, float]:
    """The interval of B / A from the replicates of two positive means, drawn and widened on the
    log scale: a ratio of times cannot reach 0, and its bootstrap is skewed (a short run's
    interval widened about the ratio itself went below 0: "0.30x to -85.23x")."""
    with np.errstate(invalid="ignore", divide="ignore"):
        logs = np.log(rep_b) - np.log(rep_a)
    low, high = _interval(logs, math.log(ratio), widen)
    return math.exp(low), math.exp(high)


def _never_negative(a: np.ndarray, b: np.ndarray) -> bool:
    """Both runs' values are times or amounts (none below 0): B - A's interval is A x (B / A's
    interval - 1), so that B's mean never goes below 0 within it."""
    return bool(np.nanmin(a) >= 0 and np.nanmin(b) >= 0) if len(a) and len(b) else False


def _mean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if len(finite) else math.nan


def _verdict(
    column: str, a: float, diff: tuple[float, float, float], step_a: float, part: bool
) -> str:
    """'within noise' unless the interval of B - A excludes 0, the change is SAME_SPEED or
    more of A's mean and, for a part, PART_OF_STEP or more of A's step."""
    change, low, high = diff
    outside = low > 0 or high < 0
    big = abs(change) >= (SAME_SPEED - 1) * abs(a) if a else change != 0
    if part:
        big = big and abs(change) >= PART_OF_STEP * step_a
    if not (outside and big):
        return "within noise"
    if column.endswith("_ms"):
        return "slower" if change > 0 else "faster"
    return "higher" if change > 0 else "lower"


def judge(
    samples_a: Mapping[str, np.ndarray],
    samples_b: Mapping[str, np.ndarray],
    per: str = "step",
    compute_name: str = "Compute",
    seed: int = SEED,
    replicates: int = REPLICATES,
) -> Judgement | None:
    """The change from A to B (see the module's doc) from their analysed per-step samples
    (`analysed_samples`); None when either run has fewer than MIN_STEPS analysed steps or no
    step time."""
    if "step_ms" not in samples_a or "step_ms" not in samples_b:
        return None
    rng = np.random.default_rng(seed)
    rep_a = replicate_means(samples_a, rng, replicates)
    rep_b = replicate_means(samples_b, rng, replicates)
    if not rep_a or not rep_b:
        return None
    step_a, step_b = _mean(samples_a["step_ms"]), _mean(samples_b["step_ms"])
    if not (step_a > 0 and step_b > 0):
        return None
    blocks = min(len(block_edges(len(s["step_ms"]))) - 1 for s in (samples_a, samples_b))
    widen = widening(blocks)
    columns = []
    for column in [c for c in samples_a if c in samples_b]:
        a, b = _mean(samples_a[column]), _mean(samples_b[column])
        if math.isnan(a) or math.isnan(b):
            continue
        diff = (b - a, *_interval(rep_b[column] - rep_a[column], b - a, widen))
        ratio = ratio_low = ratio_high = None
        if a > 0 and b > 0:
            ratio = b / a
            ratio_low, ratio_high = ratio_interval(rep_a[column], rep_b[column], ratio, widen)
            if _never_negative(samples_a[column], samples_b[column]):
                diff = (b - a, a * (ratio_low - 1.0), a * (ratio_high - 1.0))
        elif a > 0:
            ratio = b / a
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio_low, ratio_high = _interval(rep_b[column] / rep_a[column], ratio, widen)
        is_part = column.endswith("_ms") and column not in NOT_A_PART and column != "step_ms"
        name, unit = column_label(column)
        name = {"step_ms": "Step time", "data_wait_ms": "Data wait", "compute_ms": compute_name}.get(
            column, name
        )
        verdict = _verdict(column, a, diff, step_a, is_part)
        columns.append(
            ColumnChange(name, column, unit, a, b, *diff, ratio, ratio_low, ratio_high, verdict, is_part)
        )
    step = columns[0]
    assert step.ratio_low is not None and step.ratio_high is not None
    if step.verdict == "faster":
        slower = [c for c in columns[1:] if c.part and c.verdict == "slower"]
        change = Change.MIXED if slower else Change.IMPROVEMENT
    elif step.verdict == "slower":
        change = Change.REGRESSION
    else:
        change = Change.NO_CHANGE
    # The speed-up is work per second, B over A: A's mean step over B's, with its interval.
    steps = (len(samples_a["step_ms"]), len(samples_b["step_ms"]))
    return Judgement(
        change, step_a / step_b, 1 / step.ratio_high, 1 / step.ratio_low, per, columns, steps
    )
