"""What the GPU watch measures of a run's copies and syncs (capture/gpu/h2d.py,
capture/gpu/syncs.py): the result's `gpu.h2d` and `gpu.sync_stalls`, the summary's `sync_top`
(docs/gpu.md)."""

from __future__ import annotations

from typing import TypedDict


class CopySite(TypedDict):
    """A line that copied to the GPU: its copies, per step their bytes, time and bandwidth, how
    many were pinned, non_blocking, pageable non_blocking, on a side stream, and what the loop's
    stream waited for."""

    filename: str
    line: int
    in_cell: bool
    copies: int
    timed: int
    copies_per_step: float
    bytes_per_step: float
    ms_per_step: float | None  # None: none of its copies was timed
    gb_per_s: float | None
    pinned: int
    non_blocking: int
    pageable_non_blocking: int
    side_stream: int
    waited: int
    waited_ms_per_step: float


class Copies(TypedDict):
    """The copies to the GPU (`gpu.h2d`): totals over the watched steps and the copying lines,
    costliest first."""

    copies: int
    bytes: int
    ms: float
    steps: int
    sites: list[CopySite]


class SyncSite(TypedDict):
    """A line whose calls waited for the GPU: the call as written, its kinds, how many calls
    (untimed ones apart), per step, in how many steps, the host's wait a step and its share of
    the step."""

    filename: str
    line: int
    in_cell: bool
    call: str | None  # the call as written in the cell
    kinds: list[str]
    calls: int
    untimed: int
    calls_per_step: float
    steps: int
    every_step: bool
    wait_ms_per_step: float | None  # None: no call of it was timed
    share: float | None


class SyncStalls(TypedDict, total=False):
    """The syncs that stalled the host (`gpu.sync_stalls`): totals over the watched steps and
    the syncing lines (longest wait first) from the sync watch; what the watch could not see and
    whether torch's sync warnings were counted, from the GPU watch."""

    calls: int
    untimed: int
    steps: int
    sites: list[SyncSite]
    counted_implicit: bool  # torch's sync warnings were counted
    all_counted: bool
    hidden: list[str]  # why some waits may have gone unseen (capture/gpu/hidden_waits.py)
    warning_us: float | None


class SyncTop(TypedDict):
    """The line whose syncs cost the host most (the first of `SyncStalls`' sites): the summary's
    `sync_top`."""

    line: int
    in_cell: bool
    call: str | None
    calls_per_step: float
    every_step: bool
    wait_ms_per_step: float | None
    share: float | None


class CudaGraphs(TypedDict):
    """The cell's CUDA graphs (`gpu.cuda_graphs`, capture/gpu/cuda_graphs.py): captured,
    invalidated, replayed (in all and a step), the training events recorded into a capture, the
    calls skipped while capturing, and whether a graph was captured outside torch.cuda.graph."""

    captures: int
    invalidated: int
    replays: int
    replays_per_step: float | None
    training_events_in_captures: int
    calls_skipped_during_capture: int
    capture_outside_cudagraph: bool
