"""Guarded reads of the user's objects (batch size, length, type, loader settings): whatever they
raise or return, the answer is a plain value or None, and the user's loop never sees an error.
Each read goes through `failures.read_or`, the one guard for the user's code; nothing else here
can fail."""

from __future__ import annotations

import math
import sys
from typing import Any

from ...failures import read_or

MAX_COUNT = 1 << 53  # a length or batch size past this is a lie (or a float in disguise)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        return None
    n = int(value)
    return n if n == value and 0 <= n <= MAX_COUNT else None


def plain_count(value: Any) -> int | None:
    """A non-negative int that can be a real count, else None (NaN, negative, huge, not a number)."""
    return read_or(None, _count, value)


def _len_count(obj: Any) -> int | None:
    return _count(len(obj))


def safe_len(obj: Any) -> int | None:
    """len(obj), or None when it has none, raises anything, or returns something absurd."""
    return read_or(None, _len_count, obj)


def _type_name(obj: Any) -> str:
    return str(type(obj).__name__)


def type_name(obj: Any) -> str:
    """The name of the object's type; "object" when even that cannot be read."""
    return read_or("object", _type_name, obj)


LOOK_FURTHER = -1  # `_look_into` found no rows in an item: the next item decides


def _look_into(item: Any, queue: list[Any]) -> int | None:
    """The rows of `item` when it has a shape with a first dimension (None: unreadable);
    LOOK_FURTHER for a scalar, or a container whose parts it puts on `queue`."""
    shape = getattr(item, "shape", None)
    if shape is not None:
        return (plain_count(shape[0]) or None) if len(shape) else LOOK_FURTHER
    if isinstance(item, (tuple, list)):
        queue.extend(item[:8])
    elif isinstance(item, dict):
        queue.extend(list(item.values())[:8])
    return LOOK_FURTHER


def batch_size_of(batch: Any) -> int | None:
    """Rows of the first tensor (or array) found in a batch: a tensor, a tuple/list, a dict, or
    any nesting of those (`enumerate` gives `(i, (x, y))`). None when it cannot be read, e.g.
    nested tensors, whose `.shape` raises."""
    queue: list[Any] = [batch]
    for _ in range(16):
        if not queue:
            return None
        rows = read_or(LOOK_FURTHER, _look_into, queue.pop(0), queue)  # one that raises: skipped
        if rows != LOOK_FURTHER:
            return rows
    return None


def attribute(obj: Any, name: str) -> Any:
    """getattr that never raises (a property may)."""
    return read_or(None, getattr, obj, name, None)


def _shell_namespace() -> dict[str, Any] | None:
    from IPython import get_ipython

    shell = get_ipython()
    return getattr(shell, "user_ns", None) if shell is not None else None


def user_namespace() -> dict[str, Any] | None:
    """The running IPython shell's user namespace (where the notebook's names live), or None."""
    if "IPython" not in sys.modules:
        return None
    return read_or(None, _shell_namespace)
