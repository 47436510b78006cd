"""GPU memory while a loop runs on CUDA: the caching allocator's statistics on the loop's device
after every step (peak allocated during the step, allocated and reserved at its end), the
device's capacity, what earlier cells hold when the cell starts (by name), and the facts of an
out-of-memory error.

The allocator's statistics are host-side counters (`torch.cuda.memory_stats_as_nested_dict`,
`reset_peak_memory_stats`): reading them never waits for the GPU. Two calls a step, on the CUDA
path only (the CPU path never comes here); `memory_stats_as_nested_dict` builds a dict of every
statistic, so where a read costs more than READ_BUDGET of a step, the reads are spaced (every
k-th step; each read's peak then covers the steps since the previous one). Nothing here
initialises CUDA: the watch starts when the capture has seen the loop run on a device (CUDA is
then initialised by the user's code).

Resetting the peak each step changes what `torch.cuda.max_memory_allocated()` returns after the
cell (the last step's peak): when the traced code itself reads or resets the peak, it is left
alone and the per-step peak column is the allocator's running peak instead.
"""

from __future__ import annotations

import math
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from time import perf_counter_ns
from typing import Any

from ...facts.resources import GpuMemoryFacts, HeldBefore, HeldDevice, OomFacts
from ...failures import failure_text, read_or
from ..gpu.cuda_state import cuda_initialized, torch_cuda
from ..steps.step_tally import StepTally

MIB = 2**20
MEMORY_COLUMNS = ("gpu_mem_peak_mib", "gpu_mem_allocated_mib", "gpu_mem_reserved_mib")
# Code that reads (or resets) the allocator's peak: the watch must not reset it under it.
READS_PEAK = re.compile(
    r"max_memory_allocated|max_memory_reserved|max_memory_cached|reset_peak_memory_stats|"
    r"reset_max_memory|memory_summary|memory_stats"
)
READ_BUDGET = 0.01  # the allocator reads take at most 1 % of the steps' time
READ_EVERY_MAX = 1024
SCAN_BUDGET_S = 0.05  # the scan of the namespace for what earlier cells hold stops after this
SCAN_MAX_ITEMS = 10_000  # elements of one list, tuple, set or dict looked at
TOP_HOLDERS = 5


# The CUDA module the memory watch reads (a seam: tests put a fake GPU here).
cuda_module = torch_cuda


def reads_peak(*sources: str | None) -> bool:
    """Whether any of the cells' code reads or resets the allocator's peak statistics."""
    return any(s and READS_PEAK.search(s) for s in sources)


def _stat(stats: Mapping[str, Any], name: str, which: str) -> float:
    """One figure of `memory_stats_as_nested_dict()` in MiB (0 when absent)."""
    try:
        return float(stats[name]["all"][which]) / MIB
    except (KeyError, TypeError, ValueError):
        return 0.0


def capacity_mib(cuda: Any, device: int) -> float | None:
    """The device's memory (`get_device_properties(d).total_memory`), MiB; a MIG slice's own."""
    total = getattr(cuda.get_device_properties(device), "total_memory", None)
    return float(total) / MIB if total is not None else None


class GpuMemory:
    """The allocator's figures after each step of a loop on CUDA device `device`, in three
    StepTally columns (the Recorder's memory bound; merged steps are unmeasured).

    The capture calls `loop_started(device)` once it knows the loop's device, `step_ended(i)`
    after each step, and `merged(first)` when it merges steps. Never raises: an error turns the
    watch off with a note."""

    def __init__(self, resets: bool = True, cuda: Callable[[], Any] | None = None) -> None:
        self.resets = resets
        self._cuda_of = cuda
        self.device: int | None = None
        self.capacity_mib: float | None = None
        self.off: str | None = None  # why the figures stopped (or never came)
        self.tallies = {name: StepTally(dense=False) for name in MEMORY_COLUMNS}
        self.last: dict[str, float] | None = None  # the newest step's figures (the live header)
        self.steps_read = 0
        self.read_every = 1  # steps between two reads (see READ_BUDGET)
        self.read_ns = 0.0  # the last read's host cost
        self._skipped = 0
        self._last_t: int | None = None
        self._stats: Callable[[int], Any] | None = None
        self._reset: Callable[[int], Any] | None = None

    def loop_started(self, device: int) -> None:
        """The loop runs on `device`: start reading its memory statistics per step, or say in `off`
        why not (CUDA not initialised, an error)."""
        if self._stats is not None or self.off is not None:
            return
        try:
            cuda = self._cuda_of() if self._cuda_of is not None else cuda_module()
            if not cuda_initialized(cuda):
                self.off = "GPU memory was not read: CUDA is not initialised."
                return
            self.device = int(device)
            self.capacity_mib = capacity_mib(cuda, self.device)
            self._stats = cuda.memory_stats_as_nested_dict
            self._reset = cuda.reset_peak_memory_stats if self.resets else None
            if self._reset is not None:
                self._reset(self.device)  # the first step's peak is its own
        except Exception as exc:
            self._failed(exc)

    def step_ended(self, index: int, t_ns: int | None = None) -> None:
        """Step `index` ended at host time `t_ns` (perf_counter_ns): read its figures, or skip
        it while reads are spaced."""
        stats, device = self._stats, self.device
        if stats is None or device is None:
            return
        self._skipped += 1
        if self._skipped < self.read_every:
            return
        steps, self._skipped = self._skipped, 0
        began = perf_counter_ns()
        try:
            s = stats(device)
            peak = _stat(s, "allocated_bytes", "peak")
            allocated = _stat(s, "allocated_bytes", "current")
            reserved = _stat(s, "reserved_bytes", "current")
            if self._reset is not None:
                self._reset(device)
        except Exception as exc:
            self._failed(exc)
            return
        if peak == allocated == reserved == 0.0:  # no statistics (a pluggable allocator)
            self._failed(None)
            return
        self._pace(perf_counter_ns() - began, t_ns, steps)
        t = self.tallies
        t["gpu_mem_peak_mib"].add(index, peak)
        t["gpu_mem_allocated_mib"].add(index, allocated)
        t["gpu_mem_reserved_mib"].add(index, reserved)
        self.last = {"peak_mib": peak, "allocated_mib": allocated, "reserved_mib": reserved}
        self.steps_read += 1

    def _pace(self, cost_ns: int, t_ns: int | None, steps: int) -> None:
        """Space the reads so that they take at most READ_BUDGET of the steps' time."""
        self.read_ns = float(cost_ns)
        if t_ns is not None and self._last_t is not None and t_ns > self._last_t:
            step_ns = (t_ns - self._last_t) / steps
            every = math.ceil(cost_ns / (READ_BUDGET * step_ns)) if step_ns > 0 else 1
            self.read_every = max(1, min(READ_EVERY_MAX, every))
        self._last_t = t_ns

    def merged(self, first: int) -> None:
        """Steps from `first` on became one step: their figures are dropped (the merged step
        gets its own at its end)."""
        for tally in self.tallies.values():
            tally.merge_from(first)

    def _failed(self, exc: BaseException | None) -> None:
        self._stats = self._reset = None
        if exc is None:
            self.off = (
                "GPU memory per step n/a: the allocator reports no statistics (a pluggable allocator?)."
            )
        else:
            self.off = f"GPU memory per step stopped: {failure_text(exc)}"

    def columns(self) -> dict[str, Callable[[Any], Any]]:
        """The per-step columns of GPU memory (peak, allocated, reserved), by name."""
        return {name: tally.column for name, tally in self.tallies.items()}

    def result(self) -> GpuMemoryFacts:
        """What the run keeps of the GPU memory: the device, its capacity, how often it was read and
        at what cost."""
        return {
            "device": self.device,
            "capacity_mib": self.capacity_mib,
            "peak_reset_each_step": self.resets,
            "steps_read": self.steps_read,
            "read_every": self.read_every,
            "read_us": self.read_ns / 1e3,
            "note": self.off,
        }


# -- what earlier cells hold ----------------------------------------------------------------------


@dataclass(frozen=True)
class Kinds:
    """The classes the namespace scan recognises (torch's; a test double's in CPU tests)."""

    tensor: tuple[type, ...]
    module: tuple[type, ...] = ()
    optimizer: tuple[type, ...] = ()


def torch_kinds() -> Kinds | None:
    """torch's tensor, module and optimizer classes, when torch is imported; else None."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    module = getattr(getattr(torch, "nn", None), "Module", None)
    optimizer = getattr(getattr(torch, "optim", None), "Optimizer", None)
    if not (isinstance(tensor, type) and isinstance(module, type) and isinstance(optimizer, type)):
        return None  # no torch, or a half-imported one
    return Kinds((tensor,), (module,), (optimizer,))


def module_names(namespace: Mapping[str, Any] | None, kinds: Kinds | None = None) -> list[str]:
    """The names of the namespace bound to torch modules (the model, the criterion)."""
    kinds = kinds or torch_kinds()
    if not namespace or kinds is None or not kinds.module:
        return []
    module = kinds.module
    return read_or(  # the user's namespace and objects (a class whose __class__ raises)
        [], lambda: [k for k, v in list(namespace.items()) if not k.startswith("_") and isinstance(v, module)]
    )


def on_cuda_device(device: int) -> Callable[[Any], bool]:
    """Whether a tensor lives on CUDA device `device`."""

    def check(t: Any) -> bool:
        where = t.device
        kind = getattr(where, "type", None)
        if kind is None:  # a device written as a string ("cuda:0")
            text = str(where)
            kind, _, index = text.partition(":")
            return kind == "cuda" and int(index or 0) == device
        return bool(kind == "cuda" and (where.index if where.index is not None else 0) == device)

    return check


class _Scan:
    """One walk of the namespace: each storage counted once, for the first name that holds it."""

    def __init__(self, kinds: Kinds, on_device: Callable[[Any], bool], budget_s: float) -> None:
        self.kinds = kinds
        self.on_device = on_device
        self.deadline = time.perf_counter() + budget_s
        self.seen: set[Any] = set()
        self.visited: set[int] = set()
        self.stopped = False

    def tensor(self, t: Any) -> int:
        """The bytes of a tensor's storage on the device, the first time it is seen (a
        tensor-like object of the user's that cannot say: 0)."""
        return read_or(0, self._tensor, t)

    def _tensor(self, t: Any) -> int:
        if not self.on_device(t):
            return 0
        storage = t.untyped_storage()
        key = (str(t.device), int(storage.data_ptr()))
        if key in self.seen:
            return 0
        self.seen.add(key)
        return int(storage.nbytes())

    def tensors(self, items: Iterable[Any]) -> int:
        total = 0
        for t in items:
            total += self.tensor(t)
            grad = _attr(t, "grad") if _attr(t, "is_leaf") else None  # non-leaf .grad warns
            if grad is not None:
                total += self.tensor(grad)
        return total

    def walk(self, obj: Any, depth: int) -> int:
        """The device bytes `obj` holds, `depth` containers deep (an object of the user's that
        raises when looked at holds none)."""
        if time.perf_counter() > self.deadline:
            self.stopped = True
            return 0
        return read_or(0, self._walk, obj, depth)

    def _walk(self, obj: Any, depth: int) -> int:
        kinds, held = self.kinds, obj  # `held`: Any, not narrowed by isinstance
        if isinstance(obj, kinds.tensor):
            return self.tensors([obj])
        if kinds.module and isinstance(obj, kinds.module):
            return self.tensors(held.parameters()) + self.tensors(held.buffers())
        if kinds.optimizer and isinstance(obj, kinds.optimizer):
            return sum(int(self.walk(state, 1)) for state in list(held.state.values()))
        if depth <= 0 or id(obj) in self.visited:
            return 0
        self.visited.add(id(obj))
        kind = type(obj)
        if kind in (list, tuple, set, frozenset):
            return sum(self.walk(x, depth - 1) for x in islice(obj, SCAN_MAX_ITEMS))
        if kind is dict:
            return sum(self.walk(x, depth - 1) for x in islice(obj.values(), SCAN_MAX_ITEMS))
        if isinstance(obj, type) or callable(obj) or kind.__module__ == "builtins":
            return 0
        attrs = getattr(obj, "__dict__", None)  # an object holding a model (a trainer)
        if type(attrs) is dict:
            return sum(self.walk(x, depth - 1) for x in islice(attrs.values(), SCAN_MAX_ITEMS))
        return 0


def _attr(obj: Any, name: str) -> Any:
    return read_or(None, getattr, obj, name, None)


def _candidates(namespace: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The user's names in definition order, then the output history (`Out[5]`); IPython's own
    names (`_5`, `_oh`, `In`) are skipped."""
    items: list[tuple[Any, Any]] = read_or([], lambda: list(namespace.items()))  # the user's mapping
    out = [(k, v) for k, v in items if type(k) is str and not k.startswith("_") and k not in _NOT_THE_USERS]
    history = dict(items).get("Out")
    if type(history) is dict:
        out += [(f"Out[{k}]", v) for k, v in list(history.items())]
    return out


_NOT_THE_USERS = ("In", "Out", "exit", "quit", "get_ipython")


def held_by_names(
    namespace: Mapping[str, Any],
    on_device: Callable[[Any], bool],
    kinds: Kinds,
    budget_s: float = SCAN_BUDGET_S,
) -> tuple[list[tuple[str, float]], bool]:
    """The names of the namespace that hold device memory, biggest first, in MiB: tensors,
    modules (parameters, their gradients, buffers), optimizer states, lists, tuples and dicts of
    them, and objects holding them one attribute deep. Each storage counts once. Every probe is
    guarded; the walk stops after `budget_s` (the second value says so)."""
    scan = _Scan(kinds, on_device, budget_s)
    held: dict[str, int] = {}
    candidates = _candidates(namespace)
    with warnings.catch_warnings():  # a probe of the user's objects never prints under the cell
        warnings.simplefilter("ignore")
        # Tensors, modules and optimizers by name first (cheap), then what holds them: a big
        # container cannot use up the budget before a model is found.
        for depth in (0, 2):
            for name, value in candidates:
                if scan.stopped:
                    break
                if name not in held or depth == 0:
                    nbytes = scan.walk(value, depth)
                    if nbytes > 0:
                        held[name] = held.get(name, 0) + nbytes
    rows = [(name, nbytes / MIB) for name, nbytes in held.items()]
    rows.sort(key=lambda r: -r[1])
    return rows, scan.stopped


def held_before(
    namespace: Mapping[str, Any] | None, cuda: Any = None, kinds: Kinds | None = None
) -> HeldBefore | None:
    """When a traced cell starts with CUDA initialised: what each device already has allocated
    and the biggest holders by name; None when CUDA is not initialised or nothing is allocated."""
    cuda = cuda if cuda is not None else cuda_module()
    if not cuda_initialized(cuda):
        return None
    kinds = kinds or torch_kinds()
    devices: list[HeldDevice] = []
    began = time.perf_counter()
    for device in range(int(cuda.device_count())):
        allocated = float(cuda.memory_allocated(device)) / MIB
        if allocated <= 0:
            continue
        holders: list[tuple[str, float]] = []
        stopped = False
        if namespace is not None and kinds is not None:
            holders, stopped = held_by_names(namespace, on_cuda_device(device), kinds)
        devices.append(
            {
                "device": device,
                "allocated_mib": allocated,
                "capacity_mib": capacity_mib(cuda, device),
                "holders": [{"name": k, "mib": v} for k, v in holders[:TOP_HOLDERS]],
                "named_mib": sum(v for _, v in holders),
                "scan_stopped": stopped,
            }
        )
    if not devices:
        return None
    return {"devices": devices, "scan_ms": (time.perf_counter() - began) * 1e3}


# -- out of memory ----------------------------------------------------------------------------

_UNITS = {"bytes": 1 / MIB, "B": 1 / MIB, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0, "TiB": 1024.0**2}
_SIZE = r"([0-9.]+) (bytes|B|KiB|MiB|GiB|TiB)"


def is_cuda_oom(error: BaseException | None) -> bool:
    """torch.cuda.OutOfMemoryError (torch.OutOfMemoryError of a CUDA allocation)."""
    if error is None:
        return False
    cuda = cuda_module()
    kind = getattr(cuda, "OutOfMemoryError", None) if cuda is not None else None
    text = read_or("", str, error)  # the user's exception: its __str__ may raise
    if isinstance(kind, type) and isinstance(error, kind):
        return "CUDA" in text or cuda_initialized(cuda)
    return type(error).__name__ == "OutOfMemoryError" and "CUDA out of memory" in text


def _size(pattern: str, text: str) -> float | None:
    found = re.search(pattern, text)
    if found is None:
        return None
    return float(found.group(1)) * _UNITS[found.group(2)]


def oom_facts(error: BaseException, device: int | None, cuda: Any = None) -> OomFacts:
    """What the error and the allocator say: the request, the device and its capacity, what
    is free, allocated, reserved and the peak (MiB; None where unknown)."""
    text = str(error)
    found = re.search(r"GPU (\d+) has a total capacity of " + _SIZE, text)
    if device is None and found is not None:
        device = int(found.group(1))
    facts: OomFacts = {
        "requested_mib": _size(r"Tried to allocate " + _SIZE, text),
        "device": device,
        "capacity_mib": float(found.group(2)) * _UNITS[found.group(3)] if found else None,
        "free_mib": _size(r"of which " + _SIZE + " is free", text),
        "allocated_mib": None,
        "reserved_mib": None,
        "peak_mib": None,
    }
    cuda = cuda if cuda is not None else cuda_module()
    if device is not None and cuda_initialized(cuda):
        s = cuda.memory_stats_as_nested_dict(device)
        facts["allocated_mib"] = _stat(s, "allocated_bytes", "current")
        facts["reserved_mib"] = _stat(s, "reserved_bytes", "current")
        facts["peak_mib"] = _stat(s, "allocated_bytes", "peak")
        if facts["capacity_mib"] is None:
            facts["capacity_mib"] = capacity_mib(cuda, device)
    return facts
