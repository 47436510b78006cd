"""GPU utilisation and memory while a loop runs: an NVML sampler thread that only fills a bounded buffer."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import numpy as np

SAMPLE_PERIOD_S = 0.2  # at most 5 samples a second
CAPACITY = 2048  # samples kept; when full, every other one goes and the period doubles
THREAD_NAME = "traceml-nvml"

NO_NVML = "GPU n/a (no NVML)"
NO_CUDA = "GPU n/a (no CUDA device)"
NOT_YET_ON_GPU = "GPU n/a (no CUDA work yet)"
NOT_ON_GPU = "GPU n/a (the loop did not use CUDA)"
NVML_FAILED = "GPU n/a (NVML error)"

SAMPLE_COLUMNS = ("time_s", "gpu_util_pct", "gpu_mem_used_mib")


def pci_bus_id(props: Any) -> str | None:
    """NVML's name of a device ("0000:17:00.0") from torch's device properties, if it has them."""
    try:
        domain, bus, device = props.pci_domain_id, props.pci_bus_id, props.pci_device_id
        return f"{int(domain):04x}:{int(bus):02x}:{int(device):02x}.0"
    except (AttributeError, TypeError, ValueError):
        return None


def cuda_device_of_loop() -> tuple[str, str | int] | None:
    """How NVML finds the GPU the loop uses (torch's current device, once CUDA is initialised):
    ("pci", bus id), else ("index", NVML index honouring CUDA_VISIBLE_DEVICES), else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        index = torch.cuda.current_device()
        bus = pci_bus_id(torch.cuda.get_device_properties(index))
        if bus is not None:
            return ("pci", bus)
        return ("index", int(torch.cuda._get_nvml_device_index(index)))
    except Exception:
        return None


def cuda_available() -> bool:
    """torch is imported and can use a CUDA device (without initialising CUDA)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


def open_nvml() -> tuple[Any, str | None]:
    """(pynvml, None) with NVML initialised, or (None, why not)."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and its subclasses, or a broken install
        return None, f"{type(exc).__name__}: {exc}"
    return pynvml, None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuSamples:
    """Bounded sample buffer: written by the sampler thread, read (copied) by the main thread."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._lock = threading.Lock()
        self._data = np.full((len(SAMPLE_COLUMNS), capacity), np.nan)
        self._n = 0
        self.decimations = 0  # each one halved the kept samples (and the sampling rate)

    def add(self, time_s: float, util_pct: float, mem_used_mib: float) -> None:
        with self._lock:
            if self._n == self._data.shape[1]:
                half = self._data[:, ::2].copy()
                self._data[:] = np.nan
                self._data[:, : half.shape[1]] = half
                self._n = half.shape[1]
                self.decimations += 1
            self._data[:, self._n] = (time_s, util_pct, mem_used_mib)
            self._n += 1

    def __len__(self) -> int:
        return self._n

    def latest(self) -> tuple[float, float] | None:
        """(utilisation %, memory used MiB) of the newest sample."""
        with self._lock:
            if not self._n:
                return None
            return float(self._data[1, self._n - 1]), float(self._data[2, self._n - 1])

    def columns(self) -> dict[str, np.ndarray]:
        with self._lock:
            return {name: self._data[i, : self._n].copy() for i, name in enumerate(SAMPLE_COLUMNS)}


def at_steps(samples: dict[str, np.ndarray], step_time_s: np.ndarray) -> dict[str, np.ndarray]:
    """GPU samples placed on steps (linear interpolation by time); NaN outside the sampled span."""
    out: dict[str, np.ndarray] = {}
    t = samples.get("time_s", np.empty(0))
    for name in SAMPLE_COLUMNS[1:]:
        values = samples.get(name, np.empty(0))
        if len(t) == 0:
            out[name] = np.full(len(step_time_s), np.nan)
        else:
            out[name] = np.interp(step_time_s, t, values, left=np.nan, right=np.nan)
    return out


class GpuSampler:
    """Samples the loop's GPU at most 5 times a second on a thread named "traceml-nvml".

    `start_when_ready()` runs on the main thread (the live view calls it on each refresh): it
    decides once, cheaply, whether there is a GPU to watch, and starts the thread when the loop
    has initialised CUDA. Without NVML, without a CUDA device, or on an NVML error nothing runs
    and `note` says why GPU figures are missing. `stop()` joins the thread.
    """

    def __init__(
        self,
        origin_ns: int | None = None,
        period_s: float = SAMPLE_PERIOD_S,
        capacity: int = CAPACITY,
    ) -> None:
        self.origin_ns = origin_ns if origin_ns is not None else time.perf_counter_ns()
        self.period_s = max(period_s, SAMPLE_PERIOD_S)
        self.samples = GpuSamples(capacity)
        self.note: str | None = None  # why there are no GPU figures (None while they come)
        self.detail: str | None = None  # the error behind the note, for the report
        self.device: str | None = None  # "NVIDIA H200, 0000:17:00.0, 143771 MiB"
        self.mem_total_mib: float | None = None
        self._decided = False
        self._cuda: bool | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start_when_ready(self) -> None:
        if self._decided or self._stop.is_set():
            return
        if self._cuda is None:
            self._cuda = cuda_available()
        if not self._cuda:
            self._decided = True
            nvml, why = open_nvml()
            if nvml is None:
                self.note, self.detail = NO_NVML, why
                return
            self.note = NO_CUDA
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
            return
        device = cuda_device_of_loop()
        if device is None:
            self.note = NOT_YET_ON_GPU
            return
        self._decided = True
        self.note = None
        self._thread = threading.Thread(
            target=self._sample, args=(device,), name=THREAD_NAME, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling and wait for the thread; a run that never used CUDA says so."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if not self._decided and self.note == NOT_YET_ON_GPU:
            self.note = NOT_ON_GPU
        self._decided = True
        if self.note is None and not len(self.samples):
            self.note = NOT_ON_GPU if self._thread is None else "GPU n/a (no sample taken)"

    def _sample(self, device: tuple[str, str | int]) -> None:
        nvml, why = open_nvml()
        if nvml is None:
            self.note, self.detail = NO_NVML, why
            return
        try:
            kind, key = device
            if kind == "pci":
                handle = nvml.nvmlDeviceGetHandleByPciBusId(str(key).encode())
            else:
                handle = nvml.nvmlDeviceGetHandleByIndex(int(key))
            total = float(nvml.nvmlDeviceGetMemoryInfo(handle).total) / 2**20
            self.mem_total_mib = total
            self.device = f"{_text(nvml.nvmlDeviceGetName(handle))}, {key}, {total:.0f} MiB"
            period = self.period_s
            while not self._stop.is_set():
                util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                used = float(nvml.nvmlDeviceGetMemoryInfo(handle).used) / 2**20
                kept = self.samples.decimations
                now = (time.perf_counter_ns() - self.origin_ns) / 1e9
                self.samples.add(now, util, used)
                if self.samples.decimations != kept:
                    period *= 2
                self._stop.wait(period)
        except Exception as exc:
            self.note, self.detail = NVML_FAILED, f"{type(exc).__name__}: {exc}"
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
