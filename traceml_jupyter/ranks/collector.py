"""The kernel's side of the forked ranks: one thread reads every rank's frames, keeps each
rank's steps and refreshes the run's views; at the cell's end the ranks' summaries become the
run's (adopt)."""

from __future__ import annotations

import contextvars
import os
import selectors
import socket
import threading
from collections.abc import Mapping
from time import monotonic, perf_counter_ns
from typing import TYPE_CHECKING, Any, TypedDict, cast

import numpy as np

from ..analysis.rank_evidence import paired_evidence
from ..analysis.rank_verdict import compare_ranks, holds_back, rank_summary
from ..analysis.summary import summarize
from ..analysis.summary_keys import RankRow
from ..capture.data.probes import plain_count
from ..capture.steps.recorder import Recorder
from ..failures import failure_text, never_raise
from ..result import RunResult
from .backward import RankParts, StepSample
from .wire import END, HELLO, STEPS, End, end_result, read_frames

if TYPE_CHECKING:
    from ..facts.loader import LoaderFacts
    from ..recording import Recording


DRAIN_S = 3.0  # how long the end of a cell waits for ranks that are still sending steps

RECV_BYTES = 1 << 16

class LiveRank(TypedDict, total=False):
    """A rank's medians over the live chart's window, as compare_ranks reads them (`paired`: its
    per-step evidence against the others, rank_evidence.py)."""

    rank: int
    n_steps: int
    n_analysed: int
    data_wait_ms: float | None
    compute_ms: float | None
    step_ms: float | None
    backward_ms: float | None
    forward_ms: float | None
    optimizer_ms: float | None
    rest_ms: float | None
    paired: Mapping[str, object]


class RankWindow(TypedDict):
    """A rank's last steps on the live chart: their series (steps from 1) and its medians."""

    rank: int
    step: np.ndarray
    step_ms: np.ndarray
    data_wait_ms: np.ndarray
    n_steps: int
    n_analysed: int
    data_wait_ms_median: float | None
    summary: LiveRank


class LiveRanks(TypedDict):
    """What the live chart draws of several processes: each one's window, and the rank that
    holds the others back over them (None: balanced, or processes of no job), cause, score."""

    series: list[RankWindow]
    slowest: int | None
    cause: str | None
    score: float | None
    text: str


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
        self.end: End | None = None
        self.result: RunResult | None = None  # what its END said it measured (the codec's)
        self.eof = False

    @property
    def label(self) -> int:
        """The rank, once known; else the fork's index."""
        return self.rank if self.rank is not None else self.index

    @property
    def status(self) -> str:
        """finished, failed (its end says an error), stopped (closed without an end) or running."""
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
        """One frame from the rank: who it is (HELLO), steps (STEPS), or its end (END)."""
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
            end = cast(End, dict(meta))  # JSON from the process: its result is checked by the codec
            self.result = end_result(end, f"the end of process {self.pid}")
            self.end = end
            self.pid = plain_count(end.get("pid")) or self.pid

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

    def summary(self, warmup: int | None) -> RankRow:
        """The rank's summary for the per-rank table (`warmup`: the run's)."""
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

    def per_step(self, n: int | None = None) -> dict[str, np.ndarray]:
        """Its steps (the last `n`, else all that the recorder keeps) as rank_evidence's COLUMNS:
        the time in backward() beside each step's wait, compute and step time."""
        cols = self.recorder.columns() if n is None else self.recorder.tail(n)
        steps = np.asarray(cols["step"], dtype=np.int64)
        sync = np.full(len(steps), np.nan)
        sample = self.backward
        if len(sample.steps) and len(steps):
            idx = np.clip(np.searchsorted(sample.steps, steps), 0, len(sample.steps) - 1)
            hit = sample.steps[idx] == steps
            sync[hit] = sample.values[idx[hit]]
        return {
            "step": steps,
            "sync_ms": sync,
            "data_wait_ms": cols["data_wait_ms"],
            "compute_ms": cols["compute_ms"],
            "step_ms": cols["step_ms"],
        }

    def window(self, n: int) -> RankWindow:
        """The last n steps: the chart's series and the numbers that compare ranks live."""
        tail = self.recorder.tail(n)
        steps = tail["step"]
        backward = self.backward.values[self.backward.steps >= (steps[0] if len(steps) else 0)]
        backward = backward[np.isfinite(backward)]

        def med(values: np.ndarray) -> float | None:
            return float(np.median(values)) if len(values) else None

        parts = self.parts.medians(int(steps[0]) if len(steps) else 0)
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
                "forward_ms": parts["forward_ms"],
                "optimizer_ms": parts["optimizer_ms"],
                "rest_ms": parts["rest_ms"],
            },
        }


class Collector:
    """The kernel's side of the forked ranks: one thread (traceml-ranks) reads them all, keeps
    their steps and refreshes the run's views; `stop()` takes the rest, closes, joins."""

    def __init__(self, run: Recording) -> None:
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
        """Start the reading thread."""
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
        # Never let the kernel's thread die silently.
        with never_raise(self.notes, "The ranks' steps stopped arriving"):
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
            self.notes.append(f"{self.describe(stream)} sent what could not be read: {failure_text(exc)}")

    def describe(self, stream: Stream) -> str:
        """A stream in the notes: "Process 4242 (rank 1)"."""
        return f"Process {stream.pid} (rank {stream.label})"

    def adopt_into(self, run: Recording, drain_s: float) -> None:
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
        if run.tick_due(now):
            run.tick(now)

    def live(self, window: int) -> LiveRanks | None:
        """For the live chart: each rank's last `window` steps, and the rank that holds the
        others back over them (None when balanced)."""
        streams = sorted((s for s in self.streams if s.recorder.n_steps), key=lambda s: s.label)
        if not streams:
            return None
        series = [s.window(window) for s in streams]
        evidence = paired_evidence({s.label: s.per_step(window) for s in streams})
        for one in series:
            if one["rank"] in evidence:
                one["summary"]["paired"] = evidence[one["rank"]]
        if self.run.finished:
            found = self.run.result.straggler
            slowest = found["rank"] if found else None
            cause = found["cause"] if found else None
            score = found["score"] if found else None
        else:
            compared = compare_ranks([w["summary"] for w in series])
            on = holds_back(compared)
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
        self._selector.close()

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
        if self in running:
            running.remove(self)


running: list[Collector] = []  # the kernel's running collectors


def rank_summaries(streams: list[Stream], warmup: int | None) -> list[RankRow]:
    """Each rank's summary with its per-step evidence against the others (`paired`: the steps
    after the latest warm-up among them, paired by step index)."""
    summaries = [s.summary(warmup) for s in streams]
    first = max((int(x.get("warmup_steps") or 0) for x in summaries), default=0)
    evidence = paired_evidence({s.label: s.per_step() for s in streams if s.recorder.n_steps}, first)
    for entry in summaries:
        if entry["rank"] in evidence:
            entry["paired"] = evidence[entry["rank"]]
    return summaries


def adopt(run: Recording, collector: Collector, drain_s: float) -> None:
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
    run.ranks = rank_summaries(ranks, run.warmup)
    if collector.own_recorder.n_steps:
        run.recorder = collector.own_recorder
        run.notes.append("The steps shown are the kernel's own; the ranks are in the per-rank table.")
        return
    # The run shows the steps of the rank that holds the others back, else of the lowest rank.
    found = compare_ranks(run.ranks)
    late = next((s for s in ranks if holds_back(found) and s.label == found["rank"]), None)  # type: ignore[index]
    main = late or collector.main_stream() or ranks[0]
    run.recorder = main.recorder
    shows_parts_of(run, main)
    if main.result is not None:
        steps, loader = main.result.steps, main.result.data.loader
        if run.step_kind == "none" and steps.kind != "none":
            run.step_kind = steps.kind
            run.step_definition = f"{steps.definition}, on each rank"
        if run.batch_size is None and steps.batch_size:
            run.batch_size, run.batches_per_step = steps.batch_size, steps.batches_per_step
        if run.loader_info is None and loader is not None:  # the checklist reads the loader of the rank that holds back
            run.loader_info = cast("LoaderFacts", dict(loader))
    whose = f"rank {main.label}'s" + (" (the rank that holds the others back)" if late else "")
    run.notes.append(f"The steps shown are {whose}; every rank is in the per-rank table.")


def shows_parts_of(run: Recording, stream: Stream) -> None:
    """The run shows `stream`'s steps: their parts too, the facts its END said of them, and
    where its passes over the training loader began (each epoch's start-up)."""
    end = stream.end or {}
    stream.parts.facts_seen = dict(end.get("parts") or {})
    run.step_parts = stream.parts
    run.pass_starts = [k for k in end.get("pass_steps") or [] if plain_count(k) is not None]
