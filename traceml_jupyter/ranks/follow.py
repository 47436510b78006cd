"""A capture followed across processes (followed()): forked ranks streamed to the kernel,
torchrun ranks timing backward() for the summary gathered at the end, and the note for
nn.DataParallel."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from ..capture.instrument.patches import patched
from ..capture.session import Capture, capture_session
from ..failures import never_raise, read_or
from . import collector
from .backward import BackwardTimer, LocalRank, StepTap
from .collector import Collector
from .identity import distributed_env

if TYPE_CHECKING:
    from ..recording import Recording


DATAPARALLEL_NOTE = (
    "nn.DataParallel drives every GPU from this one process (one Python thread; the model is "
    "copied to each GPU every step), so it is timed as one process. DistributedDataParallel, one "
    "process per GPU, is faster: start it with torchrun, or from a notebook with "
    'torch.multiprocessing.start_processes(fn, nprocs=N, start_method="fork"); traceml then times '
    "each rank and names the one that holds the others back."
)


@contextmanager
def watching(run: Recording, capture: Capture) -> Iterator[None]:
    """For the capture's duration in a process that is one rank of several (torchrun): time
    backward() per step at the ticks, for the summary gathered at the end. Elsewhere nothing."""
    torch = sys.modules.get("torch")
    autograd = getattr(torch, "autograd", None)
    if autograd is None or getattr(autograd, "backward", None) is None or not distributed_env():
        yield
        return
    timer = BackwardTimer()
    tap = StepTap(capture, timer)
    local = LocalRank()

    def at_tick(_run: Recording) -> None:
        rows = tap.take()
        if rows is not None:
            local.add(rows)

    with patched(autograd, {"backward": timer.wrap(autograd.backward)}):
        run.rank_collector = local
        run.observe(at_tick)
        undo = tap.follow_merges(capture.model)
        try:
            yield
        finally:
            undo()
            run.stop_observing(at_tick)
            rows = tap.take(final=True)
            if rows is not None:
                local.add(rows)


def capture_ended(run: Recording, capture: Capture) -> None:
    """After a capture, in the process that made it: the forked ranks' summaries on the run
    (their last steps taken first), and the note for nn.DataParallel. Never raises."""
    feed = run.rank_collector
    # An interrupted cell (KeyboardInterrupt going up through the capture) does not wait for
    # ranks still running: the user asked to stop.
    interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
    guard = never_raise(run.notes, "The ranks could not be summarised")
    with guard:
        if isinstance(feed, Collector) and feed.pid == os.getpid():
            feed.adopt_into(run, 0.0 if interrupted else collector.DRAIN_S)
        dataparallel_note(run)
    if guard.error is not None and isinstance(feed, Collector):
        feed.stop(0.0)


def dataparallel_note(run: Recording) -> None:
    """nn.DataParallel in the user's namespace (IPython's, or a script's __main__): say it is
    one process, and what to use instead."""
    torch = sys.modules.get("torch")
    parallel = getattr(getattr(torch, "nn", None), "DataParallel", None)
    if parallel is None or not (run.recorder.n_steps or run.ranks):
        return
    from ..kernel.shell import ipython_shell

    shell = ipython_shell()
    names = getattr(shell, "user_ns", None)
    if names is None:
        names = getattr(sys.modules.get("__main__"), "__dict__", {})
    for value in list(names.values()):
        if read_or(False, isinstance, value, parallel):  # a user's class may raise in __class__
            if DATAPARALLEL_NOTE not in run.notes:
                run.notes.append(DATAPARALLEL_NOTE)
            return


@contextmanager
def followed(run: Recording, capture: Capture | None = None) -> Iterator[Capture]:
    """`capture_session(run, capture)` followed across processes: ranks forked inside it stream their
    steps to this run (their summaries are on it once it ends), and on one rank of several
    (torchrun) its own backward() is timed for the summary gathered at the end."""
    capture = capture or Capture(run)
    with ExitStack() as stack:
        stack.callback(capture_ended, run, capture)  # after the capture closed; never raises
        stack.enter_context(capture_session(run, capture))
        stack.enter_context(watching(run, capture))
        yield capture

