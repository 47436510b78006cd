"""A forked rank's end of its channel to the kernel: its steps at the run's ticks and its end at
exit, through non-blocking sends (training never waits for the kernel)."""

from __future__ import annotations

import os
import socket
from collections import deque
from time import monotonic, perf_counter_ns
from typing import TYPE_CHECKING

import numpy as np

from ..failures import failure_text, never_raise
from .backward import StepTap
from .identity import dist_rank, loader_facts
from .wire import END, HELLO, STEPS, STEPS_PER_FRAME, End, Hello, Who, end_document, frame

if TYPE_CHECKING:
    from ..recording import Recording


FINAL_SEND_S = 2.0  # how long a rank's exit waits for the kernel to take its last frames
MAX_QUEUED = 16 << 20  # bytes a rank keeps for a kernel that stopped reading; past it, it stops

class Sender:
    """A forked rank's end of its channel: its steps at the ticks, its end at exit. Training
    never waits for the kernel: sends are non-blocking, and what the socket cannot take now is
    sent at a later tick."""

    def __init__(self, sock: socket.socket, tap: StepTap, run: Recording, index: int) -> None:
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
        self.told: Who | None = None
        sock.setblocking(False)

    def hello(self) -> None:
        """Tell the kernel who this rank is (pid, fork index)."""
        hello: Hello = {"pid": self.pid, "index": self.index}
        self._put(frame(HELLO, hello))
        self._push()

    def __call__(self, run: Recording) -> None:
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
            with never_raise():
                if not self.closed:
                    rows = self.tap.take(final=True)
                    if rows is not None:
                        self._put_steps(self._who(), rows)
                    self._put(frame(END, self._end()))
                    self._push(deadline=monotonic() + FINAL_SEND_S)
        finally:
            self._close()

    def forget_in_child(self) -> None:
        """In a process forked by the rank (its DataLoader workers): let go of the rank's socket."""
        self.closed = self.ended = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _who(self) -> Who:
        rank, world = dist_rank()
        return {"rank": rank, "world": world}

    def _end(self) -> End:
        """Who it was and how it ended, then what it measured (see wire.End); when that cannot
        be read, the end says why and the kernel keeps the steps it has."""
        rank, world = dist_rank()
        end: End = {"rank": rank, "world": world, "pid": self.pid, "error": self.error}
        try:
            end.update(self._measured())
        except Exception as exc:
            end["note"] = f"what fed its steps could not be read: {failure_text(exc)}"
        return end

    def _measured(self) -> End:
        """Its result through the one codec, and what the kernel's summary of its steps reads
        besides: its loader as the per-rank table compares it, its parts, its passes."""
        self._close_recording()
        run = self.run
        loader = run.loader_ref() if run.loader_ref is not None else None
        return {
            "result": end_document(run.result),
            "loader": loader_facts(run.loader_info, loader),
            "parts": self.tap.capture.parts.facts(),
            "pass_steps": list(run.pass_starts),
        }

    def _close_recording(self) -> None:
        """A forked rank's capture never closes (the rank ends with its process): what it saw is
        read into the run here, as a closing capture does."""
        run = self.run
        run.read_capture(self.tap.capture, perf_counter_ns() - (run.recorder.origin_ns or 0))

    def _put_steps(self, who: Who, rows: np.ndarray | None) -> None:
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


