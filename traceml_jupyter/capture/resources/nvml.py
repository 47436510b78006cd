"""GPU utilisation and memory while a loop runs: an NVML sampler thread that only fills a bounded
buffer, and the samples placed on the steps they describe.

Nothing here initialises CUDA: the loop's device comes from the capture (or, once the user's
code has initialised CUDA, from torch's current device), never from `torch.cuda.is_available()`.
NVML's utilisation is the share of a past window (1/6 s to 1 s, by product) in which a kernel
ran; a sample is stamped at the middle of that window, and steps are placed on the GPU's
timeline (their host end plus the GPU's backlog) before they are matched with samples. The
verdict ignores utilisation unless enough samples fall inside the loop. Under MIG, NVML has no
utilisation for a slice: the note says so, and memory is read from the slice.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...failures import failure_text
from ..gpu.cuda_state import cuda_initialized, torch_cuda
from .samples import SampleBuffer, Sampler

SAMPLE_PERIOD_S = 0.2  # at most 5 samples a second
CAPACITY = 2048  # samples kept; when full, every other one goes and the period doubles
THREAD_NAME = "traceml-nvml"
UTIL_WINDOW_S = 1 / 6  # NVML's averaging window (1/6 s on data-centre GPUs, up to 1 s)
MIN_SAMPLES_IN_LOOP = 3  # fewer utilisation samples inside the loop's GPU span: not used

NO_NVML = "GPU n/a (no NVML)"
NO_CUDA = "GPU n/a (no CUDA device)"
NOT_YET_ON_GPU = "GPU n/a (no CUDA work yet)"
NOT_ON_GPU = "GPU n/a (the loop did not use CUDA)"
NVML_FAILED = "GPU n/a (NVML error)"
MIG_NO_UTIL = "GPU utilisation n/a (MIG slice: NVML does not report it)"

SAMPLE_COLUMNS = ("time_s", "gpu_util_pct", "gpu_mem_used_mib", "gpu_clock_mhz", "gpu_temp_c")


def pci_bus_id(props: Any) -> str | None:
    """NVML's name of a device ("0000:17:00.0") from torch's device properties, if it has them."""
    try:
        domain, bus, device = props.pci_domain_id, props.pci_bus_id, props.pci_device_id
        return f"{int(domain):04x}:{int(bus):02x}:{int(device):02x}.0"
    except (AttributeError, TypeError, ValueError):
        return None


def cuda_available() -> bool:
    """torch is imported and built with CUDA (asks the build, never the driver: no CUDA init)."""
    cuda = getattr(getattr(sys.modules.get("torch"), "backends", None), "cuda", None)
    is_built = getattr(cuda, "is_built", None)
    return callable(is_built) and bool(is_built())


def cuda_device_of_loop(device: int | None = None) -> tuple[str, str | int, str | None] | None:
    """How NVML finds the loop's GPU: ("pci", bus id, uuid), else ("index", NVML index honouring
    CUDA_VISIBLE_DEVICES, uuid), else None. `device`: the loop's CUDA device (None: torch's
    current device). None while CUDA is not initialised."""
    if not cuda_initialized():
        return None
    cuda = torch_cuda()
    index = int(cuda.current_device()) if device is None else int(device)
    props = cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    uuid_text = str(uuid) if uuid is not None else None
    bus = pci_bus_id(props)
    if bus is not None:
        return ("pci", bus, uuid_text)
    nvml_index = getattr(cuda, "_get_nvml_device_index", None)  # torch's, private: may be gone
    if nvml_index is None:
        return None
    try:
        return ("index", int(nvml_index(index)), uuid_text)
    except (RuntimeError, ValueError):  # CUDA_VISIBLE_DEVICES that torch cannot map to NVML
        return None


def open_nvml() -> tuple[Any, str | None]:
    """(pynvml, None) with NVML initialised, or (None, why not)."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # no driver, no library, no permission
        return None, failure_text(exc)
    return pynvml, None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


NAN = float("nan")


def clock_and_temperature(nvml: Any, handle: Any) -> tuple[float, float]:
    """The SM clock (MHz) and the temperature (°C) of the device, NaN where NVML has none: the
    trend over the run says when a GPU slowed down because it throttled."""
    return (
        _nvml_read(nvml, "nvmlDeviceGetClockInfo", handle, "NVML_CLOCK_SM"),
        _nvml_read(nvml, "nvmlDeviceGetTemperature", handle, "NVML_TEMPERATURE_GPU"),
    )


def _nvml_read(nvml: Any, function: str, handle: Any, which: str) -> float:
    """One figure NVML may not have (an older pynvml, a device without it): NaN then."""
    read, kind = getattr(nvml, function, None), getattr(nvml, which, None)
    if read is None or kind is None:
        return NAN
    try:
        return float(read(handle, kind))
    except nvml.NVMLError:  # not supported on this device
        return NAN


class GpuSamples(SampleBuffer):
    """Bounded sample buffer: written by the sampler thread, read (copied) by the main thread."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        super().__init__(SAMPLE_COLUMNS, capacity)

    def add(
        self, time_s: float, util_pct: float, mem_used_mib: float, clock_mhz: float = NAN, temp_c: float = NAN
    ) -> None:
        """One NVML reading at `time_s`: utilisation, memory used, SM clock and temperature."""
        self.add_row((time_s, util_pct, mem_used_mib, clock_mhz, temp_c))

    def latest(self) -> tuple[float, float] | None:
        """(utilisation %, memory used MiB) of the newest sample."""
        row = self.last_row()
        return None if row is None else (row["gpu_util_pct"], row["gpu_mem_used_mib"])


def gpu_time_of_steps(step_time_s: np.ndarray, gpu_lag_ms: np.ndarray | None) -> np.ndarray:
    """When the GPU finished each step (s): its host end plus the GPU's backlog then (measured
    on probed steps, interpolated between them; no probe: the host time)."""
    t = np.asarray(step_time_s, dtype=np.float64)
    if gpu_lag_ms is None:
        return t
    lag = np.asarray(gpu_lag_ms, dtype=np.float64)
    have = np.isfinite(lag) & np.isfinite(t)
    if not have.any():
        return t
    return t + np.interp(t, t[have], lag[have]) / 1000.0


def at_steps(
    samples: dict[str, np.ndarray],
    step_time_s: np.ndarray,
    gpu_lag_ms: np.ndarray | None = None,
    min_inside: int = MIN_SAMPLES_IN_LOOP,
) -> dict[str, np.ndarray]:
    """GPU samples placed on steps (linear interpolation by time on the GPU's timeline, see
    gpu_time_of_steps); NaN outside the sampled span, and utilisation NaN everywhere when fewer
    than `min_inside` samples fall inside the loop's GPU span (too few to say anything)."""
    out: dict[str, np.ndarray] = {}
    t = samples.get("time_s", np.empty(0))
    steps = np.asarray(step_time_s, dtype=np.float64)
    on_gpu = gpu_time_of_steps(steps, gpu_lag_ms)
    finite = on_gpu[np.isfinite(on_gpu)]
    span = (float(finite.min()), float(finite.max())) if len(finite) else (np.inf, -np.inf)
    for name in SAMPLE_COLUMNS[1:]:
        if name not in samples and name in ("gpu_clock_mhz", "gpu_temp_c"):
            continue  # samples of a sampler that read no clock or temperature
        values = np.asarray(samples.get(name, np.empty(0)), dtype=np.float64)
        ok = np.isfinite(values) & np.isfinite(t) if len(t) else np.zeros(0, bool)
        inside = int(np.sum(ok & (t >= span[0]) & (t <= span[1]))) if len(t) else 0
        if not ok.any() or (name == "gpu_util_pct" and inside < min_inside):
            out[name] = np.full(len(steps), np.nan)
        else:
            out[name] = np.interp(on_gpu, t[ok], values[ok], left=np.nan, right=np.nan)
    return out


class GpuSampler(Sampler):
    """Samples the loop's GPU at most 5 times a second on a thread named "traceml-nvml".

    `start_when_ready(device)` runs on the main thread (the live view calls it on each refresh):
    once CUDA is initialised (by the user's code) and the loop's device is known, it starts the
    thread. Without NVML, without a CUDA build, or on an NVML error nothing runs and `note`
    says why GPU figures are missing. `stop()` joins the thread. `sample_once()` is one reading
    (the thread's loop; tests call it directly with a fake clock).
    """

    def __init__(
        self,
        origin_ns: int | None = None,
        period_s: float = SAMPLE_PERIOD_S,
        capacity: int = CAPACITY,
        clock: Callable[[], int] = time.perf_counter_ns,
        device_of_loop: Callable[[], int | None] | None = None,
    ) -> None:
        self.samples: GpuSamples = GpuSamples(capacity)
        super().__init__(THREAD_NAME, self.samples, max(period_s, SAMPLE_PERIOD_S))
        self.clock = clock
        self.origin_ns = origin_ns if origin_ns is not None else clock()
        self.note: str | None = None  # why there are no GPU figures (None while they come)
        self.detail: str | None = None  # the error behind the note, for the report
        self.device: str | None = None  # "NVIDIA H200, 0000:17:00.0, 143771 MiB"
        self.mem_total_mib: float | None = None
        self.util_note: str | None = None  # why utilisation is missing while memory is sampled
        self.shared_note: str | None = None  # other processes use the GPU
        self.window_s = UTIL_WINDOW_S
        self._device_of_loop = device_of_loop
        self._decided = False
        self._where: tuple[str, str | int, str | None] | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._mem_handle: Any = None

    def start_when_ready(self, device: int | None = None) -> None:
        """Start sampling once the loop's GPU is known (the capture saw it, or `device`); until
        then, and where there is no CUDA or no NVML, `note` says why not."""
        if self._decided or self._stop.is_set():
            return
        if not cuda_available():
            self._decided = True
            nvml, why = open_nvml()
            if nvml is None:
                self.note, self.detail = NO_NVML, why
                return
            self.note = NO_CUDA
            _shutdown(nvml)
            return
        if device is None and self._device_of_loop is not None:
            device = self._device_of_loop()
            if device is None:  # the capture has not seen the loop on a GPU (yet)
                self.note = NOT_YET_ON_GPU
                return
        where = cuda_device_of_loop(device)
        if where is None:
            self.note = NOT_YET_ON_GPU
            return
        self._decided = True
        self.note = None
        self._where = where
        self.start_thread()

    def stop(self) -> None:
        """Stop sampling and wait for the thread; a run that never used CUDA says so."""
        self.stop_thread()
        if not self._decided and self.note == NOT_YET_ON_GPU:
            self.note = NOT_ON_GPU
        self._decided = True
        if self.note is None and not len(self.samples):
            self.note = NOT_ON_GPU if self._thread is None else "GPU n/a (no sample taken)"

    # -- on the sampler's thread ------------------------------------------------------------
    def begin(self) -> bool:
        """On the thread: NVML opened on the loop's GPU, then the first sample."""
        if self._where is None or not self.open(self._where):
            return False
        self.sample_once()
        return True

    def open(self, where: tuple[str, str | int, str | None]) -> bool:
        """NVML's handle of the loop's GPU (and of its MIG slice); False with a note without
        NVML (an NVML error raises: on the thread, its edge notes it)."""
        nvml, why = open_nvml()
        if nvml is None:
            self.note, self.detail = NO_NVML, why
            return False
        self._nvml = nvml
        kind, key, uuid = where
        if kind == "pci":
            handle = nvml.nvmlDeviceGetHandleByPciBusId(str(key).encode())
        else:
            handle = nvml.nvmlDeviceGetHandleByIndex(int(key))
        self._handle = self._mem_handle = handle
        if self._mig(nvml, handle):
            self.util_note = MIG_NO_UTIL
            self._mem_handle = self._mig_handle(nvml, uuid) or handle
        total = float(nvml.nvmlDeviceGetMemoryInfo(self._mem_handle).total) / 2**20
        self.mem_total_mib = total
        self.device = f"{_text(nvml.nvmlDeviceGetName(handle))}, {key}, {total:.0f} MiB"
        if self.util_note:
            self.device += " (MIG slice)"
        self.shared_note = self._others(nvml, handle)
        return True

    def failed(self, error: Exception) -> None:
        """NVML failed on the thread: no more samples, and the note and detail say why."""
        self.note, self.detail = NVML_FAILED, failure_text(error)

    def end(self) -> None:
        """Let go of NVML."""
        self.close()

    @staticmethod
    def _mig(nvml: Any, handle: Any) -> bool:
        read = getattr(nvml, "nvmlDeviceGetMigMode", None)  # an older pynvml has none
        if read is None:
            return False
        try:
            current = read(handle)[0]
        except nvml.NVMLError:  # not supported (a GPU without MIG), or an old driver
            return False
        return bool(current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1))

    @staticmethod
    def _mig_handle(nvml: Any, uuid: str | None) -> Any:
        """The MIG slice's own handle, from the CUDA device's UUID, if NVML knows it."""
        if not uuid:
            return None
        names = [uuid] if uuid.startswith(("MIG-", "GPU-")) else [f"MIG-{uuid}", f"GPU-{uuid}"]
        for name in names:
            try:
                return nvml.nvmlDeviceGetHandleByUUID(name.encode())
            except nvml.NVMLError:  # not a name NVML knows: the next one
                continue
        return None

    @staticmethod
    def _others(nvml: Any, handle: Any) -> str | None:
        """A note when other processes compute on the GPU (NVML's figures are device-wide)."""
        read = getattr(nvml, "nvmlDeviceGetComputeRunningProcesses", None)
        if read is None:
            return None
        try:
            procs = read(handle)
        except nvml.NVMLError:  # not supported, or not allowed
            return None
        pids = {int(getattr(p, "pid", -1)) for p in procs}
        others = pids - {os.getpid()}
        if len(pids) < 2 or not others:  # in a container NVML may show host pids: only us
            return None
        return (
            f"{len(others)} other process(es) use this GPU: utilisation and memory are the "
            "whole device's, theirs included."
        )

    def sample_once(self) -> None:
        """One reading: utilisation stamped at the middle of NVML's window, device memory."""
        nvml = self._nvml
        before = self.clock()
        util = float("nan")
        if self.util_note is None:
            try:
                util = float(nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            except nvml.NVMLError as exc:
                if "NotSupported" not in type(exc).__name__ and "Not Supported" not in str(exc):
                    raise
                self.util_note = "GPU utilisation n/a (NVML: not supported on this device)"
        used = float(nvml.nvmlDeviceGetMemoryInfo(self._mem_handle).used) / 2**20
        after = self.clock()
        read_at = (before + after) / 2
        stamp = (read_at - self.origin_ns) / 1e9 - self.window_s / 2
        self.samples.add(stamp, util, used, *clock_and_temperature(nvml, self._handle))

    def close(self) -> None:
        """Let go of NVML (never raises)."""
        if self._nvml is not None:
            _shutdown(self._nvml)
            self._nvml = None


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:  # NVML already gone: nothing left to let go of
        pass
