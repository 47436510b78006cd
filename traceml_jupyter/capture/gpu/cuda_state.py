"""Whether the user's code uses CUDA, asked without side effects: torch.cuda only when torch is
imported (never importing it), and `is_initialized()`, which, unlike `is_available()`,
`device_count()` or `current_device()`, never initialises the driver (that would make every
later fork-started CUDA process fail).

Once CUDA is initialised, a query of its state may still fail with CUDA's own error: after an
illegal memory access every later runtime call returns it (a sticky error), and the user's code
raises it where it next touches CUDA. `cuda_or` is the one guard for those queries (the current
device, the allocator's counters, a stream's queue, whether a graph capture is under way): the
fallback answers, and the user's own call reports the error."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
D = TypeVar("D")


def torch_cuda() -> Any:
    """torch.cuda when torch is imported (never imports torch itself), else None."""
    torch = sys.modules.get("torch")
    return getattr(torch, "cuda", None) if torch is not None else None


def cuda_or(default: D, query: Callable[..., T], *args: Any) -> T | D:
    """`query(*args)`, a read of CUDA's state once CUDA is initialised, or `default` when CUDA
    answers with its own error (see the module docstring). Not for our code's bookkeeping."""
    try:
        return query(*args)
    except Exception:
        return default


def cuda_initialized(cuda: Any = None) -> bool:
    """CUDA was initialised (by the user's code). `cuda`: a torch.cuda-like module (default:
    torch.cuda, when torch is imported)."""
    cuda = cuda if cuda is not None else torch_cuda()
    is_initialized = getattr(cuda, "is_initialized", None)  # never raises in torch
    return callable(is_initialized) and bool(is_initialized())
