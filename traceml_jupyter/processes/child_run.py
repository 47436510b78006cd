"""A child process's recording once it trains (the start-up hook's tripwires start it at the
process's first training event): the capture of `%%traceml` on the thread that trains, and its
sender (ranks.Sender): its HELLO says who it is, its steps go at the run's ticks, its END says
how it ended, what fed its steps and where its loader was built."""

from __future__ import annotations

import atexit
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import ranks
from ..capture import hooks
from ..capture.dataloaders import split_site
from ..capture.patches import patched
from ..capture.recording import Capture, capturing
from ..capture.sources import training_source
from ..run import Run, _jsonable
from .startup_hook import command_line

if TYPE_CHECKING:
    from .startup_hook import Tripwires


class ChildSender(ranks.Sender):
    """A child's end of its connection to the kernel."""

    def __init__(self, sock: Any, tap: ranks.StepTap, run: Run, tripwires: Tripwires) -> None:
        super().__init__(sock, tap, run, 0)
        self.tripwires = tripwires
        self.status: int | None = None

    def hello(self) -> None:
        meta = {
            "pid": self.pid,
            "index": 0,
            "command": command_line(),
            "origin_ns": self.run.recorder.origin_ns,
            **self._who(),
        }
        self._put(ranks.frame(ranks.HELLO, meta))
        self._push()

    def __call__(self, run: Run) -> None:
        self.tripwires.tidy()
        super().__call__(run)

    def _end(self) -> dict[str, Any]:
        end: dict[str, Any] = super()._end()
        run = self.run
        end["status"] = self.status
        end["command"] = command_line()
        try:
            training = training_source(list(self.tap.capture.model.sources.values()))
            key = training.key if training is not None and training.kind == "dataloader" else None
            site = self.tripwires.sites.get(key) if isinstance(key, int) else None  # built before the capture
            loader_site, dataset_site = split_site(site) if site else (run.loader_site, run.dataset_site)
            end.update(
                loader_site=loader_site,
                dataset_site=dataset_site,
                sources=_jsonable(run.sources),
                phases=_jsonable(run.phases),
                notes=list(run.notes),
                wall_ms=run.wall_ms,
                batch_kind=run.batch_kind,
            )
        except Exception as exc:
            end["note"] = f"what fed its steps could not be read: {type(exc).__name__}: {exc}"
        return end


@dataclass
class Recording:
    """A started child: its capture (undone by `stack`) and its sender."""

    stack: ExitStack
    sender: ChildSender

    def finish(self, exit_code: Any, exit_error: str | None) -> None:
        """At exit: close the capture (it classifies what is still open), send the last steps
        and the end."""
        try:
            self.stack.close()
        except Exception:
            pass
        self.sender.status, self.sender.error = exit_status(exit_code, exit_error)
        self.sender.finish()

    def forget_in_child(self) -> None:
        """In a process forked from this one: the parent's capture records nothing here and its
        connection is let go."""
        hooks.active = None
        self.sender.forget_in_child()


def record(tripwires: Tripwires, sock: Any) -> Recording:
    """Start recording this process on the calling thread, streaming to the kernel over `sock`
    (connected, token sent); at exit, tripwires.finish sends the end."""
    run = Run(command_line())
    capture = Capture(run)
    stack = ExitStack()
    stack.enter_context(capturing(run, capture))
    timer = None
    autograd: Any = getattr(sys.modules.get("torch"), "autograd", None)
    if autograd is not None and ranks.distributed_env() and getattr(autograd, "backward", None) is not None:
        timer = ranks.BackwardTimer()  # ranks wait for each other in backward()
        stack.enter_context(patched(autograd, {"backward": timer.wrap(autograd.backward)}))
    tap = ranks.StepTap(capture, timer)
    stack.callback(tap.follow_merges(capture.model))
    sender = ChildSender(sock, tap, run, tripwires)
    run._observers[:] = [sender]  # the live chart is the kernel's
    run._next_tick = 0
    capture.listen()
    ranks._in_rank = True  # forks from here start no rank channel: one that trains connects itself
    original_exit = sys.exit

    def exit(status: Any = None) -> Any:  # how the process says it ends
        tripwires.exit_code = status
        tripwires.exit_error = ranks.describe_error(sys.exc_info()[1])
        return original_exit(status)

    sys.exit = exit
    atexit.register(tripwires.finish)
    if "multiprocessing" in sys.modules:  # multiprocessing children leave through os._exit
        import multiprocessing.util

        multiprocessing.util.Finalize(tripwires, tripwires.finish, exitpriority=100)
    sender.hello()
    return Recording(stack, sender)


def exit_status(code: Any, handled: str | None) -> tuple[int | None, str | None]:
    """(exit status, error) of a process at its exit: an uncaught exception (status 1; the
    KeyboardInterrupt of the stop button, 130), what sys.exit() was given, else 0."""
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(uncaught, BaseException):
        status = 130 if isinstance(uncaught, KeyboardInterrupt) else 1
        return status, ranks.describe_error(uncaught)
    if code is None or code is True or code is False:
        status = int(bool(code)) if code is not None else 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        status = 1  # sys.exit("message") prints it and exits 1
    if status == 0:
        return 0, None
    return status, handled or (str(code) if not isinstance(code, int) else f"exit status {status}")
