"""A finished run as a value, and what reads and writes it: `RunResult` and its sections
(value.py), the one codec (codec.py: `to_dict`, `from_dict`, every schema version), the text
renderers (render.py: the box, the lines after the verdict, the text box). Nothing here imports
torch, IPython or the capture: a result is built from a recording once, or read from its JSON."""

from __future__ import annotations

from .codec import SCHEMA_VERSION, LoadError, ResourcesRow, from_dict, resources_dict, to_dict
from .render import box, lines_after_verdict, text
from .value import DataFeed, Gpu, KernelRead, Loop, Resources, RunResult, Steps, jsonable

__all__ = [
    "SCHEMA_VERSION",
    "DataFeed",
    "Gpu",
    "KernelRead",
    "LoadError",
    "Loop",
    "Resources",
    "ResourcesRow",
    "RunResult",
    "Steps",
    "box",
    "from_dict",
    "jsonable",
    "lines_after_verdict",
    "resources_dict",
    "text",
    "to_dict",
]
