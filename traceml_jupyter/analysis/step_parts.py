"""Inside the step and over the run, in numbers and words (pure): the parts of a step (forward,
backward, optimizer, the rest) on the run's clock, advice by the part that dominates, the rest's
own verdict line, the trend of the step time and the data wait over the run, and the wait at
the start of each pass over the training loader (an epoch's start-up)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .number_text import ms as _ms
from .number_text import pct as _pct
from .summary_keys import EpochStartup, LineCost, LineCosts, MovedPart, Summary, Trend, part_figures
from .verdict import WARN_SHARE, severity_for

PARTS = ("forward", "backward", "optimizer", "rest")
PART_WORDS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer", "rest": "the rest"}
OPTIMIZER_HEAVY = 0.30  # the optimizer's share of compute that makes it the advice
BACKWARD_RATIO = 3.0  # backward this many times the forward is "much more than 2x"
BACKWARD_SHARE = 0.20  # ... and at least this share of the step, so that it matters
# Trend: the last third of the analysed steps against the first. A change is reported when it
# is past the noise (Z_TREND standard errors of the difference of the two medians, each from
# its third's spread: 1.4826 x MAD is the spread of normal noise, and a median of n such
# values has a standard error of 1.2533 x spread / sqrt(n)), and large enough to matter
# (MIN_TREND of the first third's median). Medians and MADs are not moved by the spikes a run
# has anyway (an epoch's start-up, a GC pause).
Z_TREND = 3.0
MIN_TREND = 0.10
# ... and claimed only well beyond that band, as a steady move: the change is BEYOND_BAND times
# the band or more, DOMINANCE of the pairs (a step of the last third, one of the first) agree on
# its direction, and the middle third lies between the two (`steady_change`). Steps drawn
# uniformly from 1-10 ms, or that wander (AR(1), 0.9 from one step to the next), claimed a trend
# in 2-5 % and 40 % of runs under the band alone; under these, 0 % and about 10 %, while a 20 %
# ramp with 3 % noise is still found in every run of 60 steps.
BEYOND_BAND = 2.0
DOMINANCE = 0.8
MIN_THIRD = 8  # analysed steps per third for a step-time trend
MIN_PART_THIRD = 4  # sampled steps per third for a part's change
MOVED_SHARE = 0.05  # a component moved when its change is this share of the step, or more
# Epoch start-up: reported when the waits at the first batch of the passes after the first
# cost this share of the run, each one well above a typical fetch and longer than STARTUP_STEPS
# steps (persistent workers still make each pass wait for its first batch: about a step).
STARTUP_SHARE = 0.03
STARTUP_MIN_MS = 1.0
STARTUP_STEPS = 2.0


def _finite(values: Any) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    return a[np.isfinite(a)]


def _median(values: np.ndarray) -> float | None:
    return float(np.median(values)) if len(values) else None


# -- the parts ----------------------------------------------------------------------------------
def parts_summary(columns: Mapping[str, np.ndarray], analysed: np.ndarray, clock: str) -> Summary:
    """Medians over the analysed sampled steps of each part (ms) and of its share of the step,
    on the run's clock; None where a part was never timed."""
    suffix = "_gpu_ms" if clock == "gpu" else "_ms"
    step = np.asarray(columns.get("step" + suffix, columns["step_ms"]), dtype=np.float64)[analysed]
    sampled = np.zeros(len(step), dtype=bool)
    ms: dict[str, float | None] = {}
    share: dict[str, float | None] = {}
    for part in PARTS:
        col = columns.get(part + suffix)
        if col is None:
            ms[part] = share[part] = None
            continue
        values = np.asarray(col, dtype=np.float64)[analysed]
        ok = np.isfinite(values)
        sampled |= ok
        ms[part] = _median(values[ok])
        good = ok & (step > 0)
        share[part] = float(np.median(values[good] / step[good])) if good.any() else None
    return {
        "forward_ms": ms["forward"],
        "forward_share": share["forward"],
        "backward_ms": ms["backward"],
        "backward_share": share["backward"],
        "optimizer_ms": ms["optimizer"],
        "optimizer_share": share["optimizer"],
        "rest_ms": ms["rest"],
        "rest_share": share["rest"],
        "parts_steps": int(sampled.sum()),
        "parts_clock": clock,
    }


def _label_names(labels: Sequence[str]) -> list[str]:
    """"model (Net)" -> "model"; a bare class name is no name in the code."""
    return [str(label).split(" (")[0] for label in labels if " (" in str(label)]


def part_lines(
    statements: Sequence[Mapping[str, Any]],
    cell_lines: Sequence[str],
    modules: Sequence[str],
    optimizers: Sequence[str],
) -> set[int]:
    """The body statements (their first lines) that call the model, backward() or an
    optimizer's step: the others are the rest of the step."""
    model_names = _label_names(modules)
    optimizer_names = _label_names(optimizers)
    patterns = [r"\.backward\s*\(", r"\bbackward\s*\("]
    patterns += [rf"\b{re.escape(n)}\s*\(" for n in model_names]
    patterns += [rf"\b{re.escape(n)}\.step\s*\(" for n in optimizer_names]
    if not optimizer_names:  # any .step( that is not a scheduler's
        patterns.append(r"\b(?!\w*sched)\w*opt\w*\.step\s*\(")
    found = set()
    for st in statements:
        first, last = int(st["line"]), int(st.get("end_line") or st["line"])
        text = "\n".join(cell_lines[first - 1 : last]) if cell_lines else str(st.get("text") or "")
        if any(re.search(p, text) for p in patterns):
            found.add(first)
    return found


def rest_line(summary: Summary, line_costs: LineCosts | None, cell_lines: Sequence[str]) -> LineCost | None:
    """The costliest body statement that is none of the parts, when it makes a good part of
    the rest: {"line", "text", "ms_per_step"}."""
    rest = summary.get("rest_ms")
    if not line_costs or rest is None or rest <= 0:
        return None
    timed = [(s, ms) for s in line_costs.get("statements") or [] if (ms := s.get("ms_per_step")) is not None]
    statements = [s for s, _ in timed]
    modules = summary.get("forward_modules") or []
    optimizers = [o.get("label", "") for o in summary.get("optimizers") or []]
    parts = part_lines(statements, cell_lines, modules, optimizers)
    others = [(s, ms) for s, ms in timed if int(s["line"]) not in parts]
    if not others:
        return None
    top, top_ms = max(others, key=lambda pair: pair[1])
    if top_ms < 0.25 * rest:
        return None
    return {"line": int(top["line"]), "text": str(top.get("text") or ""), "ms_per_step": float(top_ms)}


def parts_sentence(summary: Summary) -> str | None:
    """"forward 5.3 ms (12.4 %), backward 23.5 ms (54.4 %), ...": the split, or why there is
    none."""
    if not summary.get("parts_steps"):
        return None
    bits = []
    for part, (value, share) in part_figures(summary).items():
        if value is None:
            continue
        bits.append(f"{PART_WORDS[part]} {_ms(value)} ({_pct(share)})")
    text = ", ".join(bits) + f" of the step (median of {summary['parts_steps']} sampled steps"
    state = summary.get("forward_state")
    modules = summary.get("forward_modules") or []
    if summary.get("forward_ms") is not None and modules:
        text += "; forward: " + ", ".join(modules)
    text += ")"
    if state == "not found":
        text += (
            ". Forward not found: no module holding parameters was called from the step's "
            "own code (a model called inside a compiled or scripted function, or none), so "
            "the rest is not split from it"
        )
    optimizers = summary.get("optimizers") or []
    if len(optimizers) > 1:
        text += "; optimizer: " + ", ".join(str(o.get("label") or o.get("name")) for o in optimizers)
    return text + "."


def _optimizer_advice(summary: Summary) -> str | None:
    opt, compute = summary.get("optimizer_ms"), summary.get("compute_ms")
    if opt is None or not compute or opt < OPTIMIZER_HEAVY * compute:
        return None
    seen, tips = [], []
    for o in summary.get("optimizers") or []:
        name = str(o.get("name") or "the optimizer")
        groups, tensors = o.get("param_groups"), o.get("tensors")
        how = "fused" if o.get("fused") else ("foreach" if o.get("foreach") else "one at a time")
        what = f"{tensors} tensors, {how}" if tensors else how
        if groups:
            what += f", in {groups} parameter group{'s' if groups != 1 else ''}"
        seen.append(f"{name}: {what}")
        if not o.get("fused"):
            tips.append(f"{name}(..., fused=True) or foreach=True (fused exists for Adam, AdamW, SGD and Adagrad)")
        if groups and groups > 1:
            tips.append(f"fewer parameter groups ({groups} now: fused and foreach batch the tensors of one group)")
    if not tips:
        tips.append("step less often (gradient accumulation) or a cheaper optimizer")
    steps = f"; {'; '.join(seen)}" if seen else ""
    return (
        f"The optimizer takes {_pct(opt / compute)} of the compute ({_ms(opt)} a step{steps}): "
        f"use {', and '.join(dict.fromkeys(tips))}."
    )


def _backward_advice(summary: Summary) -> str | None:
    fwd, bwd, step = summary.get("forward_ms"), summary.get("backward_ms"), summary.get("step_ms")
    if not fwd or bwd is None or not step or bwd < BACKWARD_RATIO * fwd or bwd < BACKWARD_SHARE * step:
        return None
    head = f"Backward takes {bwd / fwd:.1f}x the forward ({_ms(bwd)} against {_ms(fwd)}; usually about 2x)"
    late = summary.get("straggler")
    if late:
        return f"{head}: it holds the all-reduce's wait for rank {late['rank']}, the rank that holds the others back."
    return (
        f"{head}: look for activation checkpointing (it runs the forward again), hooks on "
        "gradients or parameters, ops whose backward is slow (large embeddings, scatter and index "
        "ops), and, with several processes, the all-reduce waiting for a slower rank."
    )


def rest_verdict(summary: Summary, named: LineCost | None) -> tuple[str, str] | None:
    """The rest of the step >= 10 % (critical >= 20 %): its severity and its own line."""
    share = summary.get("rest_share")
    if share is None or share < WARN_SHARE:
        return None
    severity = severity_for(share, int(summary.get("n_analysed") or 0))
    head = (
        f"The rest of the step takes {_pct(share)} ({_ms(summary.get('rest_ms'))} of "
        f"{_ms(summary.get('step_ms'))}) outside forward, backward and the optimizer"
    )
    if named is not None:
        text = f" `{named['text']}`" if named.get("text") and len(named["text"]) <= 60 else ""
        return severity, (
            f"{head}: line {named['line']}{text} takes {_ms(named['ms_per_step'])} a step. Do it "
            "every N steps, or make it cheaper."
        )
    return severity, (
        f"{head}: usually logging every step (with `.item()` or `.cpu()`, which also wait for "
        "the GPU), metrics, checkpoints, LR schedulers and callbacks. Do them every N steps."
    )


# -- over the run --------------------------------------------------------------------------------
def _third_change(values: np.ndarray, minimum: int) -> tuple[float, float, float] | None:
    """Medians of the first and last thirds of `values` (in order) and the standard error of
    their difference; None with fewer than `minimum` finite values in a third."""
    n = len(values)
    first, last = values[: n // 3], values[n - n // 3 :]
    first, last = first[np.isfinite(first)], last[np.isfinite(last)]
    if len(first) < minimum or len(last) < minimum:
        return None
    m1, m3 = float(np.median(first)), float(np.median(last))

    def se(v: np.ndarray, m: float) -> float:
        spread = 1.4826 * float(np.median(np.abs(v - m)))
        return 1.2533 * spread / math.sqrt(len(v))

    return m1, m3, math.hypot(se(first, m1), se(last, m3))


def later_share(first: np.ndarray, last: np.ndarray) -> float:
    """The share of the pairs (a step of `last`, one of `first`) in which the later step is the
    slower, ties counting half (the Mann-Whitney statistic), in O(n log n): sorted and counted,
    never the n x n table of pairs (a 100,000-step run would hold a gigabyte of it)."""
    ordered = np.sort(first)
    below = np.searchsorted(ordered, last, side="left")
    ties = np.searchsorted(ordered, last, side="right") - below
    return float((below.sum() + 0.5 * ties.sum()) / (len(first) * len(last)))


def steady_change(step: np.ndarray, delta: float) -> bool:
    """The thirds move one way: the last third's steps are slower (faster) than the first's in
    DOMINANCE of their pairs or more, and the middle third's median lies between theirs (a run
    that wanders and comes back has no trend, whatever its two ends say)."""
    n = len(step)
    first, middle, last = (v[np.isfinite(v)] for v in (step[: n // 3], step[n // 3 : n - n // 3], step[n - n // 3 :]))
    if not (len(first) and len(middle) and len(last)):
        return False
    later = later_share(first, last)
    if (later if delta > 0 else 1.0 - later) < DOMINANCE:
        return False
    low, high = sorted((float(np.median(first)), float(np.median(last))))
    return low <= float(np.median(middle)) <= high


def trend(columns: Mapping[str, np.ndarray], analysed: np.ndarray, clock: str) -> Trend | None:
    """The step time's last third against its first (analysed steps, in order), with the noise
    band, and what moved: data wait, each part, GPU utilisation, clocks and temperature where
    measured. None with too few steps."""
    suffix = "_gpu_ms" if clock == "gpu" else "_ms"
    step = np.asarray(columns.get("step" + suffix, columns["step_ms"]), dtype=np.float64)[analysed]
    change = _third_change(step, MIN_THIRD)
    if change is None:
        return None
    m1, m3, se = change
    delta = m3 - m1
    rel = delta / m1 if m1 > 0 else 0.0
    band = Z_TREND * se / m1 if m1 > 0 else 0.0
    found = abs(delta) >= BEYOND_BAND * Z_TREND * se and abs(rel) >= MIN_TREND and steady_change(step, delta)
    moved_parts: list[MovedPart] = []
    out: Trend = {
        "first_ms": m1,
        "last_ms": m3,
        "change": rel,
        "noise": band,
        "direction": ("slower" if delta > 0 else "faster") if found else None,
        "steps": int(len(step)),
        "moved": moved_parts,
    }
    components = [("data wait", "data_wait" + suffix, MIN_THIRD, "ms")]
    components += [(PART_WORDS[p], p + suffix, MIN_PART_THIRD, "ms") for p in PARTS]
    if not any(p + suffix in columns for p in PARTS):
        components.append(("compute", "compute" + suffix, MIN_THIRD, "ms"))
    components += [
        ("GPU utilisation", "gpu_util_pct", MIN_THIRD, "%"),
        ("GPU clock", "gpu_clock_mhz", MIN_THIRD, "MHz"),
        ("GPU temperature", "gpu_temp_c", MIN_THIRD, "°C"),
    ]
    for label, name, minimum, unit in components:
        col = columns.get(name)
        if col is None:
            continue
        moved = _third_change(np.asarray(col, dtype=np.float64)[analysed], minimum)
        if moved is None:
            continue
        a, b, s = moved
        d = b - a
        big = abs(d) >= MOVED_SHARE * m1 if unit == "ms" else abs(d) >= MIN_TREND * max(abs(a), 1e-9)
        if abs(d) >= Z_TREND * s and big:
            moved_parts.append({"what": label, "first": a, "last": b, "delta": d, "unit": unit})
    moved_parts.sort(key=lambda m: -abs(m["delta"]) if m["unit"] == "ms" else 0.0)
    wait = _third_change(np.asarray(columns.get("data_wait" + suffix, columns["data_wait_ms"]), dtype=np.float64)[analysed], MIN_THIRD)
    if wait is not None:
        out["data_wait_first_ms"], out["data_wait_last_ms"] = wait[0], wait[1]
    return out


def trend_sentence(found: Trend | None) -> str | None:
    """"Steps got 23 % slower over the run (12.0 ms -> 14.8 ms, ...): forward +2.6 ms." when a
    trend was found, else None."""
    if not found or not found.get("direction"):
        return None
    text = (
        f"Steps got {abs(100 * found['change']):.0f} % {found['direction']} over the run "
        f"({_ms(found['first_ms'])} -> {_ms(found['last_ms'])}, median of the first third of the "
        f"analysed steps against the last; noise ±{100 * found['noise']:.1f} %)"
    )
    moved = found.get("moved") or []
    if moved:
        bits = []
        for m in moved[:3]:
            if m["unit"] == "ms":
                bits.append(f"{m['what']} {m['delta']:+.1f} ms")
            else:
                bits.append(f"{m['what']} {m['first']:.0f} -> {m['last']:.0f} {m['unit']}")
        text += ": " + ", ".join(bits)
    else:
        text += ": no single part moved past its noise"
    return text + "."


def epoch_startup(
    columns: Mapping[str, np.ndarray],
    pass_steps: Sequence[int],
    step_total_ms: float | None,
    loader: Mapping[str, Any] | None,
    clock: str = "cpu",
) -> EpochStartup | None:
    """The wait at the first batch of each pass over the training loader after the first (the
    first pass's start is the run's own start-up), above a typical step's wait: per pass, in
    total, and as a share of the run. None with a single pass or none kept."""
    starts = sorted(set(int(k) for k in pass_steps))
    if len(starts) < 2:
        return None
    suffix = "_gpu_ms" if clock == "gpu" else "_ms"
    steps = np.asarray(columns["step"], dtype=np.int64)
    wait = np.asarray(columns.get("data_wait" + suffix, columns["data_wait_ms"]), dtype=np.float64)
    is_start = np.isin(steps, starts)
    typical = _median(_finite(wait[~is_start]))
    step = _median(_finite(np.asarray(columns.get("step" + suffix, columns["step_ms"]), dtype=np.float64)[~is_start]))
    if typical is None or step is None:
        return None
    by_step = dict(zip(steps.tolist(), wait.tolist(), strict=True))
    excess = [max(0.0, by_step[k] - typical) for k in starts[1:] if k in by_step and math.isfinite(by_step[k])]
    if not excess:
        return None
    total = float(sum(excess))
    first = by_step.get(starts[0])
    workers = int((loader or {}).get("num_workers") or 0)
    persistent = bool((loader or {}).get("persistent_workers"))
    restart = workers > 0 and not persistent
    each = float(np.median(excess))
    share = total / step_total_ms if step_total_ms else None
    out: EpochStartup = {
        "passes": len(starts),
        "restarts": len(excess),
        "wait_ms": each,
        "total_ms": total,
        "share": share,
        "typical_wait_ms": typical,
        "typical_step_ms": step,
        "first_pass_ms": max(0.0, first - typical) if first is not None and math.isfinite(first) else None,
        "num_workers": workers,
        "persistent_workers": persistent,
        "cause": "workers restart" if restart else "iter(loader): the sampler's or dataset's set-up",
    }
    out["reported"] = bool((share or 0.0) >= STARTUP_SHARE and each >= max(STARTUP_MIN_MS, 3.0 * typical, STARTUP_STEPS * step))
    return out


def wait_words(wait_ms: float) -> str:
    """"0.4 s" from 100 ms on, else "12.3 ms"."""
    return f"{wait_ms / 1e3:.2g} s" if wait_ms >= 100 else _ms(wait_ms)


def startup_sentence(found: EpochStartup | None) -> str | None:
    """"Each epoch starts with a 1.4 s wait (workers restart, 6.0 % of the run):
    persistent_workers=True." when reported, else None."""
    if not found or not found.get("reported"):
        return None
    text = f"Each epoch starts with a {wait_words(found['wait_ms'])} wait ({found['cause']}, {_pct(found['share'])} of the run"
    text += f", {found['restarts']} restarts)"
    if found["cause"] == "workers restart":
        return text + f": persistent_workers=True keeps the {found['num_workers']} workers alive between epochs."
    return text + ": make iter(loader) cheaper (a sampler that shuffles or a dataset that opens files once per pass)."


# -- the lines a report adds -----------------------------------------------------------------------
def also_lines(
    summary: Summary,
    line_costs: LineCosts | None = None,
    cell_lines: Sequence[str] = (),
) -> list[tuple[str, str]]:
    """(severity, text) for each line the report adds after the verdict: the rest of the step
    (its own verdict line), advice by the part that dominates, the trend, the epoch start-up."""
    out: list[tuple[str, str]] = []
    rest = rest_verdict(summary, rest_line(summary, line_costs, cell_lines))
    if rest is not None:
        out.append(rest)
    for advice in (_optimizer_advice(summary), _backward_advice(summary)):
        if advice:
            out.append(("info", advice))
    startup = startup_sentence(summary.get("epoch_startup"))
    if startup:
        out.append(("warn", startup))
    moving = trend_sentence(summary.get("trend"))
    if moving:
        out.append(("warn" if (summary.get("trend") or {}).get("direction") == "slower" else "info", moving))
    return out
