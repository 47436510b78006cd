"""The processes a traced cell starts (`!python train.py`, `!torchrun ...`, `subprocess.run`,
`os.system`) and the command line (`traceml-jupyter run -- ...`): the kernel's side.

While the cell runs, a private channel is open — a Unix domain socket in a directory only this
user can open (`tempfile.mkdtemp`: mode 0700), or 127.0.0.1 where there are no Unix sockets —
and the environment the cell's children inherit names it, with a random token for this cell, and
puts the directory, which also holds the start-up hook (startup_hook.py, as `sitecustomize.py`),
first on PYTHONPATH. A connection is read only after it sent the token; then it is one more
stream of the ranks' collector (ranks.Collector): frames of JSON and numbers, each at most
ranks.MAX_FRAME bytes, a malformed one dropped with a note. When the cell ends the environment is
put back as it was, the channel closed and its directory removed, and what the children sent
becomes the run's (`adopt_children`):

- the kernel trained itself: its own steps are the run's, the children are notes;
- ranks of one job (torchrun: a world of two or more): the per-rank table and the rank verdict,
  the run showing the rank that holds the others back (else the lowest);
- otherwise the process that trained (the one with the most steps when several did; the others
  are notes): its steps, what a step was, its loader, where that loader was built.
"""

from __future__ import annotations

import ast
import hmac
import os
import selectors
import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .. import ranks
from ..analysis.rank_verdict import compare_ranks, holds_back
from ..analysis.summary_keys import RankRow
from ..capture.data.probes import plain_count
from ..facts.processes import ProcessRow
from ..result import RunResult
from . import startup_hook
from .startup_hook import CHANNEL, LOOP, NOTE, PACKAGE, TOKEN

if TYPE_CHECKING:
    from ..facts.loader import CodeSite, LoaderFacts
    from ..facts.resources import GpuMemoryFacts, HostFacts, OomFacts
    from ..recording import Recording
    from ..result import RunResult

HOOK_FILE = "sitecustomize.py"
MAX_KNOCKS = 64  # connections waiting to give the token


# -- the channel ------------------------------------------------------------------------------------
def _unix_listener(directory: str) -> tuple[socket.socket | None, str]:
    """A Unix socket in `directory`, or None where there are none or the path is too long for
    one (about 107 bytes: a deep TMPDIR)."""
    if not hasattr(socket, "AF_UNIX"):
        return None, ""
    path = os.path.join(directory, "channel")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        return None, ""
    return sock, f"unix:{path}"


class Channel:
    """A private directory with the start-up hook and a listening socket; the token."""

    def __init__(self, tcp: bool = False, loop: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="traceml-")  # mode 0700: only this user gets in
        self.token = os.urandom(16).hex()
        self.loop = loop  # --loop FILE:LINE for the children (script_loop)
        with ExitStack() as undo:  # the directory goes if the channel cannot be made
            undo.callback(shutil.rmtree, self.dir, ignore_errors=True)
            write_hook(self.dir)
            listener, self.address = _unix_listener(self.dir) if not tcp else (None, "")
            if listener is None:  # no Unix sockets here, or a temp path too long for one
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.bind(("127.0.0.1", 0))  # this machine's loopback only
                self.address = f"tcp:127.0.0.1:{listener.getsockname()[1]}"
            self.listener: socket.socket = listener
            self.listener.listen(MAX_KNOCKS)
            self.listener.setblocking(False)
            undo.pop_all()

    def env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """What the children's environment gets: the channel, the token, the hook's directory
        first on PYTHONPATH (before what `environ` has there)."""
        path = environ.get("PYTHONPATH")
        env = {
            CHANNEL: self.address,
            TOKEN: self.token,
            PACKAGE: os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # traceml_jupyter/
            "PYTHONPATH": self.dir + (os.pathsep + path if path else ""),
        }
        if self.loop:
            env[LOOP] = self.loop
        return env

    def close(self) -> None:
        """Close the listening socket and remove the channel's private directory."""
        try:
            self.listener.close()
        except OSError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


_HOOK_PYC: list[bytes] = []  # the hook's bytecode, compiled once per kernel


def write_hook(directory: str) -> None:
    """The start-up hook as `sitecustomize.py`, with its bytecode beside it (children load it
    without compiling, also where PYTHONDONTWRITEBYTECODE keeps them from writing it)."""
    import importlib.util
    import py_compile

    source = Path(directory, HOOK_FILE)
    source.write_text(Path(startup_hook.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    cached = Path(importlib.util.cache_from_source(str(source)))
    try:
        if not _HOOK_PYC:  # unchecked: valid for every copy of the same source
            py_compile.compile(str(source), str(cached), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
            _HOOK_PYC.append(cached.read_bytes())
        else:
            cached.parent.mkdir(exist_ok=True)
            cached.write_bytes(_HOOK_PYC[0])
    except (OSError, py_compile.PyCompileError):
        pass  # the child compiles it


@contextmanager
def child_environment(channel: Channel) -> Iterator[None]:
    """os.environ with the channel's variables for the duration; then exactly as before. A
    variable the cell itself changed meanwhile keeps the cell's value (PYTHONPATH without the
    hook's directory)."""
    ours = channel.env(os.environ)
    before = {name: os.environ.get(name) for name in ours}
    os.environ.update(ours)
    try:
        yield
    finally:
        for name, value in ours.items():
            now = os.environ.get(name)
            if now == value:
                restored = before[name]
            elif name == "PYTHONPATH" and now is not None:
                parts = [p for p in now.split(os.pathsep) if p != channel.dir]
                restored = os.pathsep.join(parts) if parts or before[name] is not None else None
            else:
                continue  # the cell set it: its value stays
            if restored is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = restored


# -- the collector's side ------------------------------------------------------------------------------
@dataclass(eq=False)
class Knock:
    """A connection that has not given the token yet: nothing of it is read but the token."""

    sock: socket.socket
    buf: bytes = b""


class ChildStream(ranks.Stream):
    """A child process: a stream that says how it was started (its command line)."""

    def __init__(self, sock: socket.socket, index: int, origin_ns: int | None) -> None:
        super().__init__(sock, index, origin_ns)
        self.command = "a child process"
        self.note: str | None = None
        self.said_hello = False

    def apply(self, kind: int, meta: Mapping[str, Any], rows: np.ndarray | None) -> None:
        """Take one frame the child sent (its hello, steps, end, or a note that it could not be
        traced)."""
        command = meta.get("command")
        if isinstance(command, str) and command:
            self.command = command[:200]
        if kind == NOTE:  # it trains, but could not be traced (then it closes the connection)
            self.pid = plain_count(meta.get("pid")) or self.pid
            self.note = str(meta.get("note"))[:500]
            return
        if kind == ranks.HELLO:
            self.said_hello = True
        super().apply(kind, meta, rows)

    @property
    def exit_status(self) -> int | None:
        """The exit status the child reported at its end; None before it ended."""
        return plain_count((self.end or {}).get("status"))

    @property
    def distributed(self) -> bool:
        """One rank of a job of several (torchrun, a process group)."""
        world = plain_count(self.world)
        return self.rank is not None and world is not None and world > 1

    def record(self) -> ProcessRow:
        """What `run.processes` keeps of it."""
        status = self.status
        if status == "stopped" and self.note:
            status = "not traced"
        return {
            "pid": self.pid,
            "command": self.command,
            "rank": self.rank,
            "n_steps": self.recorder.n_steps,
            "status": status,
            "exit_status": self.exit_status,
            "error": self.end.get("error") if self.end is not None else None,
            "note": self.note,
        }


class ChildCollector(ranks.Collector):
    """The ranks' collector, also listening on the channel: each child that gives the token is
    one more stream."""

    def __init__(self, run: Recording, channel: Channel) -> None:
        super().__init__(run)
        self.channel = channel
        self.knocks: list[Knock] = []
        self.children = 0
        self._selector.register(channel.listener, selectors.EVENT_READ, channel)

    def _read(self, item: Any) -> None:
        if item is self.channel:
            self._accept()
        elif isinstance(item, Knock):
            self._knock(item)
        else:
            super()._read(item)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.channel.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(self.knocks) >= MAX_KNOCKS:
                sock.close()
                continue
            sock.setblocking(False)
            knock = Knock(sock)
            self.knocks.append(knock)
            self._selector.register(sock, selectors.EVENT_READ, knock)

    def _knock(self, knock: Knock) -> None:
        """Read the token, and nothing past it; a connection without it is closed unread."""
        token = self.channel.token.encode("ascii")
        try:
            data = knock.sock.recv(len(token) - len(knock.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        knock.buf += data
        if data and len(knock.buf) < len(token):
            return
        self._selector.unregister(knock.sock)
        self.knocks.remove(knock)
        if not hmac.compare_digest(knock.buf, token):
            knock.sock.close()
            self.notes.append("A connection that did not give this cell's token was refused (nothing it sent was read).")
            return
        stream = ChildStream(knock.sock, self.children, self.own_recorder.origin_ns)
        self.children += 1
        self.streams.append(stream)
        self._selector.register(knock.sock, selectors.EVENT_READ, stream)
        super()._read(stream)

    def describe(self, stream: ranks.Stream) -> str:
        """A child by its command and pid, as notes name it."""
        if isinstance(stream, ChildStream):
            return f"`{stream.command}` (pid {stream.pid})"
        return super().describe(stream)

    def live(self, window: int) -> ranks.LiveRanks | None:
        """The per-process chart for several processes (ranks: with the one that holds the others
        back); one process gets the usual chart of its steps."""
        children = [s for s in self.streams if isinstance(s, ChildStream)]
        if len(children) < len(self.streams):
            return super().live(window)  # ranks forked from the cell
        stepped = [s for s in children if s.recorder.n_steps]
        if len(stepped) < 2:
            return None
        found = super().live(window)
        if found is not None and not any(s.distributed for s in stepped):
            found["slowest"], found["cause"], found["score"] = None, None, None
            found["text"] = f"{len(stepped)} processes"
        return found

    def adopt_into(self, run: Recording, drain_s: float) -> None:
        """Put what the children sent into the run: their steps where they trained, else notes."""
        adopt_children(run, self, drain_s)

    def forget_in_child(self) -> None:
        """In a process forked from the kernel: close the kernel's sockets without touching the
        kernel's collector."""
        super().forget_in_child()
        for sock in [self.channel.listener] + [k.sock for k in self.knocks]:
            try:
                sock.close()
            except OSError:
                pass

    def stop(self, drain_s: float) -> None:
        """Stop reading (after `drain_s` for the last frames) and close the pending connections."""
        super().stop(drain_s)
        for knock in self.knocks:
            knock.sock.close()
        self.knocks.clear()


# -- what the children sent becomes the run's -----------------------------------------------------------
def adopt_children(run: Recording, collector: ChildCollector, drain_s: float) -> None:
    """See the module docstring."""
    children = [s for s in collector.streams if isinstance(s, ChildStream)]
    if len(children) < len(collector.streams):  # ranks forked from the cell: theirs is the run
        ranks.adopt(run, collector, drain_s)
        run.processes = [s.record() for s in children] or None
        return
    collector.stop(drain_s)
    run.notes.extend(collector.notes)
    if not children:
        return
    run.processes = [s.record() for s in children]
    for stream in children:
        line = no_step_line(collector.describe(stream), stream)
        if line is not None:
            run.notes.append(line)
    trained = [s for s in children if s.recorder.n_steps]
    if not trained:
        return
    if collector.own_recorder.n_steps:  # the live chart may have shown a child's meanwhile
        run.recorder = collector.own_recorder
        for stream in trained:
            run.notes.append(f"{collector.describe(stream)}, a child process, trained too ({steps(stream)}); its steps are not shown.")
        run.notes.append("The steps shown are the kernel's own.")
        return
    job = sorted((s for s in trained if s.distributed), key=lambda s: s.label)
    gathered = next((g for g in (job_ranks(s) for s in job) if g), None)  # a job over several nodes
    if len(job) >= 2 or gathered:
        run.ranks = job_rows = gathered or ranks.rank_summaries(list(job), run.warmup)
        if gathered:
            run.notes.append(f"Every node's ranks were gathered over the process group at its end ({len(job)} of {len(gathered)} run on this node).")
        found = compare_ranks(job_rows)
        late = next((s for s in job if holds_back(found) and s.label == found["rank"]), None)  # type: ignore[index]
        main = late or job[0]
        whose = f"rank {main.label}'s" + (" (the rank that holds the others back)" if late else "")
        run.notes.append(f"The steps shown are {whose}, `{main.command}`; every rank is in the per-rank table.")
    else:
        main = max(trained, key=lambda s: s.recorder.n_steps)
        run.notes.append(f"The steps are those of {collector.describe(main)}, a child process.")
    for stream in trained:
        if stream is not main and stream not in job:
            run.notes.append(f"{collector.describe(stream)} trained too ({steps(stream)}); its steps are not shown.")
    become(run, main, ranked=bool(run.ranks))


def job_ranks(stream: ChildStream) -> list[RankRow] | None:
    """Every rank's summary of a job over several nodes, as one of its ranks gathered them."""
    found = stream.result.ranks if stream.result is not None else None
    return [r.copy() for r in found] if found is not None and len(found) >= 2 else None


def steps(stream: ranks.Stream) -> str:
    """"1 step" or "N steps": the steps a stream sent."""
    n = stream.recorder.n_steps
    return f"{n} step" + ("" if n == 1 else "s")


def become(run: Recording, stream: ChildStream, ranked: bool) -> None:
    """The run shows `stream`'s steps, with what its END said (its result, read by the codec):
    what a step was, the batches, the loader and where it was built, the passes kept out, the
    child's CPU and memory, its notes, and how it ended."""
    run.recorder = stream.recorder
    ranks.shows_parts_of(run, stream)
    child = stream.result
    if child is not None:
        shows_result(run, child, ranked)
    if stream.end is not None and stream.end.get("note"):
        run.notes.append(f"`{stream.command}`: {stream.end.get('note')}")
    if stream.status != "finished" and run.error is None:
        run.error = ended_how(stream)


def shows_result(run: Recording, child: RunResult, ranked: bool) -> None:
    """What the run shows of a child's result besides its steps (the steps came in STEPS
    frames): its loop when --loop named one, what a step was, its batches, loader, data sources
    and passes, where the loader was built, the child's own CPU and memory (not the kernel's),
    and its notes."""
    steps, data, used = child.steps, child.data, child.resources
    if child.loop.line is not None and child.loop.where is not None:  # --loop FILE:LINE
        run.loop_line, run.loop_where = child.loop.line, child.loop.where
    run.step_kind = steps.kind
    run.step_definition = steps.definition + (", on each rank" if ranked else "")
    run.batch_size, run.batches_per_step, run.batch_kind = steps.batch_size, steps.batches_per_step, steps.batch_kind
    run.loader_info = cast("LoaderFacts", dict(data.loader)) if data.loader is not None else None
    run.expected_steps = plain_count((run.loader_info or {}).get("len"))
    run.sources = [s.copy() for s in data.sources]
    run.phases = [p.copy() for p in data.phases]
    run.loader_site = cast("CodeSite", dict(data.loader_site)) if data.loader_site is not None else None
    run.dataset_site = cast("CodeSite", dict(data.dataset_site)) if data.dataset_site is not None else None
    run.loader_inside = data.inside  # (docs/loader-inside.md)
    run.host = cast("HostFacts", dict(used.host)) if used.host is not None else None
    run.gpu_memory = cast("GpuMemoryFacts", dict(used.gpu_memory)) if used.gpu_memory is not None else None
    run.oom = cast("OomFacts", dict(used.oom)) if used.oom is not None else None
    run.held_before = None  # the kernel's earlier cells hold nothing of the child's GPU
    run.notes.extend(child.notes)


def ended_how(stream: ChildStream) -> str:
    """"`python train.py` failed (exit status 1): ValueError: corrupt sample 7"."""
    end = stream.end or {}
    if stream.status == "stopped":
        return f"`{stream.command}` ended without saying how (killed, or os._exit)"
    if stream.status == "running":
        return f"`{stream.command}` was still running"
    status = stream.exit_status
    error = end.get("error")
    how = f"`{stream.command}` failed" + (f" (exit status {status})" if status is not None else "")
    return how + (f": {error}" if error and error != f"exit status {status}" else "")


def no_step_line(who: str, stream: ChildStream) -> str | None:
    """Why a child that connected ran no step (None when it did)."""
    if stream.recorder.n_steps:
        return None
    if stream.note:
        return f"{who} trains but was not traced: {stream.note}"
    if stream.status in ("failed", "stopped"):
        return f"{ended_how(stream)}, before its first step."
    return f"{who} used torch's training API but ran no step (it ended before its first step)."


# -- the cell --------------------------------------------------------------------------------------------
def script_loop(value: Any) -> str | None:
    """`--loop FILE:LINE` for a loop in a script the cell (or the command) runs, as
    "ABSOLUTE_PATH:LINE"; None when `value` is a loop of the cell (LINE, FUNCTION:LINE).
    ValueError when the file is not there."""
    if value is None:
        return None
    text = str(value)
    name, _, line = text.rpartition(":")
    if not name or not line.strip().isdigit() or not (name.endswith(".py") or "/" in name or os.sep in name):
        return None
    path = os.path.abspath(os.path.expanduser(name))
    if not os.path.isfile(path):
        raise ValueError(f"--loop {text}: there is no file {name}")
    return f"{path}:{int(line)}"


@contextmanager
def followed(run: Recording, tcp: bool = False, loop: str | None = None) -> Iterator[ChildCollector]:
    """For a traced cell: the channel open and in the environment while it runs; its children's
    streams go to the run's collector (the forked ranks' too). After it, nothing is left:
    the environment as before, no socket, no file, no thread."""
    channel = Channel(tcp, loop)
    collector: ChildCollector | None = None
    try:
        collector = ChildCollector(run, channel)
        run.rank_collector = collector
        ranks.running.append(collector)
        collector.start()
        with child_environment(channel):
            yield collector
    finally:
        if collector is not None:
            collector.stop(0.0)  # adopted already (ranks.capture_ended); else nothing to wait for
            if collector in ranks.running:
                ranks.running.remove(collector)
        channel.close()


# Calls a cell starts processes with: IPython's `!cmd` (get_ipython().system), subprocess, os.
STARTERS = {"system", "getoutput", "run", "Popen", "call", "check_call", "check_output", "spawnv", "spawnl", "execv"}


def started_commands(tree: ast.AST) -> list[str]:
    """The commands a cell's code starts (`!ls -la` is `get_ipython().system('ls -la')`), as
    written, for the line that says none of them trained."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in STARTERS:
            continue
        arg = node.args[0]
        text = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ast.unparse(arg)
        found.append(text if len(text) <= 60 else text[:57] + "...")
    return found


def no_training_line(run: RunResult, commands: list[str], started_by: str = "this cell") -> str | None:
    """The one line for a cell (or a command: `started_by`) whose processes ran no step (None
    when it started none)."""
    processes = run.processes or ()
    if not processes and not commands:
        return None
    reasons = [str(n) for n in run.notes if " before its first step" in n or "was not traced" in n or "ran no step" in n]
    if reasons:
        return "traceml: no step ran: " + " ".join(reasons)
    started = ", ".join(f"`{c}`" for c in commands[:3])
    return (
        f"traceml: no step ran: no process {started_by} started ({started}) trained. A child process is "
        "traced when it is Python and trains with torch (a DataLoader, backward(), an optimizer step)."
    )
