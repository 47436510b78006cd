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
of numbers per rank (its summary and its last steps, for the per-step evidence) over the process
group already there (CPU tensors on gloo, tensors on the
rank's CUDA device on NCCL).

Both time backward() per step: data-parallel ranks wait for each other there, which is what the
rank verdict (rank_verdict.py) reads.

The package, along its jobs: wire.py (the frames), backward.py (backward() per step and the steps
taken at the ticks), identity.py (who this process is), sender.py (a forked rank's side),
collector.py (the kernel's side), forks.py (the fork hooks), follow.py (a capture followed across
processes), gather.py (torchrun).
"""

from __future__ import annotations

from ..processes.startup_hook import KIND, LENGTH
from .backward import BackwardTimer, LocalRank, RankParts, StepSample, StepTap
from .collector import (
    DRAIN_S,
    RECV_BYTES,
    Collector,
    LiveRanks,
    Stream,
    adopt,
    rank_summaries,
    running,
    shows_parts_of,
)
from .follow import DATAPARALLEL_NOTE, capture_ended, dataparallel_note, followed, watching
from .forks import HELPERS, become_rank, start_no_rank_channel
from .gather import INTEGERS, decode, encode, gather, local_summary, shows_report
from .identity import describe_error, dist_rank, distributed_env, loader_facts
from .sender import FINAL_SEND_S, MAX_QUEUED, Sender
from .wire import END, HELLO, MAX_FRAME, PART_ROWS, ROWS, STEPS, STEPS_PER_FRAME, frame, read_frames

__all__ = [
    "DATAPARALLEL_NOTE", "DRAIN_S", "END", "FINAL_SEND_S", "HELLO", "HELPERS", "INTEGERS", "KIND",
    "LENGTH", "MAX_FRAME", "MAX_QUEUED", "PART_ROWS", "RECV_BYTES", "ROWS", "STEPS",
    "STEPS_PER_FRAME", "BackwardTimer", "Collector", "LiveRanks", "LocalRank", "RankParts", "Sender",
    "StepSample", "StepTap", "Stream", "adopt", "become_rank", "capture_ended", "dataparallel_note",
    "decode", "describe_error", "dist_rank", "distributed_env", "encode", "followed", "frame",
    "gather", "loader_facts", "local_summary", "rank_summaries", "read_frames", "running", "shows_parts_of",
    "shows_report", "start_no_rank_channel", "watching",
]
