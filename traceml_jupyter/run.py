"""The run users hold: a handle with its name, the recording its capture writes into while
the cell runs (recording.py), and its result once it has finished (result/: the RunResult
value, its codec and text renderers); and this kernel's runs (runs, last, find_run). The
capture does the measuring; views render the result."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from . import kernel_state
from . import result as render
from .analysis.checklist.facts import ItemRow
from .analysis.summary_keys import Straggler, Summary
from .analysis.verdict import Verdict
from .recording import REFRESH_NS, Observer, Recording
from .result import SCHEMA_VERSION, RunResult

if TYPE_CHECKING:
    import numpy as np

__all__ = ["REFRESH_NS", "SCHEMA_VERSION", "Observer", "Recording", "Run", "RunResult", "find_run", "last", "runs"]


def runs() -> list[Run]:
    """Every run of this kernel, oldest first."""
    return list(kernel_state.RUNS)


def last() -> Run | None:
    """The most recent run, or None before any."""
    return kernel_state.RUNS[-1] if kernel_state.RUNS else None


def find_run(name: str) -> Run | None:
    """The latest run of this kernel with that name, or None."""
    return next((run for run in reversed(kernel_state.RUNS) if run.name == name), None)


class Run:
    """One traced run, as users hold it: its name, the recording its capture writes into while
    the cell runs (`run.recording`), and, once it has finished, its result (`run.result`, a
    RunResult: summary, verdict, per-step columns, what ran and on what). `summary`, `verdict`,
    `steps`, `text()`, `to_dict()`, `save()` read that result, and the views render it. When the
    run finishes its recording goes (its per-step buffers freed): the result holds what it
    measured.

    Steps are what the training does (step_model.py): one optimizer step, else one backward(),
    else one iteration of the located loop, else the interval between two batches.

    A run read back from its file (`traceml_jupyter.load`, `Run(result=..., path=...)`) holds
    its result alone: `read_back` is True, `path` the file it came from.

    What the kernel still reads of the live objects once the run has finished: `loader_ref`
    and `loader_name` (the training DataLoader and its name, for tune and the checklist) and
    `loops_started`.
    """

    def __init__(
        self, name: str | None = None, warmup: int | None = None, *, result: RunResult | None = None, path: str = ""
    ) -> None:
        self.name = result.name if result is not None else name or f"run {len(kernel_state.RUNS) + 1}"
        self.read_back = result is not None  # from its file: nothing of it is live
        self.path = path
        self.loader_ref: Callable[[], Any] | None = None
        self.loader_name: str | None = None
        self.loops_started = 0
        self._result: RunResult | None = result
        self._recording: Recording | None = None
        if result is None:
            self._recording = Recording(self.name, warmup)
            kernel_state.RUNS.append(self)

    # -- while it runs ----------------------------------------------------------------------
    @property
    def recording(self) -> Recording:
        """What the capture, the ranks and the child processes write while the run records
        (RuntimeError once it has finished: its result holds what it measured)."""
        if self._recording is None:
            raise RuntimeError(f"{self.name}: finished, its recording is gone (read run.result)")
        return self._recording

    @property
    def finished(self) -> bool:
        """The run has finished (or was read back from its file): `result` is frozen."""
        return self._recording is None or self._recording.finished

    def loop(self, iterable: Iterable[Any]) -> Iterable[Any]:
        """Iterate `iterable` as a plain for loop would, timing each fetch and each iteration
        (the `trace()` API; inside `%%traceml` the located loop is wrapped for you)."""
        return iterable if self._recording is None else self._recording.loop(iterable)

    def current_step(self) -> int | None:
        """Index of the step being run on the capture's thread; None elsewhere or between runs."""
        return None if self._recording is None else self._recording.current_step()

    def observe(self, observer: Observer) -> None:
        """Call `observer` with the recording at its ticks from the next step on (at most 4
        times a second), and once when the run finishes (a raise removes it, with a note)."""
        self.recording.observe(observer)

    def stop_observing(self, observer: Observer) -> None:
        """`observer` is called no more (nothing happens if it was not observing)."""
        if self._recording is not None:
            self._recording.stop_observing(observer)

    # -- the end ---------------------------------------------------------------------------
    def finish(self, error: BaseException | None = None) -> Run:
        """Close the run (after its capture): its result is frozen (`result`), the views draw
        their final state from it, and the recording goes."""
        recording = self._recording
        if recording is None:
            return self
        self._result = recording.finish(error)
        self.loader_ref, self.loader_name = recording.loader_ref, recording.loader_name
        self.loops_started = recording.loops_started
        self._recording = None
        return self

    # -- the result --------------------------------------------------------------------------
    @property
    def result(self) -> RunResult:
        """What the run measured and concluded (a RunResult), frozen when the run finished;
        before, what the recording holds so far (computed again at each read)."""
        if self._result is not None:
            return self._result
        return self.recording.result

    def keep_reading(self, checklist: Sequence[ItemRow] | None, quoted_cells: dict[str, str] | None) -> None:
        """What the kernel read once the run finished (kernel/code_facts.read_kernel_at_end): the
        checklist as evaluated and the cells the report quotes. The result becomes a new value
        that holds them (the one before is left as it was)."""
        self._result = self.result.with_reading(checklist, quoted_cells)

    @property
    def notes(self) -> list[str]:
        """What could not be measured or shown: the recording's notes while it runs (a note of
        ours goes there), a copy of the result's once finished."""
        return self._recording.notes if self._recording is not None else list(self.result.notes)

    @property
    def started_at(self) -> float:
        """When the run started (time.time())."""
        return self.result.started_at if self._recording is None else self._recording.started_at

    # -- the result API: what `result` holds ------------------------------------------------
    @property
    def summary(self) -> Summary:
        """The medians, shares and counts the verdict read (every key: docs/api.md): a plain
        dict, copied from the result (changing it changes nothing of the run)."""
        return self.result.summary.copy()

    @property
    def verdict_detail(self) -> Verdict:
        """The verdict with its severity, why, what to try next and the evidence."""
        return self.result.verdict

    @property
    def verdict(self) -> str:
        """The verdict's label: INPUT-BOUND, COMPUTE-BOUND, ..."""
        return self.verdict_detail.label

    @property
    def severity(self) -> str:
        """The verdict's severity: "info", "warn" or "critical"."""
        return self.verdict_detail.severity

    @property
    def clock(self) -> str:
        """The clock the verdict read: "gpu" (CUDA events) or "cpu" (the wall clock)."""
        return str(self.summary["clock"])

    @property
    def n_steps(self) -> int:
        """The steps recorded."""
        return self._result.n_steps if self._result is not None else self.recording.n_steps

    @property
    def gpu_used(self) -> bool:
        """The loop ran on a CUDA device: its steps are timed with CUDA events too."""
        return self._result.gpu.used if self._result is not None else self.recording.gpu_used

    @property
    def machine(self) -> dict[str, Any] | None:
        """What the run ran on (python, torch, cuda, platform, cpu, cpus, gpu), read once the
        run has finished; None before (a plain dict, copied from the result)."""
        machine = self.result.machine
        return dict(machine) if machine is not None else None

    @property
    def straggler(self) -> Straggler | None:
        """Several ranks: {"rank", "cause": input|h2d|compute|unknown, "score"} of the rank that
        holds the others back (RANK STRAGGLER), else None (a plain dict)."""
        found = self.result.straggler
        return found.copy() if found is not None else None

    @property
    def steps(self) -> dict[str, np.ndarray]:
        """Per-step columns (numpy arrays): step, time_s, data_wait_ms, compute_ms, step_ms,
        and the GPU columns (NaN where not measured)."""
        return self.columns()

    def columns(self) -> dict[str, np.ndarray]:
        """The recorder's kept steps, with the columns of the optional watches and the NVML
        samples (gpu_util_pct, gpu_mem_used_mib) placed on the same steps: a plain dict of the
        result's read-only arrays (once finished), for pandas or numpy as they are."""
        return dict(self.result.columns) if self._result is not None else self.recording.columns()

    @property
    def unsaved(self) -> frozenset[str]:
        """Read back from a file: the result's fields its file did not hold (an older version
        wrote fewer keys); empty for a run of this kernel."""
        return self.result.unsaved

    @property
    def schema_version(self) -> int | None:
        """Read back from a file: the file's schema version; None for a run of this kernel."""
        return self.result.schema_version

    def box(self) -> str:
        """The verdict box alone."""
        return render.box(self.result)

    def lines_after_verdict(self) -> list[tuple[str, str]]:
        """(severity, text) of the lines after the verdict (result.lines_after_verdict)."""
        return render.lines_after_verdict(self.result)

    def text(self) -> str:
        """The text box (what a terminal prints; result.text)."""
        return render.text(self.result)

    def __repr__(self) -> str:
        where = f" from {self.path}" if self.path else ""
        return f"<traceml run {self.name!r}{where}: {self.verdict}, {self.n_steps} steps>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        """Read back from its file, in a notebook: the report as the cell showed it; else the
        text box."""
        if not self.read_back or not kernel_state.REPORT_BUNDLES:
            return {"text/plain": self.text()}
        return kernel_state.REPORT_BUNDLES[0](self, include, exclude)

    def to_dict(self) -> dict[str, Any]:
        """What --save writes: JSON-ready, unmeasured values as null (result.to_dict); a run read
        back writes what it read (keys of a later version included)."""
        return render.to_dict(self.result)

    def resources_dict(self) -> render.ResourcesRow:
        """What --save writes of the resources (result.resources_dict)."""
        return render.resources_dict(self.result)

    def save(self, path: str) -> str:
        """Write the run to `path`: the report as one standalone HTML page for `.html` (no
        script, no network: it opens in any browser), else JSON (what `traceml_jupyter.load`
        reads back)."""
        writer = kernel_state.FILE_WRITERS.get(os.path.splitext(path)[1].lower())
        if writer is not None:
            writer(self, path)
            return path
        if path.lower().endswith((".html", ".htm")):
            raise ValueError(f"{path}: no HTML writer (traceml_jupyter.views.display.register_views())")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1, allow_nan=False)
        return path
