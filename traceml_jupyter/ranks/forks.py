"""The fork hooks: a fork from a recording thread gets a socket pair; in the kernel a Collector
reads its end, the forked child becomes a rank that sends its steps. Registered once per process
(os.register_at_fork, multiprocessing's after-fork registry)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

from ..capture.instrument import hooks
from ..failures import never_raise
from .backward import BackwardTimer, StepTap
from .collector import Collector, running
from .identity import describe_error
from .sender import Sender

# Forks that start no rank: DataLoader workers and subprocesses (their stacks pass here).
HELPERS = (
    f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}",
    f"{os.sep}subprocess.py",
    f"{os.sep}pty.py",  # IPython's `!cmd` forks a pseudo-terminal (pexpect) to run the command
    f"{os.sep}ptyprocess{os.sep}",
)


@dataclass
class _Pending:
    """A fork about to happen from a recording thread: its socket pair."""

    capture: Any
    run: Any
    kernel_end: socket.socket
    child_end: socket.socket
    index: int


_pending: _Pending | None = None
_child: Sender | None = None  # in a forked rank: its sender
_in_rank = False  # this process is a forked rank (or was forked by one): it starts no channel


def start_no_rank_channel() -> None:
    """This process is a rank started otherwise (a child run): forks from it start no rank
    channel (one that trains connects itself)."""
    global _in_rank
    _in_rank = True


def _forking_helper() -> bool:
    """The fork starts DataLoader workers or a subprocess, not a rank."""
    frame_: Any = sys._getframe(1)
    for _ in range(64):
        if frame_ is None:
            return False
        name = frame_.f_code.co_filename
        if any(part in name for part in HELPERS):
            return True
        frame_ = frame_.f_back
    return False


def _before_fork() -> None:
    global _pending
    _drop_pending()
    capture: Any = hooks.active
    if capture is None or capture.thread != threading.get_ident():
        return  # forks from other threads, or between runs, start no rank
    run = getattr(capture, "run", None)
    if run is None or _in_rank or not getattr(capture, "active", False) or _forking_helper():
        return
    try:
        kernel_end, child_end = socket.socketpair()
    except OSError:
        return
    feed = run.rank_collector
    index = feed.forks if isinstance(feed, Collector) and not feed.stopped else 0
    _pending = _Pending(capture, run, kernel_end, child_end, index)


def _drop_pending() -> None:
    global _pending
    if _pending is not None:
        for sock in (_pending.kernel_end, _pending.child_end):
            sock.close()
        _pending = None


def _after_fork_parent() -> None:
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    pending.child_end.close()
    run = pending.run
    guard = never_raise(run.notes, "A forked process could not be followed")
    with guard:
        feed = run.rank_collector
        if not (isinstance(feed, Collector) and feed.pid == os.getpid() and not feed.stopped):
            feed = Collector(run)
            run.rank_collector = feed
            running.append(feed)
            feed.start()
        feed.forks = pending.index + 1
        feed.add(pending.kernel_end, pending.index)
    if guard.error is not None:
        pending.kernel_end.close()


def _after_fork_child() -> None:
    global _pending, _child, _in_rank
    pending, _pending = _pending, None
    for collector in running:
        collector.forget_in_child()
    running.clear()
    if _child is not None:  # forked by a rank (its DataLoader workers): not a rank
        _child.forget_in_child()
        _child = None
    if pending is None:
        return
    _in_rank = True
    pending.kernel_end.close()
    guard = never_raise()
    with guard:
        _child = become_rank(pending)
    if guard.error is not None:
        pending.child_end.close()


def become_rank(pending: _Pending) -> Sender:
    """In the forked child: time backward() per step, send the steps at the run's ticks in place
    of the kernel's views, and send the end at exit."""
    run, capture = pending.run, pending.capture
    run.recorder = capture.model.recorder  # this process's own steps
    timer = BackwardTimer()
    torch = sys.modules.get("torch")
    autograd = getattr(torch, "autograd", None)
    if autograd is not None and getattr(autograd, "backward", None) is not None:
        # for the rest of this process's life: it ends with its training
        autograd.backward = timer.wrap(autograd.backward)
    tap = StepTap(capture, timer)
    tap.follow_merges(capture.model)
    sender = Sender(pending.child_end, tap, run, pending.index)
    run.observe_only(sender)  # the live chart is the kernel's
    run.rank_collector = None
    capture.listen()  # the model calls back from the next step on
    multiprocessing.util.Finalize(sender, sender.finish, exitpriority=100)
    sender.hello()
    return sender


def _mp_child_started(_marker: object) -> None:
    """In a multiprocessing child, once its bootstrap has cleared the parent's finalizers: a
    rank notes how its process function ends and sends its end at exit."""
    sender = _child
    if sender is None or sender.pid != os.getpid():
        return
    process = multiprocessing.current_process()
    original = process.run

    def run() -> None:
        try:
            original()
        except SystemExit as exc:  # torch's start_processes turns an error into exit(1)
            if exc.code not in (None, 0):
                sender.error = describe_error(exc.__context__) or f"exit code {exc.code}"
            raise
        except BaseException as exc:
            sender.error = describe_error(exc)
            raise

    process.run = run  # type: ignore[method-assign]
    multiprocessing.util.Finalize(sender, sender.finish, exitpriority=100)


class _Marker:
    """Kept alive for multiprocessing's after-fork registry (it holds weak references)."""


_MARKER = _Marker()
if not globals().get("_REGISTERED"):  # once per process, also if the module is reloaded
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child)
    multiprocessing.util.register_after_fork(_MARKER, _mp_child_started)
    _REGISTERED = True


