"""The wire format between a forked rank and the kernel: frames of a JSON header and the steps
as float64 columns (ROWS). What arrives is data, never code."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..processes.startup_hook import KIND, LENGTH, pack

PART_ROWS = ("forward_ms", "optimizer_ms", "rest_ms")  # the parts of sampled steps (NaN elsewhere)
ROWS = ("step", "time_s", "data_wait_ms", "compute_ms", "step_ms", "backward_ms", *PART_ROWS)
HELLO, STEPS, END = 1, 2, 3  # frames: startup_hook.pack (length, kind, JSON header, rows)
MAX_FRAME = 4 << 20  # bytes: a longer frame is not read (a rank sends its steps in chunks)
STEPS_PER_FRAME = (MAX_FRAME - 65536) // (8 * len(ROWS))

def frame(kind: int, meta: Mapping[str, Any], rows: np.ndarray | None = None) -> bytes:
    """One message: HELLO, STEPS (meta + ROWS as float64 columns) or END."""
    body = b"" if rows is None else np.ascontiguousarray(rows, dtype="<f8").tobytes()
    return pack(kind, meta, body)


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


