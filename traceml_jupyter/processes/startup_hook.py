"""The start-up hook a traced cell (or `traceml-jupyter run`) gives the Python processes it starts:
copied as `sitecustomize.py` into a private directory put first on their PYTHONPATH, for the
cell's duration only (children.py). Standard library only: it runs in every child interpreter.

In a child it does almost nothing: it runs the sitecustomize it hides (the next one on sys.path),
and when the channel variable is set it waits for `import torch` (one finder on sys.meta_path
that answers for the name "torch" alone and then removes itself). Once torch is imported,
child.py arms the capture; the child connects to the kernel only when it trains. The same
module, imported as `traceml_jupyter.startup_hook`, is where both sides read the wire's frame
format and the channel's handshake: the child's token first, then frames.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import socket
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

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
    head = json.dumps(dict(meta)).encode()
    return LENGTH.pack(KIND.size + len(head) + len(body)) + KIND.pack(kind, len(head)) + head + body


def connect(address: str, token: str, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """A connection to the kernel's channel, the token sent first (OSError when it is gone)."""
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
    except BaseException:
        sock.close()
        raise
    return sock


def tell_kernel(note: str) -> None:
    """A child that trains but cannot be traced (another interpreter without our dependencies,
    an error of ours) says why, once; never raises."""
    address, token = os.environ.get(CHANNEL), os.environ.get(TOKEN)
    if not address or not token:
        return
    try:
        with connect(address, token) as sock:
            meta = {"pid": os.getpid(), "command": command_line(), "note": note}
            sock.sendall(pack(NOTE, meta))
    except Exception:
        pass


def command_line(argv: Sequence[str] | None = None) -> str:
    """How the process was started, as a user would type it: `python train.py --epochs 3`."""
    args = list(argv if argv is not None else getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    if args:
        args[0] = os.path.basename(args[0])
    text = " ".join(" ".join(args).split())
    return text if len(text) <= 80 else text[:77] + "..."


# -- the child's start-up ------------------------------------------------------------------------
class TorchWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on `import torch` it lets the other finders find torch, and has
    `armed` called once torch's module has run. Then it is gone from sys.meta_path."""

    def __init__(self, armed: Any) -> None:
        self.armed = armed

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
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
    """Once torch is imported, child.arm() (our package imported from where the kernel has it
    when this interpreter cannot import it). Errors become one note to the kernel."""
    try:
        try:  # by name: this file runs as sitecustomize, outside the package
            child = importlib.import_module("traceml_jupyter.processes.child")
        except ImportError:
            child = _import_from(os.environ.get(PACKAGE))
        child.arm()
    except Exception as exc:
        tell_kernel(f"traceml could not start here: {type(exc).__name__}: {exc}")


def _import_from(package_dir: str | None) -> Any:
    """traceml_jupyter.child from the kernel's copy of the package (nothing else of that
    directory's parent comes onto sys.path)."""
    if not package_dir:
        raise ImportError("traceml_jupyter is not importable here")
    init = os.path.join(package_dir, "__init__.py")
    spec = importlib.util.spec_from_file_location("traceml_jupyter", init, submodule_search_locations=[package_dir])
    if spec is None or spec.loader is None:
        raise ImportError(f"traceml_jupyter not found in {package_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["traceml_jupyter"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("traceml_jupyter.processes.child")


def chain(here: str) -> None:
    """Run the sitecustomize this one hides (the next one on sys.path), as site would have."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def start(here: str) -> None:
    """What sitecustomize does in a child: the hidden sitecustomize first, then the watcher."""
    try:
        chain(here)
    except Exception as exc:  # as site reports an error in sitecustomize
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}", file=sys.stderr)
    if os.environ.get(CHANNEL) and os.environ.get(TOKEN) and "torch" not in sys.modules:
        sys.meta_path.insert(0, TorchWatcher(arm_when_torch_is_imported))


if __name__ == "sitecustomize":
    start(os.path.dirname(os.path.abspath(__file__)))
