"""What a run ran on: Python, torch and CUDA versions, the CPU and the cores this process may
use, the GPU's name. Read once when a run is saved or compared; nothing here initialises CUDA."""

from __future__ import annotations

import platform
import sys
from functools import cache

from ...facts.machine import MachineFacts
from ..gpu.cuda_state import cuda_initialized


def cpu_model() -> str | None:
    """The CPU's model name ('AMD EPYC 7B13'), None where the platform does not say."""
    name = platform.processor()
    if name and name not in ("x86_64", "i386", "arm", "aarch64"):
        return name
    try:  # Linux: platform.processor() names only the architecture
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith(("model name", "hardware")):
                    return line.partition(":")[2].strip() or None
    except OSError:
        pass
    return name or None


def gpu_name(cuda_device: int | None, nvml_device: str | None) -> str | None:
    """The run's GPU by name: torch's name for the loop's device when CUDA is initialised (by the
    user's code), else the name NVML gave ('NVIDIA H200, 0000:17:00.0, 143771 MiB' -> 'NVIDIA
    H200'); None when the run used no GPU."""
    if cuda_device is not None and cuda_initialized():  # torch is imported: its CUDA answers
        return str(sys.modules["torch"].cuda.get_device_name(cuda_device))
    return nvml_device.split(",")[0].strip() if nvml_device else None


def describe_machine(
    cpus: int | None, cuda_device: int | None = None, nvml_device: str | None = None
) -> MachineFacts:
    """The facts `compare` checks before it compares two runs (None: not known)."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    return {
        "python": platform.python_version(),
        "torch": str(getattr(torch, "__version__", "")) or None,
        "cuda": getattr(version, "cuda", None) if version is not None else None,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpus": cpus,
        "gpu": gpu_name(cuda_device, nvml_device),
        "traceml_jupyter": package_version(),
    }


@cache
def package_version() -> str | None:
    """traceml-jupyter's installed version; None when run from a source tree that was not
    installed. Read once a process (the package metadata search costs about a millisecond)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("traceml-jupyter")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return None
