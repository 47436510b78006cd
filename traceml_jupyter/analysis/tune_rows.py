"""What tune reads and writes, as its result and JSON hold them: the DataLoader settings it tries
and changes, a measured candidate's row, the num_workers=0 split (tune_plan.py builds them)."""

from __future__ import annotations

from typing import TypedDict


class LoaderSettings(TypedDict, total=False):
    """The DataLoader keyword arguments tune tries and changes (a candidate's settings, the
    changes to make, the user's own)."""

    num_workers: int
    persistent_workers: bool
    prefetch_factor: int | None
    pin_memory: bool


class CandidateRow(TypedDict):
    """A measured candidate as tune's result and its JSON hold it (Row.to_dict)."""

    settings: LoaderSettings
    label: str
    status: str
    batches_per_s: float | None
    startup_s: float | None
    samples_measured: int | None
    batches_measured: int
    seconds: float
    message: str | None
    take_ms: float | None
    worker_cpu_ms: float | None
    compute_ratio: float | None


class SplitRow(TypedDict):
    """The num_workers=0 split as tune's result and its JSON hold it (Split.to_dict)."""

    batch_ms: float
    samples_per_batch: float | None
    getitem_ms: float | None
    per_sample_ms: float | None
    collate_ms: float | None
    pin_ms: float | None
    other_ms: float
    cpu_share: float | None
    source: str
