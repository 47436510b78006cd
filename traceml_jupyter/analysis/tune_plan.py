"""The arithmetic of `%traceml tune`, pure: which loader settings to measure, which measured one
keeps the model fed, the predicted step and speed-up, the line to write, and where a batch's time
goes. No torch, no timing, no display: tuning/ measures, this decides."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .number_text import ms as _ms
from .number_text import ms_fine
from .tune_rows import CandidateRow, LoaderSettings, SplitRow

# With workers, loading overlaps compute: the loader keeps the model fed when it makes batches
# at least this many times faster than the model takes them (room for jitter and for the
# training process's own share of each batch).
KEEP_FED = 1.2
# Without workers, loading is serial with compute: it keeps the model fed only when it adds
# less than this share to the step (the INPUT-BOUND threshold), that is at 9x the model's rate.
SERIAL_SHARE = 0.10
# At num_workers=0, a process CPU time below this share of the wall time means a sample mostly
# waits (file or network I/O, a sleep): a worker more than the cores still helps.
WAITING_CPU_SHARE = 0.5
# Worker counts tried on a large machine: every count up to 4, then about 1.5x apart.
WORKER_LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# A larger worker count that does not beat the best smaller one by this factor means the
# workers are saturated (the CPU, a lock, the disk): more of them are not tried.
SATURATED = 1.05
DEFAULT_PREFETCH = 2
DEEPER_PREFETCH = 4
# A deeper queue is worth recommending only when it measurably beats the default one.
PREFETCH_GAIN = 1.10

OK, TIMEOUT, NO_START, ERROR, STOPPED, EMPTY = (
    "ok",
    "timeout",
    "no start",
    "error",
    "stopped",
    "empty",
)


@dataclass(frozen=True)
class Setting:
    """DataLoader keyword arguments of one candidate."""

    num_workers: int
    persistent_workers: bool = False
    prefetch_factor: int | None = None  # None: the default (2 with workers)
    pin_memory: bool = False

    def kwargs(self) -> LoaderSettings:
        """What the candidate's DataLoader is built with."""
        out: LoaderSettings = {"num_workers": self.num_workers}
        if self.num_workers > 0:
            out["persistent_workers"] = self.persistent_workers
            out["prefetch_factor"] = self.prefetch_factor or DEFAULT_PREFETCH
        out["pin_memory"] = self.pin_memory
        return out

    def label(self) -> str:
        """How a row names it: "num_workers=2, persistent_workers=True"."""
        parts = [f"num_workers={self.num_workers}"]
        if self.num_workers > 0 and self.persistent_workers:
            parts.append("persistent_workers=True")
        if self.prefetch_factor not in (None, DEFAULT_PREFETCH):
            parts.append(f"prefetch_factor={self.prefetch_factor}")
        if self.pin_memory:
            parts.append("pin_memory=True")
        return ", ".join(parts)

    def short(self) -> str:
        """The chart's bar label: "2", "2 pf4"."""
        text = str(self.num_workers)
        if self.prefetch_factor not in (None, DEFAULT_PREFETCH):
            text += f" pf{self.prefetch_factor}"
        return text

    def size(self) -> tuple[int, int, bool]:
        """Order of "smaller": fewer workers, then a shallower queue, then no pinning."""
        return (self.num_workers, self.prefetch_factor or DEFAULT_PREFETCH, self.pin_memory)


@dataclass(frozen=True)
class Row:
    """One measured candidate."""

    setting: Setting
    status: str = OK  # ok, timeout (stopped at the budget), no start, error, stopped, empty
    batches_per_s: float | None = None  # steady rate, worker start-up excluded
    startup_s: float | None = None  # workers: from iter() to the first batch, less one batch
    samples_measured: int | None = None
    batches_measured: int = 0
    seconds: float = 0.0
    message: str | None = None  # why it has no rate, or what stopped it
    # With workers: what taking a ready batch costs the training process (ms, next() timed once
    # the workers are ahead), and the workers' CPU time per batch (ms). None: not measured.
    take_ms: float | None = None
    worker_cpu_ms: float | None = None
    # The model's compute beside these workers over what the run measured: a stand-in for it (its
    # CPU work burnt, its waits slept), run at the model's pace with this candidate, took this
    # many times the run's compute (above 1: the workers' CPU work crowds the cores).
    compute_ratio: float | None = None

    def to_dict(self) -> CandidateRow:
        """The candidate's measurement as JSON-ready values."""
        return {
            "settings": self.setting.kwargs(),
            "label": self.setting.label(),
            "status": self.status,
            "batches_per_s": self.batches_per_s,
            "startup_s": self.startup_s,
            "samples_measured": self.samples_measured,
            "batches_measured": self.batches_measured,
            "seconds": self.seconds,
            "message": self.message,
            "take_ms": self.take_ms,
            "worker_cpu_ms": self.worker_cpu_ms,
            "compute_ratio": self.compute_ratio,
        }


@dataclass(frozen=True)
class ModelRate:
    """How fast the model takes batches: median compute per step and batches per step, from a
    `%%traceml` run (`source` names it) or from `compute_ms=`."""

    compute_ms: float
    batches_per_step: float = 1.0
    source: str = "compute_ms"
    step_ms: float | None = None  # the run's time per step: the base of the predicted speed-up
    # The share of the compute that is the training process's CPU work (model_cpu); None: not
    # known (then all of it on the CPU clock, none on a GPU).
    cpu_share: float | None = None

    @property
    def batches_per_s(self) -> float:
        """The batches a second the model takes at its measured compute time."""
        return self.batches_per_step * 1000.0 / self.compute_ms


@dataclass(frozen=True)
class Split:
    """Where a batch's time goes at num_workers=0 (ms per batch; None: not measured)."""

    batch_ms: float  # the whole batch, from the measured rate
    samples_per_batch: float | None
    getitem_ms: float | None  # the dataset's __getitem__ (or its iterator), all samples
    collate_ms: float | None
    pin_ms: float | None = None  # pinning (CUDA only)
    cpu_share: float | None = None  # process CPU time / wall time while loading
    source: str = "__getitem__"  # "__getitem__", "__getitems__" or "the dataset's iterator"

    @property
    def per_sample_ms(self) -> float | None:
        """`__getitem__`'s time per sample (ms); None when not measured."""
        if self.getitem_ms is None or not self.samples_per_batch:
            return None
        return self.getitem_ms / self.samples_per_batch

    @property
    def other_ms(self) -> float:
        """What the parts measured do not explain (ms per batch, at least 0)."""
        known = sum(v for v in (self.getitem_ms, self.collate_ms, self.pin_ms) if v is not None)
        return max(0.0, self.batch_ms - known)

    def to_dict(self) -> SplitRow:
        """The split as JSON-ready values."""
        return {
            "batch_ms": self.batch_ms,
            "samples_per_batch": self.samples_per_batch,
            "getitem_ms": self.getitem_ms,
            "per_sample_ms": self.per_sample_ms,
            "collate_ms": self.collate_ms,
            "pin_ms": self.pin_ms,
            "other_ms": self.other_ms,
            "cpu_share": self.cpu_share,
            "source": self.source,
        }


@dataclass(frozen=True)
class Conclusion:
    """What the measured rows say."""

    best: Row | None
    changes: LoaderSettings  # DataLoader kwargs to change (empty: keep the loader as it is)
    keeps_up: bool  # the best row keeps the model fed (False also without a model rate)
    predicted_step_ms: float | None
    predicted_speedup: float | None
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# -- which candidates ------------------------------------------------------------------------


def is_waiting(cpu_share: float | None) -> bool:
    """A sample's cost is mostly waiting (I/O, sleeps), not CPU time."""
    return cpu_share is not None and cpu_share < WAITING_CPU_SHARE


def worker_counts(cpus: int, waiting: bool) -> list[int]:
    """num_workers to try: 0 up to the usable CPUs (all of them on a small machine, a ladder on
    a large one), and one step beyond when a sample's cost is waiting rather than CPU time."""
    cpus = max(1, cpus)
    counts = [n for n in WORKER_LADDER if n <= cpus]
    if counts[-1] != cpus:
        counts.append(cpus)
    if waiting:
        beyond = [n for n in WORKER_LADDER if n > cpus]
        counts.append(beyond[0] if beyond else cpus + 1)
    return counts


def required_rate(num_workers: int, model_batches_per_s: float) -> float:
    """The batches a second a setting must make to keep the model fed."""
    if num_workers == 0:
        return model_batches_per_s * (1 - SERIAL_SHARE) / SERIAL_SHARE
    return model_batches_per_s * KEEP_FED


def keeps_up(row: Row, model_batches_per_s: float | None) -> bool:
    """The candidate delivers batches at least as fast as the model takes them (with its workers'
    margin)."""
    if model_batches_per_s is None or row.batches_per_s is None:
        return False
    return row.batches_per_s >= required_rate(row.setting.num_workers, model_batches_per_s)


def sweep_done(rows: Sequence[Row], model_batches_per_s: float | None) -> bool:
    """Stop adding workers: one count past the first that keeps the model fed (to show the
    headroom), or when more workers stopped helping (saturated)."""
    measured = [r for r in rows if r.batches_per_s is not None]
    fed = [i for i, r in enumerate(measured) if keeps_up(r, model_batches_per_s)]
    if fed and len(measured) - fed[0] >= 2:
        return True
    # One worker makes about what the training process makes alone: judge from two workers
    # up, and call it saturated when two counts in a row add nothing.
    if len(measured) >= 4 and measured[-2].setting.num_workers >= 2:
        return _adds_nothing(measured, -1) and _adds_nothing(measured, -2)
    return False


def _adds_nothing(measured: Sequence[Row], i: int) -> bool:
    before = max(r.batches_per_s or 0.0 for r in measured[:i])
    return (measured[i].batches_per_s or 0.0) < before * SATURATED


# -- the choice -----------------------------------------------------------------------------


def predicted_step_ms(
    row: Row, model: ModelRate, cpus: int | None = None, model_on_cpu: bool = False
) -> float | None:
    """The step with this setting. Without workers, loading adds to compute. With workers,
    loading overlaps compute and the step is the slower of the training process's own chain
    (its compute, slowed by the workers' CPU work, plus taking each batch from the workers, both
    measured at the model's pace) and the workers' rate measured alone. Where the compute was
    not measured, the CPU that the training process (its compute too, when the model runs on
    the CPU) and the workers need per step, shared by the usable `cpus`, bounds it instead."""
    if row.batches_per_s is None or row.batches_per_s <= 0:
        return None
    batches = model.batches_per_step
    load_ms = batches * 1000.0 / row.batches_per_s
    if row.setting.num_workers == 0:
        return model.compute_ms + load_ms
    take = batches * (row.take_ms or 0.0)
    step = max(model.compute_ms * (row.compute_ratio or 1.0) + take, load_ms)
    if row.compute_ratio is None and cpus and row.worker_cpu_ms is not None:
        share = model.cpu_share if model.cpu_share is not None else float(model_on_cpu)
        own = model.compute_ms * share
        step = max(step, (own + take + batches * row.worker_cpu_ms) / cpus)
    return step


def step_parts(row: Row, model: ModelRate, step: float) -> str:
    """What the predicted step is made of, in words: " (6.1 ms compute + 2.2 ms to take each
    batch from the workers)", " (the workers' pace)", " (the CPU work the cores share)"; ""
    without workers or without the figures measured at the model's pace."""
    if row.setting.num_workers == 0 or row.take_ms is None or not row.batches_per_s:
        return ""
    take = model.batches_per_step * row.take_ms
    compute = model.compute_ms * (row.compute_ratio or 1.0)
    if step > compute + take + 1e-6:
        load = model.batches_per_step * 1000.0 / row.batches_per_s
        return " (the workers' pace)" if step <= load + 1e-6 else " (the CPU work the cores share)"
    beside = " beside the workers" if row.compute_ratio is not None else ""
    return f" ({_ms(compute)} compute{beside} + {_ms(take)} to take each batch from the workers)"


@dataclass(frozen=True)
class ModelCpu:
    """A run's compute as work of the training process: `share` of it (uncontended) burns its
    CPU, the rest waits (a GPU, a sleep); `scale`: that uncontended time over the measured one
    (below 1 when the run's thread waited for a core other programs held)."""

    share: float
    scale: float = 1.0


def model_cpu(
    process_cpu_ms: float | None,
    compute_ms: float,
    batches: float,
    loading_cpu_ms: float | None,
    wait_ms: float,
    thread_cpu_ms: float | None = None,
    thread_wait_ms: float | None = None,
) -> ModelCpu | None:
    """The model's CPU work, from a run's totals: the process's CPU time less what loading its
    `batches` took (`loading_cpu_ms` a batch: tune's num_workers=0 split, CPU time, which a busy
    machine does not change; unknown: all of the run's data wait, `wait_ms`), within the run's
    `compute_ms`. The training thread's wait for a core (`thread_wait_ms` over `thread_cpu_ms`,
    Linux) is taken out of the compute in the share of its CPU time that was the model's, so a
    stand-in replays the model's work, not the run's crowding. None when not measured."""
    if process_cpu_ms is None or compute_ms <= 0:
        return None
    loading = wait_ms if loading_cpu_ms is None else batches * loading_cpu_ms
    cpu = min(compute_ms, max(0.0, process_cpu_ms - loading))
    waited = 0.0
    if thread_wait_ms and thread_cpu_ms and thread_cpu_ms > 0:
        waited = thread_wait_ms * min(1.0, cpu / thread_cpu_ms)
    uncontended = max(cpu, compute_ms - waited)
    if uncontended <= 0:
        return ModelCpu(0.0)
    return ModelCpu(cpu / uncontended, uncontended / compute_ms)


def choose(rows: Sequence[Row], model_batches_per_s: float | None) -> tuple[Row | None, bool]:
    """The smallest setting that keeps the model fed, else the fastest; and whether it keeps up."""
    measured = [r for r in rows if r.batches_per_s is not None]
    if not measured:
        return None, False
    fed = [r for r in measured if keeps_up(r, model_batches_per_s)]
    if fed:
        return min(fed, key=lambda r: r.setting.size()), True
    fastest = max(measured, key=lambda r: r.batches_per_s or 0.0)
    # A deeper queue is chosen only where it beats the same workers with the default queue.
    if fastest.setting.prefetch_factor not in (None, DEFAULT_PREFETCH):
        plain = [
            r
            for r in measured
            if r.setting.num_workers == fastest.setting.num_workers
            and r.setting.prefetch_factor in (None, DEFAULT_PREFETCH)
        ]
        if plain and (fastest.batches_per_s or 0) < (plain[0].batches_per_s or 0) * PREFETCH_GAIN:
            return plain[0], False
    return fastest, False


def with_pace_figures(rows: Sequence[Row]) -> list[Row]:
    """Rows whose figures at the model's pace were not measured (a deeper queue measured in
    what was left of the budget, a candidate cut short) borrow them from the measured row with
    the most similar worker count, so that a missing figure never reads as a free batch."""
    measured = [r for r in rows if r.setting.num_workers and r.take_ms is not None]
    out = []
    for row in rows:
        if row.setting.num_workers and row.take_ms is None and row.batches_per_s and measured:
            near = min(measured, key=lambda m: (abs(m.setting.num_workers - row.setting.num_workers), m.setting.size()))
            row = replace(
                row,
                take_ms=near.take_ms,
                compute_ratio=row.compute_ratio or near.compute_ratio,
            )
        out.append(row)
    return out


def quickest(
    rows: Sequence[Row], model: ModelRate, cpus: int | None, model_on_cpu: bool
) -> Row | None:
    """When no setting keeps the model fed: the one with the shortest predicted step (taking
    batches and the workers' CPU counted, the fastest loader alone may not be the fastest in
    training), the smaller on a tie within 2 %; a deeper queue only where it beats the same
    workers with the default queue by PREFETCH_GAIN."""
    steps = [(predicted_step_ms(r, model, cpus, model_on_cpu), r) for r in rows]
    known = [(s, r) for s, r in steps if s is not None]
    plain = {
        r.setting.num_workers: s
        for s, r in known
        if r.setting.prefetch_factor in (None, DEFAULT_PREFETCH)
    }

    def worth_it(step: float, row: Row) -> bool:
        if row.setting.prefetch_factor in (None, DEFAULT_PREFETCH):
            return True
        base = plain.get(row.setting.num_workers)
        return base is None or step * PREFETCH_GAIN <= base

    kept = sorted(((s, r) for s, r in known if worth_it(s, r)), key=lambda sr: sr[1].setting.size())
    if not kept:
        return None
    fastest = min(s for s, _ in kept)
    return next(r for s, r in kept if s <= fastest * 1.02)


def changes_from(setting: Setting, current: LoaderSettings) -> LoaderSettings:
    """The keyword arguments to change on the user's loader to get `setting`."""
    out: LoaderSettings = {}
    workers = int(current.get("num_workers") or 0)
    if setting.num_workers != workers:
        out["num_workers"] = setting.num_workers
    if setting.num_workers > 0:
        if setting.persistent_workers and not current.get("persistent_workers"):
            out["persistent_workers"] = True
        want = setting.prefetch_factor or DEFAULT_PREFETCH
        have = current.get("prefetch_factor") or DEFAULT_PREFETCH
        if want != have:
            out["prefetch_factor"] = want
    else:
        if current.get("persistent_workers"):
            out["persistent_workers"] = False
        if current.get("prefetch_factor") is not None:
            out["prefetch_factor"] = None
    if setting.pin_memory and not current.get("pin_memory"):
        out["pin_memory"] = True
    return out


def code_line(
    dataset: str,
    batch: str | None,
    changes: Mapping[str, Any],
    current: LoaderSettings | None = None,
) -> str:
    """The line to write: `DataLoader(dataset, batch_size=64, num_workers=3, persistent_workers=True)`.

    `batch` is how the loader batches, as written (`batch_size=64, shuffle=True` or
    `batch_sampler=sampler`); `current` adds the other settings already on, so the line is whole.
    """
    parts = [dataset]
    if batch:
        parts.append(batch)
    merged: dict[str, object] = {}
    for key in ("num_workers", "persistent_workers", "prefetch_factor", "pin_memory"):
        value = (current or {}).get(key)
        if key in changes:
            value = changes[key]
        if key == "num_workers" and value:
            merged[key] = value
        elif key == "persistent_workers" and value and merged.get("num_workers"):
            merged[key] = True
        elif key == "prefetch_factor" and merged.get("num_workers"):
            if value not in (None, DEFAULT_PREFETCH):
                merged[key] = value
        elif key == "pin_memory" and value:
            merged[key] = True
    parts += [f"{k}={v!r}" for k, v in merged.items()]
    return f"DataLoader({', '.join(parts)})"


# -- words ------------------------------------------------------------------------------------


def rate_text(value: float | None) -> str:
    """A rate as the tables show it: "1,234" from 100 up, "12.3" below, "n/a" when unmeasured."""
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def _share(part: float | None, whole: float) -> str:
    return "" if part is None or whole <= 0 else f" ({100 * part / whole:.0f} %)"


def split_sentence(split: Split) -> str:
    """ "At num_workers=0 a batch takes 16.4 ms: __getitem__ 2.0 ms a sample x 8 (98 %), ..."."""
    parts = []
    per_sample = split.per_sample_ms
    if per_sample is not None and split.getitem_ms is not None:
        samples = split.samples_per_batch or 0
        parts.append(
            f"{split.source} {ms_fine(per_sample)} a sample x {samples:.0f}"
            + _share(split.getitem_ms, split.batch_ms)
        )
    elif split.getitem_ms is not None:
        parts.append(
            f"{split.source} {ms_fine(split.getitem_ms)}"
            + _share(split.getitem_ms, split.batch_ms)
        )
    if split.collate_ms is not None:
        parts.append(
            f"collate_fn {ms_fine(split.collate_ms)}" + _share(split.collate_ms, split.batch_ms)
        )
    if split.pin_ms is not None:
        parts.append(f"pinning {ms_fine(split.pin_ms)}" + _share(split.pin_ms, split.batch_ms))
    parts.append(f"the rest {ms_fine(split.other_ms)}" + _share(split.other_ms, split.batch_ms))
    return f"At num_workers=0 a batch takes {ms_fine(split.batch_ms)}: " + ", ".join(parts) + "."


def costliest(split: Split) -> str:
    """What to make cheaper, from the split."""
    parts = {
        split.source: split.getitem_ms or 0.0,
        "collate_fn": split.collate_ms or 0.0,
        "pinning": split.pin_ms or 0.0,
    }
    name, value = max(parts.items(), key=lambda kv: kv[1])
    if value < split.other_ms:
        return "the loader's own work per batch (sampling, fetching)"
    return name


def optimistic_note(
    split: Split | None, num_workers: int, cpus: int, model_on_cpu: bool
) -> str | None:
    """Measured alone, workers had the cores to themselves. When each sample costs CPU time and
    the workers (with the training process) need every core, training will load slower."""
    if split is None or split.cpu_share is None or is_waiting(split.cpu_share) or not num_workers:
        return None
    if num_workers < cpus and not (model_on_cpu and num_workers + 1 >= cpus):
        return None
    return (
        f"The prediction may be optimistic: each sample costs CPU time ({100 * split.cpu_share:.0f} % "
        f"of the loading time at num_workers=0), and {num_workers} worker(s) "
        f"{'and the model ' if model_on_cpu else 'and the training process '}share {cpus} "
        "CPU core(s) while training; measured alone, the workers had them to themselves."
    )


def conclude(
    rows: Sequence[Row],
    model: ModelRate | None,
    current: LoaderSettings,
    cpus: int,
    split: Split | None = None,
    model_on_cpu: bool = False,
    saturated: str | None = None,
) -> Conclusion:
    """The best setting, the kwargs to change, the predicted step and speed-up, and the advice.
    `saturated` (the run's CPU SATURATED, in a sentence): no setting with more workers than the
    loader has is chosen, whatever it made alone (training shares those cores)."""
    model_rate = model.batches_per_s if model is not None else None
    if saturated is not None:
        workers = int(current.get("num_workers") or 0)
        rows = [r for r in rows if r.setting.num_workers <= workers] or list(rows)
    rows = with_pace_figures(rows)
    best, fed = choose(rows, model_rate)
    if best is not None and not fed and model is not None:
        best = quickest(rows, model, cpus, model_on_cpu) or best
    notes: list[str] = []
    if best is None:
        return Conclusion(None, {}, False, None, None, ["No setting delivered a batch."], notes)
    changes = changes_from(best.setting, current)
    step = predicted_step_ms(best, model, cpus, model_on_cpu) if model is not None else None
    if step is not None and model is not None and not changes and model.step_ms:
        step = model.step_ms  # the loader as it is: the step the run measured
    speedup = model.step_ms / step if model is not None and model.step_ms and step else None
    advice = []
    name = best.setting.label()
    if model is None:
        advice.append(
            f"Fastest: {name} at {rate_text(best.batches_per_s)} batches/s. Without the model's "
            "rate the step cannot be predicted: run the training cell under %%traceml first, "
            "or pass compute_ms= (compute per step, ms)."
        )
    elif fed:
        who = f"{name} keeps" if changes else "Your loader keeps"
        advice.append(
            f"{who} the model fed: {rate_text(best.batches_per_s)} batches/s against the "
            f"model's {rate_text(model_rate)} ({(best.batches_per_s or 0) / (model_rate or 1):.1f}x)."
        )
        if step is not None and changes:
            text = f"Predicted step {_ms(step)}{step_parts(best, model, step)}"
            if speedup is not None and model.step_ms:
                text += f": {speedup:.1f}x faster than {model.source} ({_ms(model.step_ms)})"
            advice.append(text + ".")
    else:
        advice.append(
            f"No setting keeps the model fed: the best, {name}, makes "
            f"{rate_text(best.batches_per_s)} batches/s (a batch every "
            f"{ms_fine(1000.0 / (best.batches_per_s or 1.0))}) and the model takes "
            f"{rate_text(model_rate)} (one every {ms_fine(1000.0 / (model_rate or 1.0))})."
        )
        if step is not None:
            text = f"With it, predicted step {_ms(step)}{step_parts(best, model, step)}"
            if speedup is not None and model.step_ms:
                text += f" ({speedup:.1f}x faster than {model.source}, {_ms(model.step_ms)})"
            advice.append(text + ".")
        if split is not None:
            advice.append(split_sentence(split) + f" Make {costliest(split)} cheaper.")
    if best.setting.num_workers > 0 and best.startup_s is not None and best.startup_s >= 0.05:
        notes.append(
            f"Workers take {best.startup_s:.2f} s to start: with persistent_workers=True "
            "that is paid once, not at every epoch."
        )
    note = optimistic_note(split, best.setting.num_workers, cpus, model_on_cpu)
    if note is not None and model is not None and best.compute_ratio is None:
        notes.append(note)
    if saturated is not None:
        what = costliest(split) if split is not None else "each sample's work"
        advice.append(
            f"{saturated} More workers won't help while training shares these cores: make {what} "
            "cheaper, cache decoded samples, or move the work to the GPU."
        )
    return Conclusion(best, changes, fed, step, speedup, advice, notes)
