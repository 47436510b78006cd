"""Waits for the GPU that nobody reports: when the host may have waited for the GPU where no
sync debug warning and no timed call of ours says so, "every sync was seen" cannot be claimed,
and HOST-BOUND then needs NVML's evidence (analysis/verdict.py).

- `CUDA_LAUNCH_BLOCKING=1`: every kernel launch returns once the kernel ran (the CUDA runtime
  reads it once, at initialisation; a value set later in the kernel's life has no effect, but
  we cannot tell when it was set, so any "1" counts);
- NCCL collectives (torch.distributed with the nccl backend): their waits never warn;
- the caching allocator freeing GPU memory (`cudaFree` waits for the device): a retry after a
  failed allocation, or frees seen without a `torch.cuda.empty_cache()` of the user's (those
  are timed where the user calls them);
- third-party extensions' own waits are not seen at all: the README says so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

FREE_KEYS = ("num_alloc_retries", "num_device_free")


def launch_blocking() -> bool:
    """CUDA_LAUNCH_BLOCKING=1 is set: every kernel launch waits for the GPU."""
    return os.environ.get("CUDA_LAUNCH_BLOCKING", "").strip() == "1"


def nccl_in_use() -> bool:
    """torch.distributed is initialised with the nccl backend (never imports it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not all(callable(getattr(dist, n, None)) for n in ("is_available", "is_initialized", "get_backend")):
        return False  # torch built without distributed: none of these is there
    return bool(dist.is_available() and dist.is_initialized() and str(dist.get_backend()) == "nccl")


def allocator_frees(stats: Mapping[str, Any] | None) -> dict[str, int]:
    """The allocator's retries and cudaFree calls so far, from `torch.cuda.memory_stats(d)`
    (native allocator; cudaMallocAsync reports neither: its frees are stream-ordered)."""
    return {k: int((stats or {}).get(k, 0) or 0) for k in FREE_KEYS}


def at_loop_start() -> list[str]:
    """Reasons known when the loop starts on the GPU."""
    reasons = []
    if launch_blocking():
        reasons.append("CUDA_LAUNCH_BLOCKING=1: every kernel launch waits for the GPU, unreported")
    if nccl_in_use():
        reasons.append("NCCL collectives (torch.distributed, nccl) wait for the GPU unreported")
    return reasons


def at_loop_end(before: Mapping[str, int], after: Mapping[str, int], empty_cache_calls: int) -> list[str]:
    """Reasons from what the allocator did during the loop."""
    reasons = []
    retries = after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0)
    frees = after.get("num_device_free", 0) - before.get("num_device_free", 0)
    if retries > 0:
        reasons.append(
            f"the caching allocator ran out of cached memory {retries} time(s) and freed GPU memory "
            "(cudaFree waits for the GPU, unreported)"
        )
    elif frees > 0 and not empty_cache_calls:
        reasons.append(f"the caching allocator freed GPU memory {frees} time(s) (cudaFree waits for the GPU, unreported)")
    return reasons
