"""What fed the training steps, in words, and what makes it faster. A DataLoader's remedies are
its settings (workers, persistent workers, pinned memory); a generator, a list, a custom
iterator or a `get_batch()` function has none of those, and the advice names that source by its
expression and line and says what makes such a source faster. Pure functions of the summary
(`data_source`, `data_source_kind`, `data_source_type`, `data_source_line`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


def feeder(summary: Mapping[str, Any]) -> Feeder | None:
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


def input_next(summary: Mapping[str, Any]) -> str:
    """The INPUT-BOUND verdict's `next`: the DataLoader's settings for a DataLoader (unless the
    CPU is already saturated: then cheaper samples), else the source by name and line and its
    own remedies."""
    f = feeder(summary)
    saturated = bool(summary.get("cpu_saturated"))
    if f is None:
        return SATURATED_INPUT_NEXT if saturated else DATALOADER_INPUT_NEXT
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


def straggler_next(summary: Mapping[str, Any]) -> str:
    """The INPUT STRAGGLER verdict's `next`, for the source that fed the steps."""
    f = feeder(summary)
    if f is None:
        return DATALOADER_STRAGGLER_NEXT
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
