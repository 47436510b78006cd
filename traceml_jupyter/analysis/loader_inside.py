"""Inside the DataLoader, in numbers and words (pure): the workers' records of a traced run
(capture/loader/) summarised per worker and per stage, the loop's data wait split into "the
workers were still producing" and "handing over", and the findings with the fix that fits
(docs/loader-inside.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from statistics import median
from typing import TypedDict

from .verdict import Verdict, VerdictLabel

MS = 1e6  # ns in a ms
SLOW_WORKER_RATIO = 2.0  # a worker this many times the median of the others
SLOW_SAMPLE_RATIO = 5.0  # a sample this many times the median sample
SLOW_SAMPLE_MIN_MS = 2.0  # and at least this long
SLOW_SAMPLES_KEPT = 8
LANE_BARS = 400  # batches the lane picture keeps (the first ones)
SLOWEST = 4  # (index, ns) pairs a worker's record holds


class WorkerRow(TypedDict):
    """One worker's batches: how many, their items, the mean time a batch in `__getitem__`,
    in `collate_fn` and in all (ms), the worker's busy time (ms) and the mean time an item."""

    worker: int
    pid: int
    batches: int
    items: int
    getitem_ms: float
    collate_ms: float
    batch_ms: float
    busy_ms: float
    item_ms: float | None


class SlowSample(TypedDict):
    """A sample among the slowest: its index (an IterableDataset's: its place in the worker's
    stream), its `__getitem__` time, the worker."""

    index: int
    ms: float
    worker: int


class LaneBar(TypedDict):
    """One batch in the lane picture, in ms from the cell's start: its start, the start of
    its collate, its end in the worker, when the training process received it (None: not matched)."""

    worker: int
    start_ms: float
    collate_ms: float
    end_ms: float
    received_ms: float | None


class LoaderInside(TypedDict, total=False):
    """What happened inside the DataLoader's workers (`data.inside`, docs/loader-inside.md):
    batches made, per worker, per batch the mean ms in `__getitem__`, in `collate_fn` and the
    hand-over (ready in the worker -> received by the loop), MB a batch, the median sample,
    the slowest samples, the loop's data wait on the batches matched split into producing and
    handing over, the lane picture's bars and the loop's waits beneath them ([asked, received]
    in ms from the cell's start), the pin-memory thread's ms a batch and batches."""

    batches: int
    received: int
    workers: list[WorkerRow]
    getitem_ms: float | None
    collate_ms: float | None
    batch_ms: float | None
    handover_ms: float | None
    mb_per_batch: float | None
    item_ms: float | None
    slow_samples: list[SlowSample]
    wait_ms: float | None
    producing_ms: float | None
    handing_over_ms: float | None
    lanes: list[LaneBar]
    waits: list[list[float]]
    pin_ms: float | None
    pinned: int


class Finding(TypedDict):
    """A finding inside the loader: its label, what was measured, the fix that fits."""

    label: str
    text: str
    fix: str


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(records: Sequence[Sequence[int]], receptions: Sequence[Sequence[int]], began_ns: int,
              pinned: Sequence[Sequence[int]] = ()) -> LoaderInside:  # fmt: skip
    """The workers' records (worker_side.RECORD: pid, worker, ordinal, start, collate start,
    end, getitem ns, items, bytes, SLOWEST (index, ns)), the loop's receptions (pid, wait
    start, received; in order per worker) and the pin-memory thread's batches (start, end) as
    the run keeps them. Every time: monotonic ns."""
    by_pid: dict[int, list[Sequence[int]]] = {}
    for r in records:
        by_pid.setdefault(r[0], []).append(r)
    workers: list[WorkerRow] = []
    samples: list[SlowSample] = []
    per_item: list[float] = []
    for pid, rows in sorted(by_pid.items(), key=lambda kv: (kv[1][0][1], kv[0])):
        rows.sort(key=lambda r: r[2])
        getitem = [r[6] / MS for r in rows]
        collate = [(r[5] - r[4]) / MS for r in rows]
        items = sum(r[7] for r in rows)
        per_item += [r[6] / MS / r[7] for r in rows if r[7]]
        for r in rows:
            samples += [SlowSample(index=r[9 + 2 * k], ms=r[10 + 2 * k] / MS, worker=r[1]) for k in range(SLOWEST) if r[9 + 2 * k] >= 0 or r[10 + 2 * k] > 0]
        workers.append(WorkerRow(
            worker=rows[0][1], pid=pid, batches=len(rows), items=items,
            getitem_ms=sum(getitem) / len(rows), collate_ms=sum(collate) / len(rows),
            batch_ms=sum((r[5] - r[3]) / MS for r in rows) / len(rows),
            busy_ms=sum((r[5] - r[3]) / MS for r in rows), item_ms=sum(getitem) / items if items else None,
        ))  # fmt: skip
    matched = _matched(by_pid, receptions)
    handover = [(got - max(ready, asked)) / MS for ready, asked, got in matched]
    producing = [max(0, ready - asked) / MS for ready, asked, got in matched]
    sizes = [r[8] for r in records if r[8] >= 0]
    samples.sort(key=lambda s: -s["ms"])
    n = len(records)
    return LoaderInside(
        batches=n, received=len(matched), workers=workers,
        getitem_ms=_mean([r[6] / MS for r in records]), collate_ms=_mean([(r[5] - r[4]) / MS for r in records]),
        batch_ms=_mean([(r[5] - r[3]) / MS for r in records]), handover_ms=_mean(handover),
        mb_per_batch=sum(sizes) / len(sizes) / 1e6 if sizes else None,
        item_ms=median(per_item) if per_item else None, slow_samples=samples[:SLOW_SAMPLES_KEPT],
        wait_ms=sum((got - asked) / MS for _, asked, got in matched) if matched else None,
        producing_ms=sum(producing) if matched else None, handing_over_ms=sum(handover) if matched else None,
        lanes=_lanes(records, by_pid, receptions, began_ns),
        waits=[[(asked - began_ns) / MS, (got - began_ns) / MS] for _, asked, got in list(receptions)[:LANE_BARS]],
        pin_ms=_mean([(t1 - t0) / MS for t0, t1 in pinned]), pinned=len(pinned),
    )  # fmt: skip


def _matched(by_pid: dict[int, list[Sequence[int]]], receptions: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """(ready in the worker, the loop asked, the loop received) of each batch received: the
    n-th batch the loop received from a worker is the n-th that worker made."""
    seen: dict[int, int] = {}
    out = []
    for pid, asked, got in receptions:
        k = seen.get(pid, 0)
        seen[pid] = k + 1
        rows = by_pid.get(pid)
        if rows is not None and k < len(rows):
            out.append((rows[k][5], asked, got))
    return out


def _lanes(records: Sequence[Sequence[int]], by_pid: dict[int, list[Sequence[int]]], receptions: Sequence[Sequence[int]], began_ns: int) -> list[LaneBar]:
    received: dict[tuple[int, int], int] = {}
    seen: dict[int, int] = {}
    for pid, _, got in receptions:
        k = seen.get(pid, 0)
        seen[pid] = k + 1
        received[(pid, k)] = got
    first = sorted(records, key=lambda r: r[3])[:LANE_BARS]
    ordinal = {id(r): k for rows in by_pid.values() for k, r in enumerate(rows)}
    bars = []
    for r in first:
        at = received.get((r[0], ordinal[id(r)]))
        bars.append(LaneBar(
            worker=r[1], start_ms=(r[3] - began_ns) / MS, collate_ms=(r[4] - began_ns) / MS,
            end_ms=(r[5] - began_ns) / MS, received_ms=(at - began_ns) / MS if at is not None else None,
        ))  # fmt: skip
    return bars


# -- findings ---------------------------------------------------------------------------------------


def slow_worker(inside: LoaderInside) -> Finding | None:
    """SLOW WORKER: one worker SLOW_WORKER_RATIO x the median of the others, a batch or in all
    (whichever ratio is the larger)."""
    rows = [w for w in inside.get("workers") or [] if w["batches"] >= 2]
    if len(rows) < 2:
        return None
    found: list[tuple[float, WorkerRow, float, str]] = []
    for per_batch in (True, False):
        values = [w["batch_ms"] if per_batch else w["busy_ms"] for w in rows]
        k = max(range(len(rows)), key=lambda i: values[i])
        others = median(v for i, v in enumerate(values) if i != k)
        if others > 0 and values[k] - others >= 1.0:
            found.append((values[k] / others, rows[k], others, "a batch" if per_batch else "in all"))
    if not found:
        return None
    ratio, worst, others, what = max(found, key=lambda f: f[0])
    if ratio < SLOW_WORKER_RATIO:
        return None
    ms = worst["batch_ms"] if what == "a batch" else worst["busy_ms"]
    text = f"worker {worst['worker']} took {ms:.1f} ms {what}, {ratio:.1f}x the others' median ({others:.1f} ms)"
    fix = ("uneven shards or a slow source in that worker: split an IterableDataset's items evenly "
           "across workers (get_worker_info()), check what that worker reads")
    return Finding(label="SLOW WORKER", text=text, fix=fix)


def slow_samples(inside: LoaderInside) -> Finding | None:
    """SLOW SAMPLES: samples SLOW_SAMPLE_RATIO x the median sample and at least SLOW_SAMPLE_MIN_MS."""
    typical = inside.get("item_ms")
    if typical is None:
        return None
    bar = max(SLOW_SAMPLE_RATIO * typical, SLOW_SAMPLE_MIN_MS)
    slow = [s for s in inside.get("slow_samples") or [] if s["ms"] >= bar]
    if not slow:
        return None
    shown = ", ".join(f"{s['index']} ({s['ms']:.0f} ms)" for s in slow[:6])
    text = f"indices {shown} against {typical:.2f} ms for the median sample"
    return Finding(label="SLOW SAMPLES", text=text, fix="look at what those indices read (a huge or corrupt file, an augmentation that retries)")


def dominant_stage(inside: LoaderInside) -> Finding | None:
    """The stage that takes most of a batch's making: GETITEM, COLLATE or TRANSFER, with its figure."""
    stages = {"GETITEM": inside.get("getitem_ms"), "COLLATE": inside.get("collate_ms"), "TRANSFER": inside.get("handover_ms")}
    known = {k: v for k, v in stages.items() if v is not None}
    if not known or sum(known.values()) <= 0:
        return None
    label = max(known, key=lambda k: known[k])
    ms, share = known[label], known[label] / sum(known.values())
    if label == "GETITEM":
        typical = inside.get("item_ms")
        each = f" ({typical:.2f} ms a sample)" if typical is not None else ""
        return Finding(label=label, text=f"{ms:.1f} ms a batch in __getitem__{each}, {share:.0%} of a batch's making",
                       fix="cache or pre-decode the samples, make __getitem__ cheaper, or more workers")
    if label == "COLLATE":
        return Finding(label=label, text=f"{ms:.1f} ms a batch in collate_fn, {share:.0%} of a batch's making",
                       fix="vectorise collate_fn (stack, pad once), or do the per-sample work in __getitem__")
    mb, pin = inside.get("mb_per_batch"), inside.get("pin_ms")
    size = f"{mb:.1f} MB a batch, " if mb is not None else ""
    pinning = f" (pinning {pin:.1f} ms of it)" if pin is not None else ""
    return Finding(label=label, text=f"{size}{ms:.1f} ms a batch handing it to the loop{pinning}, {share:.0%} of a batch's making",
                   fix="send smaller batches (uint8 or float16, converted in the step on the device)")


def wait_split(inside: LoaderInside) -> str | None:
    """The loop's data wait on the batches matched: producing vs handing over, in words."""
    wait, producing, handing = inside.get("wait_ms"), inside.get("producing_ms"), inside.get("handing_over_ms")
    if wait is None or producing is None or handing is None:
        return None
    return (f"the loop waited {wait:.0f} ms for {inside.get('received', 0)} batches: {producing:.0f} ms while the "
            f"workers were still producing them, {handing:.0f} ms handing them over")


def findings(inside: LoaderInside) -> list[Finding]:
    """The findings inside the loader, in order: a slow worker, slow samples, the dominant stage."""
    return [f for f in (slow_worker(inside), slow_samples(inside), dominant_stage(inside)) if f is not None]


def inside_lines(inside: LoaderInside | None) -> list[str]:
    """The text box's Also lines: each finding with its fix, then the wait's split."""
    if not inside or not inside.get("batches"):
        return []
    lines = [f"inside the loader, {f['label']}: {f['text']} - {f['fix']}" for f in findings(inside)]
    split = wait_split(inside)
    if split:
        lines.append(f"inside the loader, {split}")
    return lines


def next_step(inside: LoaderInside | None) -> str | None:
    """The Next line of an input-bound run when the stage that dominates is known."""
    stage = dominant_stage(inside) if inside and inside.get("batches") else None
    return f"{stage['label']} dominates inside the loader ({stage['text']}): {stage['fix']}" if stage else None


def inside_next(verdict: Verdict, inside: LoaderInside | None) -> Verdict:
    """An INPUT-BOUND verdict whose Next goes on with the stage that dominates inside the loader."""
    step = next_step(inside) if verdict.label == VerdictLabel.INPUT_BOUND else None
    return replace(verdict, next=f"{verdict.next} {step}") if step else verdict


def compare_lines(a: LoaderInside | None, b: LoaderInside | None) -> list[str]:
    """Two runs' stages side by side: "collate 40.0 -> 4.0 ms a batch"."""
    if not a or not b:
        return []
    out = []
    for key, name in (("getitem_ms", "__getitem__"), ("collate_ms", "collate"), ("handover_ms", "hand-over")):
        x, y = a.get(key), b.get(key)
        if isinstance(x, float) and isinstance(y, float):
            out.append(f"{name} {x:.1f} -> {y:.1f} ms a batch")
    return out
