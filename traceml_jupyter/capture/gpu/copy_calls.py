"""What a `Tensor.to(...)` or `Tensor.cuda(...)` call asks for, read off its arguments without
touching CUDA (the device it names, non_blocking, the source's bytes and pinning), and the cell
line that made it. The tensor is the user's (a subclass, a stand-in): its size and pinning are
read through `failures.read_or`."""

from __future__ import annotations

from collections.abc import Mapping
from types import FrameType
from typing import Any

from ...failures import read_or
from ..instrument.cell_functions import is_cell_file

FRAME_DEPTH = 16  # how far up the stack a copy or a sync is looked for in a notebook cell
CURRENT = -1  # "the current CUDA device" (`.to("cuda")`, `.cuda()`)


def cell_line(frame: FrameType | None, cell_filename: str | None) -> tuple[str, int]:
    """Where in the notebook a call came from: the nearest frame of the traced cell, else of
    any notebook cell (a function defined in another cell), else the immediate caller."""
    first: tuple[str, int] | None = None
    other_cell: tuple[str, int] | None = None
    for _ in range(FRAME_DEPTH):
        if frame is None:
            break
        filename = frame.f_code.co_filename
        if first is None:
            first = (filename, frame.f_lineno)
        if filename == cell_filename:
            return filename, frame.f_lineno
        if other_cell is None and is_cell_file(filename):
            other_cell = (filename, frame.f_lineno)
        frame = frame.f_back
    return other_cell or first or ("?", 0)


def device_arg(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The device a `.to(...)` call asks for: its `device=` keyword or its first argument (None if
    neither)."""
    device = kwargs.get("device")
    if device is None and args:
        device = args[0]
    return device


# Classes whose instances never name a device (dtypes, numbers): `.to(torch.float16)` is told
# apart in one set lookup, the commonest call in a model (the hooks' host cost).
NOT_A_DEVICE: set[type] = {bool, float, type(None)}


def cuda_index(device: Any) -> int | None:
    """The CUDA device a `.to(...)`/`.cuda(...)` target names: its index, CURRENT for "the
    current device", None for the CPU, a dtype or anything else."""
    kind = type(device)
    if kind in NOT_A_DEVICE:
        return None
    if kind is str:
        if not device.startswith("cuda"):
            return None
        digits = device[5:]
        return int(digits) if digits.isdigit() else CURRENT
    if kind is int:
        return int(device)  # `x.to(0)`: a CUDA device index
    device_type = getattr(device, "type", None)
    if isinstance(device_type, str):  # a torch.device
        if device_type != "cuda":
            return None
        index = getattr(device, "index", None)
        return CURRENT if index is None else int(index)
    if getattr(device, "is_cuda", False):  # another tensor that lives on CUDA
        where = getattr(device, "device", None)
        found = cuda_index(where) if where is not None and where is not device else None
        return CURRENT if found is None else found
    if not any(hasattr(kind, name) for name in ("type", "is_cuda", "device")):
        NOT_A_DEVICE.add(kind)
    return None


def target_is_cuda(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` moves to a CUDA device: a device string, a
    torch.device, a device index, or another tensor that lives on CUDA."""
    return cuda_index(device_arg(args, kwargs)) is not None


def target_is_cpu(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` names the CPU (`.to("cpu")`, `torch.device("cpu")`)."""
    device = device_arg(args, kwargs)
    kind = type(device)
    if kind in NOT_A_DEVICE:
        return False
    if kind is str:
        return bool(device == "cpu" or device.startswith("cpu:"))
    return getattr(device, "type", None) == "cpu"


def non_blocking_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """`non_blocking` of a `.to(...)` or `.cuda(...)` call: the keyword, else the first
    positional bool (`.to(device, dtype, non_blocking, copy)`, `.cuda(device, non_blocking)`)."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    for arg in args:
        if isinstance(arg, bool):
            return arg
    return False


def nbytes_of(tensor: Any) -> int:
    """The tensor's size in bytes; 0 when it cannot be read."""
    return read_or(0, _nbytes, tensor)


def _nbytes(tensor: Any) -> int:
    return int(tensor.nelement()) * int(tensor.element_size())


def is_pinned(tensor: Any) -> bool:
    """The tensor is in pinned (page-locked) host memory; False when it cannot be asked."""
    return read_or(False, _pinned, tensor)


def _pinned(tensor: Any) -> bool:
    return bool(tensor.is_pinned())
