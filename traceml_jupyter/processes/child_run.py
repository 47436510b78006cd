"""A child process's recording once it trains (child.py starts it at the first training event):
the capture of `%%traceml` on the thread that trains, and its sender (ranks.Sender): its HELLO
says who it is, its steps go at the run's ticks, its END says how it ended, what fed its steps
and where its loader was built."""

from __future__ import annotations

import atexit
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from .. import ranks
from ..capture.dataloaders import split_site
from ..capture.patches import patched
from ..capture.recording import Capture, capturing
from ..capture.sources import training_source
from ..run import Run, _jsonable
from .startup_hook import command_line

if TYPE_CHECKING:
    from .child import Tripwires


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


def record(tripwires: Tripwires, sock: Any) -> None:
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
    tripwires.stack, tripwires.sender, tripwires.run, tripwires.capture = stack, sender, run, capture
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
