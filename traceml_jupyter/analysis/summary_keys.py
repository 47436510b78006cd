"""The summary's keys and the type of each (`Summary`): what run_summary.analyse builds from the
analysis functions, what a result holds and its JSON writes, what the verdict, the checklist and
the views read. Its keys are the list docs/api.md ("The summary") is held to.

Every key is optional to the type checker (total=False): a run writes every key but those docs
marks *only*, and a file an older version saved holds fewer. The parts the analysis functions
build (the headline, the GPU's work, the resources...) are `Summary`s too, with their own keys
only."""

from __future__ import annotations

from typing import Literal, TypedDict

from ..facts.gpu import SyncTop
from ..facts.loader import PhaseRow, RankLoader
from .findings import FindingRow
from .rank_evidence import PairedEvidence


class Stats(TypedDict):
    """One column's spread over the analysed steps (None with no steps)."""

    median: float | None
    mean: float | None
    p90: float | None
    p99: float | None
    max: float | None


class StepPattern(TypedDict, total=False):
    """The analysed steps' shape (analysis/step_pattern.py)."""

    shape: Literal["even", "skewed", "two humps"]
    typical_ms: float
    slow_ms: float | None
    slow_wait_ms: float | None
    slow_steps: int
    steps: int
    period: int | None
    slow_in: Literal["data wait", "compute"] | None
    at_pass_starts: bool
    steady_wait: bool
    stalls: int
    cause: str | None
    text: str | None


class MovedPart(TypedDict):
    """What moved over the run (a trend's part): its first third's and last third's medians."""

    what: str
    first: float
    last: float
    delta: float
    unit: str


class Trend(TypedDict, total=False):
    """The step time's last third against its first (analysis/step_parts.py)."""

    first_ms: float
    last_ms: float
    change: float
    noise: float
    direction: Literal["slower", "faster"] | None
    steps: int
    moved: list[MovedPart]
    data_wait_first_ms: float
    data_wait_last_ms: float


class EpochStartup(TypedDict, total=False):
    """Each pass's start-up wait over the training loader (analysis/step_parts.py)."""

    passes: int
    restarts: int
    wait_ms: float
    total_ms: float
    share: float | None
    typical_wait_ms: float
    typical_step_ms: float
    first_pass_ms: float | None
    num_workers: int
    persistent_workers: bool
    cause: str
    reported: bool


class Oversubscription(TypedDict, total=False):
    """CPU OVERSUBSCRIBED's figures (analysis/threads.py)."""

    threads: int
    busy_workers: int
    usable_cores: float
    wanted_cores: float
    compute_p50_ms: float | None
    compute_p90_ms: float | None
    compute_p90_p50: float | None
    suggested_threads: int
    suggested_workers: int | None


class LineCost(TypedDict, total=False):
    """A line of the loop body and what it cost (a statement of `line_costs`; `host_top_line`)."""

    line: int
    end_line: int
    text: str
    ms_per_step: float | None
    share: float | None
    gpu_ms_per_step: float | None
    runs: int


class LineCosts(TypedDict, total=False):
    """The cost per line of the loop body (the result's `line_costs`, capture/inside/line_costs.py):
    its statements, their ms per step by line (int keys while live, str keys read back from JSON),
    the timed steps and how they were sampled, the loop's line and its fetch time."""

    statements: list[LineCost]
    ms_per_step: dict[int | str, float | None]
    gpu_ms_per_step: dict[int | str, float | None] | None
    timed_steps: int
    warmup_steps: int
    step_ms: float | None
    loop_line: int | None
    fetch_ms_per_step: float | None
    clock: str
    sampling: str
    gpu_sampled_steps: int


class OptimizerSeen(TypedDict, total=False):
    """An optimizer that stepped: its class, its name in the code, foreach/fused, its groups."""

    name: str
    label: str
    foreach: bool | None
    fused: bool | None
    param_groups: int
    tensors: int


class Straggler(TypedDict, total=False):
    """A RANK STRAGGLER: the rank, its cause, its score and the per-step evidence behind it."""

    rank: int
    cause: str  # input, h2d, compute or unknown
    score: float
    n_paired: int
    last_share: float
    expected_share: float
    last_p: float
    gap_ms: float
    gap_low_ms: float
    gap_high_ms: float


class RankRow(TypedDict, total=False):
    """One rank of a job (`run.ranks`, rank_verdict.rank_summary): its numbers (RANK_NUMBERS;
    None where not measured), its median backward, its clock, how it ended (finished, failed,
    stopped, running) with its error, its training loader, and its per-step evidence against
    the others (`paired`)."""

    rank: int
    pid: int | None
    n_steps: int | None
    n_analysed: int | None
    warmup_steps: int | None
    data_wait_ms: float | None
    compute_ms: float | None
    step_ms: float | None
    backward_ms: float | None
    h2d_ms: float | None
    data_wait_share: float | None
    compute_share: float | None
    straggler_share: float | None
    steps_per_s: float | None
    host_ms: float | None
    h2d_share: float | None
    num_workers: int | None
    batch_size: int | None
    forward_ms: float | None
    optimizer_ms: float | None
    rest_ms: float | None
    clock: str
    status: str
    error: str | None
    loader: RankLoader | None
    paired: PairedEvidence


class RankComparison(TypedDict, total=False):
    """Which rank arrives last at the synchronised phase and why (rank_verdict.compare_ranks)."""

    part_excess_ms: dict[str, float]
    rank: int
    cause: str  # input, h2d, compute or unknown
    score: float
    gap_ms: float
    step_ms: float
    excess_ms: dict[str, float | None]
    phase: str
    waiting: list[int]
    n_analysed: int
    evidence: PairedEvidence | None  # the late rank's per-step evidence
    holds_back: bool


class Summary(TypedDict, total=False):
    """`run.summary` and the JSON's `summary`: docs/api.md, "The summary", says what each key
    holds."""

    clock: Literal["gpu", "cpu"]
    n_steps: int
    n_analysed: int
    warmup_steps: int
    mean_step_ms: float | None
    mean_data_wait_ms: float | None
    mean_compute_ms: float | None
    loop_ms: float | None
    warmup_ms: float | None
    outside_steps_ms: float | None
    data_wait_time_share: float | None
    mean_step_noise: float | None
    step_pattern: StepPattern | None
    loader_workers: int | None
    loader_persistent: bool | None
    loader_passes: int | None
    step_ms: float | None
    data_wait_ms: float | None
    compute_ms: float | None
    data_wait_share: float | None
    compute_share: float | None
    steps_per_s: float | None
    samples_per_s: float | None
    batch_size: int | None
    batches_per_step: float | None
    straggler_share: float | None
    straggler_steps: int
    host_ms: float | None
    stats: dict[str, Stats]
    totals_ms: dict[str, float] | None
    h2d_ms: float | None
    h2d_share: float | None
    h2d_bytes: float | None
    h2d_gbps: float | None
    h2d_pinned_share: float | None
    h2d_non_blocking_share: float | None
    sync_ms: float | None
    sync_calls: float | None
    own_host_ms: float | None
    untimed_sync_share: float | None
    host_issue_ms: float | None
    gpu_backlog_ms: float | None
    gpu_busy_share: float | None
    host_share: float | None
    step_kind: str
    step_definition: str
    data_source: str | None
    data_source_kind: str | None
    data_source_type: str | None
    data_source_line: int | None
    phases: list[PhaseRow]
    wall_ms: float | None
    model_compiled: bool
    compile_s: float | None
    compile_share: float | None
    compiling_steps: list[int]
    eager_share: float | None
    forward_ms: float | None
    backward_ms: float | None
    optimizer_ms: float | None
    rest_ms: float | None
    forward_share: float | None
    backward_share: float | None
    optimizer_share: float | None
    rest_share: float | None
    parts_steps: int
    parts_clock: str
    parts_sampled_steps: int
    parts_sampling: str | None
    forward_state: str | None
    forward_modules: list[str]
    optimizers: list[OptimizerSeen]
    trend: Trend | None
    epoch_startup: EpochStartup | None
    kept_graphs: list[dict[str, object]]
    gpu_mem_capacity_mib: float | None
    gpu_mem_peak_mib: float | None
    gpu_mem_peak_share: float | None
    gpu_mem_reserved_mib: float | None
    gpu_mem_end_mib: float | None
    gpu_mem_growth_mib: float | None
    gpu_mem_growth_per_step_mib: float | None
    gpu_batch_room: float | None
    gpu_held_before_mib: float | None
    cpu_usable_cores: float | None
    cpu_cores: float | None
    cpu_process_cores: float | None
    cpu_workers_cores: float | None
    cpu_machine_cores: float | None
    cpu_workers: float | None
    cpu_workers_running: float | None
    cpu_saturated: bool | None
    cpu_torch_threads: int | None
    cpu_oversubscription: Oversubscription | None
    host_rss_mib: float | None
    host_rss_growth_mib: float | None
    workers_seen: int | None
    worker_uss_growth_mib: float | None
    resource_findings: list[FindingRow]
    h2d_lines: list[int]
    h2d_pageable_non_blocking: list[int]
    h2d_side_stream_waited: list[int]
    sync_top: SyncTop | None
    syncs_all_seen: bool
    syncs_hidden: list[str]
    host_top_line: LineCost | None
    cuda_graphs_used: bool
    ranks: list[dict[str, object]]
    rank_comparison: RankComparison | None
    rank_notes: list[str]
    straggler: Straggler | None


# The keys, in docs/api.md's order: the list its section "The summary" is held to.
SUMMARY_KEYS: tuple[str, ...] = tuple(Summary.__annotations__)


def part_figures(summary: Summary) -> dict[str, tuple[float | None, float | None]]:
    """Each part of the step (forward, backward, optimizer, rest): its median ms and its share of
    the step (None: not timed)."""
    return {
        "forward": (summary.get("forward_ms"), summary.get("forward_share")),
        "backward": (summary.get("backward_ms"), summary.get("backward_share")),
        "optimizer": (summary.get("optimizer_ms"), summary.get("optimizer_share")),
        "rest": (summary.get("rest_ms"), summary.get("rest_share")),
    }


def measured(value: float | None) -> float:
    """A figure its reader knows was measured (a sentence about a saturated CPU reads the cores
    busy): None here is a bug of ours, and raises."""
    if value is None:
        raise ValueError("a figure read as measured was not measured")
    return float(value)
