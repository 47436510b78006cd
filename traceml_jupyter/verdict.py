"""Pure verdict rules: from a summary to what bounds the loop, with why, next and evidence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

WARN_SHARE = 0.10
CRITICAL_SHARE = 0.20
CRITICAL_MIN_STEPS = 20
COMPUTE_SHARE = 0.90
MIN_ANALYSED = 2


@dataclass(frozen=True)
class Verdict:
    label: str
    severity: str  # "info", "warn" or "critical"
    why: str
    next: str
    evidence: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "severity": self.severity,
            "why": self.why,
            "next": self.next,
            "evidence": [list(row) for row in self.evidence],
        }


def severity_for(share: float, n_analysed: int) -> str:
    """warn from 10 %; critical from 20 %, once there are enough steps to be sure."""
    if share >= CRITICAL_SHARE and n_analysed >= CRITICAL_MIN_STEPS:
        return "critical"
    return "warn"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def diagnose(summary: Mapping[str, Any]) -> Verdict:
    """The first rule that holds, in order: no data, warm-up, input, straggler, compute."""
    n_steps = int(summary["n_steps"])
    n = int(summary["n_analysed"])
    clock = summary["clock"]
    compute_name = "GPU compute" if clock == "gpu" else "CPU compute"
    wait, compute, step = summary["data_wait_ms"], summary["compute_ms"], summary["step_ms"]
    wait_share, compute_share = summary["data_wait_share"], summary["compute_share"]
    evidence = [
        ("Data wait (median)", _ms(wait)),
        (f"{compute_name} (median)", _ms(compute)),
        ("Step time (median)", _ms(step)),
        ("Data wait share", _pct(wait_share)),
        ("Analysed steps", f"{n} (after {summary['warmup_steps']} warm-up)"),
        ("Clock", clock.upper()),
    ]

    if n_steps == 0:
        return Verdict(
            "NO DATA",
            "info",
            "The loop ran no step: its iterator yielded no batch.",
            "Check that the DataLoader and its dataset are not empty (len(loader) > 0).",
            evidence,
        )
    if n < MIN_ANALYSED:
        return Verdict(
            "WARMUP",
            "info",
            f"Only {n} step(s) after {summary['warmup_steps']} warm-up step(s); a verdict needs "
            f"{MIN_ANALYSED}.",
            "Run more steps (or lower --warmup) to get a verdict.",
            evidence,
        )
    if wait_share is not None and wait_share >= WARN_SHARE:
        return Verdict(
            "INPUT-BOUND",
            severity_for(wait_share, n),
            f"The loop waits for data {_pct(wait_share)} of each step: {_ms(wait)} of a "
            f"{_ms(step)} median step, over {n} steps ({compute_name.lower()}: {_ms(compute)}).",
            "Feed the loop faster: more DataLoader workers, persistent workers, pinned memory, "
            "and less per-sample work (see the checklist).",
            evidence,
        )
    lost = summary.get("straggler_share") or 0.0
    if lost >= WARN_SHARE:
        return Verdict(
            "INPUT STRAGGLER",
            severity_for(lost, n),
            f"{summary['straggler_steps']} of {n} fetches stall (p99 wait "
            f"{_ms(summary['stats']['data_wait_ms']['p99'])}, median {_ms(wait)}) and cost "
            f"{_pct(lost)} of the total time.",
            "Keep workers alive between epochs (persistent_workers=True), prefetch more, and "
            "look for slow samples, files or shards.",
            evidence + [("Time lost to stalls", _pct(lost))],
        )
    if compute_share is not None and compute_share >= COMPUTE_SHARE:
        return Verdict(
            "COMPUTE-BOUND",
            "info",
            f"{compute_name} is {_pct(compute_share)} of the median step ({_ms(compute)} of "
            f"{_ms(step)}); data wait is {_pct(wait_share)}.",
            "The input keeps up: to go faster, make the step cheaper (mixed precision, "
            "torch.compile, a larger batch, a smaller model).",
            evidence,
        )
    return Verdict(
        "MIXED",
        "info",
        f"No phase stands out: data wait {_pct(wait_share)}, {compute_name.lower()} "
        f"{_pct(compute_share)} of the median step.",
        "Look at the step-time distribution: the steps vary more than any one phase explains.",
        evidence,
    )
