"""Pure verdict rules: from a summary to what bounds the loop, with why, next and evidence."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, TypedDict

from .data_sources import input_next, straggler_next
from .number_text import ms as _ms
from .number_text import pct as _pct
from .summary_keys import Summary, measured

WARN_SHARE = 0.10
CRITICAL_SHARE = 0.20
CRITICAL_MIN_STEPS = 20
COMPUTE_SHARE = 0.90
# A verdict over fewer than CRITICAL_MIN_STEPS steps, or whose mean step is known to no better
# than ±SURE_NOISE (its 95 % interval, from blocks of consecutive steps), says how sure it is.
SURE_NOISE = 0.25
MIN_ANALYSED = 2
# Below this median step (20 µs) the hooks' own cost (about 1 µs a step, split between fetch and
# body) is a visible share of the step, and would read as data wait: no verdict but TOO SHORT.
MIN_STEP_MS = 0.02
# HOST-BOUND (GPU clock) needs evidence that the GPU idled while the host issued work. The GPU
# "is behind" when the work still queued as a step ends is BACKLOG_BEHIND_MS or more (a GPU
# that waits on the host has a backlog of microseconds), or BACKLOG_MAX_SHARE of the step; the
# host "waits for the GPU" when its timed syncs take BACKLOG_MAX_SHARE of the step. Neither may
# hold. Then:
# - with NVML (enough samples inside the loop): GPU idle inside the steps (1 - utilisation -
#   data-wait share - H2D share) >= WARN_SHARE: warn; >= CRITICAL_SHARE: critical (with
#   CRITICAL_MIN_STEPS steps);
# - without NVML, only when nothing is hidden: the backlog was measured, every synchronising
#   call was seen, the host's issue time is known (untimed waits such as torch.nonzero make a
#   step's unknown) and it is >= HOST_ISSUE_SHARE of the step: warn only. Otherwise the tool
#   can't tell, and says so rather than HOST-BOUND.
# COMPUTE-BOUND on the GPU clock needs evidence of GPU work too: the GPU behind, NVML
# utilisation >= GPU_BUSY_PCT, or the host waiting for the GPU in timed syncs. "GPU compute" is
# the GPU-timeline span of the step body (from the batch in hand to the step's end): it counts
# the GPU's idle gaps inside the body as well as its work.
BACKLOG_MAX_SHARE = 0.10
BACKLOG_BEHIND_MS = 1.0
HOST_ISSUE_SHARE = 0.50
GPU_BUSY_PCT = 90.0


class VerdictLabel(StrEnum):
    """A verdict's label, as the text box, the report and the JSON write it (a str: it compares
    equal to the label read back from a saved run)."""

    NO_DATA = "NO DATA"  # the loop ran no step
    WARMUP = "WARMUP"  # too few steps after the warm-up for a verdict
    TOO_SHORT = "TOO SHORT"  # steps too short to time honestly
    INPUT_BOUND = "INPUT-BOUND"
    INPUT_STRAGGLER = "INPUT STRAGGLER"
    H2D_BOUND = "H2D-BOUND"
    HOST_BOUND = "HOST-BOUND"
    COMPUTE_BOUND = "COMPUTE-BOUND"
    MIXED = "MIXED"
    RANK_STRAGGLER = "RANK STRAGGLER"  # several ranks: one holds the others back


class VerdictRow(TypedDict):
    """A verdict as the JSON's `verdict` holds it (Verdict.to_dict, Verdict.from_dict)."""

    label: str
    severity: str
    why: str
    next: str
    evidence: list[list[str]]


@dataclass(frozen=True)
class Verdict:
    """A run's verdict: its label (INPUT-BOUND, COMPUTE-BOUND, ...), how serious, why, what to do
    next, and the numbers behind it."""

    label: str  # a VerdictLabel (a saved run read back keeps the label its file holds)
    severity: str  # "info", "warn" or "critical"
    why: str
    next: str
    evidence: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> Verdict:
        """The verdict its to_dict() wrote (a saved run's; a missing part reads empty)."""
        rows = saved.get("evidence") or []
        return cls(
            str(saved["label"]),
            str(saved.get("severity") or "info"),
            str(saved.get("why") or ""),
            str(saved.get("next") or ""),
            [(str(r[0]), str(r[1])) for r in rows if isinstance(r, (list, tuple)) and len(r) == 2],
        )

    def to_dict(self) -> VerdictRow:
        """The verdict as JSON-ready values (from_dict reads them back)."""
        return {
            "label": str(self.label),
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


def _bytes(value: float | None) -> str:
    if value is None:
        return "n/a"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _lines(lines: list[int]) -> str:
    if not lines:
        return ""
    if len(lines) == 1:
        return f" on line {lines[0]}"
    return " on lines " + ", ".join(map(str, lines))


def h2d_bound(summary: Summary) -> str | None:
    """The severity when host-to-device copies take >= 10 % of the GPU step, else None."""
    share = summary.get("h2d_share")
    if summary.get("clock") != "gpu" or share is None or share < WARN_SHARE:
        return None
    return severity_for(share, int(summary["n_analysed"]))


def gpu_behind(summary: Summary) -> bool:
    """The GPU still had work queued when steps ended (median backlog >= BACKLOG_BEHIND_MS or
    >= BACKLOG_MAX_SHARE of the step): it was not waiting on the host."""
    backlog, step = summary.get("gpu_backlog_ms"), summary.get("step_ms")
    if backlog is None:
        return False
    return bool(backlog >= BACKLOG_BEHIND_MS or (step and backlog >= BACKLOG_MAX_SHARE * step))


def host_waits_for_gpu(summary: Summary) -> bool:
    """The host's timed waits for the GPU (syncs) take >= BACKLOG_MAX_SHARE of the step."""
    sync, step = summary.get("sync_ms"), summary.get("step_ms")
    return bool(sync is not None and step and sync >= BACKLOG_MAX_SHARE * step)


def host_bound(summary: Summary) -> str | None:
    """The severity when the GPU waits on the host inside the steps, else None (see the
    HOST-BOUND thresholds above): only with evidence that the GPU idled while the host issued."""
    step = summary.get("step_ms")
    if summary.get("clock") != "gpu" or not step:
        return None
    if gpu_behind(summary) or host_waits_for_gpu(summary):
        return None
    idle = summary.get("host_share")
    if idle is not None:
        return severity_for(idle, int(summary["n_analysed"])) if idle >= WARN_SHARE else None
    # No utilisation: HOST-BOUND only when nothing is hidden (see above), and warn only.
    issue = summary.get("host_issue_ms")
    if summary.get("gpu_backlog_ms") is None or not summary.get("syncs_all_seen"):
        return None
    if issue is None or issue < HOST_ISSUE_SHARE * step:
        return None
    return "warn"


def gpu_busy_evidence(summary: Summary) -> str | None:
    """What shows the GPU was busy during the steps (GPU clock), as a phrase; None: nothing
    does (no backlog, no utilisation, no timed wait for the GPU)."""
    busy = summary.get("gpu_busy_share")
    if busy is not None and 100.0 * busy >= GPU_BUSY_PCT:
        return f"NVML utilisation {_pct(busy)}"
    if gpu_behind(summary):
        return f"the GPU was still {_ms(summary.get('gpu_backlog_ms'))} behind when steps ended"
    if host_waits_for_gpu(summary):
        return f"the host waited {_ms(summary.get('sync_ms'))} a step for the GPU"
    return None


def hidden_waits_sentence(summary: Summary) -> str:
    """" Waits nobody reports may hide: CUDA_LAUNCH_BLOCKING=1 ..." or ""."""
    hidden = list(summary.get("syncs_hidden") or [])
    return f" Waits nobody reports may hide there: {'; '.join(hidden)}." if hidden else ""


def sync_sentence(top: Mapping[str, Any] | None) -> str | None:
    """"`loss.item()` on line 7 synchronises every step: the host waits there 31.0 % of the
    step." for the costliest syncing line of the cell, or None."""
    if not top or not top.get("in_cell"):
        return None
    call = top.get("call") or "a call"
    per = top.get("calls_per_step") or 0.0
    if top.get("every_step"):
        how = "every step" if per < 1.5 else f"{per:.0f} times every step"
    else:
        how = f"{per:.2g} times per step"
    text = f"`{call}` on line {top['line']} synchronises {how}"
    if top.get("share") is not None:
        text += f": the host waits there {_pct(top['share'])} of the step"
    return text + "."


def _h2d_verdict(summary: Summary, severity: str, evidence: list[tuple[str, str]]) -> Verdict:
    share, h2d, step = measured(summary["h2d_share"]), summary["h2d_ms"], summary["step_ms"]
    pinned, nb = summary.get("h2d_pinned_share"), summary.get("h2d_non_blocking_share")
    gbps = summary.get("h2d_gbps")
    pinned_text = "pageable memory" if not pinned else ("pinned memory" if pinned >= 0.999 else f"{_pct(pinned)} pinned")
    nb_text = "blocking" if not nb else ("non_blocking" if nb >= 0.999 else f"{_pct(nb)} non_blocking")
    lines = list(summary.get("h2d_lines") or [])
    rate = f" at {gbps:.1f} GB/s" if gbps is not None else ""
    why = (
        f"Host-to-device copies take {_pct(share)} of each step: {_ms(h2d)} of a {_ms(step)} "
        f"median step, {_bytes(summary.get('h2d_bytes'))} per step{rate} ({pinned_text}, "
        f"{nb_text})."
    )
    pageable_nb = list(summary.get("h2d_pageable_non_blocking") or [])
    if pageable_nb:
        why += (
            f" non_blocking=True without pinned memory is synchronous{_lines(pageable_nb)}: CUDA "
            "waits for the GPU before it copies from pageable memory."
        )
    waited = list(summary.get("h2d_side_stream_waited") or [])
    if waited:
        why += (
            f" The copy{_lines(waited)} runs on a side stream, but the loop's stream waits for it "
            "(wait_stream, wait_event) before it is done, so most of it does not overlap compute: start the next "
            "batch's copy before this step's compute (a prefetch), and make the copy cheaper."
        )
    # Pinning makes a copy about twice as fast; on the loop's stream it still runs between
    # the kernels, so only a copy on a side stream (a prefetcher) overlaps compute.
    after = share * ((pinned or 0.0) + (1.0 - (pinned or 0.0)) / 2.0)
    remains = f" (about {_pct(after)} of the step would remain)" if (pinned or 0.0) < 0.999 else ""
    return Verdict(
        VerdictLabel.H2D_BOUND,
        severity,
        why,
        "Copy less and faster: pin the batches (DataLoader(pin_memory=True)) and copy them with "
        f".to(device, non_blocking=True){_lines(lines)}: about twice as fast{remains}, and the "
        "host is free; on the loop's stream the copy still runs between the kernels, so to hide "
        "it prefetch the next batch on a side CUDA stream (torch.cuda.Stream, wait_stream, "
        "record_stream). Send compact dtypes (uint8 images) and convert on the GPU.",
        evidence
        + [
            ("H2D copies (median per step)", _ms(h2d)),
            ("H2D share", _pct(share)),
            ("Copied per step", _bytes(summary.get("h2d_bytes"))),
            ("Effective bandwidth", f"{gbps:.1f} GB/s" if gbps is not None else "n/a"),
            ("Pinned memory", _pct(pinned)),
            ("Asynchronous copies (non_blocking, pinned)", _pct(nb)),
            ("Copy lines", ", ".join(map(str, lines)) or "n/a"),
        ],
    )


def _host_verdict(summary: Summary, severity: str, evidence: list[tuple[str, str]]) -> Verdict:
    step, issue, backlog = summary["step_ms"], summary.get("host_issue_ms"), summary.get("gpu_backlog_ms")
    idle, busy = summary.get("host_share"), summary.get("gpu_busy_share")
    queued = f"the GPU has no work queued when a step ends (backlog {_ms(backlog)})" if backlog is not None else "the GPU is never behind the host"
    if idle is not None:
        why = (
            f"The GPU waits on the host inside the steps: it idles {_pct(idle)} of the step (NVML "
            f"utilisation {_pct(busy)}) while the host takes {_ms(issue)} to issue a {_ms(step)} "
            f"step and {queued}."
        )
    else:
        why = (
            f"The host sets the pace: it takes {_ms(issue)} to issue each {_ms(step)} step and "
            f"{queued}. GPU utilisation is unknown (no NVML samples), so how long the GPU idles "
            "is not measured."
        )
    sync = sync_sentence(summary.get("sync_top"))
    if sync:
        why += " " + sync
    top = summary.get("host_top_line")
    if top and top.get("ms_per_step") is not None and top.get("line") is not None:
        text = f" (`{top['text']}`)" if top.get("text") and len(str(top["text"])) <= 60 else ""
        why += (
            f" Line {top['line']}{text} takes the host most time: {_ms(top['ms_per_step'])} a "
            "step; if it fetches data, the GPU is starved by input, not by launches."
        )
    own = summary.get("own_host_ms")
    if own:
        why += f" (traceml's own hooks took {_ms(own)} of the host's time a step; it is not counted.)"
    calls = summary.get("sync_calls")
    graphs = "" if summary.get("cuda_graphs_used") else "CUDA graphs, "
    compile_it = "" if summary.get("model_compiled") else "torch.compile, "
    return Verdict(
        VerdictLabel.HOST_BOUND,
        severity,
        why,
        "Give the GPU more work per launch: a larger batch, mixed precision (torch.autocast), "
        f"{compile_it}{graphs}fewer small ops, and no .item() or other sync every step "
        "(log every N steps).",
        evidence
        + [
            ("Host time issuing a step (median)", _ms(issue)),
            ("GPU backlog at step end (median)", _ms(backlog)),
            ("GPU utilisation (NVML, median)", _pct(busy)),
            ("GPU idle inside steps", _pct(idle)),
            ("Syncs per step (median)", "n/a" if calls is None else f"{calls:g}"),
            ("Host wait in syncs (median)", _ms(summary.get("sync_ms"))),
        ],
    )


def cheaper_step_ideas(summary: Summary) -> list[str]:
    """Ways to make a compute-bound step cheaper that are true for this run: no mixed precision
    on the CPU clock, no torch.compile for a model that is already compiled."""
    ideas = []
    if summary.get("clock") == "gpu":
        ideas.append("mixed precision")
    if not summary.get("model_compiled"):
        ideas.append("torch.compile")
    return ideas + [larger_batch(summary), "a smaller model"]


def larger_batch(summary: Summary) -> str:
    """"a larger batch", with the room the GPU memory peak leaves when it was measured."""
    room, share = summary.get("gpu_batch_room"), summary.get("gpu_mem_peak_share")
    if room is None or share is None:
        return "a larger batch"
    if room < 1.2:
        return f"a larger batch only with less memory per sample: the peak is {_pct(share)} of the GPU"
    return f"a larger batch: the memory peak is {_pct(share)} of the GPU, room for about {room:.1f}x the batch"


def diagnose(summary: Summary) -> Verdict:
    """The first rule that holds, in order: no data, warm-up, too short, input (a steady pattern
    of waits before stragglers), straggler, host-to-device copies, host, compute (or mixed); its
    `why` ends with how sure it is when the steps are few or noisy."""
    evidence = _evidence(summary)
    found = _no_verdict(summary, evidence)
    if found is not None:
        return found
    found = _input_verdict(summary, evidence)
    if found is None:
        severity = h2d_bound(summary)
        if severity is not None:
            found = _h2d_verdict(summary, severity, evidence)
    if found is None:
        severity = host_bound(summary)
        if severity is not None:
            found = _host_verdict(summary, severity, evidence)
    if found is None:
        found = _compute_verdict(summary, evidence)
    # A straggler's stalls are what make its mean step uncertain: the verdict is sure of them.
    sure = how_sure(summary) if found.label != VerdictLabel.INPUT_STRAGGLER else ""
    return replace(found, why=found.why + sure) if sure else found


def _compute_name(summary: Summary) -> str:
    return "GPU compute" if summary["clock"] == "gpu" else "CPU compute"


def _evidence(summary: Summary) -> list[tuple[str, str]]:
    """The numbers every verdict shows: the means that add up to the loop's time (where the
    summary has them), the medians, the wait's share, the steps, the clock."""
    mean_rows = [
        ("Data wait (mean, every step)", _ms(summary.get("mean_data_wait_ms"))),
        (f"{_compute_name(summary)} (mean, every step)", _ms(summary.get("mean_compute_ms"))),
        ("Step time (mean, every step)", _ms(summary.get("mean_step_ms"))),
    ]
    return (mean_rows if summary.get("mean_step_ms") is not None else []) + [
        ("Data wait (median)", _ms(summary["data_wait_ms"])),
        (f"{_compute_name(summary)} (median)", _ms(summary["compute_ms"])),
        ("Step time (median)", _ms(summary["step_ms"])),
        ("Data wait share", _pct(summary["data_wait_share"])),
        ("Analysed steps", f"{int(summary['n_analysed'])} (after {summary['warmup_steps']} warm-up)"),
        ("Clock", summary["clock"].upper()),
    ]


def _no_verdict(summary: Summary, evidence: list[tuple[str, str]]) -> Verdict | None:
    """No step, too few after the warm-up, or steps too short to time: no verdict on the pace."""
    n = int(summary["n_analysed"])
    step = summary["step_ms"]
    if int(summary["n_steps"]) == 0:
        return Verdict(
            VerdictLabel.NO_DATA,
            "info",
            "The loop ran no step: its iterator yielded no batch.",
            "Check that the DataLoader and its dataset are not empty (len(loader) > 0).",
            evidence,
        )
    if n < MIN_ANALYSED:
        return Verdict(
            VerdictLabel.WARMUP,
            "info",
            f"Only {n} step(s) after {summary['warmup_steps']} warm-up step(s); a verdict needs "
            f"{MIN_ANALYSED}.",
            "Run more steps (or lower --warmup) to get a verdict.",
            evidence,
        )
    if step is not None and step < MIN_STEP_MS:
        return Verdict(
            VerdictLabel.TOO_SHORT,
            "info",
            f"A step takes {step * 1000:.2g} µs (median): too short to time honestly, since the "
            "timing itself costs about a microsecond a step, a visible share of that.",
            "Trace a loop whose steps do real work (a batch through a model).",
            evidence,
        )
    return None


def _input_verdict(summary: Summary, evidence: list[tuple[str, str]]) -> Verdict | None:
    """The loop waits for data in a typical step (INPUT-BOUND), or a few fetches stall long
    enough to cost a share of the time (INPUT STRAGGLER). When both hold, the larger loss names
    the verdict: stalls that cost most of the run (workers restarting each epoch) are the finding
    even where taking each ready batch from the workers also costs a tenth of a loaded machine's
    step, and the straggler's `why` quotes that typical wait too."""
    n = int(summary["n_analysed"])
    wait, compute, step = summary["data_wait_ms"], summary["compute_ms"], summary["step_ms"]
    wait_share = summary["data_wait_share"]
    typical = wait_share is not None and wait_share >= WARN_SHARE
    lost = summary.get("straggler_share") or 0.0
    steady = _steady_input_verdict(summary, evidence)
    if steady is not None:
        return steady
    if typical and wait_share is not None and lost <= wait_share:
        return Verdict(
            VerdictLabel.INPUT_BOUND,
            severity_for(wait_share, n),
            f"The loop spends {_pct(wait_share)} of a typical step waiting for data (median "
            f"wait {_ms(wait)}, median step {_ms(step)}, {_compute_name(summary).lower()} "
            f"{_ms(compute)}), over {n} steps.",
            input_next(summary),
            evidence,
        )
    if lost >= WARN_SHARE:
        besides = f"; besides, a typical step waits {_pct(wait_share)} of its time" if typical else ""
        return Verdict(
            VerdictLabel.INPUT_STRAGGLER,
            severity_for(lost, n),
            f"{summary['straggler_steps']} of {n} fetches stall (p99 wait "
            f"{_ms(summary['stats']['data_wait_ms']['p99'])}, median {_ms(wait)}) and cost "
            f"{_pct(lost)} of the total time{besides}.",
            straggler_next(summary),
            evidence + [("Time lost to stalls", _pct(lost))],
        )
    return None


def _steady_input_verdict(summary: Summary, evidence: list[tuple[str, str]]) -> Verdict | None:
    """Waits that repeat with a short period (workers in lockstep: a round of batches arrives at
    once, then every worker is busy) are the loader's steady state, not stragglers: INPUT-BOUND
    on the share of the time the loop waits, when that is WARN_SHARE or more."""
    pattern = summary.get("step_pattern") or {}
    share = summary.get("data_wait_time_share")
    if not pattern.get("steady_wait") or share is None or share < WARN_SHARE:
        return None
    n = int(summary["n_analysed"])
    stats = summary.get("stats") or {}
    wait_stats, step_stats = stats.get("data_wait_ms"), stats.get("step_ms")
    mean_wait = wait_stats["mean"] if wait_stats else None
    mean_step = step_stats["mean"] if step_stats else None
    cause = f" ({pattern['cause']})" if pattern.get("cause") else ""
    text = pattern.get("text")
    if pattern.get("period") and pattern.get("slow_in") == "data wait":
        how = f"in a steady pattern: {text}{cause}"
        pace = "the waits repeat with the loader's rounds"
    else:
        how = f"steadily: {pattern.get('stalls')} of {n} fetches wait long" + (f" ({text})" if text else "")
        pace = "the waits are spread over the run, not at the passes' starts"
    return Verdict(
        VerdictLabel.INPUT_BOUND,
        severity_for(share, n),
        f"The loop waits for data {_pct(share)} of its time, {how}. Mean wait {_ms(mean_wait)} of "
        f"a {_ms(mean_step)} mean step, over {n} steps: {pace}, so they are its pace, not "
        "stragglers.",
        input_next(summary),
        evidence + ([("Pattern", str(text))] if text else []),
    )


def how_sure(summary: Summary) -> str:
    """" Over 8 steps the mean step is known to ±23 %: run longer to be sure." when the steps
    are few (under CRITICAL_MIN_STEPS) or noisy (the mean's interval wider than ±SURE_NOISE: a
    machine shared with other work, a step that varies by a factor), else ""."""
    n, noise = int(summary.get("n_analysed") or 0), summary.get("mean_step_noise")
    if n < MIN_ANALYSED or noise is None or (n >= CRITICAL_MIN_STEPS and noise <= SURE_NOISE):
        return ""
    return f" Over {n} steps the mean step is known to ±{100 * noise:.0f} %: run longer to be sure."


def _compute_verdict(summary: Summary, evidence: list[tuple[str, str]]) -> Verdict:
    """Compute is most of the step (COMPUTE-BOUND; on a GPU, only with evidence the GPU worked
    during it), else no phase stands out (MIXED)."""
    clock = summary["clock"]
    compute_name = _compute_name(summary)
    wait_share, compute_share = summary["data_wait_share"], summary["compute_share"]
    compute, step = summary["compute_ms"], summary["step_ms"]
    busy_evidence = gpu_busy_evidence(summary) if clock == "gpu" else None
    if compute_share is not None and compute_share >= COMPUTE_SHARE and clock == "gpu" and not busy_evidence:
        # The GPU-timeline span of the body is most of the step, but nothing shows the GPU
        # worked during it (it may have idled while the host issued work or waited untimed).
        return Verdict(
            VerdictLabel.MIXED,
            "info",
            f"GPU compute (the GPU-timeline span of the step body, busy or idle) is "
            f"{_pct(compute_share)} of the median step ({_ms(compute)} of {_ms(step)}) and data "
            f"wait is {_pct(wait_share)}, but GPU busy is unknown: no work was queued when steps "
            "ended, GPU utilisation was not measured, and the host's waits for the GPU were not "
            "timed, so whether the GPU or the host sets the pace can't be told."
            + hidden_waits_sentence(summary),
            "Install nvidia-ml-py (GPU utilisation) and run again; replace untimed syncs "
            "(torch.nonzero, boolean masks) or log them every N steps.",
            evidence,
        )
    if compute_share is not None and compute_share >= COMPUTE_SHARE:
        span = (
            f" (the GPU-timeline span of the step body; {busy_evidence})" if busy_evidence else ""
        )
        return Verdict(
            VerdictLabel.COMPUTE_BOUND,
            "info",
            f"{compute_name} is {_pct(compute_share)} of the median step ({_ms(compute)} of "
            f"{_ms(step)}){span}; data wait is {_pct(wait_share)}.",
            "The input keeps up: to go faster, make the step cheaper ("
            + ", ".join(cheaper_step_ideas(summary))
            + ").",
            evidence,
        )
    return Verdict(
        VerdictLabel.MIXED,
        "info",
        f"No phase stands out: data wait {_pct(wait_share)}, {compute_name.lower()} "
        f"{_pct(compute_share)} of the median step.",
        "Look at the step-time distribution: the steps vary more than any one phase explains.",
        evidence,
    )
