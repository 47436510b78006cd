"""In a process started by a traced cell (or `traceml-jupyter run`): its training, recorded with
the same step model as the kernel's and streamed to the kernel like a forked rank's.

startup_hook.py calls `arm()` once the child has imported torch. Arming only sets tripwires, each
a plain pass-through that costs one check: `DataLoader.__iter__`, `torch.autograd.backward` and a
global optimizer step pre-hook (and `DataLoader.__init__`, which notes the line each DataLoader
is built on, for the checklist). The first of them to fire on a thread — the process's first
DataLoader pass, backward() or optimizer step — starts the capture on that thread: it connects
to the kernel (token first), records as `%%traceml` does (recording.capturing; no loop is
located: steps are the training's events), and sends its steps at the run's ticks without ever
waiting for the kernel (ranks.Sender), then its end at exit (how it ended, its loader, where
that loader was built). A process that never trains — torchrun's agent, DataLoader workers,
compilers, any helper — never connects and sends nothing.

Processes forked from here: a DataLoader worker lets go of the connection; a process that trains
starts its own (a child is one more stream). Nothing here raises into the child's code: a
failure of ours leaves the child untraced, with a note to the kernel when it can send one.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from .startup_hook import CHANNEL, TOKEN, connect, tell_kernel

if TYPE_CHECKING:
    from .child_run import ChildSender

ARMED, STARTED, OFF = "armed", "started", "off"


class Tripwires:
    """This process's state: armed (waiting for the first training event), started (the capture
    records, the sender streams), or off (the kernel is gone, or an error of ours)."""

    def __init__(self) -> None:
        self.state = ARMED
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.sites: dict[int, dict[str, Any]] = {}  # id(DataLoader) -> where it was built
        self.exit_code: Any = None  # what sys.exit() was given
        self.exit_error: str | None = None  # the exception being handled when it was called
        self.stack: ExitStack | None = None
        self.sender: ChildSender | None = None
        self.run: Any = None
        self.capture: Any = None
        self._pre_hook: Any = None
        self.finished = False

    # -- arming (once torch is imported) ------------------------------------------------------
    def install(self) -> None:
        import functools

        import torch
        from torch.utils.data import DataLoader

        original_init = DataLoader.__dict__["__init__"]
        original_iter = DataLoader.__dict__["__iter__"]
        trip = self.trip

        @functools.wraps(original_init)
        def __init__(loader: Any, *args: Any, **kwargs: Any) -> None:
            original_init(loader, *args, **kwargs)
            self.note_site(loader)

        @functools.wraps(original_iter)
        def __iter__(loader: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            if trip():  # the capture's DataLoader.__iter__ is in place now: go through it
                return DataLoader.__iter__(loader)
            return original_iter(loader)

        DataLoader.__init__ = __init__  # type: ignore[method-assign,assignment]
        DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
        autograd = torch.autograd
        original_backward = autograd.__dict__.get("backward")
        if original_backward is not None:

            @functools.wraps(original_backward)
            def backward(*args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True  # noqa: F841
                if trip():
                    return autograd.backward(*args, **kwargs)
                return original_backward(*args, **kwargs)

            autograd.backward = backward
        try:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
        except Exception:  # torch < 2.0: backward() and DataLoaders start it
            return

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            trip()  # the capture's post hook then sees this step

        self._pre_hook = register_optimizer_step_pre_hook(before_step)

    def note_site(self, loader: Any) -> None:
        """Where `loader` is built (before the capture starts: it notes later ones itself)."""
        from ..capture.dataloaders import note_site

        note_site(self.sites, loader, sys._getframe(2))

    # -- the first training event ------------------------------------------------------------------
    def trip(self) -> bool:
        """True once, when this call started the capture (the caller then goes through it)."""
        if self.state is not ARMED:
            return False
        with self.lock:
            if self.state is not ARMED or os.getpid() != self.pid:
                return False
            try:
                started = self._start()
            except Exception as exc:
                started = False
                tell_kernel(f"traceml could not start: {type(exc).__name__}: {exc}")
            self.state = STARTED if started else OFF
            return started

    def _start(self) -> bool:
        address, token = os.environ.get(CHANNEL), os.environ.get(TOKEN)
        if not address or not token:
            return False
        try:
            sock = connect(address, token)
        except OSError:  # the cell is over (or never was ours): stay untraced
            return False
        try:
            self._record(sock)
        except BaseException:
            sock.close()
            raise
        return True

    def _record(self, sock: Any) -> None:
        from .child_run import record

        record(self, sock)

    def tidy(self) -> None:
        """At the first tick: the optimizer pre-hook goes (it had one job: start the capture)."""
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None

    # -- the end ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """At exit: close the capture, send the last steps and the end. Never raises."""
        if self.state is not STARTED or self.finished or os.getpid() != self.pid:
            return
        self.finished = True
        sender = self.sender
        try:
            if self.stack is not None:
                self.stack.close()  # the capture classifies what is still open
        except Exception:
            pass
        if sender is not None:
            sender.status, sender.error = exit_status(self.exit_code, self.exit_error)
            sender.finish()

    def forked(self) -> None:
        """In a process forked from this one: it is armed on its own (a DataLoader worker never
        fires; a process that trains connects itself); the parent's connection is let go."""
        self.pid = os.getpid()
        self.lock = threading.Lock()
        if self.state is STARTED:
            from ..capture import hooks

            if self.sender is not None:
                self.sender.forget_in_child()
            hooks.active = None  # the parent's capture records nothing here
            self.state, self.finished = ARMED, False
            self.stack = self.sender = self.run = self.capture = None


def exit_status(code: Any, handled: str | None) -> tuple[int | None, str | None]:
    """(exit status, error) of a process at its exit: an uncaught exception (status 1; the
    KeyboardInterrupt of the stop button, 130), what sys.exit() was given, else 0."""
    from ..ranks import describe_error

    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(uncaught, BaseException):
        status = 130 if isinstance(uncaught, KeyboardInterrupt) else 1
        return status, describe_error(uncaught)
    if code is None or code is True or code is False:
        status = int(bool(code)) if code is not None else 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        status = 1  # sys.exit("message") prints it and exits 1
    if status == 0:
        return 0, None
    return status, handled or (str(code) if not isinstance(code, int) else f"exit status {status}")


_tripwires: Tripwires | None = None


def arm() -> None:
    """Set the tripwires in this process (once; startup_hook calls it after `import torch`)."""
    global _tripwires
    if _tripwires is not None:
        return
    tripwires = Tripwires()
    tripwires.install()
    _tripwires = tripwires


def _after_fork_in_child() -> None:
    if _tripwires is not None:
        _tripwires.forked()


def current() -> Tripwires | None:
    """This process's tripwires (None before torch is imported, or outside a traced child)."""
    return _tripwires


os.register_at_fork(after_in_child=_after_fork_in_child)
