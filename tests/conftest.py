"""Shared fixtures: a real IPython shell with the extension loaded, a guard that fails any
test leaving a patch, a hook name or a thread behind (like tqdm's leaked-bar check), and the
codec's invariant checked on every run a test finishes: its result reads back from its JSON as
the same value."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from traceml_jupyter.capture.instrument.rewrite import HOOK

# The stop button is a SIGINT, which a kernel (and an interactive python) turns into
# KeyboardInterrupt. A test run started in the background of a shell without job control
# (`cmd &` in a script, nohup) inherits SIGINT ignored, and Python then installs no handler:
# the tests that press stop would wait forever. Install the handler a kernel has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def ip() -> Any:
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "traceml_jupyter")
    return shell


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a module's tests (`pytestmark = pytest.mark.usefixtures(...)`):
    on a shared 2-core machine, two OpenMP threads slow a step up to 10x whenever another
    process takes a core, which no verdict margin survives; one thread is slowed 2x at most."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def every_finished_run_reads_back_as_itself() -> Iterator[None]:
    """from_dict(to_dict(r)) == r for the result of every run the test finished in this kernel."""
    from traceml_jupyter import kernel_state
    from traceml_jupyter.result import from_dict, to_dict

    before = {id(run) for run in kernel_state.RUNS}
    yield
    for run in [r for r in kernel_state.RUNS if id(r) not in before and r.finished and not r.read_back]:
        document = json.loads(json.dumps(to_dict(run.result), allow_nan=False))
        assert from_dict(document) == run.result, f"{run.name}: its JSON reads back as another result"


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    iter_before = DataLoader.__dict__["__iter__"]
    next_before = _BaseDataLoaderIter.__dict__["__next__"]
    threads_before = set(threading.enumerate())
    yield
    assert DataLoader.__dict__["__iter__"] is iter_before, "DataLoader.__iter__ left patched"
    assert _BaseDataLoaderIter.__dict__["__next__"] is next_before, "__next__ left patched"
    leaked = [
        t
        for t in set(threading.enumerate()) - threads_before
        if t.is_alive() and t.name.startswith("traceml")
    ]
    assert not leaked, f"threads left running: {leaked}"
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None:
        assert HOOK not in shell.user_ns, "loop hook left in the user namespace"
