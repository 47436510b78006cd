"""What fed the steps (capture/data/): a DataLoader's settings as the checklist reads them, the
dataset attributes holding many Python objects, where the loader was built and its dataset's
`__getitem__` written, every data source and the passes kept out of the steps: the result's
`data` section (docs/api.md)."""

from __future__ import annotations

from typing import TypedDict


class PythonObjects(TypedDict):
    """A dataset attribute that holds many Python objects (`python_objects`)."""

    attribute: str  # "records", or "dataset.records" inside a Subset
    kind: str  # list, tuple, dict or set
    length: int
    items: str  # the type of its first item


class LoaderFacts(TypedDict, total=False):
    """A DataLoader's settings as the checklist reads them (`describe_loader`); None: unknown."""

    type: str
    num_workers: int | None
    batch_size: int | None
    pin_memory: bool | None
    persistent_workers: bool | None
    prefetch_factor: int | None
    multiprocessing_context: str | None
    collate_fn: str
    custom_collate: bool
    dataset_type: str
    dataset_module: str
    len: int | None
    n_samples: int | None
    python_objects: list[PythonObjects]


class NotedSite(TypedDict, total=False):
    """Where a DataLoader was built ("file", "line") and its dataset's `__getitem__` written."""

    file: str
    line: int
    dataset_file: str
    dataset_line: int
    dataset_class: str


# Where the run says a loader was built ({"file", "line"}) or a dataset's __getitem__ is
# written ({"file", "line", "class"}): "class" is a keyword, hence the functional form.
CodeSite = TypedDict("CodeSite", {"file": str, "line": int, "class": str}, total=False)


class SourceRow(TypedDict):
    """A data source the loop read (`data.sources`): its label, kind (dataloader, loop, call),
    what fed it (its type, expression and line as written), the name it is bound to, whether it
    fed the training steps, its wait (ms), batches and passes, and its workers."""

    label: str
    kind: str
    type: str | None
    expression: str | None
    line: int | None
    name: str | None
    training: bool
    wait_ms: float
    batches: int
    passes: int
    num_workers: int | None


class PhaseRow(TypedDict):
    """Passes kept out of the steps (`data.phases`: validation, an eval loop): their source, kind,
    passes, batches, time and wait (ms), the wait's share of the phase and the phase's share of
    the cell (None: not known), and the source's workers."""

    label: str
    source_kind: str
    kind: str
    passes: int
    batches: int
    time_ms: float
    wait_ms: float
    wait_share: float | None
    share_of_cell: float | None
    num_workers: int | None


class RankLoader(TypedDict):
    """What the per-rank table compares of a rank's training loader (ranks/identity.py)."""

    num_workers: int | None
    batch_size: int | None
    sampler: str | None
    samples: int | None
