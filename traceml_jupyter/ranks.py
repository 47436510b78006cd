"""Several processes over torch.distributed: every rank records its own steps; ranks forked from a
traced cell stream them to the kernel, `torchrun` ranks gather their summaries at the end.

Forked ranks (a notebook launcher: torch.multiprocessing.start_processes(..., start_method=
"fork"), multiprocessing fork processes, accelerate.notebook_launcher): each fork from the thread
a capture records on gets a socket pair, made just before it (os.register_at_fork). The child
inherits the capture, so its training goes through the same step model; at the run's ticks (at
most 4 a second, at step boundaries) it sends the steps closed since the last tick, and never
waits for the kernel (non-blocking sends: what the socket cannot take now goes at the next tick).
At its exit it sends its end (how its process function ended, its loader): a
multiprocessing.util.Finalize, since multiprocessing children leave through os._exit and skip
atexit. In the kernel one thread (traceml-ranks) reads every child, keeps each rank's steps in a
Recorder and refreshes the run's views; when the capture ends it takes what is left (waiting a
few seconds at most for ranks still sending), closes every socket and is joined.

torchrun: nothing on the per-step path; at the end of `trace()` one all_gather of a fixed vector
of numbers per rank over the process group already there (CPU tensors on gloo, tensors on the
rank's CUDA device on NCCL).

Both time backward() per step: data-parallel ranks wait for each other there, which is what the
rank verdict (rank_verdict.py) reads.
"""

from __future__ import annotations

import contextvars
import json
import multiprocessing
import multiprocessing.util
import os
import selectors
import socket
import sys
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from time import monotonic, perf_counter_ns
from typing import TYPE_CHECKING, Any

import numpy as np

from .analysis.rank_verdict import RANK_NUMBERS, backward_median, compare_ranks, rank_summary
from .analysis.summary import summarize
from .analysis.verdict import WARN_SHARE
from .capture import hooks
from .capture.patches import patched
from .capture.probes import attribute, plain_count, safe_len, type_name
from .capture.recorder import Recorder
from .capture.recording import Capture, capturing
from .capture.step_model import BACKWARD
from .processes.startup_hook import KIND, LENGTH, pack

if TYPE_CHECKING:
    from .run import Run

PART_ROWS = ("forward_ms", "optimizer_ms", "rest_ms")  # the parts of sampled steps (NaN elsewhere)
ROWS = ("step", "time_s", "data_wait_ms", "compute_ms", "step_ms", "backward_ms", *PART_ROWS)
HELLO, STEPS, END = 1, 2, 3  # frames: startup_hook.pack (length, kind, JSON header, rows)
MAX_FRAME = 4 << 20  # bytes: a longer frame is not read (a rank sends its steps in chunks)
STEPS_PER_FRAME = (MAX_FRAME - 65536) // (8 * len(ROWS))
DRAIN_S = 3.0  # how long the end of a cell waits for ranks that are still sending steps
FINAL_SEND_S = 2.0  # how long a rank's exit waits for the kernel to take its last frames
MAX_QUEUED = 16 << 20  # bytes a rank keeps for a kernel that stopped reading; past it, it stops
RECV_BYTES = 1 << 16
# Forks that start no rank: DataLoader workers and subprocesses (their stacks pass here).
HELPERS = (
    f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}",
    f"{os.sep}subprocess.py",
    f"{os.sep}pty.py",  # IPython's `!cmd` forks a pseudo-terminal (pexpect) to run the command
    f"{os.sep}ptyprocess{os.sep}",
)
INTEGERS = {"rank", "pid", "n_steps", "n_analysed", "warmup_steps", "num_workers", "batch_size"}
DATAPARALLEL_NOTE = (
    "nn.DataParallel drives every GPU from this one process (one Python thread; the model is "
    "copied to each GPU every step), so it is timed as one process. DistributedDataParallel, one "
    "process per GPU, is faster: start it with torchrun, or from a notebook with "
    'torch.multiprocessing.start_processes(fn, nprocs=N, start_method="fork"); traceml then times '
    "each rank and names the one that holds the others back."
)


# -- frames ------------------------------------------------------------------------------------
def frame(kind: int, meta: Mapping[str, Any], rows: np.ndarray | None = None) -> bytes:
    """One message: HELLO, STEPS (meta + ROWS as float64 columns) or END."""
    body = b"" if rows is None else np.ascontiguousarray(rows, dtype="<f8").tobytes()
    return pack(kind, meta, body)


def read_frames(buf: bytearray) -> list[tuple[int, dict[str, Any], np.ndarray | None]]:
    """The complete frames at the start of `buf` (removed from it); a partial one stays. What
    arrives is data: JSON and float64 numbers, never code. ValueError on a frame that is not one
    (too long, a header that is not a JSON object, rows that are not ROWS columns)."""
    out = []
    pos = 0
    while len(buf) - pos >= LENGTH.size:
        (length,) = LENGTH.unpack_from(buf, pos)
        if not KIND.size <= length <= MAX_FRAME:
            raise ValueError(f"a frame of {length} bytes (at most {MAX_FRAME})")
        end = pos + LENGTH.size + length
        if len(buf) < end:
            break
        kind, n_head = KIND.unpack_from(buf, pos + LENGTH.size)
        start = pos + LENGTH.size + KIND.size
        if n_head > end - start:
            raise ValueError("a frame whose header is longer than the frame")
        meta = json.loads(bytes(buf[start : start + n_head]))
        if not isinstance(meta, dict):
            raise ValueError("a frame whose header is not a JSON object")
        raw = bytes(buf[start + n_head : end])
        if len(raw) % (8 * len(ROWS)):
            raise ValueError(f"a frame of {len(raw)} bytes of numbers: not {len(ROWS)} columns")
        rows = np.frombuffer(raw, dtype="<f8").reshape(len(ROWS), -1) if raw else None
        out.append((int(kind), meta, rows))
        pos = end
    del buf[:pos]
    return out


# -- backward() per step ---------------------------------------------------------------------
class BackwardTimer:
    """Start and duration (ns) of every backward() call, handed out per step at the ticks."""

    def __init__(self) -> None:
        self.starts: array[int] = array("q")
        self.durations: array[int] = array("q")

    def wrap(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        add_start, add_duration, clock = self.starts.append, self.durations.append, perf_counter_ns

        def backward(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
            t0 = clock()
            out = inner(*args, **kwargs)
            add_duration(clock() - t0)
            add_start(t0)
            return out

        backward.__doc__ = inner.__doc__
        backward.__wrapped__ = inner  # type: ignore[attr-defined]
        return backward

    def per_step(self, bounds: np.ndarray) -> np.ndarray:
        """Time in backward() (ms) of each step [bounds[i], bounds[i+1]), a call counting for the
        step it started in; NaN for a step without one. Calls that started before bounds[-1]
        are handed out and forgotten, later ones kept for the next steps."""
        n_steps = len(bounds) - 1
        out = np.full(max(0, n_steps), np.nan)
        n = min(len(self.starts), len(self.durations))
        if n == 0 or n_steps <= 0:
            return out
        starts = np.frombuffer(self.starts[:n], dtype=np.int64).copy()
        durations = np.frombuffer(self.durations[:n], dtype=np.int64).astype(np.float64)
        index = np.searchsorted(bounds, starts, side="right") - 1
        done = starts < bounds[-1]
        mine = done & (index >= 0)
        if mine.any():
            sums = np.bincount(index[mine], weights=durations[mine], minlength=n_steps)[:n_steps]
            counts = np.bincount(index[mine], minlength=n_steps)[:n_steps]
            out = np.where(counts > 0, sums / 1e6, np.nan)
        kept = ~done
        self.starts[:n] = array("q", starts[kept].tolist())
        self.durations[:n] = array("q", durations[kept].astype(np.int64).tolist())
        return out


class StepSample:
    """Values by step index, bounded: every step up to CAP, then one step in `stride` (doubled
    when full), so medians come from a uniform sample of a run of any length."""

    CAP = 1 << 17

    def __init__(self) -> None:
        self.steps = np.empty(0, dtype=np.int64)
        self.values = np.empty(0)
        self.stride = 1

    def add(self, steps: np.ndarray, values: np.ndarray) -> None:
        steps = np.asarray(steps).astype(np.int64)
        keep = steps % self.stride == 0
        self.steps = np.concatenate([self.steps, steps[keep]])
        self.values = np.concatenate([self.values, np.asarray(values, dtype=np.float64)[keep]])
        while len(self.steps) > self.CAP:
            self.stride *= 2
            keep = self.steps % self.stride == 0
            self.steps, self.values = self.steps[keep], self.values[keep]

    def drop_from(self, first: int) -> None:
        keep = self.steps < first
        self.steps, self.values = self.steps[keep], self.values[keep]

    def median(self, first_step: int) -> float | None:
        return backward_median(self.steps, self.values, first_step)


class RankParts:
    """A forked rank's parts of its sampled steps as they arrive (forward, optimizer, the rest;
    its backward is the backward() timer's), and what the run shows of them once the run shows
    this rank's steps: columns like the capture's own (step_parts.py) and its facts."""

    def __init__(self) -> None:
        self.samples = {name: StepSample() for name in PART_ROWS}
        self.backward = StepSample()
        self.facts_seen: dict[str, Any] = {}

    def add(self, rows: np.ndarray) -> None:
        sampled = np.isfinite(rows[ROWS.index("forward_ms")]) | np.isfinite(rows[ROWS.index("optimizer_ms")])
        for name in PART_ROWS:
            self.samples[name].add(rows[0][sampled], rows[ROWS.index(name)][sampled])
        self.backward.add(rows[0][sampled], rows[5][sampled])

    def drop_from(self, first: int) -> None:
        for sample in (*self.samples.values(), self.backward):
            sample.drop_from(first)

    def medians(self, first_step: int) -> dict[str, float | None]:
        return {name: sample.median(first_step) for name, sample in self.samples.items()}

    def columns(self, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        steps = np.asarray(cols["step"], dtype=np.int64)
        out: dict[str, np.ndarray] = {}
        for name, sample in (*self.samples.items(), ("backward_ms", self.backward)):
            column = np.full(len(steps), np.nan)
            if len(sample.steps):
                idx = np.clip(np.searchsorted(sample.steps, steps), 0, len(sample.steps) - 1)
                hit = sample.steps[idx] == steps
                column[hit] = sample.values[idx[hit]]
            out[name] = column
        return out

    def facts(self) -> dict[str, Any]:
        return dict(self.facts_seen)


def shows_parts_of(run: Run, stream: Stream) -> None:
    """The run shows `stream`'s steps: their parts too, the facts its END said of them, and
    where its passes over the training loader began (each epoch's start-up)."""
    end = stream.end or {}
    stream.parts.facts_seen = dict(end.get("parts") or {})
    run.step_parts = stream.parts
    run.pass_starts = [k for k in end.get("pass_steps") or [] if plain_count(k) is not None]


class StepTap:
    """At the run's ticks: the steps closed since the last tick, as ROWS, with their time in
    backward(). When backward() itself ends the steps (no optimizer step seen), the newest step
    waits for the next tick: the call that closed it returns after the tick."""

    def __init__(self, capture: Capture, timer: BackwardTimer | None) -> None:
        self.capture, self.timer = capture, timer
        self.recorder: Recorder = capture.model.recorder  # the one this process's steps go to
        self.base = self.recorder.n_steps  # steps recorded before (a rank counts from 0)
        self.sent = self.base

    def follow_merges(self, model: Any) -> Callable[[], None]:
        """Steps closed on a weaker kind of event are merged once a stronger one shows (the
        step model's on_merge): those already handed out go again. Returns the undo."""
        previous = model.on_merge

        def merged(n: int) -> None:
            self.sent = min(self.sent, self.recorder.n_steps)
            if previous is not None:
                previous(n)

        model.on_merge = merged

        def undo() -> None:
            model.on_merge = previous

        return undo

    def take(self, final: bool = False) -> np.ndarray | None:
        rec = self.recorder
        n = rec.n_steps
        self.sent = min(self.sent, n)
        upto = n if final or self.capture.model.level != BACKWARD else n - 1
        if upto <= self.sent:
            return None
        cols = rec.tail(n - self.sent)
        step = cols["step"]
        sel = (step >= self.sent) & (step < upto)
        if not sel.any():
            self.sent = upto
            return None
        starts = (rec.origin_ns or 0) + np.rint(cols["time_s"] * 1e9).astype(np.int64)
        held = step == upto
        if held.any():  # the held-back step starts where the last handed-out one ends
            end = int(starts[held][0])
        else:
            model_start = getattr(self.capture.model, "start", None)
            last = int(starts[sel][-1] + cols["step_ms"][sel][-1] * 1e6)
            end = max(last, int(model_start)) + 1 if model_start is not None else last + 1
        bounds = np.append(starts[sel], end)
        backward = self.timer.per_step(bounds) if self.timer is not None else np.full(int(sel.sum()), np.nan)
        self.sent = upto
        parts = self.parts_of(cols)
        return np.vstack(
            [
                (step[sel] - self.base).astype(np.float64),
                cols["time_s"][sel],
                cols["data_wait_ms"][sel],
                cols["compute_ms"][sel],
                cols["step_ms"][sel],
                backward,
                *(parts[name][sel] for name in PART_ROWS),
            ]
        )

    def parts_of(self, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The parts of these steps (step_parts.py), NaN where not sampled or not measured."""
        parts = getattr(self.capture, "parts", None)
        if parts is not None:
            try:
                return parts.columns(cols)  # type: ignore[no-any-return]
            except Exception:
                pass
        return {name: np.full(len(cols["step"]), np.nan) for name in PART_ROWS}


# -- who this process is ------------------------------------------------------------------------
def dist_rank() -> tuple[int | None, int | None]:
    """(rank, world size) from an initialised process group, else from RANK / WORLD_SIZE."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:
        pass
    return env_count("RANK"), env_count("WORLD_SIZE")


def env_count(name: str) -> int | None:
    """A count from the environment (torchrun sets RANK, WORLD_SIZE as decimal strings)."""
    text = os.environ.get(name, "").strip()
    return plain_count(int(text)) if text.isdecimal() else None


def distributed_env() -> bool:
    """This process is one rank of several (torchrun, or a process group already set up)."""
    rank, world = dist_rank()
    return world is not None and world > 1


def describe_error(exc: BaseException | None) -> str | None:
    if exc is None:
        return None
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1]}" if text else type(exc).__name__


def loader_facts(info: Mapping[str, Any] | None, loader: Any) -> dict[str, Any] | None:
    """What the per-rank table compares of a rank's training loader: workers, batch size,
    sampler (and its shard for a DistributedSampler), samples."""
    if info is None and loader is None:
        return None
    info = info or {}
    sampler = attribute(loader, "sampler") if loader is not None else None
    name = type_name(sampler) if sampler is not None else None
    replicas, rank = attribute(sampler, "num_replicas"), attribute(sampler, "rank")
    if name and plain_count(replicas) is not None and plain_count(rank) is not None:
        name += f" (shard {rank} of {replicas})"
    return {
        "num_workers": info.get("num_workers"),
        "batch_size": info.get("batch_size"),
        "sampler": name,
        "samples": safe_len(sampler) if sampler is not None else info.get("n_samples"),
    }


# -- the rank's side of a fork ------------------------------------------------------------------
class Sender:
    """A forked rank's end of its channel: its steps at the ticks, its end at exit. Training
    never waits for the kernel: sends are non-blocking, and what the socket cannot take now is
    sent at a later tick."""

    def __init__(self, sock: socket.socket, tap: StepTap, run: Run, index: int) -> None:
        self.pid = os.getpid()
        self.sock = sock
        self.tap = tap
        self.run = run
        self.index = index
        self.queue: deque[bytes] = deque()
        self.offset = 0  # bytes of the first queued frame already sent
        self.queued = 0
        self.closed = False
        self.ended = False
        self.error: str | None = None
        self.told: dict[str, Any] = {}
        sock.setblocking(False)

    def hello(self) -> None:
        self._put(frame(HELLO, {"pid": self.pid, "index": self.index}))
        self._push()

    def __call__(self, run: Run) -> None:
        """The run's observer in the rank (at most 4 times a second, at a step boundary)."""
        if os.getpid() != self.pid or self.closed:
            return
        rows = self.tap.take()
        who = self._who()
        if rows is not None or who != self.told:  # its rank is known as soon as it is set
            self.told = who
            self._put_steps(who, rows)
        self._push()

    def finish(self) -> None:
        """At the rank's exit: the last steps and its end, waiting FINAL_SEND_S at most."""
        if self.ended or os.getpid() != self.pid:
            return
        self.ended = True
        try:
            if not self.closed:
                rows = self.tap.take(final=True)
                if rows is not None:
                    self._put_steps(self._who(), rows)
                self._put(frame(END, self._end()))
                self._push(deadline=monotonic() + FINAL_SEND_S)
        except Exception:
            pass
        finally:
            self._close()

    def forget_in_child(self) -> None:
        """In a process forked by the rank (its DataLoader workers): let go of the rank's socket."""
        self.closed = self.ended = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _who(self) -> dict[str, Any]:
        rank, world = dist_rank()
        return {"rank": rank, "world": world}

    def _end(self) -> dict[str, Any]:
        from .analysis.phases import step_definition
        from .capture.sources import describe_run_sources

        end: dict[str, Any] = {**self._who(), "pid": self.pid, "error": self.error}
        try:
            facts = describe_run_sources(self.run, self.tap.capture)
            loader = facts.loader_ref() if facts.loader_ref is not None else None
            end.update(
                step_kind=facts.step_kind,
                step_definition=step_definition(
                    facts.step_kind, facts.optimizer, facts.batches_per_step, self.run.loop_line, self.run.loop_where
                ),
                batch_size=facts.batch_size,
                batches_per_step=facts.batches_per_step,
                loader_info=facts.loader_info,
                loader=loader_facts(facts.loader_info, loader),
                parts=self.tap.capture.parts.facts(),
                pass_steps=list(facts.pass_steps),
            )
        except Exception as exc:
            end["note"] = f"its loader could not be read: {type(exc).__name__}: {exc}"
        return end

    def _put_steps(self, who: dict[str, Any], rows: np.ndarray | None) -> None:
        """STEPS frames, each under MAX_FRAME (a fast loop closes many steps between ticks)."""
        if rows is None or rows.shape[1] <= STEPS_PER_FRAME:
            self._put(frame(STEPS, who, rows))
            return
        for first in range(0, rows.shape[1], STEPS_PER_FRAME):
            self._put(frame(STEPS, who, rows[:, first : first + STEPS_PER_FRAME]))

    def _put(self, data: bytes) -> None:
        self.queue.append(data)
        self.queued += len(data)
        if self.queued > MAX_QUEUED:  # the kernel stopped reading: stop rather than grow
            self._close()

    def _push(self, deadline: float | None = None) -> None:
        while self.queue and not self.closed:
            head = self.queue[0]
            try:
                if deadline is not None:
                    left = deadline - monotonic()
                    if left <= 0:
                        return
                    self.sock.settimeout(left)
                sent = self.sock.send(memoryview(head)[self.offset :])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # the kernel closed its end (the cell is over), or timed out
                self._close()
                return
            self.offset += sent
            if self.offset == len(head):
                self.queue.popleft()
                self.queued -= len(head)
                self.offset = 0

    def _close(self) -> None:
        self.closed = True
        self.queue.clear()
        try:
            self.sock.close()
        except OSError:
            pass


# -- the kernel's side ------------------------------------------------------------------------------
class Stream:
    """One forked process as the kernel sees it: its steps (a Recorder of their own) and its end."""

    def __init__(self, sock: socket.socket, index: int, origin_ns: int | None) -> None:
        self.sock = sock
        self.index = index  # order of the fork (the label while no rank is known)
        self.buf = bytearray()
        self.pid: int | None = None
        self.rank: int | None = None
        self.world: int | None = None
        self.recorder = Recorder()
        self.recorder.origin_ns = origin_ns
        self.backward = StepSample()
        self.parts = RankParts()
        self.end: dict[str, Any] | None = None
        self.eof = False

    @property
    def label(self) -> int:
        return self.rank if self.rank is not None else self.index

    @property
    def status(self) -> str:
        if self.end is not None:
            return "failed" if self.end.get("error") else "finished"
        return "stopped" if self.eof else "running"

    @property
    def is_rank(self) -> bool:
        """It trained (or named its rank, or failed): not a helper process that never stepped."""
        return bool(self.recorder.n_steps or self.rank is not None or (self.end or {}).get("error"))

    @property
    def done(self) -> bool:
        """Nothing more to wait for: it ended, or never stepped (a helper may live on)."""
        return self.eof or self.end is not None or not self.recorder.n_steps

    def apply(self, kind: int, meta: Mapping[str, Any], rows: np.ndarray | None) -> None:
        if meta.get("rank") is not None:
            self.rank, self.world = int(meta["rank"]), meta.get("world")
        if kind == HELLO:
            self.pid = plain_count(meta.get("pid"))
            origin = meta.get("origin_ns")  # a child started apart has a time 0 of its own
            if isinstance(origin, int) and not self.recorder.n_steps:
                self.recorder.origin_ns = origin
        elif kind == STEPS and rows is not None:
            self._add(rows)
        elif kind == END:
            self.end = dict(meta)
            self.pid = plain_count(meta.get("pid")) or self.pid

    def _add(self, rows: np.ndarray) -> None:
        rec = self.recorder
        first = int(rows[0, 0])
        if first < rec.n_steps:  # merged steps, sent again
            rec.pop_tail(rec.n_steps - first)
            self.backward.drop_from(first)
            self.parts.drop_from(first)
        t0 = (rec.origin_ns or 0) + np.rint(rows[1] * 1e9).astype(np.int64)
        t1 = t0 + np.rint(rows[2] * 1e6).astype(np.int64)
        t2 = t0 + np.rint(rows[4] * 1e6).astype(np.int64)
        add = rec.add
        for a, b, c in zip(t0.tolist(), t1.tolist(), t2.tolist(), strict=True):
            add(a, b, c)
        self.backward.add(rows[0], rows[5])
        self.parts.add(rows)

    def summary(self, warmup: int | None) -> dict[str, Any]:
        rec = self.recorder
        s = summarize(rec.columns(), rec.n_steps, warmup, False, rec.totals())
        end = self.end or {}
        first = int(s["warmup_steps"])
        return rank_summary(
            self.label,
            s,
            self.backward.median(first),
            pid=self.pid,
            status=self.status,
            error=end.get("error"),
            loader=end.get("loader"),
            **self.parts.medians(first),
        )

    def window(self, n: int) -> dict[str, Any]:
        """The last n steps: the chart's series and the numbers that compare ranks live."""
        tail = self.recorder.tail(n)
        steps = tail["step"]
        backward = self.backward.values[self.backward.steps >= (steps[0] if len(steps) else 0)]
        backward = backward[np.isfinite(backward)]

        def med(values: np.ndarray) -> float | None:
            return float(np.median(values)) if len(values) else None

        return {
            "rank": self.label,
            "step": steps + 1,
            "step_ms": tail["step_ms"],
            "data_wait_ms": tail["data_wait_ms"],
            "n_steps": self.recorder.n_steps,
            "n_analysed": len(steps),
            "data_wait_ms_median": med(tail["data_wait_ms"]),
            "summary": {
                "rank": self.label,
                "n_steps": self.recorder.n_steps,
                "n_analysed": len(steps),
                "data_wait_ms": med(tail["data_wait_ms"]),
                "compute_ms": med(tail["compute_ms"]),
                "step_ms": med(tail["step_ms"]),
                "backward_ms": med(backward),
                **self.parts.medians(int(steps[0]) if len(steps) else 0),
            },
        }


class Collector:
    """The kernel's side of the forked ranks: one thread (traceml-ranks) reads them all, keeps
    their steps and refreshes the run's views; `stop()` takes the rest, closes, joins."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.pid = os.getpid()
        self.own_recorder = run.recorder  # the kernel's own steps (it may train too)
        self.streams: list[Stream] = []
        self.forks = 0
        self.notes: list[str] = []
        self.stopped = False
        self._new: list[tuple[socket.socket, int]] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stop_at: float | None = None
        self._changed = False
        # The cell's context: what the views display from this thread goes to the cell's output.
        context = contextvars.copy_context()
        self.thread = threading.Thread(target=context.run, args=(self._loop,), name="traceml-ranks", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def add(self, sock: socket.socket, index: int) -> None:
        """A forked child's socket (from the forking thread, right after the fork)."""
        sock.setblocking(False)
        with self._lock:
            self._new.append((sock, index))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _take_new(self) -> None:
        with self._lock:
            new, self._new = self._new, []
        for sock, index in new:
            stream = Stream(sock, index, self.own_recorder.origin_ns)
            self.streams.append(stream)
            self._selector.register(sock, selectors.EVENT_READ, stream)

    def _loop(self) -> None:
        try:
            while True:
                timeout = None if self._stop_at is None else max(0.0, self._stop_at - monotonic())
                events = self._selector.select(timeout)
                self._take_new()
                for key, _ in events:
                    if key.data is None:
                        self._drain_wake()
                    else:
                        self._read(key.data)
                if self._stop_at is not None and (
                    all(s.done for s in self.streams) or monotonic() >= self._stop_at
                ):
                    return
                if self._changed:
                    self._changed = False
                    self._refresh()
        except Exception as exc:  # never let the kernel's thread die silently
            self.notes.append(f"The ranks' steps stopped arriving: {type(exc).__name__}: {exc}")

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError, OSError):
            pass

    def _read(self, stream: Stream) -> None:
        while not stream.eof:
            try:
                data = stream.sock.recv(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                stream.eof = True
                try:
                    self._selector.unregister(stream.sock)
                except (KeyError, ValueError):
                    pass
                break
            stream.buf += data
        try:
            for kind, meta, rows in read_frames(stream.buf):
                stream.apply(kind, meta, rows)
                self._changed = self._changed or kind == STEPS
        except Exception as exc:  # dropped, with a note: nothing more is read from it
            stream.eof = True
            stream.buf.clear()
            try:
                self._selector.unregister(stream.sock)
            except (KeyError, ValueError):
                pass
            self.notes.append(f"{self.describe(stream)} sent what could not be read: {type(exc).__name__}: {exc}")

    def describe(self, stream: Stream) -> str:
        """A stream in the notes: "Process 4242 (rank 1)"."""
        return f"Process {stream.pid} (rank {stream.label})"

    def adopt_into(self, run: Run, drain_s: float) -> None:
        """The end of the cell: what the processes sent becomes the run's (see adopt)."""
        adopt(run, self, drain_s)

    def main_stream(self) -> Stream | None:
        """The rank whose steps the run shows: the lowest rank that stepped."""
        stepped = [s for s in self.streams if s.recorder.n_steps]
        return min(stepped, key=lambda s: s.label) if stepped else None

    def _refresh(self) -> None:
        """On this thread, while the kernel's own thread waits for the ranks: the run shows the
        lowest rank's steps, and its views refresh at the run's pace (never when the kernel
        trains too: then its own steps drive them, on its own thread)."""
        run = self.run
        if self.own_recorder.n_steps:
            return
        main = self.main_stream()
        if main is not None and run.recorder is not main.recorder:
            run.recorder = main.recorder
        now = perf_counter_ns()
        if now >= run._next_tick:
            run._tick(now)

    def live(self, window: int) -> dict[str, Any] | None:
        """For the live chart: each rank's last `window` steps, and the rank that holds the
        others back over them (None when balanced)."""
        streams = sorted((s for s in self.streams if s.recorder.n_steps), key=lambda s: s.label)
        if not streams:
            return None
        series = [s.window(window) for s in streams]
        if self.run.finished:
            found = self.run.straggler
            slowest = found["rank"] if found else None
            cause = found["cause"] if found else None
            score = found["score"] if found else None
        else:
            compared = compare_ranks([w["summary"] for w in series])
            on = compared is not None and compared["score"] >= WARN_SHARE
            slowest = compared["rank"] if compared is not None and on else None
            cause = compared["cause"] if compared is not None and on else None
            score = compared["score"] if compared is not None and on else None
        text = f"{len(series)} ranks"
        return {"series": series, "slowest": slowest, "cause": cause, "score": score, "text": text}

    def forget_in_child(self) -> None:
        """In a forked child: let go of the kernel's sockets (copies); the thread is not here."""
        for sock in [s.sock for s in self.streams] + [sock for sock, _ in self._new] + [self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass
        try:
            self._selector.close()
        except Exception:
            pass

    def stop(self, drain_s: float) -> None:
        """Wait (drain_s at most) for the ranks still sending, read what is left, close every
        socket and join the thread."""
        if self.stopped:
            return
        self.stopped = True
        self._stop_at = monotonic() + drain_s
        self._wake()
        self.thread.join(drain_s + 10.0)
        if self.thread.is_alive():
            self.notes.append("The ranks' reader did not stop in time; their last steps may be missing.")
        else:
            self._take_new()
            for stream in self.streams:
                self._read(stream)
        when = f"{drain_s:g} s after the cell ended" if drain_s else "when the cell was interrupted"
        for stream in self.streams:
            if not stream.done:
                self.notes.append(
                    f"{self.describe(stream)} was still running {when}; its later steps are not counted."
                )
        for sock in [s.sock for s in self.streams] + [self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass
        self._selector.close()
        if self in _collectors:
            _collectors.remove(self)


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
_collectors: list[Collector] = []  # the kernel's running collectors


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
    feed = run.rank_feed
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
    try:
        feed = run.rank_feed
        if not (isinstance(feed, Collector) and feed.pid == os.getpid() and not feed.stopped):
            feed = Collector(run)
            run.rank_feed = feed
            _collectors.append(feed)
            feed.start()
        feed.forks = pending.index + 1
        feed.add(pending.kernel_end, pending.index)
    except Exception as exc:
        pending.kernel_end.close()
        run.notes.append(f"A forked process could not be followed: {type(exc).__name__}: {exc}")


def _after_fork_child() -> None:
    global _pending, _child, _in_rank
    pending, _pending = _pending, None
    for collector in _collectors:
        collector.forget_in_child()
    _collectors.clear()
    if _child is not None:  # forked by a rank (its DataLoader workers): not a rank
        _child.forget_in_child()
        _child = None
    if pending is None:
        return
    _in_rank = True
    pending.kernel_end.close()
    try:
        _child = become_rank(pending)
    except Exception:
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
    run._observers[:] = [sender]  # the live chart is the kernel's
    run._next_tick = 0
    run.rank_feed = None
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


# -- the capture's hooks --------------------------------------------------------------------------
class LocalRank:
    """A torchrun rank's own backward() per step, for its summary at the end."""

    def __init__(self) -> None:
        self.backward = StepSample()

    def add(self, rows: np.ndarray) -> None:
        self.backward.drop_from(int(rows[0, 0]))  # merged steps come again
        self.backward.add(rows[0], rows[5])


@contextmanager
def watching(run: Run, capture: Capture) -> Iterator[None]:
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

    def at_tick(_run: Run) -> None:
        rows = tap.take()
        if rows is not None:
            local.add(rows)

    with patched(autograd, {"backward": timer.wrap(autograd.backward)}):
        run.rank_feed = local
        run.observe(at_tick)
        undo = tap.follow_merges(capture.model)
        try:
            yield
        finally:
            undo()
            if at_tick in run._observers:
                run._observers.remove(at_tick)
            rows = tap.take(final=True)
            if rows is not None:
                local.add(rows)


def capture_ended(run: Run, capture: Capture) -> None:
    """After a capture, in the process that made it: the forked ranks' summaries on the run
    (their last steps taken first), and the note for nn.DataParallel. Never raises."""
    feed = run.rank_feed
    # An interrupted cell (KeyboardInterrupt going up through the capture) does not wait for
    # ranks still running: the user asked to stop.
    interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
    try:
        if isinstance(feed, Collector) and feed.pid == os.getpid():
            feed.adopt_into(run, 0.0 if interrupted else DRAIN_S)
        dataparallel_note(run)
    except Exception as exc:
        run.notes.append(f"The ranks could not be summarised: {type(exc).__name__}: {exc}")
        if isinstance(feed, Collector):
            feed.stop(0.0)


def adopt(run: Run, collector: Collector, drain_s: float) -> None:
    """The forked ranks' summaries become the run's `ranks` (after waiting drain_s at most for
    ranks still sending); a kernel that did not train itself shows the steps of the rank that
    holds the others back, else of the lowest rank."""
    collector.stop(drain_s)
    run.notes.extend(collector.notes)
    ranks = sorted((s for s in collector.streams if s.is_rank), key=lambda s: s.label)
    if not ranks:
        run.recorder = collector.own_recorder
        return
    for stream in collector.streams:
        if not stream.is_rank:
            run.notes.append(f"Process {stream.pid} (forked from the cell) reported no step.")
    run.ranks = [s.summary(run.warmup) for s in ranks]
    if collector.own_recorder.n_steps:
        run.recorder = collector.own_recorder
        run.notes.append("The steps shown are the kernel's own; the ranks are in the per-rank table.")
        return
    # The run shows the steps of the rank that holds the others back, else of the lowest rank.
    found = compare_ranks(run.ranks)
    late = next((s for s in ranks if found and found["score"] >= WARN_SHARE and s.label == found["rank"]), None)
    main = late or collector.main_stream() or ranks[0]
    run.recorder = main.recorder
    end = main.end or {}
    shows_parts_of(run, main)
    if run.step_kind == "none" and end.get("step_kind"):
        run.step_kind = str(end["step_kind"])
        run.step_definition = f"{end.get('step_definition')}, on each rank"
    if run.batch_size is None and end.get("batch_size"):
        run.batch_size = plain_count(end.get("batch_size"))
        run.batches_per_step = end.get("batches_per_step")
    if run.loader_info is None:  # the checklist reads the loader of the rank that holds back
        info = (main.end or {}).get("loader_info")
        run.loader_info = dict(info) if isinstance(info, dict) else None
    whose = f"rank {main.label}'s" + (" (the rank that holds the others back)" if late else "")
    run.notes.append(f"The steps shown are {whose}; every rank is in the per-rank table.")


def dataparallel_note(run: Run) -> None:
    """nn.DataParallel in the user's namespace (IPython's, or a script's __main__): say it is
    one process, and what to use instead."""
    torch = sys.modules.get("torch")
    parallel = getattr(getattr(torch, "nn", None), "DataParallel", None)
    if parallel is None or not (run.recorder.n_steps or run.ranks):
        return
    from .views.environment import ipython_shell

    shell = ipython_shell()
    names = getattr(shell, "user_ns", None)
    if names is None:
        names = getattr(sys.modules.get("__main__"), "__dict__", {})
    for value in list(names.values()):
        try:
            found = isinstance(value, parallel)
        except Exception:
            found = False
        if found:
            if DATAPARALLEL_NOTE not in run.notes:
                run.notes.append(DATAPARALLEL_NOTE)
            return


# -- torchrun: the gather at the end of trace() ----------------------------------------------------
def encode(summary: Mapping[str, Any]) -> list[float]:
    """A rank's summary as a fixed vector of numbers (NaN: not measured) for all_gather."""
    values = []
    for key in RANK_NUMBERS:
        value = summary.get(key)
        values.append(float(value) if isinstance(value, (int, float)) and value is not None else float("nan"))
    values.append(1.0 if summary.get("clock") == "gpu" else 0.0)
    return values


def decode(values: Any) -> dict[str, Any]:
    numbers = [float(v) for v in values]
    out: dict[str, Any] = {}
    for key, value in zip(RANK_NUMBERS, numbers, strict=False):
        if value != value:
            out[key] = None
        else:
            out[key] = int(value) if key in INTEGERS else value
    out["clock"] = "gpu" if numbers[len(RANK_NUMBERS)] else "cpu"
    out.update(status="finished", error=None, loader=None)
    return out


def local_summary(run: Run, rank: int) -> dict[str, Any]:
    """This rank's summary (its own steps, before any other rank's is known)."""
    summary = run.summary
    feed = run.rank_feed
    backward = feed.backward.median(int(summary["warmup_steps"])) if isinstance(feed, LocalRank) else None
    loader = run.loader_ref() if run.loader_ref is not None else None
    return rank_summary(rank, summary, backward, pid=os.getpid(), loader=loader_facts(run.loader_info, loader))


def gather(run: Run, error: BaseException | None) -> None:
    """At the end of trace() on one rank of several: every rank's summary on every rank, in one
    all_gather over the existing process group. Not after an error (the others may never come
    to the collective)."""
    dist = sys.modules.get("torch.distributed")
    torch = sys.modules.get("torch")
    try:
        ready = bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:
        ready = False
    if not ready or torch is None or dist is None:
        if distributed_env():
            run.notes.append("The ranks were not gathered: no process group at the end of trace().")
        return
    try:
        world, rank = int(dist.get_world_size()), int(dist.get_rank())
        if world < 2:
            return
        if error is not None:
            run.notes.append(
                "The ranks were not gathered: this rank stopped with an error (a collective now "
                "could wait for ranks that never come)."
            )
            return
        mine = encode(local_summary(run, rank))
        device = torch.device("cpu")
        if str(dist.get_backend()) == "nccl" and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())
        tensor = torch.tensor(mine, dtype=torch.float64, device=device)
        out = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(out, tensor)
        run.ranks = [decode(t.cpu().tolist()) for t in out]
        found = compare_ranks(run.ranks)
        if found is not None and found["score"] >= WARN_SHARE and found["rank"] != rank:
            run.notes.append(
                f"The box shows the medians of rank {found['rank']} (the rank that holds the "
                f"others back); the steps and the evidence are this rank's (rank {rank})."
            )
    except Exception as exc:
        run.notes.append(f"The ranks were not gathered: {type(exc).__name__}: {exc}")


def shows_report(run: Run) -> bool:
    """Among several ranks only rank 0 prints the report (every rank has `run.ranks`)."""
    rank, world = dist_rank()
    return world is None or world < 2 or not rank


@contextmanager
def followed(run: Run, capture: Capture | None = None) -> Iterator[Capture]:
    """`capturing(run, capture)` followed across processes: ranks forked inside it stream their
    steps to this run (their summaries are on it once it ends), and on one rank of several
    (torchrun) its own backward() is timed for the summary gathered at the end."""
    capture = capture or Capture(run)
    with ExitStack() as stack:
        stack.callback(capture_ended, run, capture)  # after the capture closed; never raises
        stack.enter_context(capturing(run, capture))
        stack.enter_context(watching(run, capture))
        yield capture
