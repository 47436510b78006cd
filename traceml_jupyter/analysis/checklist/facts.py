"""What the checklist reads (Facts) and what it says (Item), and the words its items share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from ...facts.gpu import SyncTop
from ..cell_code import CodeSite, SampleCode, Transfer
from ..data_sources import Feeder
from ..loader_inside import LoaderInside
from ..summary_keys import EpochStartup, Oversubscription
from ..verdict import VerdictLabel

OK, FIX, CHECK = "ok", "fix", "check"
INPUT_VERDICTS = frozenset({VerdictLabel.INPUT_BOUND, VerdictLabel.INPUT_STRAGGLER})
WORKER_VERDICTS = INPUT_VERDICTS | {VerdictLabel.MIXED}
TRANSFER_VERDICTS = frozenset({VerdictLabel.INPUT_BOUND, VerdictLabel.H2D_BOUND, VerdictLabel.MIXED})
DEFAULT_PREFETCH = 2
PREFETCH_TO_TRY = 4
UNSAFE_START_METHODS = frozenset({"spawn", "forkserver"})


class ItemRow(TypedDict):
    """A checklist item as the JSON's `checklist` holds it (Item.to_dict, Item.from_dict)."""

    key: str
    title: str
    status: str
    seen: str
    to_try: str | None
    line: int | None
    cell: str | None
    where: str | None
    reason: str
    bears_on_verdict: bool


@dataclass(frozen=True)
class Item:
    """One evaluated checklist item."""

    key: str
    title: str
    status: str  # "ok", "fix" or "check"
    seen: str
    to_try: str | None
    site: CodeSite | None
    reason: str
    bears_on_verdict: bool

    @property
    def line(self) -> int | None:
        """The line the item points at, if any."""
        return self.site.line if self.site is not None else None

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> Item:
        """The item `to_dict` wrote (a saved run's checklist, as it was evaluated)."""
        line = saved.get("line")
        site = CodeSite(int(line), saved.get("cell")) if isinstance(line, int) else None
        return cls(
            str(saved.get("key") or ""),
            str(saved.get("title") or ""),
            str(saved.get("status") or CHECK),
            str(saved.get("seen") or ""),
            saved.get("to_try"),
            site,
            str(saved.get("reason") or ""),
            bool(saved.get("bears_on_verdict")),
        )

    def to_dict(self) -> ItemRow:
        """The item as JSON-ready values (Item.from_dict reads it back)."""
        return {
            "key": self.key,
            "title": self.title,
            "status": self.status,
            "seen": self.seen,
            "to_try": self.to_try,
            "line": self.line,
            "cell": self.site.cell if self.site is not None else None,
            "where": self.site.label() if self.site is not None else None,
            "reason": self.reason,
            "bears_on_verdict": self.bears_on_verdict,
        }


@dataclass(frozen=True)
class CopySeen:
    """What one line copied to the GPU, as measured (h2d.py), per step of the run."""

    site: CodeSite | None  # None: no notebook line could be named
    text: str  # the call as written (`x.to("cuda")`), else the line's text
    bytes_per_step: float
    ms_per_step: float | None  # GPU time of the copies
    gb_per_s: float | None
    pinned_share: float  # share of the line's copies made from pinned memory
    non_blocking_share: float  # share made with non_blocking=True


@dataclass(frozen=True)
class LineSeen:
    """A statement of the loop body and its measured host time per step (line_costs.py)."""

    site: CodeSite
    text: str
    ms_per_step: float


@dataclass(frozen=True)
class Facts:
    """Everything the rules read: the loader's settings, the code around the loop, the run."""

    verdict: str
    loader: Mapping[str, Any] | None
    cpu_count: int | None
    on_gpu: bool = False
    several_passes: bool = False
    loader_site: CodeSite | None = None
    transfers: tuple[Transfer, ...] | None = None  # None: the loop body could not be read
    sample_code: SampleCode | None = None
    start_method: str | None = None
    straggler_steps: int = 0
    wait_median_ms: float | None = None
    wait_p99_ms: float | None = None
    pinned_share: float | None = None  # measured share of copied bytes from pinned memory
    non_blocking_share: float | None = None  # measured share of bytes copied non_blocking
    copies: tuple[CopySeen, ...] | None = None  # measured copies to the GPU, costliest first
    sync_top: SyncTop | None = None  # the line whose syncs cost most (summary key)
    batch_size: int | None = None
    step_ms: float | None = None  # median step on the run's clock
    host_issue_ms: float | None = None  # median host time issuing a step (GPU clock)
    gpu_idle_share: float | None = None  # GPU idle inside steps (NVML), else None
    busiest_line: LineSeen | None = None  # the body statement with the most host time
    tuned: Mapping[str, Any] | None = None  # the last `%traceml tune` of this loader (to_dict())
    epoch_startup: EpochStartup | None = None  # each pass's start-up wait (summary key)
    cpu_saturated: bool | None = None  # CPU SATURATED (analysis/resources.py); None: not measured
    cpu_sentence: str | None = None  # the cores busy, in words ("the training process and ...")
    workers_cores: float | None = None  # median cores the DataLoader workers kept busy
    oversubscription: Oversubscription | None = None  # CPU OVERSUBSCRIBED's figures (analysis/threads.py)
    # What fed the steps when it is no DataLoader (a generator, a list, an iterator, get_batch()),
    # where it is, and the code behind it (its costly calls), when found.
    feeder: Feeder | None = None
    feeder_site: CodeSite | None = None
    feeder_code: SampleCode | None = None
    inside: LoaderInside | None = None  # measured inside the loader's workers (loader-inside.md)


def needs_change(bears: bool) -> str:
    """A setting worth changing is a fix when it bears on the verdict, else worth a check."""
    return FIX if bears else CHECK


def workers_now(f: Facts) -> int:
    """The loader's num_workers."""
    assert f.loader is not None
    return int(f.loader.get("num_workers") or 0)


def measured_share(share: float | None, what: str) -> str:
    """" (62 % of copied bytes pinned)" from a measured share; "" when not measured."""
    return "" if share is None else f" ({100 * share:.0f} % of copied bytes {what})"


def how_much(share: float, yes: str, no: str) -> str:
    """"pinned", "pageable" or "60 % pinned" for a share of copies."""
    if share >= 0.999:
        return yes
    if share <= 0.001:
        return no
    return f"{100 * share:.0f} % {yes}"


def capitalised(text: str) -> str:
    """`text` with its first letter in capitals."""
    return text[:1].upper() + text[1:]
