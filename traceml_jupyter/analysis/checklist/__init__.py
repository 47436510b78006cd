"""The checklist: pure rules that read the real DataLoader settings, the cell's code and what the
run measured (copies to the GPU, syncs, host time per line), and say item by item what is ok,
what to fix and what to check, with the value to try and the line.

facts.py holds what the rules read and say; loader_items.py and gpu_items.py the rules;
analysis/cell_code.py reads the code they quote."""

from __future__ import annotations

from .cpu_items import torch_threads_item
from .facts import CHECK, FIX, OK, CopySeen, Facts, Item, LineSeen
from .gpu_items import (
    batch_size_item,
    h2d_copies_item,
    launch_overhead_item,
    non_blocking_item,
    per_step_bytes,
    pin_memory_item,
    sync_item,
)
from .loader_items import (
    collate_item,
    data_source_item,
    dataloader_item,
    default_start_method,
    num_workers_item,
    per_item_item,
    per_sample_item,
    persistent_workers_item,
    prefetch_factor_item,
    start_method_item,
    storage_item,
    suggested_workers,
)

__all__ = [
    "CHECK", "FIX", "OK", "CopySeen", "Facts", "Item", "LineSeen", "batch_size_item", "collate_item",
    "data_source_item", "dataloader_item", "default_start_method", "evaluate", "h2d_copies_item",
    "launch_overhead_item", "non_blocking_item", "num_workers_item", "per_item_item",
    "per_sample_item", "per_step_bytes", "persistent_workers_item", "pin_memory_item",
    "prefetch_factor_item", "start_method_item", "storage_item", "suggested_workers", "sync_item",
    "torch_threads_item",
]


def evaluate(f: Facts) -> list[Item]:
    """Every item, those that bear on the verdict first (each group in checklist order)."""
    items: list[Item] = []
    source = f.feeder if f.loader is None else None
    if source is not None:
        items.append(data_source_item(f, source))
    elif f.loader is None:
        items.append(dataloader_item(f))
    else:
        workers = num_workers_item(f)
        items += [
            workers,
            persistent_workers_item(f),
            prefetch_factor_item(f),
            pin_memory_item(f),
        ]
    items.append(non_blocking_item(f))
    copies = h2d_copies_item(f)
    if copies is not None:
        items.append(copies)
    if f.on_gpu:
        items += [batch_size_item(f), launch_overhead_item(f)]
    sync = sync_item(f)
    if sync is not None:
        items.append(sync)
    if f.loader is not None:
        items.append(collate_item(f))
    items.append(per_item_item(f, source) if source is not None else per_sample_item(f))
    items.append(storage_item(f))
    threads = torch_threads_item(f)
    if threads is not None:
        items.append(threads)
    if f.loader is not None:
        items.append(start_method_item(f, workers_advised=workers.status == FIX))
    return sorted(items, key=lambda item: not item.bears_on_verdict)
