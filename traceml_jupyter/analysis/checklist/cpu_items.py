"""The checklist's items about the training process's own CPU threads."""

from __future__ import annotations

from ..threads import fix, sentence
from .facts import FIX, Facts, Item


def torch_threads_item(f: Facts) -> Item | None:
    """CPU OVERSUBSCRIBED: torch's threads and the busy workers want more cores than there are
    (only then: a machine with spare cores gets no item)."""
    o = f.oversubscription
    if not o:
        return None
    ratio = o.get("compute_p90_p50")
    unstable = ratio is not None and ratio >= 1.5
    return Item(
        "torch_threads",
        "Threads beside the workers (torch.set_num_threads)",
        FIX,
        f"{o['threads']} thread(s) x (1 + {o['busy_workers']} busy worker(s)) on {o['usable_cores']:g} core(s)",
        f"torch.set_num_threads({o['suggested_threads']})",
        None,
        f"{sentence(o)[0].upper()}{sentence(o)[1:]} {fix(o)}",
        unstable,
    )
