"""Replacing attributes of a class for the duration of a traced cell, restored in finally."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any


@contextmanager
def patched(owner: Any, replacements: Mapping[str, Any]) -> Iterator[None]:
    """Set `owner.<name> = value` for each replacement; on exit put back exactly what was in
    the class's own __dict__ (or remove the attribute if it was inherited)."""
    saved = {name: owner.__dict__.get(name) for name in replacements}
    for name, value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
