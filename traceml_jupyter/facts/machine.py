"""What a run ran on (capture/resources/machine.py): the result's `machine`, which compare
checks before it compares two runs."""

from __future__ import annotations

from typing import TypedDict


class MachineFacts(TypedDict):
    """What a run ran on (None: not known): Python's, torch's and CUDA's versions, the platform,
    the CPU's model, the cores this process may use, the GPU's name, this package's version."""

    python: str
    torch: str | None
    cuda: str | None
    platform: str
    cpu: str | None
    cpus: int | None
    gpu: str | None
    traceml_jupyter: str | None
