"""Whether the user's code uses CUDA, asked without side effects: torch.cuda only when torch is
imported (never importing it), and `is_initialized()`, which, unlike `is_available()`,
`device_count()` or `current_device()`, never initialises the driver (that would make every
later fork-started CUDA process fail)."""

from __future__ import annotations

import sys
from typing import Any


def torch_cuda() -> Any:
    """torch.cuda when torch is imported (never imports torch itself), else None."""
    torch = sys.modules.get("torch")
    return getattr(torch, "cuda", None) if torch is not None else None


def cuda_initialized(cuda: Any = None) -> bool:
    """CUDA was initialised (by the user's code). `cuda`: a torch.cuda-like module (default:
    torch.cuda, when torch is imported)."""
    cuda = cuda if cuda is not None else torch_cuda()
    is_initialized = getattr(cuda, "is_initialized", None)  # never raises in torch
    return callable(is_initialized) and bool(is_initialized())
