"""The host sampler's two cheap reads of a process: its private memory from one read of
/proc/PID/smaps_rollup (psutil's figure, from the same file), and its minor page faults, which
grow when it touches new pages."""

from __future__ import annotations

import os

import psutil
import pytest

from traceml_jupyter.capture.resources.host import MIB, minor_faults, private_mib

linux = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="no /proc/PID/smaps_rollup")


@linux
def test_private_memory_is_psutils_uss() -> None:
    ours = private_mib(os.getpid())
    theirs = psutil.Process().memory_full_info().uss / MIB
    assert ours is not None and abs(ours - theirs) <= max(4.0, 0.02 * theirs)


@linux
def test_page_faults_grow_with_new_pages() -> None:
    before = minor_faults(os.getpid())
    floats = [float(i) for i in range(1_000_000)]  # 24 MiB of new Python objects: ~6000 pages
    after = minor_faults(os.getpid())
    assert len(floats) == 1_000_000
    assert before is not None and after is not None and after - before >= 1000


def test_a_process_that_cannot_be_read_is_none() -> None:
    gone = 2**22 + 12345  # above the usual pid_max: no such process
    assert private_mib(gone) is None and minor_faults(gone) is None
