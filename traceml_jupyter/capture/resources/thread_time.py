"""The training thread's CPU time, and the time it was ready to run but waited for a core (other
processes or threads held them), from Linux's /proc/thread-self/schedstat: psutil reads a
process's CPU time, not a thread's run-queue wait. None where the file is not there."""

from __future__ import annotations

SCHEDSTAT = "/proc/thread-self/schedstat"


def thread_schedstat() -> tuple[float, float] | None:
    """(ms on a CPU, ms waiting for one) of the calling thread so far; None if not readable."""
    try:
        with open(SCHEDSTAT, encoding="ascii") as fh:
            on_cpu, waiting = fh.read().split()[:2]
        return int(on_cpu) / 1e6, int(waiting) / 1e6
    except (OSError, ValueError):
        return None
