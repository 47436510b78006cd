"""A child process's recording once it trains (the start-up hook's tripwires start it at the
process's first training event): the capture of `%%traceml` on the thread that trains, and its
sender (ranks.Sender): its HELLO says who it is, its steps go at the run's ticks, its END says
how it ended, what fed its steps and where its loader was built."""

from __future__ import annotations

import ast
import atexit
import builtins
import os
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from .. import ranks
from ..capture.data.dataloaders import split_site
from ..capture.data.sources import training_source
from ..capture.instrument import hooks
from ..capture.instrument.locate import loop_at_line
from ..capture.instrument.patches import patched
from ..capture.instrument.rewrite import instrument_loop
from ..capture.session import Capture, capture_session, new_token
from ..facts.loader import LoaderFacts, NotedSite
from ..ranks.wire import End, Hello, Who
from ..recording import Recording
from .startup_hook import command_line

if TYPE_CHECKING:
    from .startup_hook import Tripwires


class ChildSender(ranks.Sender):
    """A child's end of its connection to the kernel."""

    def __init__(self, sock: Any, tap: ranks.StepTap, run: Recording, tripwires: Tripwires) -> None:
        super().__init__(sock, tap, run, 0)
        self.tripwires = tripwires
        self.status: int | None = None
        # The script's file, while it runs (Python takes __file__ off __main__ when it ends).
        self.main_file: str | None = getattr(sys.modules.get("__main__"), "__file__", None)

    def hello(self) -> None:
        """Introduce this process to the kernel: pid, command line, clock origin and who it is
        (rank, world size)."""
        hello: Hello = {
            "pid": self.pid,
            "index": 0,
            "command": command_line(),
            "origin_ns": self.run.recorder.origin_ns,
            **self._who(),
        }
        self._put(ranks.frame(ranks.HELLO, hello))
        self._push()

    def __call__(self, run: Recording) -> None:
        self.tripwires.tidy()
        super().__call__(run)

    def _put_steps(self, who: Who, rows: Any) -> None:
        feed = self.run.rank_collector
        if rows is not None and isinstance(feed, ranks.LocalRank):  # for the gather of a job over nodes
            feed.add(rows)
        super()._put_steps(who, rows)

    def _end(self) -> End:
        end = super()._end()
        end["status"], end["command"] = self.status, command_line()
        return end

    def _close_recording(self) -> None:
        """Its capture closed already (at exit, before the end is sent): what the kernel's
        checklist reads of a script is set on the run — where its training loader was built
        when that was before the capture started, the loader's settings as a script has them."""
        run = self.run
        training = training_source(list(self.tap.capture.model.sources.values()))
        key = training.key if training is not None and training.kind == "dataloader" else None
        site = self.tripwires.sites.get(key) if isinstance(key, int) else None  # built before the capture
        if site:
            run.loader_site, run.dataset_site = split_site(cast("NotedSite", site))
        if run.loader_info is not None:
            run.loader_info = script_loader_info(run.loader_info, self.main_file)


@dataclass
class ChildCapture:
    """A started child: its capture (undone by `stack`) and its sender."""

    stack: ExitStack
    sender: ChildSender

    def finish(self, exit_code: Any, exit_error: str | None) -> None:
        """At exit: close the capture (it classifies what is still open), send the last steps
        and the end."""
        try:
            self.stack.close()
        finally:  # the end goes whatever closing raised (the start-up hook's edge catches it)
            self.sender.status, self.sender.error = exit_status(exit_code, exit_error)
            self.sender.finish()

    def forget_in_child(self) -> None:
        """In a process forked from this one: the parent's capture records nothing here and its
        connection is let go."""
        hooks.active = None
        self.sender.forget_in_child()


def script_loader_info(info: LoaderFacts, main_file: str | None) -> LoaderFacts:
    """The loader's settings as the kernel's checklist should read them for a script: a Dataset
    of the script itself is in `__main__` like one of a notebook cell, but workers can import it
    (as `__mp_main__`), so it is named by its file; the start method is the script's own when it
    chose one."""
    info = info.copy()
    if info.get("dataset_module") == "__main__" and isinstance(main_file, str):
        info["dataset_module"] = os.path.basename(main_file)
    mp = sys.modules.get("multiprocessing")
    if info.get("multiprocessing_context") is None and mp is not None:
        info["multiprocessing_context"] = mp.get_start_method(allow_none=True)
    return info


def start_capture(tripwires: Tripwires, sock: Any) -> ChildCapture:
    """Start recording this process on the calling thread, streaming to the kernel over `sock`
    (connected, token sent); at exit, tripwires.finish sends the end."""
    run = Recording(command_line())
    loop = tripwires.loop  # --loop FILE:LINE: (path, line, token)
    capture = Capture(run, token=loop[2] if loop else None)
    if loop:
        run.loop_line, run.loop_where = loop[1], os.path.basename(loop[0])
    stack = ExitStack()
    stack.enter_context(capture_session(run, capture))
    timer = None
    autograd: Any = getattr(sys.modules.get("torch"), "autograd", None)
    if autograd is not None and ranks.distributed_env() and getattr(autograd, "backward", None) is not None:
        timer = ranks.BackwardTimer()  # ranks wait for each other in backward()
        stack.enter_context(patched(autograd, {"backward": timer.wrap(autograd.backward)}))
    tap = ranks.StepTap(capture, timer)
    stack.callback(tap.follow_merges(capture.model))
    sender = ChildSender(sock, tap, run, tripwires)
    run.observe_only(sender)  # the live chart is the kernel's
    capture.listen()
    ranks.start_no_rank_channel()
    original_exit = sys.exit

    def exit(status: Any = None) -> Any:  # how the process says it ends
        tripwires.exit_code = status
        tripwires.exit_error = ranks.describe_error(sys.exc_info()[1])
        return original_exit(status)

    sys.exit = exit
    if multi_node():
        gather_before_the_group_goes(run)
    atexit.register(tripwires.finish)
    if "multiprocessing" in sys.modules:  # multiprocessing children leave through os._exit
        import multiprocessing.util

        multiprocessing.util.Finalize(tripwires, tripwires.finish, exitpriority=100)
    sender.hello()
    return ChildCapture(stack, sender)


def multi_node() -> bool:
    """One rank of a torchrun job over several nodes (more ranks than this node starts)."""
    try:
        return int(os.environ["WORLD_SIZE"]) > int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return False


def gather_before_the_group_goes(run: Recording) -> None:
    """A job over several nodes: when the script destroys its process group (every rank does,
    at its end), every rank's summary is gathered over it first (ranks.gather, as at the end
    of trace()), so the kernel or command line of each node sees the whole job's ranks."""
    dist: Any = sys.modules.get("torch.distributed")
    original = getattr(dist, "destroy_process_group", None)
    if original is None:
        return
    run.rank_collector = ranks.LocalRank()
    done: list[bool] = []

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            ranks.gather(run, None)  # never raises: a failure is a note on the run
        return original(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group


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


# -- --loop FILE:LINE: a loop in a script whose iterations are steps -----------------------------------
class LoopModuleFinder:
    """On sys.meta_path: the module whose file is `path` is compiled with the loop on `line`
    rewritten (capture/instrument/rewrite.py), as a traced cell's loop is."""

    def __init__(self, path: str, line: int, token: int) -> None:
        self.path, self.line, self.token = path, line, token

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        """The module spec of the `--loop` file, loaded with its loop instrumented; None for any
        other module."""
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        origin = getattr(spec, "origin", None)
        if spec is None or origin is None or os.path.abspath(origin) != self.path:
            return None
        loader = spec.loader
        if not isinstance(loader, importlib.machinery.SourceFileLoader):
            return None
        finder = self

        class Rewriting(importlib.machinery.SourceFileLoader):
            def get_code(self, fullname: str) -> Any:
                return compile(finder.rewritten(), finder.path, "exec", dont_inherit=True)

        spec.loader = Rewriting(loader.name, loader.path)
        sys.meta_path.remove(self)
        return spec

    def rewritten(self) -> ast.Module:
        """The `--loop` file's tree with the loop at its line instrumented (SyntaxError when no for
        loop is there)."""
        with open(self.path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), self.path)
        choice = loop_at_line(tree, self.line)
        if choice is None:
            raise SyntaxError(f"--loop {self.path}:{self.line}: no for loop on that line")
        new, _ = instrument_loop(tree, choice, self.token)
        return new


def follow_loop(tripwires: Tripwires, where: str) -> None:
    """--loop FILE:LINE in a child, at its start-up: the loop is rewritten when its file is
    compiled — an imported module at import, the script itself run here as Python would run it
    (this then never returns) — and its first iteration starts the capture like any other
    training event."""
    path, _, line_text = where.rpartition(":")
    token = new_token()
    tripwires.loop = (path, int(line_text), token)
    hooks.install()

    def loop(iterable: Any, token: int) -> Any:  # the first pass of the loop trips the wire
        tripwires.trip()
        return hooks.loop(iterable, token)

    def aloop(iterable: Any, token: int) -> Any:
        tripwires.trip()
        return hooks.aloop(iterable, token)

    setattr(builtins, hooks.LOOP, loop)  # until the capture installs the plain ones
    setattr(builtins, hooks.ALOOP, aloop)
    finder = LoopModuleFinder(path, int(line_text), token)
    main = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    if main != path:
        sys.meta_path.insert(0, finder)
        return
    run_script(path, finder)


def run_script(path: str, finder: LoopModuleFinder) -> None:
    """Run the script `path` as `__main__` with its loop rewritten, then end the process as
    Python ends it (threads joined, atexit, the exit status, the traceback of an uncaught
    exception)."""
    import atexit as exits
    import threading
    import traceback

    status = 0
    try:
        code = compile(finder.rewritten(), path, "exec", dont_inherit=True)
    except (OSError, SyntaxError) as exc:
        from .startup_hook import tell_kernel

        tell_kernel(f"--loop: {exc}")
        return  # Python runs the script as it is
    main = sys.modules["__main__"]
    main.__dict__.update(__file__=path, __cached__=None)
    if not getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, os.path.dirname(path))  # as Python does for a script, after site
    try:
        exec(code, main.__dict__)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        status = 130 if isinstance(exc, KeyboardInterrupt) else 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    exits._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or file: as Python's own shutdown
            pass
    os._exit(status & 0xFF)
