"""CUDA graphs while a traced cell runs: captures and replays of `torch.cuda.CUDAGraph`.

While a stream captures, CUDA refuses queries and waits (`cudaEventQuery`, `cudaStreamQuery`,
every synchronize): from every thread in the "global" capture mode that `torch.cuda.graph`
uses by default, from the capturing thread in torch.compile's "thread_local" one. A refused
call fails with cudaErrorStreamCaptureUnsupported and invalidates the user's capture (their
`capture_end()` then raises cudaErrorStreamCaptureInvalidated), and an event recorded in a
capture cannot be queried at all (cudaErrorCapturedEvent). So nothing of ours touches CUDA
while a capture is under way: every GPU watch asks `capturing()` first (an attribute read: the
capture is known from `CUDAGraph.capture_begin/capture_end`, patched for the cell; once a step,
and before each timed copy, backlog probe or line's events, `torch.cuda.is_current_stream_capturing()`
also catches a capture begun another way).

A captured step did no work (it was recorded): the training events inside a capture end no
step. Its replay does: `g.replay()` of a graph whose capture held `optimizer.step()` (or
`backward()`) is that training event, after the replay was queued, so each replay is a step
timed on the GPU clock like any other (the replay's kernels run on the current stream,
between the step's events).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ...facts.gpu import CudaGraphs
from ...failures import failure_text
from ..instrument.patches import patched
from .cuda_state import cuda_initialized, cuda_or


@dataclass
class _Captures:
    """Process-wide: captures under way (CUDA allows one per process with cudaMallocAsync and
    "global" mode forbids our calls from any thread, so one count serves every thread)."""

    active: int = 0
    foreign: bool = False  # a capture was seen that did not go through CUDAGraph.capture_begin
    skipped: int = 0  # calls of ours skipped while a capture was under way


_STATE = _Captures()
# The strongest training event each graph's capture held (a step_model level, and the
# optimizer when it is a step), kept across cells while the graph lives: a graph captured in
# one traced cell is replayed in the next.
_LEVELS: weakref.WeakKeyDictionary[Any, tuple[int, Callable[[], Any]]] = weakref.WeakKeyDictionary()


def _ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def graph_class() -> Any:
    """torch.cuda.CUDAGraph when torch is imported (never imports torch, touches no CUDA)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    return getattr(cuda, "CUDAGraph", None)


def stream_capturing() -> bool:
    """torch.cuda.is_current_stream_capturing(), only once CUDA is initialised (it never
    initialises a context itself; it is capture-safe: cudaStreamIsCapturing)."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is None or not cuda_initialized(cuda):
        return False
    return bool(cuda_or(False, cuda.is_current_stream_capturing))  # CUDA's own error: no capture to protect


def capturing(ask_cuda: bool = False) -> bool:
    """A CUDA graph capture is under way: no event record, query, poll or wait of ours now.
    `ask_cuda`: also ask `is_current_stream_capturing()` (about a µs on a GPU: for the calls
    that cost several anyway, a timed copy, a backlog probe, a line's events)."""
    state = _STATE
    if state.active > 0 or ((ask_cuda or state.foreign) and stream_capturing()):
        state.skipped += 1
        return True
    return False


def notice_foreign_capture() -> bool:
    """Once per step on the GPU path: whether a capture is under way, asking CUDA as well (a
    capture begun without CUDAGraph.capture_begin: the C++ API, another library). Once one is
    seen, every later `capturing()` of the cell asks CUDA too."""
    state = _STATE
    if state.active > 0:
        state.skipped += 1
        return True
    if stream_capturing():
        state.foreign = True
        state.skipped += 1
        return True
    return False


@dataclass
class GraphWatch:
    """The CUDA graphs of one traced cell: captures, replays (those on the loop's thread, per
    step), the training events the captures held, and our calls skipped while one ran.

    `replayed(level, optimizer)` is called on the loop's thread after each replay: with the
    strongest training event its capture held (level None: none, or captured elsewhere)."""

    thread: int
    replayed: Callable[[int | None, Any], None] | None = None
    captures: int = 0  # captures that ended (well or not) during the cell
    invalidated: int = 0  # ... whose capture_end raised (the user's capture failed)
    replays: int = 0  # every replay during the cell, on any thread
    loop_replays: int = 0  # ... on the loop's thread
    held_events: int = 0  # training events (backward, optimizer step) made inside a capture
    notes: list[str] = field(default_factory=list)
    _stack: list[Any] = field(default_factory=list)  # graphs being captured on the loop's thread
    _skipped_before: int = 0

    def held(self, level: int, optimizer: Any = None) -> bool:
        """A training event now: inside a capture (it is recorded, not run) it goes to the
        graph being captured and ends no step (True); else False."""
        if _STATE.active <= 0:
            return False
        self.held_events += 1
        if self._stack and threading.get_ident() == self.thread:
            graph = self._stack[-1]
            try:
                known = _LEVELS.get(graph)
                if known is None or level > known[0]:
                    _LEVELS[graph] = (level, _ref(optimizer))
            except TypeError:  # a graph that takes no weak reference: its replays end no step
                pass
        return True

    def _replayed(self, graph: Any) -> None:
        self.replays += 1
        if threading.get_ident() != self.thread:
            return
        self.loop_replays += 1
        try:
            held = _LEVELS.get(graph)
        except TypeError:
            held = None
        if self.replayed is not None:
            self.replayed(*(held[0], held[1]()) if held is not None else (None, None))

    def summary(self, n_steps: int) -> CudaGraphs | None:
        """What the report says of the cell's graphs; None when it used none."""
        skipped = _STATE.skipped - self._skipped_before
        if not (self.captures or self.replays or self._stack or _STATE.foreign):
            return None
        return {
            "captures": self.captures,
            "invalidated": self.invalidated,
            "replays": self.replays,
            "replays_per_step": self.loop_replays / n_steps if n_steps else None,
            "training_events_in_captures": self.held_events,
            "calls_skipped_during_capture": skipped,
            "capture_outside_cudagraph": _STATE.foreign,
        }


def graph_note(graphs: Mapping[str, Any] | None) -> str | None:
    """The report's sentence on the cell's CUDA graphs, or None."""
    if not graphs:
        return None
    parts = []
    if graphs["captures"]:
        held = graphs["training_events_in_captures"]
        parts.append(
            f"{graphs['captures']} captured in the cell"
            + (f" (its {held} training event(s) were recorded, not run: no step)" if held else "")
        )
    if graphs["replays"]:
        per = graphs.get("replays_per_step")
        parts.append(
            f"{graphs['replays']} replays" + (f", {per:.2g} a step" if per else "")
            + ": a replayed step is timed on the GPU clock like any other"
        )
    if graphs["invalidated"]:
        parts.append(f"{graphs['invalidated']} capture(s) failed in your code")
    if graphs["capture_outside_cudagraph"]:
        parts.append("a capture begun outside torch.cuda.CUDAGraph (its steps have no GPU timings)")
    text = "CUDA graphs in use: " + "; ".join(parts) + "."
    if graphs["calls_skipped_during_capture"]:
        text += " Nothing of traceml touched CUDA while a capture was under way."
    return text


@contextmanager
def graphs_watched(watch: GraphWatch) -> Iterator[GraphWatch]:
    """`CUDAGraph.capture_begin`, `capture_end` and `replay` tell `watch` (and `capturing()`)
    what happens, for the duration. The user's calls always run, their errors unchanged;
    nothing here touches CUDA. No-op when torch is not imported."""
    cls = graph_class()
    _STATE.foreign = False
    watch._skipped_before = _STATE.skipped
    if cls is None or not all(callable(getattr(cls, n, None)) for n in ("capture_begin", "capture_end", "replay")):
        yield watch
        return
    begin, end, replay = cls.capture_begin, cls.capture_end, cls.replay
    mine = threading.get_ident

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        _STATE.active += 1  # before the capture begins: nothing of ours may run inside it
        on_loop = mine() == watch.thread
        if on_loop:
            watch._stack.append(self)
        begun = False
        try:
            out = begin(self, *args, **kwargs)
            begun = True
            return out
        finally:
            if not begun:  # the user's error goes up unchanged; no capture is under way
                _STATE.active = max(0, _STATE.active - 1)
                if on_loop and watch._stack:
                    watch._stack.pop()

    def capture_end(self: Any) -> Any:
        ended = False
        try:
            out = end(self)
            ended = True
            return out
        finally:
            if not ended:  # the capture was invalidated (the user's error goes up unchanged)
                watch.invalidated += 1
            _STATE.active = max(0, _STATE.active - 1)
            watch.captures += 1
            if mine() == watch.thread and watch._stack and watch._stack[-1] is self:
                watch._stack.pop()

    def graph_replay(self: Any) -> Any:
        out = replay(self)
        try:  # the edge of the replay's bookkeeping: never raised into the user's loop
            watch._replayed(self)
        except Exception as exc:
            if not watch.notes:
                watch.notes.append(f"CUDA graph replays not followed: {failure_text(exc)}")
        return out

    for ours, theirs in ((capture_begin, begin), (capture_end, end), (graph_replay, replay)):
        ours.__doc__ = getattr(theirs, "__doc__", None)
        ours.__wrapped__ = theirs  # type: ignore[attr-defined]
    try:
        with patched(cls, {"capture_begin": capture_begin, "capture_end": capture_end, "replay": graph_replay}):
            yield watch
    finally:
        _STATE.active = 0
        _STATE.foreign = False
        watch._stack.clear()
