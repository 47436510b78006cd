"""What the resource watches measure (capture/resources/): the host's samples and DataLoader
workers, the GPU memory watch, what earlier cells held on the GPU, an out-of-memory error's
facts: the result's `resources` section (docs/resources.md)."""

from __future__ import annotations

from typing import TypedDict

import numpy as np


class WorkerFacts(TypedDict):
    """A DataLoader worker as the run keeps it (docs/resources.md): its pid, when it was seen,
    CPU seconds, memory first, last and at peak (MiB; None before a read), the DataLoader."""

    pid: int
    first_s: float | None
    last_s: float | None
    cpu_s: float
    rss_first_mib: float | None
    rss_last_mib: float | None
    rss_max_mib: float | None
    uss_first_mib: float | None
    uss_last_mib: float | None
    uss_max_mib: float | None
    uss_reads: int
    exited: bool
    loader: int  # id() of the DataLoader whose iterator started it


class HostFacts(TypedDict):
    """What the run keeps of the host (docs/resources.md): the samples (HOST_COLUMNS, numpy
    columns), each worker, the cores this process may use and the machine's, the memory
    available at the end (MiB), the last private-memory reads' cost, torch's threads, notes."""

    available_mib: float | None
    samples: dict[str, np.ndarray]
    workers: list[WorkerFacts]
    usable_cores: float
    machine_cpus: int | None
    uss_cost_ms: float
    torch_threads: int | None
    notes: list[str]


class GpuMemoryFacts(TypedDict):
    """What the run keeps of the GPU memory watch (docs/resources.md): the device, its capacity
    (MiB), whether the peak was reset each step, how many steps were read, one in how many,
    a read's host cost (µs), and why the figures stopped (None: they did not)."""

    device: int | None
    capacity_mib: float | None
    peak_reset_each_step: bool
    steps_read: int
    read_every: int
    read_us: float
    note: str | None


class Holder(TypedDict):
    """A name of the namespace and the device memory it holds (MiB)."""

    name: str
    mib: float


class HeldDevice(TypedDict):
    """What a device had allocated when the cell started (MiB), its capacity, the biggest
    holders by name, what they hold together, whether the scan stopped at its budget."""

    device: int
    allocated_mib: float
    capacity_mib: float | None
    holders: list[Holder]
    named_mib: float
    scan_stopped: bool


class HeldBefore(TypedDict):
    """What earlier cells hold on the GPUs when a traced cell starts, and the scan's cost (ms)."""

    devices: list[HeldDevice]
    scan_ms: float


class _OomStep(TypedDict, total=False):
    step: int  # the step it happened in (1-based), once the watch knows it
    completed_steps: int


class OomFacts(_OomStep):
    """An out-of-memory error's facts (MiB; None where unknown): the request, the device and
    its capacity, what was free, allocated, reserved and the peak; then the step it hit."""

    requested_mib: float | None
    device: int | None
    capacity_mib: float | None
    free_mib: float | None
    allocated_mib: float | None
    reserved_mib: float | None
    peak_mib: float | None
