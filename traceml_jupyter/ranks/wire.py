"""The wire format between a forked rank and the kernel: frames of a JSON header and the steps
as float64 columns (ROWS). What arrives is data, never code."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, TypedDict

import numpy as np

from ..capture.inside.step_parts import PartsFacts
from ..facts.loader import RankLoader
from ..processes.startup_hook import KIND, LENGTH, pack
from ..result import RunResult, from_dict, to_dict
from ..result.codec import REQUIRED_COLUMNS
from ..result.value import read_only

PART_ROWS = ("forward_ms", "optimizer_ms", "rest_ms")  # the parts of sampled steps (NaN elsewhere)
ROWS = ("step", "time_s", "data_wait_ms", "compute_ms", "step_ms", "backward_ms", *PART_ROWS)
HELLO, STEPS, END = 1, 2, 3  # frames: startup_hook.pack (length, kind, JSON header, rows)
MAX_FRAME = 4 << 20  # bytes: a longer frame is not read (a rank sends its steps in chunks)
STEPS_PER_FRAME = (MAX_FRAME - 65536) // (8 * len(ROWS))



class Who(TypedDict):
    """A STEPS frame's header: the rank (None until a process group or RANK says) and the
    world size."""

    rank: int | None
    world: int | None


class Hello(TypedDict, total=False):
    """A HELLO frame: the process (pid, the fork's index); a child started apart adds its
    command line, its clock's time 0 and who it is."""

    pid: int
    index: int
    command: str
    origin_ns: int | None
    rank: int | None
    world: int | None


class End(TypedDict, total=False):
    """An END frame: who the process was and how it ended (its error; a child's exit status
    and command line), what it measured — `result`, its run's result as the one codec writes
    it (result/codec.py to_dict, its step columns left empty: the steps came in STEPS frames)
    — and what the kernel's summary of its steps reads besides: its loader as the per-rank
    table compares it, its parts' facts, the steps where its passes over the loader began.
    `note`: why what it measured is missing."""

    rank: int | None
    world: int | None
    pid: int
    error: str | None
    status: int | None
    command: str
    note: str
    result: dict[str, object]
    loader: RankLoader | None
    parts: PartsFacts
    pass_steps: list[int]


def frame(kind: int, meta: Mapping[str, Any], rows: np.ndarray | None = None) -> bytes:
    """One message: HELLO, STEPS (meta + ROWS as float64 columns) or END."""
    body = b"" if rows is None else np.ascontiguousarray(rows, dtype="<f8").tobytes()
    return pack(kind, meta, body)


def end_document(result: RunResult) -> dict[str, object]:
    """What an END frame says of a process's result: the codec's document (to_dict), its step
    columns empty — the steps went in STEPS frames, and a long run's would not fit one frame."""
    no_steps = read_only({name: np.empty(0) for name in REQUIRED_COLUMNS})
    return to_dict(replace(result, steps=replace(result.steps, columns=no_steps)))


def end_result(end: End, shown: str) -> RunResult | None:
    """The result an END frame holds (codec.from_dict; None when it holds none: what was
    measured could not be read); LoadError when it is not one."""
    document = end.get("result")
    return from_dict(document, shown) if document is not None else None


def read_frames(buf: bytearray) -> list[tuple[int, dict[str, Any], np.ndarray | None]]:
    """The complete frames at the start of `buf` (removed from it); a partial one stays. What
    arrives is data: JSON and float64 numbers, never code. ValueError on a frame that is not one
    (too long, a header that is not a JSON object, rows that are not ROWS columns)."""
    out = []
    pos = 0
    while len(buf) - pos >= LENGTH.size:
        (length,) = LENGTH.unpack_from(buf, pos)
        if not KIND.size <= length <= MAX_FRAME:
            raise ValueError(f"a frame of {length} bytes (at most {MAX_FRAME})")
        end = pos + LENGTH.size + length
        if len(buf) < end:
            break
        kind, n_head = KIND.unpack_from(buf, pos + LENGTH.size)
        start = pos + LENGTH.size + KIND.size
        if n_head > end - start:
            raise ValueError("a frame whose header is longer than the frame")
        meta = json.loads(bytes(buf[start : start + n_head]))
        if not isinstance(meta, dict):
            raise ValueError("a frame whose header is not a JSON object")
        raw = bytes(buf[start + n_head : end])
        if len(raw) % (8 * len(ROWS)):
            raise ValueError(f"a frame of {len(raw)} bytes of numbers: not {len(ROWS)} columns")
        rows = np.frombuffer(raw, dtype="<f8").reshape(len(ROWS), -1) if raw else None
        out.append((int(kind), meta, rows))
        pos = end
    del buf[:pos]
    return out


