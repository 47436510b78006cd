"""A real IPython shell for the benchmarks: runs notebook cells with their output captured."""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Iterator
from typing import Any

_SHELL: Any = None


def shell() -> Any:
    """The process's InteractiveShell with the extension loaded (as `%load_ext` would)."""
    global _SHELL
    if _SHELL is None:
        from IPython.testing.globalipapp import get_ipython

        _SHELL = get_ipython()
        _SHELL.run_line_magic("load_ext", "traceml_jupyter")
    return _SHELL


@contextlib.contextmanager
def quiet_fds() -> Iterator[None]:
    """Silence file descriptors 1 and 2 too: torch.profiler's C++ side prints there."""
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def run_cell(cell: str) -> tuple[float, float, str]:
    """Run `cell` as the user would (magics included). Returns its wall time and the CPU time
    of this process (all threads) in seconds, and what it printed.

    CPU time is what a benchmark on a shared machine can trust: time spent waiting for a core
    that another process holds is not in it. Raises when the cell failed, so a broken
    benchmark never reports a number."""
    ip = shell()
    out = io.StringIO()
    with quiet_fds(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        c0, t0 = time.process_time(), time.perf_counter()
        result = ip.run_cell(cell, store_history=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    error = result.error_before_exec or result.error_in_exec
    if error is not None:
        raise RuntimeError(
            f"benchmark cell failed: {error!r}\n--- cell ---\n{cell}\n--- output ---\n{out.getvalue()}"
        )
    return wall, cpu, out.getvalue()
