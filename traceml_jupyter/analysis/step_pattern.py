"""The shape of a run's steps in words, and a steady pattern told from stragglers (pure).

A mean says how long the loop took; it does not say that every 2nd step waited 28 ms while the
others took 1.7 ms. The analysed steps are split in two humps where they have two (the split
that separates them best, a few extreme steps set aside, kept only when the humps stand apart: Ashman's D of their robust
spreads >= HUMPS_APART and the slow hump SLOW_RATIO times the fast one or more), and the slow
steps' positions say whether they repeat with a period ("every 4th step") or not. Waits that
repeat with a short period away from the passes' starts are the loader's steady state (workers
in lockstep deliver a round of batches at once, then all wait for the next round): INPUT-BOUND,
not a straggler. So are stalls (`summary.stalls`) in FREQUENT_STALLS of the fetches or more, each
waiting STALL_STEP of a typical step or more, away from the passes' starts (workers that drift out of lockstep on a busy machine keep the loop
waiting as steadily, at no fixed period). Waits at each pass's start are the passes' start-up,
and rare stalls are stragglers (INPUT STRAGGLER).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .number_text import ms as _ms
from .summary import stalls
from .summary_keys import StepPattern

MIN_STEPS = 6  # analysed steps a shape needs
MIN_SLOW = 3  # slow steps a second hump needs
HUMPS_APART = 4.0  # Ashman's D from which two humps stand apart (steps drawn from 1-10 ms: 2.7)
SLOW_RATIO = 2.0  # the slow hump's median against the fast one's
REGULAR = 0.6  # share of the gaps between slow steps equal to the commonest gap: a period
MAX_PERIOD = 16  # a longer period is a pass's length or a schedule, not the loader's rounds
WAIT_PART = 0.5  # the slow steps' excess is the data wait when the wait holds this share of it
AT_STARTS = 0.5  # slow steps mostly among a pass's first batches: the passes' start-up
SKEWED = 1.25  # mean / median step from which one hump is skewed
FREQUENT_STALLS = 0.2  # stalls in this share of the fetches or more are the loader's pace ...
STALL_STEP = 0.5  # ... when they wait this share of a typical step or more (not a busy machine's jitter)


def _floats(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


def _spread(values: np.ndarray, floor: float) -> float:
    """1.4826 x MAD (the normal's spread, robust to a few stray steps), at least `floor`."""
    return max(floor, 1.4826 * float(np.median(np.abs(values - np.median(values)))))


def _split(values: np.ndarray) -> int:
    """Where sorted `values` split best in two (Otsu: the most variance between the two)."""
    n = len(values)
    cum = np.cumsum(values)
    k = np.arange(1, n)
    low_mean = cum[:-1] / k
    high_mean = (cum[-1] - cum[:-1]) / (n - k)
    return int(np.argmax(k * (n - k) * (high_mean - low_mean) ** 2)) + 1


def slow_hump(step: np.ndarray) -> np.ndarray | None:
    """The mask of the slow steps when the steps have two humps that stand apart, else None. A
    split that leaves fewer than MIN_SLOW steps above it has found a few extreme steps: they are
    set aside (they stay slow) and the rest split again, once."""
    ok = np.isfinite(step)
    values = np.sort(step[ok])
    if len(values) < MIN_STEPS:
        return None
    cut = _split(values)
    if len(values) - cut < MIN_SLOW and cut >= MIN_STEPS:
        values = values[:cut]
        cut = _split(values)
    low, high = values[:cut], values[cut:]
    if len(high) < MIN_SLOW or len(low) < MIN_SLOW:
        return None
    m_low, m_high = float(np.median(low)), float(np.median(high))
    floor = 0.01 * m_high + 1e-6
    apart = np.sqrt(2.0) * (m_high - m_low) / np.hypot(_spread(low, floor), _spread(high, floor))
    if apart < HUMPS_APART or m_high < SLOW_RATIO * max(m_low, 1e-9):
        return None
    slow: np.ndarray = ok & (step >= values[cut])
    return slow


def period_of(positions: np.ndarray) -> int | None:
    """The commonest gap between the slow steps' positions when REGULAR of the gaps are it."""
    if len(positions) < MIN_SLOW:
        return None
    gaps = np.diff(positions)
    common = int(np.argmax(np.bincount(gaps)))
    return common if float(np.mean(gaps == common)) >= REGULAR else None


def ordinal(n: int) -> str:
    """2nd, 3rd, 4th, 11th, 21st."""
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def step_pattern(
    columns: Mapping[str, np.ndarray],
    analysed: np.ndarray,
    clock: str,
    pass_steps: Sequence[int] = (),
    workers: int | None = None,
    batches_per_step: float | None = None,
) -> StepPattern | None:
    """The analysed steps' shape: "two humps" (with the slow steps' period, where they have one,
    and whether the data wait or the compute makes them slow), "skewed" or "even"; `steady_wait`:
    the waits repeat with a short period away from the passes' starts (the loader's steady
    state); `text`: "typical step 1.7 ms; every 2nd step waits 28.0 ms", or None for even steps.
    None with fewer than MIN_STEPS analysed steps."""
    suffix = "_gpu_ms" if clock == "gpu" else "_ms"
    step = _floats(columns.get("step" + suffix, columns["step_ms"]))[analysed]
    wait = _floats(columns.get("data_wait" + suffix, columns["data_wait_ms"]))[analysed]
    numbers = np.asarray(columns["step"])[analysed]
    finite = step[np.isfinite(step)]
    if len(finite) < MIN_STEPS:
        return None
    median, mean = float(np.median(finite)), float(finite.mean())
    out: StepPattern = {
        "shape": "even",
        "typical_ms": median,
        "slow_ms": None,
        "slow_wait_ms": None,
        "slow_steps": 0,
        "steps": int(len(finite)),
        "period": None,
        "slow_in": None,
        "at_pass_starts": False,
        "steady_wait": False,
        "stalls": 0,
        "cause": None,
        "text": None,
    }
    near_start = near_pass_starts(numbers, pass_steps, max(1, workers or 1))
    out["stalls"], out["steady_wait"] = _stalls(step, wait, near_start)
    slow = slow_hump(step)
    if slow is None:
        if median > 0 and mean >= SKEWED * median:
            p90 = float(np.percentile(finite, 90))
            out["shape"] = "skewed"
            out["text"] = f"typical (median) step {_ms(median)}; the slowest tenth take {_ms(p90)} or more"
        return out
    fast = np.isfinite(step) & ~slow
    typical, slow_ms = float(np.median(step[fast])), float(np.median(step[slow]))
    wait_excess = float(np.nanmedian(wait[slow]) - np.nanmedian(wait[fast]))
    in_wait = wait_excess >= WAIT_PART * (slow_ms - typical)
    positions = np.flatnonzero(slow)
    period = period_of(positions)
    at_starts = float(np.mean(near_start[slow])) >= AT_STARTS
    out["shape"], out["typical_ms"], out["slow_ms"] = "two humps", typical, slow_ms
    out["slow_wait_ms"], out["slow_steps"] = float(np.nanmedian(wait[slow])), int(slow.sum())
    out["period"], out["slow_in"] = period, "data wait" if in_wait else "compute"
    out["at_pass_starts"] = at_starts
    steady = in_wait and period is not None and period <= MAX_PERIOD and not at_starts
    out["steady_wait"] = bool(steady) or out["steady_wait"]
    if period is not None and period == workers and in_wait:
        out["cause"] = f"the {workers} workers deliver a round of batches together, then all wait for the next round"
    elif period is not None and batches_per_step and period == round(batches_per_step) and in_wait:
        out["cause"] = f"a step takes {period} batches (gradient accumulation)"
    out["text"] = pattern_text(out)
    return out


def near_pass_starts(numbers: np.ndarray, pass_steps: Sequence[int], window: int) -> np.ndarray:
    """The steps among a pass's first `window` (its workers' first batches: each restarted
    worker's first batch is slow)."""
    near = np.zeros(len(numbers), dtype=bool)
    for start in set(int(k) for k in pass_steps):
        near |= (numbers >= start) & (numbers < start + window)
    return near


def _stalls(step: np.ndarray, wait: np.ndarray, near_start: np.ndarray) -> tuple[int, bool]:
    """The stalled fetches: how many (`stalls`), and (`steady_wait`) whether they are frequent enough, away from the
    passes' starts, to be the loader's steady pace."""
    ok = np.isfinite(step) & np.isfinite(wait)
    stalled = np.zeros(len(step), dtype=bool)
    if ok.sum() >= 2:
        stalled[ok] = stalls(wait[ok], step[ok])
    count = int(stalled.sum())
    if not count:
        return 0, False
    at_starts = float(np.mean(near_start[stalled])) >= AT_STARTS
    share = count / max(1, int(ok.sum()))
    costly = float(np.median(wait[stalled])) >= STALL_STEP * float(np.median(step[ok]))
    return count, bool(share >= FREQUENT_STALLS and costly and not at_starts)


def pattern_text(p: StepPattern) -> str:
    """"typical step 1.7 ms; every 2nd step waits 28.0 ms" (two humps) or "...; 5 of 40 steps
    take 30.0 ms" (no period)."""
    head = f"typical step {_ms(p['typical_ms'])}"
    period = p.get("period")
    which = f"every {ordinal(period)} step" if period else f"{p['slow_steps']} of {p['steps']} steps"
    if p.get("at_pass_starts"):
        which = "each pass's first step" if period else which
    plural = not period
    if p.get("slow_in") == "data wait":
        return f"{head}; {which} wait{'' if plural else 's'} {_ms(p.get('slow_wait_ms'))}"
    return f"{head}; {which} take{'' if plural else 's'} {_ms(p.get('slow_ms'))}"
