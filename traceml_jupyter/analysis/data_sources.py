"""What fed the training steps, in words, and what makes it faster. A DataLoader's remedies are
its settings (workers, persistent workers, pinned memory); a generator, a list, a custom
iterator or a `get_batch()` function has none of those, and the advice names that source by its
expression and line and says what makes such a source faster. A DataLoader's advice follows
what the run saw of it: persistent workers only when the loop made several passes over it,
pinned memory only on the GPU clock, a prefetch only with workers. Pure functions of the summary
(`data_source`, `data_source_kind`, `data_source_type`, `data_source_line`, `loader_workers`,
`loader_persistent`, `loader_passes`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .number_text import ms as _ms
from .summary_keys import Summary

# The INPUT-BOUND and INPUT STRAGGLER advice for a DataLoader (and when the source is not known).
DATALOADER_INPUT_NEXT = (
    "Feed the loop faster: more DataLoader workers, persistent workers, pinned memory, and "
    "less per-sample work (see the checklist)."
)
# ... when the CPU is already saturated (analysis/resources.py): more workers won't help.
SATURATED_INPUT_NEXT = (
    "Make each sample cheaper: the CPU is saturated, so more DataLoader workers won't help; "
    "cache decoded samples, precompute, or move the per-sample work to the GPU (see the checklist)."
)
DATALOADER_STRAGGLER_NEXT = (
    "Keep workers alive between epochs (persistent_workers=True), prefetch more, and look for "
    "slow samples, files or shards."
)
NOUNS = {
    "generator": "a generator",
    "list": "a list",
    "tuple": "a tuple",
    "iterator": "an iterator",
    "iterable": "an iterable",
    "function": "a function",
}
# Sources whose items exist before the loop: taking one costs next to nothing.
BUILT = frozenset({"list", "tuple"})


@dataclass(frozen=True)
class Feeder:
    """A source of batches that is no DataLoader: `slow()` on line 3, a generator."""

    label: str  # "`slow()` on line 3" (as the run names it)
    type: str | None  # "generator", "list", "tuple", "iterator", "iterable", "function"; None
    line: int | None

    @property
    def noun(self) -> str:
        """What fed the steps in words ("a DataLoader", "a generator", ...)."""
        return NOUNS.get(self.type or "", "the loop's own source")

    @property
    def built(self) -> bool:
        """Its items are built before the loop (a list, a tuple)."""
        return self.type in BUILT

    def named(self) -> str:
        """"`slow()` on line 3 (a generator)"."""
        return f"{self.label} ({self.noun})"


def feeder(summary: Summary) -> Feeder | None:
    """What fed the steps when it is no DataLoader (a loop over a generator, a list, an iterator;
    a `get_batch()` or `next()` call in the body); None for a DataLoader or an unknown source."""
    if summary.get("data_source_kind") not in ("loop", "call"):
        return None
    label = summary.get("data_source") or "the loop's iterator"
    line = summary.get("data_source_line")
    return Feeder(str(label), summary.get("data_source_type"), int(line) if line is not None else None)


def remedies(f: Feeder) -> str:
    """What makes such a source faster, as one clause."""
    if f.built:
        return (
            "its items are built before the loop, so taking one costs next to nothing and the "
            "wait is the loop's own cost per item next to very short steps: give each step more "
            "work (a larger batch)"
        )
    return (
        "prefetch it in a background thread or put it behind a DataLoader with workers (an "
        "IterableDataset over it), cache what it recomputes, and make each item cheaper"
    )


def loader_facts(loader: Mapping[str, Any] | None, pass_steps: Sequence[int]) -> Summary:
    """What the advice reads of the training DataLoader: its workers, whether they persist, and
    how many passes the loop made over it (None where no DataLoader fed the steps)."""
    if not loader:
        return {"loader_workers": None, "loader_persistent": None, "loader_passes": None}
    workers = loader.get("num_workers")
    return {
        "loader_workers": int(workers) if workers is not None else None,
        "loader_persistent": bool(loader.get("persistent_workers")),
        "loader_passes": max(1, len(set(pass_steps))),
    }


# ... when the run saw no DataLoader feed its steps (and no other source it could name).
NO_LOADER_INPUT_NEXT = (
    "Feed the loop faster: make each batch cheaper to produce, or make it ahead of the step in a "
    "background thread or a DataLoader with workers (see the checklist)."
)
NO_LOADER_STRAGGLER_NEXT = (
    "Look for the slow batches (a large file, a cache miss, a pass's set-up), and make them ahead "
    "of the step in a background thread, so that one slow batch hides behind the steps."
)


def no_loader(summary: Summary) -> bool:
    """The run said what it saw of the training DataLoader, and saw none (a run saved before it
    said so is not taken for one without)."""
    return "loader_passes" in summary and summary.get("data_source_kind") != "dataloader"


def loader_input_next(summary: Summary) -> str:
    """The INPUT-BOUND `next` for a DataLoader, true for this run: persistent workers only over
    several passes, pinned memory only on the GPU clock; DATALOADER_INPUT_NEXT when the run
    did not say what it saw of the loader (a run saved before these keys)."""
    passes = summary.get("loader_passes")
    if passes is None:
        return NO_LOADER_INPUT_NEXT if no_loader(summary) else DATALOADER_INPUT_NEXT
    pattern = summary.get("step_pattern") or {}
    ideas = ["more DataLoader workers"]
    if passes >= 2 and not summary.get("loader_persistent"):
        ideas.append("persistent workers")
    if summary.get("clock") == "gpu":
        ideas.append("pinned memory")
    period = pattern.get("period")
    if pattern.get("steady_wait") and period and summary.get("loader_workers"):
        round_ms = (period - 1) * float(pattern.get("typical_ms") or 0.0) + float(pattern.get("slow_ms") or 0.0)
        return (
            f"Feed the loop faster: the {summary['loader_workers']} workers make a round of "
            f"batches every {_ms(round_ms)} while the steps need one every "
            f"{_ms(pattern.get('typical_ms'))}: {', '.join(ideas)} (%traceml tune measures how "
            "many), or cheaper samples (see the checklist)."
        )
    return f"Feed the loop faster: {', '.join(ideas)}, and less per-sample work (see the checklist)."


def loader_straggler_next(summary: Summary) -> str:
    """The INPUT STRAGGLER `next` for a DataLoader: persistent workers only when workers
    restarted over several passes, a prefetch only with workers, workers when it has none."""
    passes = summary.get("loader_passes")
    if passes is None:
        return NO_LOADER_STRAGGLER_NEXT if no_loader(summary) else DATALOADER_STRAGGLER_NEXT
    workers = summary.get("loader_workers") or 0
    if not workers:
        head = "Load in DataLoader workers (num_workers > 0) so that a slow batch is made while the steps run"
    elif passes >= 2 and not summary.get("loader_persistent"):
        head = "Keep workers alive between epochs (persistent_workers=True), prefetch more"
    else:
        head = "Prefetch more batches (prefetch_factor)"
    return f"{head}, and look for slow samples, files or shards."


def input_next(summary: Summary) -> str:
    """The INPUT-BOUND verdict's `next`: the DataLoader's settings for a DataLoader (unless the
    CPU is already saturated: then cheaper samples), else the source by name and line and its
    own remedies."""
    f = feeder(summary)
    saturated = bool(summary.get("cpu_saturated"))
    if f is None:
        return SATURATED_INPUT_NEXT if saturated else loader_input_next(summary)
    if saturated and not f.built:
        return (
            f"Make each item of {f.named()} cheaper: the CPU is saturated, so a thread or workers "
            "beside it won't help; cache what it recomputes, or move its work to the GPU (see "
            "the checklist)."
        )
    if f.built:
        return f"Feed the loop faster: {f.named()} fed the steps; {remedies(f)}."
    return (
        f"Feed the loop faster: {f.named()} makes every batch in the training process while the "
        f"step waits: {remedies(f)} (see the checklist)."
    )


def straggler_next(summary: Summary) -> str:
    """The INPUT STRAGGLER verdict's `next`, for the source that fed the steps."""
    f = feeder(summary)
    if f is None:
        return loader_straggler_next(summary)
    return (
        f"Look for the slow items of {f.named()} (a large file, a cache miss, a pass's set-up), "
        "and prefetch it in a background thread a few batches ahead, so that one slow item "
        "hides behind the steps."
    )


def phase_remedy(source_kind: str | None) -> str:
    """How to feed a phase (validation) faster, for what fed it."""
    if source_kind in (None, "dataloader"):
        return "more workers, persistent_workers=True"
    return "prefetch it in a background thread, or cache what it computes"
