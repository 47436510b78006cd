"""The arithmetic of `%traceml tune`, pure: which loader settings to measure, which measured one
keeps the model fed, the predicted step and speed-up, the line to write, and where a batch's time
goes. No torch, no timing, no display: tune.py measures, this decides."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .figures import ms as _ms

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

    def kwargs(self) -> dict[str, Any]:
        """What the candidate's DataLoader is built with."""
        out: dict[str, Any] = {"num_workers": self.num_workers}
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

    def to_dict(self) -> dict[str, Any]:
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
        }


@dataclass(frozen=True)
class ModelRate:
    """How fast the model takes batches: median compute per step and batches per step, from a
    `%%traceml` run (`source` names it) or from `compute_ms=`."""

    compute_ms: float
    batches_per_step: float = 1.0
    source: str = "compute_ms"
    step_ms: float | None = None  # the run's median step: the base of the predicted speed-up

    @property
    def batches_per_s(self) -> float:
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
        if self.getitem_ms is None or not self.samples_per_batch:
            return None
        return self.getitem_ms / self.samples_per_batch

    @property
    def other_ms(self) -> float:
        known = sum(v for v in (self.getitem_ms, self.collate_ms, self.pin_ms) if v is not None)
        return max(0.0, self.batch_ms - known)

    def to_dict(self) -> dict[str, Any]:
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
    changes: dict[str, Any]  # DataLoader kwargs to change (empty: keep the loader as it is)
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


def parse_workers(text: str) -> list[int]:
    """`--workers 0,1,2,4` as sorted, distinct counts; ValueError with the reason otherwise."""
    counts = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"--workers takes counts like 0,1,2,4; got {text!r}")
        counts.add(int(part))
    if not counts:
        raise ValueError("--workers needs at least one count, like 0,1,2,4")
    return sorted(counts)


def required_rate(num_workers: int, model_batches_per_s: float) -> float:
    """The batches a second a setting must make to keep the model fed."""
    if num_workers == 0:
        return model_batches_per_s * (1 - SERIAL_SHARE) / SERIAL_SHARE
    return model_batches_per_s * KEEP_FED


def keeps_up(row: Row, model_batches_per_s: float | None) -> bool:
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


def predicted_step_ms(row: Row, model: ModelRate) -> float | None:
    """The step with this setting: loading overlaps compute with workers (the slower of the
    two bounds the step), and adds to it without."""
    if row.batches_per_s is None or row.batches_per_s <= 0:
        return None
    load_ms = model.batches_per_step * 1000.0 / row.batches_per_s
    if row.setting.num_workers == 0:
        return model.compute_ms + load_ms
    return max(model.compute_ms, load_ms)


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


def changes_from(setting: Setting, current: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments to change on the user's loader to get `setting`."""
    out: dict[str, Any] = {}
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
    current: Mapping[str, Any] | None = None,
) -> str:
    """The line to write: `DataLoader(dataset, batch_size=64, num_workers=3, persistent_workers=True)`.

    `batch` is how the loader batches, as written (`batch_size=64, shuffle=True` or
    `batch_sampler=sampler`); `current` adds the other settings already on, so the line is whole.
    """
    parts = [dataset]
    if batch:
        parts.append(batch)
    merged: dict[str, Any] = {}
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
            f"{split.source} {_ms_fine(per_sample)} a sample x {samples:.0f}"
            + _share(split.getitem_ms, split.batch_ms)
        )
    elif split.getitem_ms is not None:
        parts.append(
            f"{split.source} {_ms_fine(split.getitem_ms)}"
            + _share(split.getitem_ms, split.batch_ms)
        )
    if split.collate_ms is not None:
        parts.append(
            f"collate_fn {_ms_fine(split.collate_ms)}" + _share(split.collate_ms, split.batch_ms)
        )
    if split.pin_ms is not None:
        parts.append(f"pinning {_ms_fine(split.pin_ms)}" + _share(split.pin_ms, split.batch_ms))
    parts.append(f"the rest {_ms_fine(split.other_ms)}" + _share(split.other_ms, split.batch_ms))
    return f"At num_workers=0 a batch takes {_ms_fine(split.batch_ms)}: " + ", ".join(parts) + "."


def _ms_fine(value: float) -> str:
    """Milliseconds with digits enough for a per-sample cost: "0.042 ms", "2.05 ms", "16.4 ms"."""
    if value >= 10:
        return _ms(value)
    if value >= 0.1:
        return f"{value:.2f} ms"
    return f"{value:.3f} ms"


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
    current: Mapping[str, Any],
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
    best, fed = choose(rows, model_rate)
    notes: list[str] = []
    if best is None:
        return Conclusion(None, {}, False, None, None, ["No setting delivered a batch."], notes)
    changes = changes_from(best.setting, current)
    step = predicted_step_ms(best, model) if model is not None else None
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
            text = f"Predicted step {_ms(step)}"
            if speedup is not None and model.step_ms:
                text += f": {speedup:.1f}x faster than {model.source} ({_ms(model.step_ms)})"
            advice.append(text + ".")
    else:
        advice.append(
            f"No setting keeps the model fed: the fastest, {name}, makes "
            f"{rate_text(best.batches_per_s)} batches/s (a batch every "
            f"{_ms_fine(1000.0 / (best.batches_per_s or 1.0))}) and the model takes "
            f"{rate_text(model_rate)} (one every {_ms_fine(1000.0 / (model_rate or 1.0))})."
        )
        if step is not None:
            text = f"With it, predicted step {_ms(step)}"
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
    if note is not None and model is not None:
        notes.append(note)
    if saturated is not None:
        what = costliest(split) if split is not None else "each sample's work"
        advice.append(
            f"{saturated} More workers won't help while training shares these cores: make {what} "
            "cheaper, cache decoded samples, or move the work to the GPU."
        )
    return Conclusion(best, changes, fed, step, speedup, advice, notes)


def loader_expression(line: str) -> str:
    """LOADER of `%traceml tune LOADER --budget 10` as typed (quotes kept: `loaders["train"]`):
    the line without the word `tune` and the options."""
    text = re.sub(r"(?<!\S)--(?:budget|workers)(?:=|\s+)\S+", " ", line)
    text = re.sub(r"^\s*tune(?:\s|$)", "", text)
    return text.strip()
