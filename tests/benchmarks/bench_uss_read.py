"""What a worker's private-memory read costs: one read of /proc/PID/smaps_rollup (what the host
sampler reads), psutil's memory_full_info() (its fallback), and the page-fault counter of
/proc/PID/stat that says when to read again, on a forked child that copied a list of
1.2 million (float, int, str) tuples by reading it (copy-on-read).

    .venv/bin/python tests/benchmarks/bench_uss_read.py
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil

from traceml_jupyter.capture.resources.host import MIB, minor_faults, private_mib

READS = 21


def timed(read: Callable[[], object]) -> tuple[float, float, float]:
    """Median, min and max of READS reads (ms)."""
    costs = []
    for _ in range(READS):
        began = time.perf_counter()
        read()
        costs.append((time.perf_counter() - began) * 1e3)
    costs.sort()
    return costs[len(costs) // 2], costs[0], costs[-1]


def main() -> None:
    rows = [(float(i), i, str(i)) for i in range(1_200_000)]
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker's part: read every row (writes their reference counts)
        os.close(ready_r)
        total = sum(r[1] for r in rows)
        os.write(ready_w, b"1" if total else b"0")
        time.sleep(60)
        os._exit(0)
    os.close(ready_w)
    os.read(ready_r, 1)
    proc = psutil.Process(pid)
    try:
        print(f"child's USS: smaps_rollup {private_mib(pid):.1f} MiB, psutil {proc.memory_full_info().uss / MIB:.1f} MiB")
        for name, read in (
            ("smaps_rollup, one read", lambda: private_mib(pid)),
            (f"psutil {psutil.__version__} memory_full_info()", proc.memory_full_info),
            ("/proc/PID/stat minor faults", lambda: minor_faults(pid)),
        ):
            med, low, high = timed(read)
            print(f"{name:<38} median {med:7.3f} ms  (min {low:.3f}, max {high:.3f})")
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
