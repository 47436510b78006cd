"""Pure rank analysis: each rank's numbers, the rank that holds the others back (RANK STRAGGLER)
with its cause, and for balanced ranks the usual verdict on the ranks' medians.

Data-parallel ranks meet in backward (DDP all-reduces the gradients there), so every rank's step
lasts as long as the latest rank's. The rank that arrives last waits least in backward; each of
the others waits there for it. So: the straggler is the rank with the shortest backward, the gap
is the others' backward minus its own (what each of them loses a step), the score is the gap as
a share of the step, and the cause is the phase whose excess on the straggler explains most of
the gap: its data wait (input), its host-to-device copies (h2d), or the rest of its step body
(compute: forward, loss, optimizer). No phase explains at least half of it: unknown.
Without backward() (no synchronised phase seen) the step body stands in for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import median
from typing import Any, cast

import numpy as np

from .number_text import ms as _ms
from .number_text import pct as _pct
from .rank_evidence import ALPHA, PairedEvidence, evidence_text, p_text, proven
from .summary_keys import RankComparison, RankRow, Straggler, Summary
from .verdict import MIN_ANALYSED, WARN_SHARE, Verdict, VerdictLabel, diagnose, severity_for

CAUSE_SHARE = 0.5  # a phase is the cause when its excess explains at least half of the gap
# The headline numbers of a balanced run: the median over the ranks of each rank's median.
MEDIAN_KEYS = (
    "data_wait_ms",
    "compute_ms",
    "step_ms",
    "data_wait_share",
    "compute_share",
    "straggler_share",
    "steps_per_s",
    "host_ms",
    "h2d_ms",
    "h2d_share",
)
CAUSES = ("input", "h2d", "compute", "unknown")
# A rank's summary: these numbers (None where not measured) and, as text, status and error.
RANK_NUMBERS = (
    "rank",
    "pid",
    "n_steps",
    "n_analysed",
    "warmup_steps",
    "data_wait_ms",
    "compute_ms",
    "step_ms",
    "backward_ms",
    "h2d_ms",
    "data_wait_share",
    "compute_share",
    "straggler_share",
    "steps_per_s",
    "host_ms",
    "h2d_share",
    "num_workers",
    "batch_size",
    "forward_ms",  # the parts of the rank's sampled steps (capture/inside/step_parts.py)
    "optimizer_ms",
    "rest_ms",
)
PART_KEYS = ("forward_ms", "optimizer_ms", "rest_ms")
LOADER_KEYS = ("num_workers", "batch_size", "sampler", "samples")


def backward_median(steps: np.ndarray, backward_ms: np.ndarray, first_step: int) -> float | None:
    """Median time in backward() per step over the analysed steps (index >= first_step)."""
    values = np.asarray(backward_ms, dtype=np.float64)[np.asarray(steps) >= first_step]
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else None


def rank_summary(
    rank: int,
    summary: Mapping[str, Any],
    backward_ms: float | None,
    **facts: Any,
) -> RankRow:
    """One rank's numbers, from its own summary (summary.summarize) and its median backward;
    `facts`: pid, status ("finished", "failed", "stopped", "running"), error, loader."""
    out: dict[str, Any] = {"rank": int(rank)}
    for key in RANK_NUMBERS[1:]:
        value = summary.get(key)
        out[key] = float(value) if isinstance(value, float) else value
    out["backward_ms"] = backward_ms
    out["clock"] = summary.get("clock", "cpu")
    out.update({"pid": None, "status": "finished", "error": None, "loader": None})
    out.update(facts)
    loader = out.get("loader") or {}
    for key in ("num_workers", "batch_size"):
        if loader.get(key) is not None:
            out[key] = loader[key]
    return cast(RankRow, out)


def _value(rank: Mapping[str, Any], key: str) -> float | None:
    value = rank.get(key)
    if value is None or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


def usable(ranks: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ranks with enough analysed steps to compare."""
    return [
        r for r in ranks if (r.get("n_analysed") or 0) >= MIN_ANALYSED and (_value(r, "step_ms") or 0) > 0
    ]


def compare_ranks(ranks: Sequence[Mapping[str, Any]]) -> RankComparison | None:
    """The rank that arrives last at the synchronised phase, how long the others wait for it,
    and why (see the module docstring). With every rank's per-step evidence (`paired`,
    rank_evidence.py): the rank the others wait for most, its mean paired gap, its excesses per
    step, and `holds_back` when the evidence passes its noise test and the gap is >= 10 % of the
    step; without it, the ranks' medians, never held to hold back. None with fewer than two
    comparable ranks."""
    ok = usable(ranks)
    if len(ok) < 2:
        return None
    paired = all(isinstance(r.get("paired"), Mapping) for r in ok)
    in_backward = all(_value(r, "backward_ms") is not None for r in ok)
    if paired:
        in_backward = all(r["paired"].get("phase") == "backward" for r in ok)
    sync_key = "backward_ms" if in_backward else "compute_ms"

    def sync(r: Mapping[str, Any]) -> float:
        return _value(r, sync_key) or 0.0

    if paired:
        late = max(ok, key=lambda r: float(r["paired"].get("gap_ms") or 0.0))
    else:
        late = min(ok, key=sync)
    others = [r for r in ok if r is not late]
    evidence: PairedEvidence | None = late.get("paired") if paired else None  # a rank row: untyped
    if evidence is not None:
        gap = max(0.0, float(evidence.get("gap_ms") or 0.0))
        step = float(evidence.get("step_ms") or median(_value(r, "step_ms") or 0.0 for r in ok))
    else:
        gap = max(0.0, median(sync(r) for r in others) - sync(late))
        step = median(_value(r, "step_ms") or 0.0 for r in ok)

    def excess(part: Any) -> float | None:
        mine = part(late)
        theirs = [part(r) for r in others]
        if mine is None or any(v is None for v in theirs):
            return None
        return float(mine - median(theirs))

    copies = all(_value(r, "h2d_ms") is not None for r in ok)  # else copies stay in the body

    def body(r: Mapping[str, Any]) -> float | None:
        compute, backward = _value(r, "compute_ms"), _value(r, "backward_ms")
        if compute is None or backward is None:
            return None
        return compute - backward - ((_value(r, "h2d_ms") or 0.0) if copies else 0.0)

    excesses = {
        "input": excess(lambda r: _value(r, "data_wait_ms")),
        "h2d": excess(lambda r: _value(r, "h2d_ms")),
        "compute": excess(body) if in_backward else None,
    }
    if evidence is not None:  # per step, paired: the excesses that add up to the mean gap
        wait_excess, body_excess = ((evidence.get("excess_ms") or {}).get(k) for k in ("input", "compute"))
        if wait_excess is not None:
            excesses["input"] = float(wait_excess)
        if in_backward and body_excess is not None:
            excesses["compute"] = float(body_excess) - ((excesses["h2d"] or 0.0) if copies else 0.0)
    measured = {k: v for k, v in excesses.items() if v is not None}
    cause, most = max(measured.items(), key=lambda kv: kv[1]) if measured else ("unknown", None)
    if most is None or gap <= 0 or most < CAUSE_SHARE * gap:
        cause = "unknown"
    # A compute straggler: which part of its step outside backward is slower (forward,
    # optimizer, the rest), where every rank timed them.
    parts = {key[:-3]: excess(lambda r, k=key: _value(r, k)) for key in PART_KEYS}
    score = gap / step if step > 0 else 0.0
    return {
        "part_excess_ms": {k: v for k, v in parts.items() if v is not None},
        "rank": int(late["rank"]),
        "cause": cause,
        "score": score,
        "gap_ms": gap,
        "step_ms": step,
        "excess_ms": excesses,
        "phase": "backward" if in_backward else "the step",
        "waiting": [int(r["rank"]) for r in others],
        "n_analysed": min(int(r.get("n_analysed") or 0) for r in ok),
        "evidence": PairedEvidence(**evidence) if evidence is not None else None,
        "holds_back": proven(evidence) and score >= WARN_SHARE,
    }


def holds_back(found: Mapping[str, Any] | None) -> bool:
    """compare_ranks found a rank that holds the others back, beyond the noise and >= 10 %."""
    return bool(found and found.get("holds_back"))


def _rank_list(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in sorted(ranks))


def straggler_sentence(found: Mapping[str, Any]) -> str:
    """"ranks 0, 2, 3 wait for rank 1 in backward: it waits 38.0 ms a step for data"."""
    waiting = list(found["waiting"])
    verb = "waits" if len(waiting) == 1 else "wait"
    where = "in backward" if found["phase"] == "backward" else "each step"
    head = f"{_rank_list(waiting)} {verb} for rank {found['rank']} {where}"
    extra = found["excess_ms"].get(found["cause"])
    cause = found["cause"]
    if cause == "input":
        return f"{head}: it waits {_ms(extra)} a step for data"
    if cause == "h2d":
        return f"{head}: its host-to-device copies take {_ms(extra)} more a step"
    if cause == "compute":
        split = found.get("part_excess_ms") or {}
        if split:
            words = {"forward": "forward", "optimizer": "optimizer", "rest": "the rest"}
            parts = ", ".join(f"{words[k]} {v:+.1f} ms" for k, v in sorted(split.items(), key=lambda kv: -kv[1]))
            return f"{head}: its step takes {_ms(extra)} more outside backward ({parts})"
        return f"{head}: its step takes {_ms(extra)} more outside backward (forward, loss, optimizer)"
    return (
        f"{head}: neither its data wait, its copies nor the rest of its step explain the "
        f"{_ms(found['gap_ms'])} gap"
    )


NEXT = {
    "input": (
        "Feed rank {r} faster: its DataLoader (more workers, persistent workers) and its shard "
        "(slower samples, bigger files or a slower disk on that rank; the sampler should give "
        "every rank the same amount of work)."
    ),
    "h2d": (
        "Make rank {r}'s copies cheaper: pinned memory and .to(device, non_blocking=True), and "
        "check its GPU's link (PCIe lanes, a GPU shared with another process)."
    ),
    "compute": (
        "Give rank {r} no more work than the others (same batch size, same sequence lengths) "
        "and check its device: a slower or shared GPU, thermal throttling, other processes."
    ),
    "unknown": (
        "Rank {r} arrives late for a reason outside data, copies and its own step: look for "
        "work between steps on that rank (logging, checkpointing, evaluation) or a slower host."
    ),
}


def straggler_verdict(found: Mapping[str, Any], ranks: Sequence[Mapping[str, Any]]) -> Verdict:
    """The verdict when one rank holds the others back: which rank, what it waits for, and what the
    others lose waiting for it."""
    r, score = found["rank"], float(found["score"])
    n = int(found["n_analysed"])
    why = (
        f"{straggler_sentence(found)}. Every rank's step takes about {_ms(found['step_ms'])}; "
        f"the others lose {_ms(found['gap_ms'])} of it ({_pct(score)}) waiting"
        + (" in backward's all-reduce." if found["phase"] == "backward" else ".")
    )
    paired = found.get("evidence")
    if paired:
        why += (
            f" Step by step, rank {r} was last in {round(paired['last_share'] * paired['n_paired'])} of "
            f"{paired['n_paired']} steps ({_pct(paired['last_share'], 0)}; {_pct(paired['expected_share'], 0)} expected, "
            f"{p_text(paired['last_p'])}), and the others' wait a step has a 95 % interval of "
            f"{paired['gap_low_ms']:.1f} to {paired['gap_high_ms']:.1f} ms."
        )
    evidence = [(f"Rank {x['rank']}", rank_line(x)) for x in ranks]
    evidence += [
        ("Rank that holds the others back", f"rank {r} (cause: {found['cause']})"),
        ("Wait of the others (mean per step, paired)", _ms(found["gap_ms"])),
        ("Share of the step", _pct(score)),
    ]
    paired = found.get("evidence")
    if paired:
        evidence.append(("Per-step evidence", f"rank {r} was {evidence_text(paired)}"))
    return Verdict(VerdictLabel.RANK_STRAGGLER, severity_for(score, n), why, NEXT[found["cause"]].format(r=r), evidence)


def rank_line(r: Mapping[str, Any]) -> str:
    """"40 steps: data wait 38.0 ms, compute 7.1 ms (backward 2.0 ms), step 45.2 ms"."""
    text = (
        f"{r.get('n_steps') or 0} steps: data wait {_ms(_value(r, 'data_wait_ms'))}, compute "
        f"{_ms(_value(r, 'compute_ms'))}"
    )
    if _value(r, "backward_ms") is not None:
        text += f" (backward {_ms(_value(r, 'backward_ms'))})"
    text += f", step {_ms(_value(r, 'step_ms'))}"
    if r.get("status") not in (None, "finished"):
        text += f", {r['status']}"
    return text


def rank_notes(ranks: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the per-rank table should say besides the numbers: failed, stopped or unfinished
    ranks, uneven step counts, loaders that differ, step times that differ without waiting."""
    notes = []
    for r in ranks:
        status, n = r.get("status"), r.get("n_steps") or 0
        if status == "failed":
            notes.append(f"Rank {r['rank']} failed after {n} steps: {r.get('error') or 'it raised'}.")
        elif status == "stopped":
            notes.append(
                f"Rank {r['rank']} was stopped without reporting its end (terminated when another "
                f"rank failed, or killed): {n} step{'' if n == 1 else 's'} reported, its last quarter of a "
                "second missing."
            )
        elif status == "running":
            notes.append(f"Rank {r['rank']} was still running when the cell ended; its later steps are not counted.")
    done = [r for r in ranks if r.get("status") in (None, "finished")]
    counts = {int(r.get("n_steps") or 0) for r in done}
    if len(done) == len(ranks) and len(counts) > 1:
        each = ", ".join(f"rank {r['rank']} {r.get('n_steps') or 0}" for r in done)
        notes.append(
            f"The ranks ran different numbers of steps ({each}): uneven data. Give every rank "
            "the same number of batches (DistributedSampler with drop_last=True), or use DDP's "
            "join() context for uneven inputs."
        )
    differ = loader_differences(ranks)
    if differ:
        notes.append("The ranks' DataLoaders differ: " + "; ".join(differ) + ".")
    steps = [(int(r["rank"]), _value(r, "step_ms")) for r in usable(ranks)]
    measured = [(k, v) for k, v in steps if v]
    found = compare_ranks(ranks)
    if len(measured) >= 2:
        fast, slow = min(measured, key=lambda kv: kv[1]), max(measured, key=lambda kv: kv[1])
        if slow[1] >= (1 + WARN_SHARE) * fast[1] and (found is None or found["score"] < WARN_SHARE):
            notes.append(
                f"Step times differ between ranks (rank {slow[0]} {_ms(slow[1])}, rank {fast[0]} "
                f"{_ms(fast[1])}) and none waits for another: the ranks do not synchronise each step."
            )
    paired = (found or {}).get("evidence")
    if found is not None and paired and not holds_back(found) and (found["score"] >= WARN_SHARE or paired["last_p"] < ALPHA):
        notes.append(
            f"No rank holds the others back beyond the noise: the likeliest, rank {found['rank']}, was "
            f"{evidence_text(paired)}."
        )
    return notes


def loader_differences(ranks: Sequence[Mapping[str, Any]]) -> list[str]:
    """"num_workers 2 on rank 0, 0 on rank 1" for each loader setting that differs."""
    seen = [(r["rank"], r.get("loader") or {}) for r in ranks if r.get("loader")]
    out = []
    for key in LOADER_KEYS:
        values = {rank: loader.get(key) for rank, loader in seen}
        if len(seen) >= 2 and len({repr(v) for v in values.values()}) > 1:
            out.append(f"{key} " + ", ".join(f"{v} on rank {rank}" for rank, v in values.items()))
    return out


def combined_summary(summary: Summary, ranks: Sequence[Mapping[str, Any]]) -> Summary:
    """`summary` (one rank's: its columns, stats and clock) with the headline numbers replaced
    by the median over the ranks of each rank's median: what a balanced verdict reads."""
    out = Summary(**summary)
    ok = usable(ranks)
    if not ok:
        return out
    medians = {}
    for key in MEDIAN_KEYS:
        values = [v for v in (_value(r, key) for r in ok) if v is not None]
        if values:
            medians[key] = float(median(values))
    out.update(cast(Summary, medians))  # MEDIAN_KEYS: the summary's, each a float or None
    out["n_analysed"] = min(int(r.get("n_analysed") or 0) for r in ok)
    return out


def with_ranks(summary: Summary, ranks: Sequence[Mapping[str, Any]]) -> tuple[Summary, Verdict]:
    """The run's summary and verdict once every rank's summary is known: RANK STRAGGLER when one
    rank holds the others back by >= 10 % of the step, else the usual verdict on the medians."""
    combined = combined_summary(summary, ranks)
    found = compare_ranks(ranks)
    combined["ranks"] = [dict(r) for r in ranks]
    combined["rank_comparison"] = found
    combined["rank_notes"] = rank_notes(ranks)
    if found is not None and holds_back(found):
        # The headline numbers are the straggler's own: they show why the others wait.
        late = next(r for r in ranks if r.get("rank") == found["rank"])
        combined.update(cast(Summary, {k: late[k] for k in MEDIAN_KEYS if _value(late, k) is not None}))
        combined["straggler"] = straggler_dict(found)
        return combined, straggler_verdict(found, ranks)
    combined["straggler"] = None
    return combined, diagnose(combined)


def straggler_dict(found: Mapping[str, Any]) -> Straggler:
    """The run's `straggler`: {rank, cause, score} and the per-step evidence behind it (the share
    of steps it was last, its p-value, the paired gap and its interval)."""
    out: Straggler = {"rank": found["rank"], "cause": found["cause"], "score": float(found["score"])}
    paired = found.get("evidence") or {}
    evidence = {key: paired[key] for key in STRAGGLER_EVIDENCE if paired.get(key) is not None}
    out.update(cast(Straggler, evidence))  # STRAGGLER_EVIDENCE: Straggler's keys
    return out


# The per-step evidence a straggler carries (Straggler's keys, rank_evidence.py's figures).
STRAGGLER_EVIDENCE = ("n_paired", "last_share", "expected_share", "last_p", "gap_ms", "gap_low_ms", "gap_high_ms")


CHECKLIST_VERDICTS = {"input": VerdictLabel.INPUT_BOUND, "h2d": VerdictLabel.H2D_BOUND, "compute": VerdictLabel.COMPUTE_BOUND}


def checklist_verdict(label: str, straggler: Straggler | None) -> str:
    """The verdict the checklist reads: for a RANK STRAGGLER, its cause on that rank (its loader
    is the one the run holds), so input items bear on a rank that waits for data."""
    if label == VerdictLabel.RANK_STRAGGLER and straggler:
        return CHECKLIST_VERDICTS.get(str(straggler.get("cause")), label)
    return label
