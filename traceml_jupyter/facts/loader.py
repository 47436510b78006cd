"""What the run notes of a DataLoader (capture/data/dataloaders.py): its settings as the
checklist reads them, the dataset attributes holding many Python objects, and where the loader
was built and its dataset's `__getitem__` written: the result's `data.loader`,
`data.loader_site` and `data.dataset_site` (docs/api.md)."""

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
