"""A traced run: the per-step hooks, the recorded steps, and the result users read."""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from .cuda_clock import CudaClock, cuda_in_use, gpu_memory_in_use
from .recorder import Recorder
from .summary import summarize, with_batch_size
from .textbox import report_text, verdict_box
from .verdict import Verdict, diagnose

if TYPE_CHECKING:
    import numpy as np

SCHEMA_VERSION = 1
REFRESH_NS = 250_000_000  # observers (the live view) run at most 4 times a second

Observer = Callable[["Run"], None]

_RUNS: list[Run] = []


def runs() -> list[Run]:
    """Every run of this kernel, oldest first."""
    return list(_RUNS)


def last() -> Run | None:
    """The most recent run, or None before any."""
    return _RUNS[-1] if _RUNS else None


def find_run(name: str) -> Run | None:
    for run in reversed(_RUNS):
        if run.name == name:
            return run
    return None


def batch_size_of(batch: Any) -> int | None:
    """Rows of the first tensor (or array) found in a batch: a tensor, a tuple/list, a dict,
    or any nesting of those (`enumerate` gives `(i, (x, y))`)."""
    queue: list[Any] = [batch]
    for _ in range(16):
        if not queue:
            return None
        item = queue.pop(0)
        shape = getattr(item, "shape", None)
        if shape is not None and len(shape):
            return int(shape[0])
        if isinstance(item, (tuple, list)):
            queue.extend(item[:8])
        elif isinstance(item, dict):
            queue.extend(list(item.values())[:8])
    return None


class Run:
    """One traced loop: hooks that time it while it runs, then its summary and verdict.

    While the loop runs, `loop(iterable)` wraps its iterator; the time blocked in `next()` is
    data wait, the time until the loop asks for the next batch is compute.
    """

    def __init__(self, name: str | None = None, warmup: int | None = None) -> None:
        self.name = name or f"run {len(_RUNS) + 1}"
        self.warmup = warmup
        self.started_at = time.time()
        self.recorder = Recorder()
        self.recorder.origin_ns = perf_counter_ns()
        self.batch_size: int | None = None
        self.batch_kind: str | None = None
        self.loop_line: int | None = None
        self.loop_where: str | None = None  # "this cell", "function train (cell In[3])", ...
        self.cell_source: str | None = None
        self.cell_filename: str | None = None
        self.loader_info: dict[str, Any] | None = None
        self.loader_ref: Callable[[], Any] | None = None
        self.expected_steps: int | None = None
        self.notes: list[str] = []
        self.error: str | None = None
        self.finished = False
        self.ended_at: float | None = None
        self._cuda: CudaClock | None = None
        self._gpu_used = False
        self._observers: list[Observer] = []
        self._next_tick = 0
        self._loops_started = 0
        self._summary: dict[str, Any] | None = None
        self._verdict: Verdict | None = None
        self.loader_seen: Callable[[], Any] | None = None  # last DataLoader whose __iter__ ran
        # Optional watches (sync_stalls.GpuWatch, line_costs): per-step columns they measure,
        # aligned to the recorder's steps on demand, and the few facts the verdict quotes.
        self.extra_columns: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
        self.watch_summary: dict[str, Any] = {}
        self.gpu_watch: Any = None  # has loop_started() and step_ended(t2); CUDA path only
        self.in_loop = False  # a pass of the step loop is running (CUDA path)
        self.h2d: dict[str, Any] | None = None  # host-to-device copies by line (h2d.py)
        self.sync_stalls: dict[str, Any] | None = None  # synchronising calls by line
        self.line_costs: dict[str, Any] | None = None  # ms per step of each body line
        self._gpu_samples: dict[str, Any] | None = None
        self.gpu_note: str | None = None  # why GPU figures are missing (nvml.py), else None
        self.gpu_device: str | None = None  # e.g. "NVIDIA H200, 0000:17:00.0, 143771 MiB"
        _RUNS.append(self)

    # -- hooks on the user's loop -----------------------------------------------------------
    def loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Iterate `iterable` as a plain for loop would, timing each fetch and each body."""
        if cuda_in_use():
            if self._cuda is None:
                self._cuda = CudaClock(self.recorder)
            self._gpu_used = self._gpu_used or gpu_memory_in_use()
            if self.gpu_watch is not None:
                self.gpu_watch.loop_started()
            return self._loop_cuda(iterable, self._cuda)
        return self._loop_cpu(iterable)

    def _loop_cpu(self, iterable: Iterable[Any]) -> Iterator[Any]:
        __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
        clock, add = perf_counter_ns, self.recorder.add
        t0 = clock()
        it = iter(iterable)
        try:
            item = next(it)
        except StopIteration:
            self._loop_started(iterable, None)
            return
        except BaseException:
            self._loop_started(iterable, None)  # the loader is still worth describing
            raise
        t1 = clock()
        self._loop_started(iterable, item)
        while True:
            try:
                yield item
            finally:
                t2 = clock()
                add(t0, t1, t2)
            t0 = t2
            if t2 >= self._next_tick:
                self._tick(t2)
                t0 = clock()  # the view's own time is nobody's data wait
            try:
                item = next(it)
            except StopIteration:
                return
            t1 = clock()

    def _loop_cuda(self, iterable: Iterable[Any], cuda: CudaClock) -> Iterator[Any]:
        __tracebackhide__ = True  # noqa: F841
        clock, add, mark, step = perf_counter_ns, self.recorder.add, cuda.mark, cuda.step
        ended = self.gpu_watch.step_ended if self.gpu_watch is not None else None
        self.in_loop = True
        try:
            t0 = clock()
            a = mark()
            it = iter(iterable)
            try:
                item = next(it)
            except StopIteration:
                self._loop_started(iterable, None)
                return
            except BaseException:
                self._loop_started(iterable, None)
                raise
            t1 = clock()
            b = mark()
            self._loop_started(iterable, item)
            while True:
                try:
                    yield item
                finally:
                    c = mark()
                    t2 = clock()
                    add(t0, t1, t2)
                    step(a, b, c)
                    if ended is not None:
                        ended(t2)
                t0, a = t2, c
                if t2 >= self._next_tick:
                    self._gpu_used = self._gpu_used or gpu_memory_in_use()
                    self._tick(t2)
                    t0, a = clock(), mark()  # the view's own time is nobody's data wait
                try:
                    item = next(it)
                except StopIteration:
                    return
                t1 = clock()
                b = mark()
        finally:
            self.in_loop = False

    def _loop_started(self, iterable: Any, first: Any) -> None:
        """Once per pass over the loader: note the loader, the batch size, the expected steps."""
        self._loops_started += 1
        if self._loops_started == 1:
            self._note_loader(iterable)
            if first is not None:
                self.batch_size = batch_size_of(first)
                self.batch_kind = type(first).__name__
                if self.batch_size is None:
                    self.notes.append(
                        f"Batches are {type(first).__name__}, not tensors: samples/s is not shown."
                    )

    def _note_loader(self, iterable: Any) -> None:
        from .dataloader_watch import describe_loader, unwrap_loader

        loader = unwrap_loader(iterable)
        if loader is None and self.loader_seen is not None:
            loader = self.loader_seen()
        if loader is None:
            return
        self.loader_info = describe_loader(loader)
        try:
            self.loader_ref = weakref.ref(loader)
        except TypeError:
            self.loader_ref = None
        try:
            self.expected_steps = len(iterable)  # type: ignore[arg-type,unused-ignore]
        except TypeError:
            self.expected_steps = self.loader_info.get("len")

    # -- observers (the live view) ---------------------------------------------------------
    def observe(self, observer: Observer) -> None:
        self._observers.append(observer)
        self._next_tick = 0

    def _tick(self, now: int) -> None:
        self._next_tick = now + REFRESH_NS
        for observer in list(self._observers):
            try:
                observer(self)
            except Exception as exc:  # a broken view must never stop training
                self._observers.remove(observer)
                self.notes.append(f"The live view stopped: {type(exc).__name__}: {exc}")

    # -- the end ---------------------------------------------------------------------------
    def finish(self, error: BaseException | None = None) -> Run:
        """Resolve pending GPU timings once, then compute the summary and the verdict."""
        if self.finished:
            return self
        if error is not None:
            self.error = f"{type(error).__name__}: {error}".rstrip(": ")
        if self._cuda is not None:
            try:
                self._cuda.synchronize()
            except Exception as exc:
                self.notes.append(f"GPU timings unavailable: {exc}")
            self._gpu_used = self._gpu_used or gpu_memory_in_use()
        self.finished = True
        self.ended_at = time.time()
        for observer in list(self._observers):
            try:
                observer(self)
            except Exception:
                pass
        self._observers.clear()
        return self

    def columns(self) -> dict[str, np.ndarray]:
        """The recorder's kept steps, with the columns of the optional watches and the NVML
        samples (gpu_util_pct, gpu_mem_used_mib) placed on the same steps."""
        cols = self.recorder.columns()
        for name, column in self.extra_columns.items():
            cols[name] = column(cols["step"])
        samples = self._gpu_samples
        if samples is not None and len(samples.get("time_s", ())):
            from .nvml import at_steps

            cols.update(at_steps(samples, cols["time_s"]))
        return cols

    @property
    def gpu_samples(self) -> dict[str, Any] | None:
        """NVML samples of the run's GPU (time_s, gpu_util_pct, gpu_mem_used_mib), set by the
        live view when it closes; setting them refreshes the summary."""
        return self._gpu_samples

    @gpu_samples.setter
    def gpu_samples(self, samples: dict[str, Any] | None) -> None:
        self._gpu_samples = samples
        self._summary, self._verdict = None, None

    def _analysis(self) -> tuple[dict[str, Any], Verdict]:
        if self._summary is None or self._verdict is None or not self.finished:
            rec = self.recorder
            summary = summarize(
                self.columns(), rec.n_steps, self.warmup, self._gpu_used, rec.totals()
            )
            summary.update(self.watch_summary)
            with_batch_size(summary, self.batch_size)
            verdict = diagnose(summary)
            if not self.finished:
                return summary, verdict
            self._summary, self._verdict = summary, verdict
        return self._summary, self._verdict

    # -- the result API --------------------------------------------------------------------
    @property
    def summary(self) -> dict[str, Any]:
        return self._analysis()[0]

    @property
    def verdict_detail(self) -> Verdict:
        return self._analysis()[1]

    @property
    def verdict(self) -> str:
        return self.verdict_detail.label

    @property
    def severity(self) -> str:
        return self.verdict_detail.severity

    @property
    def clock(self) -> str:
        return str(self.summary["clock"])

    @property
    def n_steps(self) -> int:
        return self.recorder.n_steps

    @property
    def steps(self) -> dict[str, Any]:
        """Per-step columns (numpy arrays): step, time_s, data_wait_ms, compute_ms, step_ms,
        and the GPU columns (NaN where not measured)."""
        return self.columns()

    def box(self) -> str:
        return verdict_box(self.verdict, self.summary)

    def text(self) -> str:
        v = self.verdict_detail
        head = f"traceml: {self.name} - {self.n_steps} steps"
        if self.loop_line is not None:
            head += f", loop on line {self.loop_line}"
        if self.loop_where and self.loop_where != "this cell":
            head += f" of {self.loop_where}"
        lines = [report_text(head, v.label, v.why, v.next, self.summary)]
        if self.error:
            lines.append(f"Stopped by: {self.error}")
        lines.extend(f"Note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<traceml run {self.name!r}: {self.verdict}, {self.n_steps} steps>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def to_dict(self) -> dict[str, Any]:
        """What --save writes: JSON-ready, unmeasured values as null."""
        cols = self.steps
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "verdict": self.verdict_detail.to_dict(),
            "summary": _jsonable(self.summary),
            "loop": {"line": self.loop_line, "where": self.loop_where},
            "loader": _jsonable(self.loader_info),
            "checklist": self._checklist(),
            "error": self.error,
            "notes": list(self.notes),
            "steps": {k: _jsonable(v.tolist()) for k, v in cols.items()},
            "stride": self.recorder.stride,
            "h2d": _jsonable(self.h2d),
            "sync_stalls": _jsonable(self.sync_stalls),
            "line_costs": _jsonable(self.line_costs),
        }

    def _checklist(self) -> list[dict[str, Any]] | None:
        from .report import checklist_for

        try:
            return checklist_for(self)
        except Exception as exc:
            self.notes.append(f"checklist unavailable: {type(exc).__name__}: {exc}")
            return None

    def save(self, path: str) -> str:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1, allow_nan=False)
        return path


def _jsonable(value: Any) -> Any:
    """NaN and infinities become null (unmeasured), containers are walked."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


@contextmanager
def trace(name: str | None = None, warmup: int | None = None, show: bool = True) -> Iterator[Run]:
    """Time a loop outside the magic (scripts, library code).

        with traceml_jupyter.trace("baseline") as run:
            for x, y in run.loop(loader):
                ...
        print(run.verdict)

    At the end the report is shown (printed outside IPython), also after an error.
    """
    run = Run(name, warmup)
    error: BaseException | None = None
    try:
        yield run
    except BaseException as exc:
        error = exc
        raise
    finally:
        run.finish(error)
        if show:
            from .display import show_report

            show_report(run)
