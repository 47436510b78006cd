"""The start-up hook a traced cell (or `traceml-jupyter run`) gives the Python processes it starts:
copied as `sitecustomize.py` into a private directory put first on their PYTHONPATH, for the
cell's duration only (children.py). It runs in every child interpreter, so it imports nothing
but the standard library until the child trains.

At start-up it runs the sitecustomize it hides (the next one on sys.path) and, when the channel
variable is set, puts one finder on sys.meta_path that answers for the name "torch" alone and
then removes itself. Once torch is imported it sets tripwires, each a pass-through that costs
one check: `DataLoader.__iter__`, `torch.autograd.backward`, a global optimizer step pre-hook
(and `DataLoader.__init__`, which notes the line a DataLoader is built on, for the checklist).
The first of them to fire — the process's first DataLoader pass, backward() or optimizer step —
connects to the kernel (the token first) and starts the capture on that thread (child_run.py).
A process that never trains — torchrun's agent, DataLoader workers, compilers, any helper —
never imports our package, never connects, and sends nothing.

A process forked from a traced one is armed on its own: a DataLoader worker never fires, a
process that trains connects itself (a child is one more stream). Nothing here raises into the
child's code: a failure of ours leaves the child untraced, with a note to the kernel when it can
send one. Imported as `traceml_jupyter.processes.startup_hook`, the same module is where both
sides read the wire's frame format and the channel's handshake.
"""

from __future__ import annotations

import os
import struct
import sys

TYPE_CHECKING = False  # what typing says, without importing typing into every child
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any, TypeVar

    T = TypeVar("T")
    D = TypeVar("D")

CHANNEL = "TRACEML_JUPYTER_CHANNEL"  # "unix:PATH" or "tcp:127.0.0.1:PORT"
TOKEN = "TRACEML_JUPYTER_TOKEN"  # the cell's random token, sent first on every connection
PACKAGE = "TRACEML_JUPYTER_PACKAGE"  # the directory of traceml_jupyter, for other interpreters
LOOP = "TRACEML_JUPYTER_LOOP"  # FILE:LINE of the loop whose iterations are steps (--loop)
NAMES = (CHANNEL, TOKEN, PACKAGE, LOOP)

LENGTH = struct.Struct("<I")  # a frame: its length, then kind and header length, header (JSON), body
KIND = struct.Struct("<BI")
NOTE = 4  # a child that trains but could not be traced says why (HELLO, STEPS, END: ranks.py)
CONNECT_TIMEOUT_S = 2.0


def pack(kind: int, meta: Mapping[str, Any], body: bytes = b"") -> bytes:
    """One frame on the wire: its length, its kind, a JSON header and a body of numbers."""
    import json

    head = json.dumps(dict(meta)).encode()
    return LENGTH.pack(KIND.size + len(head) + len(body)) + KIND.pack(kind, len(head)) + head + body


def connect(address: str, token: str, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """A connection to the kernel's channel, the token sent first (OSError when it is gone)."""
    import socket

    kind, _, where = address.partition(":")
    if kind == "unix" and hasattr(socket, "AF_UNIX"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: Any = where
    elif kind == "tcp":
        host, _, port = where.rpartition(":")
        if host != "127.0.0.1":  # never anything but this machine's loopback
            raise OSError(f"not a local channel: {address}")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        target = (host, int(port))
    else:
        raise OSError(f"unknown channel: {address}")
    try:
        sock.settimeout(timeout_s)
        sock.connect(target)
        sock.sendall(token.encode("ascii"))
    except (OSError, ValueError):  # gone, timed out, or a token that is not ours
        sock.close()
        raise
    return sock


def tell_kernel(note: str) -> None:
    """A child that trains but cannot be traced (another interpreter without our dependencies,
    an error of ours) says why, once; never raises (the kernel may be gone)."""
    address, token = os.environ.get(CHANNEL), os.environ.get(TOKEN)
    if not address or not token:
        return
    try:
        with connect(address, token) as sock:
            meta = {"pid": os.getpid(), "command": command_line(), "note": note}
            sock.sendall(pack(NOTE, meta))
    except (OSError, ValueError):  # the channel is gone or not one
        pass


def guarded(default: D, call: Callable[..., T], *args: Any, tell: Callable[[str], None] | None = None) -> T | D:
    """`call(*args)`, or `default` when it raises: a failure of ours never reaches the child's
    code. The one guard of the child's start-up (this module imports nothing of the package,
    not even failures.never_raise); `tell` gets the error as "TypeError: what it said"."""
    try:
        return call(*args)
    except Exception as exc:
        if tell is not None:
            tell(f"{type(exc).__name__}: {exc}")
        return default


def tell_kernel_that(what: str) -> Callable[[str], None]:
    """For `guarded`: the kernel is told "WHAT: the error"."""
    return lambda error: tell_kernel(f"{what}: {error}")


def command_line(argv: Sequence[str] | None = None) -> str:
    """How the process was started, as a user would type it: `python train.py --epochs 3`."""
    args = list(argv if argv is not None else getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    if args:
        args[0] = os.path.basename(args[0])
    text = " ".join(" ".join(args).split())
    return text if len(text) <= 80 else text[:77] + "..."


# -- the child's start-up ------------------------------------------------------------------------
class TorchWatcher:
    """A finder on sys.meta_path that finds nothing itself: on `import torch` it lets the other
    finders find torch, and has `armed` called once torch's module has run. Then it is gone
    from sys.meta_path."""

    def __init__(self, armed: Any) -> None:
        self.armed = armed

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        """Answer for "torch" alone, once: its spec, with the tripwires set when it has loaded; None
        for any other name."""
        if name != "torch":
            return None
        import importlib.util

        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if spec is None or exec_module is None:
            return spec
        armed = self.armed

        def run_then_arm(module: Any) -> None:
            exec_module(module)
            del loader.exec_module  # type: ignore[union-attr]  # the loader's own again
            armed()

        loader.exec_module = run_then_arm  # type: ignore[union-attr]
        return spec


def arm_when_torch_is_imported() -> None:
    """Once torch is imported: the tripwires. Errors become one note to the kernel."""
    guarded(None, arm, tell=tell_kernel_that("traceml could not start here"))


def package(name: str) -> Any:
    """A module of traceml_jupyter, imported only once the child trains (from where the kernel
    has the package when this interpreter cannot import it)."""
    import importlib

    try:  # by name: this file runs as sitecustomize, outside the package
        return importlib.import_module(name)
    except ImportError:
        _import_from(os.environ.get(PACKAGE))
        return importlib.import_module(name)


def _import_from(package_dir: str | None) -> None:
    """traceml_jupyter from the kernel's copy of the package (nothing else of that directory's
    parent comes onto sys.path)."""
    import importlib
    import importlib.util

    if not package_dir:
        raise ImportError("traceml_jupyter is not importable here")
    init = os.path.join(package_dir, "__init__.py")
    spec = importlib.util.spec_from_file_location("traceml_jupyter", init, submodule_search_locations=[package_dir])
    if spec is None or spec.loader is None:
        raise ImportError(f"traceml_jupyter not found in {package_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["traceml_jupyter"] = module
    spec.loader.exec_module(module)


# -- the tripwires (once torch is imported) -----------------------------------------------------------
ARMED, STARTED, OFF = "armed", "started", "off"


class Tripwires:
    """This process's state: armed (waiting for the first training event), started (the capture
    records, the sender streams: child_run.ChildCapture), or off (the kernel is gone, or an error
    of ours)."""

    def __init__(self) -> None:
        import threading

        self.state = ARMED
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.sites: dict[int, dict[str, Any]] = {}  # id(DataLoader) -> where it was built
        self.exit_code: Any = None  # what sys.exit() was given
        self.exit_error: str | None = None  # the exception being handled when it was called
        self.recording: Any = None  # child_run.ChildCapture once started
        self.pre_hook: Any = None
        self.loop: tuple[str, int, int] | None = None  # --loop: (file, line, its code's token)
        self.installed = False
        self.patches: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, ours)
        self.finished = False

    def install(self) -> None:
        """Set the tripwires: DataLoader's `__init__` and `__iter__`, `torch.autograd.backward` and
        an optimizer step pre-hook."""
        import functools

        self.installed = True
        import torch
        from torch.utils.data import DataLoader

        original_init = DataLoader.__dict__["__init__"]
        original_iter = DataLoader.__dict__["__iter__"]
        trip = self.trip

        @functools.wraps(original_init)
        def __init__(loader: Any, *args: Any, **kwargs: Any) -> None:
            original_init(loader, *args, **kwargs)
            if self.state is ARMED:  # where it is built, for the checklist (later: the capture notes it)
                guarded(None, self.note_site, loader, sys._getframe(1))

        @functools.wraps(original_iter)
        def __iter__(loader: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            if trip():  # the capture's DataLoader.__iter__ is in place now: go through it
                return DataLoader.__iter__(loader)
            return original_iter(loader)

        self._patch(DataLoader, "__init__", __init__)
        self._patch(DataLoader, "__iter__", __iter__)
        autograd = torch.autograd
        original_backward = autograd.__dict__.get("backward")
        if original_backward is not None:

            @functools.wraps(original_backward)
            def backward(*args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True  # noqa: F841
                if trip():
                    return autograd.backward(*args, **kwargs)
                return original_backward(*args, **kwargs)

            self._patch(autograd, "backward", backward)
        try:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
        except ImportError:  # torch < 2.0: backward() and DataLoaders start it
            return

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            trip()  # the capture's post hook then sees this step

        self.pre_hook = register_optimizer_step_pre_hook(before_step)

    def note_site(self, loader: Any, frame: Any) -> None:
        """Where `loader` is built (`frame`: its caller), kept by the loader's id."""
        package("traceml_jupyter.capture.data.dataloaders").note_site(self.sites, loader, frame)

    def _patch(self, owner: Any, name: str, ours: Any) -> None:
        self.patches.append((owner, name, owner.__dict__[name], ours))
        setattr(owner, name, ours)

    def uninstall(self) -> None:
        """The tripwires go (where nothing was put over them since): once the capture starts, a
        child's per-step path is the in-kernel one, nothing more; untraced, it is untouched."""
        for owner, name, original, ours in reversed(self.patches):
            if owner.__dict__.get(name) is ours:
                setattr(owner, name, original)
        self.patches.clear()
        self.installed = False

    def trip(self) -> bool:
        """True once, when this call started the capture (the caller then goes through it)."""
        if self.state is not ARMED:
            return False
        with self.lock:
            if self.state is not ARMED or os.getpid() != self.pid:
                return False
            self.uninstall()
            started = guarded(False, self._start, tell=tell_kernel_that("traceml could not start"))
            self.state = STARTED if started else OFF
            return started

    def _start(self) -> bool:
        address, token = os.environ.get(CHANNEL), os.environ.get(TOKEN)
        if not address or not token:
            return False
        try:
            sock = connect(address, token)
        except (OSError, ValueError):  # the cell is over (or never was ours): stay untraced
            return False
        self.recording = None
        try:
            self.recording = package("traceml_jupyter.processes.child_run").start_capture(self, sock)
        finally:
            if self.recording is None:  # it failed: the kernel sees the connection close
                sock.close()
        return True

    def tidy(self) -> None:
        """At the first tick: the optimizer pre-hook goes (it had one job: start the capture)."""
        if self.pre_hook is not None:
            self.pre_hook.remove()
            self.pre_hook = None

    def finish(self) -> None:
        """At exit: the last steps and the end go to the kernel. Never raises."""
        if self.state is not STARTED or self.finished or os.getpid() != self.pid:
            return
        self.finished = True
        guarded(None, self.recording.finish, self.exit_code, self.exit_error)

    def forked(self) -> None:
        """In a process forked from this one: armed on its own; the parent's connection let go."""
        import threading

        self.pid = os.getpid()
        self.lock = threading.Lock()
        if self.state is STARTED and guarded(False, self._rearm):
            self.state, self.finished, self.recording = ARMED, False, None

    def _rearm(self) -> bool:
        self.recording.forget_in_child()
        self.install()  # over the parent's capture, which passes through here
        return True


_tripwires: Tripwires | None = None


def tripwires() -> Tripwires:
    """This process's tripwires, made once."""
    global _tripwires
    if _tripwires is None:
        _tripwires = Tripwires()
        if hasattr(os, "register_at_fork"):  # not on Windows (no fork there)
            os.register_at_fork(after_in_child=_tripwires.forked)
    return _tripwires


def arm() -> None:
    """Set the tripwires in this process (once, after `import torch`)."""
    wires = tripwires()
    if not wires.installed:
        wires.install()


def current() -> Tripwires | None:
    """This process's tripwires (None before torch is imported, or outside a traced child)."""
    return _tripwires


def chain(here: str) -> None:
    """Run the sitecustomize this one hides (the next one on sys.path), as site would have."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def start(here: str) -> None:
    """What sitecustomize does in a child: the hidden sitecustomize first, then the watcher."""
    guarded(None, chain, here, tell=site_error)
    if not (os.environ.get(CHANNEL) and os.environ.get(TOKEN)):
        return
    if "torch" not in sys.modules:
        sys.meta_path.insert(0, TorchWatcher(arm_when_torch_is_imported))
    if os.environ.get(LOOP):  # --loop FILE:LINE (the script itself then runs from here)
        guarded(None, follow_loop, os.environ[LOOP], tell=tell_kernel_that("--loop could not be followed"))


def site_error(error: str) -> None:
    """An error in the sitecustomize this one hides, as site reports one."""
    print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{error}", file=sys.stderr)


def follow_loop(where: str) -> None:
    """--loop FILE:LINE: the loop's iterations are steps (child_run.follow_loop)."""
    package("traceml_jupyter.processes.child_run").follow_loop(tripwires(), where)


if __name__ == "sitecustomize":
    start(os.path.dirname(os.path.abspath(__file__)))
