"""Pure per-step evidence that one rank holds the others back: in each step the rank that arrived
last at the synchronised phase (it waited least there), how consistently one rank is last (a
binomial test against 1/world), and what it costs (the mean of the paired per-step difference,
with a block-bootstrap interval).

Ranks that are balanced on a busy machine each arrive last in about 1/world of the steps, and the
paired difference has a mean near 0: their medians alone can still differ by a share of a step
(a step that waits a few ms now on one rank, now on the other). Steps on a shared machine are not
independent (a rank descheduled for 20 ms is late for several steps in a row), so both tests
count the steps as fewer by their lag-1 autocorrelation, and the bootstrap draws blocks of steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypedDict

import numpy as np

MIN_PAIRED = 10  # steps seen on every rank, after the warm-up, before any rank is named
ALPHA = 0.01  # how unlikely being last so often must be for balanced ranks
CONFIDENCE = 0.95  # the interval of the cost
BOOTSTRAP = 400  # resamples of the cost (deterministic: every rank of a torchrun job agrees)
COLUMNS = ("step", "sync_ms", "data_wait_ms", "compute_ms", "step_ms")


def lag1(values: np.ndarray) -> float:
    """The lag-1 autocorrelation of `values` (0.0 when it cannot be told)."""
    if len(values) < 3:
        return 0.0
    centred = values - values.mean()
    denominator = float(np.dot(centred, centred))
    if denominator <= 0:
        return 0.0
    return float(np.dot(centred[:-1], centred[1:]) / denominator)


def effective_count(n: int, values: np.ndarray) -> float:
    """How many independent steps `n` autocorrelated ones are worth: n (1 - rho) / (1 + rho)."""
    rho = min(max(lag1(values), 0.0), 0.99)
    return max(1.0, n * (1.0 - rho) / (1.0 + rho))


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space from k up (until negligible)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if k <= n * p:  # at or below the mean: at least about a half, never a finding
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total = 0.0
    for i in range(k, n + 1):
        term = math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
        total += term
        if term < total * 1e-12:
            break
    return min(1.0, total)


def last_test(last: np.ndarray, world: int) -> tuple[float, float]:
    """(share of steps this rank was last, p-value of so large a share for balanced ranks)."""
    n = len(last)
    share = float(last.mean()) if n else 0.0
    n_eff = effective_count(n, last.astype(np.float64))
    whole = max(1, int(n_eff))
    return share, binomial_tail(int(round(share * whole)), whole, 1.0 / world)


def mean_interval(values: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A circular block-bootstrap interval of the mean of `values` (blocks of about sqrt(n)
    steps, so that runs of late steps stay together); a fixed seed: the same data, the same
    interval."""
    n = len(values)
    if n < 2:
        value = float(values.mean()) if n else float("nan")
        return value, value
    length = max(1, math.ceil(math.sqrt(n)), math.ceil(n / effective_count(n, values)))
    length = min(length, max(1, n // 2))
    blocks = math.ceil(n / length)
    doubled = np.concatenate([values, values[: length - 1]]) if length > 1 else values
    sums = np.concatenate([[0.0], np.cumsum(doubled)])
    block_means = (sums[length : length + n] - sums[:n]) / length  # the block starting at each step
    rng = np.random.default_rng(0)
    starts = rng.integers(0, n, size=(BOOTSTRAP, blocks))
    means = block_means[starts].mean(axis=1)
    tail = (1.0 - confidence) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))


def _aligned(columns: Mapping[int, Mapping[str, np.ndarray]], first_step: int, key: str) -> tuple[list[int], dict[str, np.ndarray]]:
    """The steps every rank has with a finite `key` (from first_step on), each column as a
    (ranks, steps) array in the order of the returned ranks."""
    ranks = sorted(columns)
    common: np.ndarray | None = None
    for r in ranks:
        steps = np.asarray(columns[r]["step"], dtype=np.int64)
        ok = steps[(steps >= first_step) & np.isfinite(np.asarray(columns[r][key], dtype=np.float64))]
        common = ok if common is None else np.intersect1d(common, ok)
    if common is None or not len(common):
        return ranks, {}
    out: dict[str, np.ndarray] = {}
    for name in COLUMNS[1:]:
        rows = []
        for r in ranks:
            steps = np.asarray(columns[r]["step"], dtype=np.int64)
            order = np.argsort(steps, kind="stable")
            at = order[np.searchsorted(steps[order], common)]
            rows.append(np.asarray(columns[r].get(name, np.full(len(steps), np.nan)), dtype=np.float64)[at])
        out[name] = np.vstack(rows)
    return ranks, out


def _others(values: np.ndarray) -> np.ndarray:
    """For each rank (row): the median of the other ranks' values, step by step."""
    n_ranks = values.shape[0]
    return np.vstack([np.median(np.delete(values, i, axis=0), axis=0) for i in range(n_ranks)])


def _mean(values: np.ndarray) -> float | None:
    values = values[np.isfinite(values)]
    return float(values.mean()) if len(values) else None


class PairedEvidence(TypedDict, total=False):
    """One rank's per-step evidence against the others (paired_evidence): the steps paired, the
    phase they synchronise in, how often it was last (and the p-value of that), the others' wait
    for it (mean, 95 % interval, median), the mean step, and the excesses behind the gap."""

    n_paired: int
    phase: str
    last_share: float
    expected_share: float
    last_p: float
    gap_ms: float
    gap_low_ms: float
    gap_high_ms: float
    gap_median_ms: float
    step_ms: float | None
    excess_ms: dict[str, float | None]


def paired_evidence(columns: Mapping[int, Mapping[str, np.ndarray]], first_step: int = 0) -> dict[int, PairedEvidence]:
    """Each rank's per-step evidence against the others (see the module docstring), from each
    rank's COLUMNS by step index (steps before `first_step` are the warm-up). The synchronised
    phase is backward where every rank timed it in the same steps, else the step body. Empty
    with fewer than two ranks or no step seen on all of them."""
    if len(columns) < 2:
        return {}
    ranks, aligned = _aligned(columns, first_step, "sync_ms")
    phase = "backward"
    if not aligned or aligned["sync_ms"].shape[1] < MIN_PAIRED:
        ranks, aligned = _aligned(columns, first_step, "compute_ms")
        phase = "the step"
        if aligned:
            aligned["sync_ms"] = aligned["compute_ms"]
    if not aligned:
        return {}
    sync = aligned["sync_ms"]
    n = sync.shape[1]
    world = len(ranks)
    last_rank = np.argmin(sync, axis=0)
    gaps = _others(sync) - sync  # > 0: the others waited that much longer than this rank
    waits = aligned["data_wait_ms"]
    body = aligned["compute_ms"] - sync if phase == "backward" else np.full_like(sync, np.nan)
    wait_excess = waits - _others(waits)
    body_excess = body - _others(body)
    step = _mean(aligned["step_ms"].mean(axis=0))
    out: dict[int, PairedEvidence] = {}
    for i, r in enumerate(ranks):
        share, p_value = last_test(last_rank == i, world)
        low, high = mean_interval(gaps[i])
        out[r] = {
            "n_paired": int(n),
            "phase": phase,
            "last_share": share,
            "expected_share": 1.0 / world,
            "last_p": p_value,
            "gap_ms": float(gaps[i].mean()),
            "gap_low_ms": low,
            "gap_high_ms": high,
            "gap_median_ms": float(np.median(gaps[i])),
            "step_ms": step,
            "excess_ms": {"input": _mean(wait_excess[i]), "compute": _mean(body_excess[i])},
        }
    return out


def proven(evidence: Mapping[str, Any] | None) -> bool:
    """The evidence shows this rank holds the others back beyond chance: last in more steps than
    1/world (p < ALPHA) and a cost whose interval lies above 0."""
    if not evidence or int(evidence.get("n_paired") or 0) < MIN_PAIRED:
        return False
    p_value, low = evidence.get("last_p"), evidence.get("gap_low_ms")
    return p_value is not None and low is not None and p_value < ALPHA and low > 0


def p_text(p_value: float) -> str:
    """"p < 0.001", "p = 0.012", "p = 0.43"."""
    p_value = float(p_value)
    return "p < 0.001" if p_value < 0.001 else f"p = {p_value:.3f}" if p_value < 0.1 else f"p = {p_value:.2f}"


def evidence_text(evidence: Mapping[str, Any]) -> str:
    """"last in 29 of 30 steps (97 %; 50 % expected, p < 0.001); the others wait 5.1 ms a step
    (95 % interval 4.8 to 5.4 ms)"."""
    n, share = int(evidence["n_paired"]), float(evidence["last_share"])
    return (
        f"last in {round(share * n)} of {n} steps ({share * 100:.0f} %; {evidence['expected_share'] * 100:.0f} % "
        f"expected, {p_text(evidence['last_p'])}); the others wait {evidence['gap_ms']:.1f} ms a step for it "
        f"({CONFIDENCE * 100:.0f} % interval {evidence['gap_low_ms']:.1f} to {evidence['gap_high_ms']:.1f} ms)"
    )
