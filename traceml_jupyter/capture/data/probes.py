"""Guarded reads of the user's objects (batch size, length, type, loader settings): whatever they
raise or return, the answer is a plain value or None, and the user's loop never sees an error."""

from __future__ import annotations

import math
import sys
from typing import Any

MAX_COUNT = 1 << 53  # a length or batch size past this is a lie (or a float in disguise)


def plain_count(value: Any) -> int | None:
    """A non-negative int that can be a real count, else None (NaN, negative, huge, not a number)."""
    if isinstance(value, bool):
        return None
    try:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        n = int(value)
        if n != value or not 0 <= n <= MAX_COUNT:
            return None
    except Exception:
        return None
    return n


def safe_len(obj: Any) -> int | None:
    """len(obj), or None when it has none, raises anything, or returns something absurd."""
    try:
        return plain_count(len(obj))
    except Exception:
        return None


def type_name(obj: Any) -> str:
    """The name of the object's type; "object" when even that cannot be read."""
    try:
        return str(type(obj).__name__)
    except Exception:
        return "object"


def batch_size_of(batch: Any) -> int | None:
    """Rows of the first tensor (or array) found in a batch: a tensor, a tuple/list, a dict, or
    any nesting of those (`enumerate` gives `(i, (x, y))`). None when it cannot be read, e.g.
    nested tensors, whose `.shape` raises."""
    queue: list[Any] = [batch]
    for _ in range(16):
        if not queue:
            return None
        item = queue.pop(0)
        try:
            shape = getattr(item, "shape", None)
            if shape is not None:
                if len(shape):
                    return plain_count(shape[0]) or None
                continue
            if isinstance(item, (tuple, list)):
                queue.extend(item[:8])
            elif isinstance(item, dict):
                queue.extend(list(item.values())[:8])
        except Exception:
            continue
    return None


def attribute(obj: Any, name: str) -> Any:
    """getattr that never raises (a property may)."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def user_namespace() -> dict[str, Any] | None:
    """The running IPython shell's user namespace (where the notebook's names live), or None."""
    if "IPython" not in sys.modules:
        return None
    try:
        from IPython import get_ipython

        shell = get_ipython()
        return getattr(shell, "user_ns", None) if shell is not None else None
    except Exception:
        return None
