"""Reading torch DataLoaders: the settings the checklist reads, as plain values, and the loader
behind a wrapper. Every read is guarded (probes.py): a loader that lies or raises gives None."""

from __future__ import annotations

import sys
from typing import Any

from .probes import attribute, plain_count, safe_len, type_name


def _dataloader_class() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        from torch.utils.data import DataLoader
    except Exception:
        return None
    return DataLoader


def unwrap_loader(iterable: Any) -> Any:
    """The DataLoader behind `iterable` when it is one or wraps one visibly (tqdm's .iterable)."""
    DataLoader = _dataloader_class()
    if DataLoader is None:
        return None
    for _ in range(4):
        if isinstance(iterable, DataLoader):
            return iterable
        iterable = attribute(iterable, "iterable")
        if iterable is None:
            return None
    return None


def describe_loader(loader: Any) -> dict[str, Any]:
    """The settings the checklist reads, as plain values (no reference to the loader kept).
    A value that cannot be read honestly is None ("unknown" in the report)."""
    dataset = attribute(loader, "dataset")
    collate = attribute(loader, "collate_fn")
    collate_name = attribute(collate, "__qualname__") or type_name(collate)
    collate_module = attribute(collate, "__module__") or ""
    ds_type = type(dataset)
    return {
        "type": type_name(loader),
        "num_workers": plain_count(attribute(loader, "num_workers")),
        "batch_size": plain_count(attribute(loader, "batch_size")),
        "pin_memory": _flag(attribute(loader, "pin_memory")),
        "persistent_workers": _flag(attribute(loader, "persistent_workers")),
        "prefetch_factor": plain_count(attribute(loader, "prefetch_factor")),
        "multiprocessing_context": _context_name(attribute(loader, "multiprocessing_context")),
        "collate_fn": str(collate_name),
        "custom_collate": not str(collate_module).startswith("torch."),
        "dataset_type": str(attribute(ds_type, "__name__") or "object"),
        "dataset_module": str(attribute(ds_type, "__module__") or ""),
        "len": safe_len(loader),
        "n_samples": safe_len(dataset),
        "python_objects": python_objects(dataset),
    }


PYTHON_OBJECTS_MIN = 10_000  # a container this long makes copy-on-read growth worth naming


def python_objects(dataset: Any, prefix: str = "", depth: int = 1) -> list[dict[str, Any]]:
    """The dataset's attributes that hold a list, tuple, dict or set of many Python objects
    (workers that read them copy the pages they sit on: copy-on-read), longest first; also
    those of a dataset it wraps (`Subset.dataset`). Every read is guarded."""
    found: list[dict[str, Any]] = []
    try:
        attrs = vars(dataset)
    except TypeError:
        return found
    if type(attrs) is not dict:
        return found
    for name, value in list(attrs.items()):
        kind = type(value)
        if kind in (list, tuple, dict, set):
            n = safe_len(value)
            if n is None or n < PYTHON_OBJECTS_MIN:
                continue
            try:
                first = next(iter(value.values() if kind is dict else value))
            except Exception:
                continue
            found.append({"attribute": prefix + name, "kind": kind.__name__, "length": n, "items": type_name(first)})
        elif depth > 0 and name == "dataset":
            found += python_objects(value, f"{prefix}{name}.", depth - 1)
    return sorted(found, key=lambda row: -int(row["length"]))


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _context_name(ctx: Any) -> str | None:
    if ctx is None:
        return None
    try:
        get = getattr(ctx, "get_start_method", None)
        return str(get()) if get else str(ctx)
    except Exception:
        return None


def loader_of_iterator(iterator: Any, namespace: Any) -> Any:
    """The DataLoader in the user's namespace that an iterator made before the run came from
    (`it = iter(loader)` in an earlier cell): the one over the same dataset, else None."""
    DataLoader = _dataloader_class()
    dataset = attribute(iterator, "_dataset")
    if DataLoader is None or dataset is None or not namespace:
        return None
    try:
        values = list(namespace.values())
    except Exception:
        return None
    for value in values:
        if isinstance(value, DataLoader) and attribute(value, "dataset") is dataset:
            return value
    return None
