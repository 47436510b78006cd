"""Inside the DataLoader, in numbers and words (pure): the workers' records of a traced run
(capture/loader/) summarised per worker and per stage, the loop's data wait split into "the
workers were still producing" and "handing over", and the findings with the fix that fits
(docs/loader-inside.md)."""

from __future__ import annotations

import signal
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
# The fields of a worker's record (capture/loader/worker_side.py): both kinds begin with these,
KIND, PID, WORKER, PASS, ORDINAL, TASK = range(6)
# then a BATCH record's (kind 0), after the fetch,
START, COLLATE, END, GETITEM, ITEMS, BYTES, SLOW = range(6, 13)
# and a STARTED record's (kind 1), before it: the number of samples, whether their indices run
# on from the first, the first indices (-1: none).
IN_BATCH, CONSECUTIVE, INDICES = 7, 8, 9
BATCH, STARTED = 0, 1
# What the capture hands over (capture/loader/watch.py's Watched): the records, the loop's
# receptions (pid, pass, task, asked, received), the start (ns), the pin-memory thread's
# batches (start, end), the loop's failed next() (worker, pid, pass, task, error) and the
# workers that ended with a code other than 0 (worker, pid, code; -N: signal N).
Watched = tuple[list[tuple[int, ...]], list[tuple[int, int, int, int, int]], int, list[tuple[int, int]],
                list[tuple[int, int, int, int, str]], list[tuple[int, int, int]]]  # fmt: skip


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
    in ms from the cell's start), the pin-memory thread's ms a batch and batches, the workers
    that stopped the loop (died, raised, late)."""

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
    stopped: list[WorkerStop]


class WorkerStop(TypedDict):
    """A worker that stopped the loop (died, raised, or was late past the loader's timeout):
    who, how (`died`: `code` is its exit code, or -N for signal N; `raised`; `late`), the
    error the loop got, the batch it was making (its first sample indices, how many, whether
    they run on from the first: "samples 40-47", whether they are an IterableDataset's places in
    the worker's stream; [] and None when not known) and the batches it had made before."""

    worker: int
    pid: int
    how: str
    code: int | None
    error: str | None
    samples: list[int]
    in_batch: int | None
    consecutive: bool
    stream: bool
    batches: int


class Finding(TypedDict):
    """A finding inside the loader: its label, what was measured, the fix that fits."""

    label: str
    text: str
    fix: str


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(records: Sequence[Sequence[int]], receptions: Sequence[Sequence[int]], began_ns: int,
              pinned: Sequence[Sequence[int]] = (), stops: Sequence[tuple[int, int, int, int, str]] = (),
              exits: Sequence[Sequence[int]] = ()) -> LoaderInside:  # fmt: skip
    """The workers' records (worker_side: BATCH and STARTED, the fields above), the loop's
    receptions (pid, pass, task, asked, received), the pin-memory thread's batches (start,
    end), the loop's failed next() and the workers' exit codes, as the run keeps them (Watched).
    Every time: monotonic ns."""
    batches = [r for r in records if r[KIND] == BATCH]
    by_pid: dict[int, list[Sequence[int]]] = {}
    for r in batches:
        by_pid.setdefault(r[PID], []).append(r)
    workers: list[WorkerRow] = []
    samples: list[SlowSample] = []
    per_item: list[float] = []
    for pid, rows in sorted(by_pid.items(), key=lambda kv: (kv[1][0][WORKER], kv[0])):
        rows.sort(key=lambda r: r[ORDINAL])
        getitem = [r[GETITEM] / MS for r in rows]
        items = sum(r[ITEMS] for r in rows)
        per_item += [r[GETITEM] / MS / r[ITEMS] for r in rows if r[ITEMS]]
        for r in rows:
            samples += [SlowSample(index=r[SLOW + 2 * k], ms=r[SLOW + 1 + 2 * k] / MS, worker=r[WORKER])
                        for k in range(SLOWEST) if r[SLOW + 2 * k] >= 0 or r[SLOW + 1 + 2 * k] > 0]  # fmt: skip
        workers.append(WorkerRow(
            worker=rows[0][WORKER], pid=pid, batches=len(rows), items=items,
            getitem_ms=sum(getitem) / len(rows), collate_ms=sum((r[END] - r[COLLATE]) / MS for r in rows) / len(rows),
            batch_ms=sum((r[END] - r[START]) / MS for r in rows) / len(rows),
            busy_ms=sum((r[END] - r[START]) / MS for r in rows), item_ms=sum(getitem) / items if items else None,
        ))  # fmt: skip
    made = {(r[PID], r[PASS], r[TASK]): r for r in batches if r[TASK] >= 0}
    matched = []  # (ready, asked, received) of each batch received: by its worker, pass and task
    for pid, passes, task, asked, got in receptions:
        batch = made.get((pid, passes, task))
        if batch is not None:
            matched.append((batch[END], asked, got))
    handover = [(got - max(ready, asked)) / MS for ready, asked, got in matched]
    producing = [max(0, ready - asked) / MS for ready, asked, got in matched]
    sizes = [r[BYTES] for r in batches if r[BYTES] >= 0]
    samples.sort(key=lambda s: -s["ms"])
    return LoaderInside(
        batches=len(batches), received=len(matched), workers=workers,
        getitem_ms=_mean([r[GETITEM] / MS for r in batches]), collate_ms=_mean([(r[END] - r[COLLATE]) / MS for r in batches]),
        batch_ms=_mean([(r[END] - r[START]) / MS for r in batches]), handover_ms=_mean(handover),
        mb_per_batch=sum(sizes) / len(sizes) / 1e6 if sizes else None,
        item_ms=median(per_item) if per_item else None, slow_samples=samples[:SLOW_SAMPLES_KEPT],
        wait_ms=sum((got - asked) / MS for _, asked, got in matched) if matched else None,
        producing_ms=sum(producing) if matched else None, handing_over_ms=sum(handover) if matched else None,
        lanes=_lanes(batches, made, receptions, began_ns),
        waits=[[(r[3] - began_ns) / MS, (r[4] - began_ns) / MS] for r in list(receptions)[:LANE_BARS]],
        pin_ms=_mean([(t1 - t0) / MS for t0, t1 in pinned]), pinned=len(pinned),
        stopped=stopped_workers(records, stops, exits),
    )  # fmt: skip


def _lanes(batches: Sequence[Sequence[int]], made: dict[tuple[int, int, int], Sequence[int]],
           receptions: Sequence[Sequence[int]], began_ns: int) -> list[LaneBar]:  # fmt: skip
    received = {id(made[(pid, passes, task)]): got for pid, passes, task, _, got in receptions if (pid, passes, task) in made}
    bars = []
    for r in sorted(batches, key=lambda r: r[START])[:LANE_BARS]:
        at = received.get(id(r))
        bars.append(LaneBar(
            worker=r[WORKER], start_ms=(r[START] - began_ns) / MS, collate_ms=(r[COLLATE] - began_ns) / MS,
            end_ms=(r[END] - began_ns) / MS, received_ms=(at - began_ns) / MS if at is not None else None,
        ))  # fmt: skip
    return bars


def stopped_workers(records: Sequence[Sequence[int]], stops: Sequence[tuple[int, int, int, int, str]],
                    exits: Sequence[Sequence[int]]) -> list[WorkerStop]:  # fmt: skip
    """The workers that stopped the loop: each that ended with a code other than 0 (died), else
    the worker whose batch the loop awaited when torch re-raised its error (raised) or when
    the loader's timeout passed (late); with the batch it was making (its last fetch STARTED
    and not done, for a worker that raised or was late: the batch awaited) and its batches made."""
    out: list[WorkerStop] = []
    errors = [text for *_, text in stops]
    for worker, pid, code in exits:
        error = next((text for w, p, *_, text in stops if p == pid), errors[0] if errors else None)
        out.append(_stop(records, worker, pid, "died", code, error, None))
    if out:
        return out
    for worker, pid, passes, task, text in stops:
        how = "late" if "DataLoader timed out" in text else "raised" if "in DataLoader worker process" in text else None
        if how is not None and pid >= 0:
            out.append(_stop(records, worker, pid, how, None, text, (passes, task)))
    return out[:1]


def _stop(records: Sequence[Sequence[int]], worker: int, pid: int, how: str, code: int | None,
          error: str | None, awaited: tuple[int, int] | None) -> WorkerStop:  # fmt: skip
    mine = [r for r in records if r[PID] == pid]  # (in the order the worker wrote them)
    done = {r[ORDINAL] for r in mine if r[KIND] == BATCH}
    if awaited is None:  # a worker that died: its last record, if a fetch it had begun
        last = mine[-1] if mine and mine[-1][KIND] == STARTED else None
    else:  # the fetch of the batch awaited, begun and not done
        last = next((r for r in mine if r[KIND] == STARTED and (r[PASS], r[TASK]) == awaited and r[ORDINAL] not in done), None)
    return WorkerStop(
        worker=worker, pid=pid, how=how, code=code, error=error,
        samples=[i for i in last[INDICES:] if i >= 0] if last else [], in_batch=last[IN_BATCH] if last else None,
        consecutive=bool(last[CONSECUTIVE]) if last else False, stream=bool(last and last[CONSECUTIVE] == 2),
        batches=len(done),
    )  # fmt: skip


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


CRASHES = {"SIGSEGV", "SIGABRT", "SIGILL", "SIGFPE"}  # native code that crashed


def stop_findings(inside: LoaderInside) -> list[Finding]:
    """Each worker that stopped the loop, named (WORKER DIED, WORKER RAISED, WORKER LATE) with
    what it was loading and the fix that fits how it stopped: critical."""
    return [_stop_finding(s) for s in inside.get("stopped") or []]


def _stop_finding(stop: WorkerStop) -> Finding:
    who = f"DataLoader worker {stop['worker']} (pid {stop['pid']})"
    samples = _samples(stop)
    loading = f" while loading {samples}" if samples else ""
    made = f", after {stop['batches']} batch{'es' if stop['batches'] != 1 else ''}"
    error = stop["error"] or ""
    if stop["how"] == "raised":
        kind = error.split(":", 1)[0] or "an error"
        return Finding(label="WORKER RAISED", text=f"{who} raised {kind}{loading}{made}",
                       fix="the traceback above is the worker's own: it names the line of __getitem__ (or collate_fn) that raised")
    if stop["how"] == "late":
        return Finding(label="WORKER LATE", text=f"{who} was still loading {samples or 'its batch'} when the loader's timeout passed{made}",
                       fix="a sample that takes longer than the DataLoader's timeout (a slow or stuck read): look at those samples, or a larger timeout")
    code = stop["code"]
    name = _signal_name(-code) if code is not None and code < 0 else None
    if code is None or code >= 0:
        how = f"exited with code {code}" if code is not None else "died"
        fix = ("__getitem__, or a library it calls, ended the process (os._exit, sys.exit in a worker, a C library's exit): "
               "load those samples with num_workers=0 to see where")
    elif name == "SIGKILL":
        how = "died (killed by signal 9, SIGKILL: out of memory?)"
        fix = ("the system's out-of-memory killer sends SIGKILL: fewer workers (num_workers), a smaller prefetch_factor or "
               "batch_size, or a dataset that does not hold copies of what it reads in each worker (`dmesg` shows the kill)")
    elif name == "SIGBUS":
        how = "died (signal 7, SIGBUS: shared memory full?)"
        fix = ("workers hand batches over in shared memory (/dev/shm): a larger one (a container's --shm-size), "
               "fewer workers or a smaller prefetch_factor")
    elif name in CRASHES:
        how = f"crashed (signal {-code}, {name})"
        fix = ("native code under __getitem__ crashed (an image, audio or video decoder, a C extension): load those samples "
               "with num_workers=0 to see which, and update or replace that library")
    else:
        how = f"died (killed by signal {-code}{', ' + name if name else ''})"
        fix = "something outside the loader ended it (a job scheduler, a resource limit, a kill): look at what sends that signal"
    return Finding(label="WORKER DIED", text=f"{who} {how}{loading}{made}", fix=fix)


def _signal_name(number: int) -> str | None:
    return {s.value: s.name for s in signal.Signals}.get(number)


def _samples(stop: WorkerStop) -> str:
    """"samples 40-47" ("samples 3, 17, ... (8 in the batch)" when they do not run on; "" unknown)."""
    samples, n = stop["samples"], stop["in_batch"]
    if not samples or not n:
        return ""
    if stop["stream"]:  # (an IterableDataset: no index, the items' places in the worker's stream)
        return f"item {samples[0]} of its stream" if n == 1 else f"items {samples[0]}-{samples[0] + n - 1} of its stream"
    if n == 1:
        return f"sample {samples[0]}"
    if stop["consecutive"]:
        return f"samples {samples[0]}-{samples[0] + n - 1}"
    shown = ", ".join(str(i) for i in samples[:6])
    return f"samples {shown}{', ...' if n > 6 else ''} ({n} in the batch)"


def findings(inside: LoaderInside) -> list[Finding]:
    """The findings inside the loader, in order: a slow worker, slow samples, the dominant stage."""
    return [f for f in (slow_worker(inside), slow_samples(inside), dominant_stage(inside)) if f is not None]


def stop_lines(inside: LoaderInside | None) -> list[str]:
    """The workers that stopped the loop, a line each with its fix (also under the one line of a
    cell that stopped before its first step)."""
    return [f"inside the loader, {f['label']}: {f['text']} - {f['fix']}" for f in stop_findings(inside)] if inside else []


def inside_lines(inside: LoaderInside | None) -> list[str]:
    """The text box's Also lines: each finding with its fix, then the wait's split."""
    if not inside:
        return []
    lines = stop_lines(inside) + [f"inside the loader, {f['label']}: {f['text']} - {f['fix']}" for f in findings(inside)]
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
