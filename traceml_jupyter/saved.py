"""Runs that outlive the kernel: a run read back from the JSON that `--save` (or the history)
wrote, as a frozen result that the same renderers show (the text box, the HTML report in a cell
or as a file, JSON) and that `compare` reads, like a run of this kernel.

Every schema version this package wrote loads: 1 (the first), and later ones whose added keys
are read where present and null where not; keys this version does not know are kept and
ignored. A file that is not a saved run (another JSON, an HTML report, a truncated write) is
refused with one line that says which file and why.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .analysis.verdict import Verdict
from .failures import failure_text
from .run import _RUNS, SCHEMA_VERSION, Run

# The schema versions this package has written: 1, and 2 (its added keys all nullable).
KNOWN_SCHEMAS = range(1, SCHEMA_VERSION + 1)
# Attributes a run's renderers read, by the key of `Run.to_dict` that holds them (a dotted key
# for a nested one), for the keys that are not in every version.
SAVED_ATTRIBUTES = {
    "cell_source": "cell.source",
    "loop_cell_source": "cell.loop_cell_source",
    "quoted_cells": "quoted_cells",
    "batch_size": "batch.size",
    "batch_kind": "batch.kind",
    "batches_per_step": "batch.per_step",
    "warmup": "warmup",
    "wall_ms": "wall_ms",
    "expected_steps": "expected_steps",
    "cuda_device": "gpu.cuda_device",
    "gpu_device": "gpu.device",
    "gpu_note": "gpu.note",
    "gpu_memory": "resources.gpu_memory",
    "held_before": "resources.held_before",
    "oom": "resources.oom",
    "processes": "processes",
    "loader_site": "loader_site",
    "dataset_site": "dataset_site",
}


class LoadError(ValueError):
    """A file that could not be read back as a run; the message is one line: 'PATH: why'."""


def _get(document: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    """(present, value) of a key of the document, dotted for a nested one."""
    value: Any = document
    for key in dotted.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return False, None
        value = value[key]
    return True, value


def read_document(path: str | Path) -> dict[str, Any]:
    """The JSON object of a saved run, checked enough that a run can be built from it."""
    shown = str(path)
    file = Path(path).expanduser()
    if not file.exists():
        raise LoadError(f"{shown}: no such file")
    if file.is_dir():
        raise LoadError(f"{shown}: a directory, not a saved run")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LoadError(f"{shown}: not a text file, so not a saved run") from None
    except OSError as exc:
        raise LoadError(f"{shown}: cannot be read ({exc.strerror or exc})") from None
    if text.lstrip()[:15].lower().startswith(("<!doctype", "<html")):
        raise LoadError(f"{shown}: an HTML report, not a saved run (load the .json of --save)")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise LoadError(f"{shown}: not valid JSON ({exc.msg} at {where})") from None
    except RecursionError:
        raise LoadError(f"{shown}: not valid JSON (nested too deep)") from None
    return check_document(document, shown)


def check_document(document: Any, shown: str) -> dict[str, Any]:
    """The document itself when it is a saved run of a known schema version; LoadError else."""
    if not isinstance(document, dict) or "schema_version" not in document:
        raise LoadError(f"{shown}: not a traceml run (a JSON file without schema_version)")
    version = document["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise LoadError(f"{shown}: not a traceml run (schema_version {version!r})")
    if version > KNOWN_SCHEMAS[-1]:
        raise LoadError(
            f"{shown}: written by a newer traceml_jupyter (schema_version {version}; this one "
            f"reads 1 to {KNOWN_SCHEMAS[-1]}): upgrade traceml_jupyter to load it"
        )
    if version < 1:
        raise LoadError(f"{shown}: not a traceml run (schema_version {version})")
    for key, kind in (("name", str), ("summary", dict), ("verdict", dict), ("steps", dict)):
        if not isinstance(document.get(key), kind):
            what = "missing" if key not in document else f"a {type(document[key]).__name__}"
            raise LoadError(f"{shown}: not a complete traceml run ({key} is {what})")
    if not isinstance(document["verdict"].get("label"), str):
        raise LoadError(f"{shown}: not a complete traceml run (the verdict has no label)")
    return document


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


REQUIRED_COLUMNS = ("step_ms", "data_wait_ms", "compute_ms")


def _column(name: str, values: Any) -> np.ndarray | None:
    if not isinstance(values, list):
        return None
    try:
        array = np.array(values, dtype=np.int64 if name == "step" else np.float64)
    except (TypeError, ValueError, OverflowError):
        return None
    if array.ndim != 1:
        return None
    array.flags.writeable = False
    return array


def _columns(steps: Mapping[str, Any], shown: str) -> dict[str, np.ndarray]:
    """The saved per-step columns as read-only numpy arrays (null: NaN). The step's own columns
    must be numbers, all of one length; another column that is not (a later version's column
    of another kind, a column left null) is left out."""
    out: dict[str, np.ndarray] = {}
    for name in REQUIRED_COLUMNS:
        array = _column(name, steps.get(name))
        if array is None:
            what = "missing" if name not in steps else "not a list of numbers"
            raise LoadError(f"{shown}: steps.{name} is {what}")
        out[name] = array
    lengths = {len(a) for a in out.values()}
    if len(lengths) > 1:
        raise LoadError(f"{shown}: the per-step columns have different lengths {sorted(lengths)}")
    n = lengths.pop()
    for name, values in steps.items():
        array = _column(str(name), values) if name not in out else None
        if array is not None and len(array) == n:
            out[str(name)] = array
    if "step" not in out:
        out["step"] = np.arange(n, dtype=np.int64)
        out["step"].flags.writeable = False
    return out


def host_from_json(host: Any) -> dict[str, Any] | None:
    """The host's samples as the report's plots read them (numpy columns, null: NaN), from
    their JSON (a saved run's, a child process's end)."""
    if not isinstance(host, Mapping):
        return None
    out: dict[str, Any] = dict(host)
    out["samples"] = {
        k: np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)
        for k, values in (out.get("samples") or {}).items()
        if isinstance(values, list)
    }
    return out


class SavedRun(Run):
    """A run read back from its saved JSON (`traceml_jupyter.load`): a frozen result. Its
    summary, verdict, checklist and per-step columns are the ones saved (not computed again
    here); `text()`, the report, `steps`, `compare` and `save` read them as they read a run of
    this kernel. `path` is the file it came from; `unsaved` names what the file did not hold
    (an older version wrote fewer keys: those read None). Nothing of it can be changed."""

    frozen = True

    def __init__(self, document: Mapping[str, Any], path: str = "") -> None:
        shown = path or "the document"
        document = check_document(dict(document), shown)
        summary = document["summary"]
        super().__init__(str(document["name"]), None)
        _RUNS.remove(self)  # not a run of this kernel until load() says so
        self.path = path
        self.document = document
        self.schema_version = int(document["schema_version"])
        self._saved_columns = _columns(document["steps"], shown)
        verdict = document["verdict"]
        evidence = [
            (str(row[0]), str(row[1]))
            for row in verdict.get("evidence") or []
            if isinstance(row, (list, tuple)) and len(row) == 2
        ]
        self._saved_summary = dict(summary)
        self._saved_verdict = Verdict(
            str(verdict["label"]),
            str(verdict.get("severity") or "info"),
            str(verdict.get("why") or ""),
            str(verdict.get("next") or ""),
            evidence,
        )
        n_steps = summary.get("n_steps")
        self._n_steps = int(n_steps) if isinstance(n_steps, int) else len(self._saved_columns["step"])
        started = _float(document.get("started_at"))
        self.started_at = started if started is not None else math.nan
        self.ended_at = _float(document.get("ended_at"))
        loop = document.get("loop") or {}
        step = document.get("step") or {}
        self.loop_line = loop.get("line") if isinstance(loop.get("line"), int) else None
        self.loop_where = loop.get("where")
        self.step_kind = str(step.get("kind") or summary.get("step_kind") or "none")
        self.step_definition = str(
            step.get("definition") or summary.get("step_definition") or "no step ran"
        )
        self.loader_info = document.get("loader")
        self.sources = list(document.get("sources") or [])
        self.phases = list(document.get("phases") or [])
        self.checklist = document.get("checklist")
        self.error = document.get("error")
        self.notes = [str(n) for n in document.get("notes") or []]
        self.h2d = document.get("h2d")
        self.sync_stalls = document.get("sync_stalls")
        self.line_costs = document.get("line_costs")
        self.ranks = document.get("ranks")
        self.model_compiled = bool(summary.get("model_compiled"))
        unsaved = set()
        for attribute, key in SAVED_ATTRIBUTES.items():
            present, value = _get(document, key)
            setattr(self, attribute, value)
            if not present:
                unsaved.add(attribute)
        self.batch_size = self.batch_size or summary.get("batch_size")
        self.batches_per_step = self.batches_per_step or summary.get("batches_per_step")
        present, machine = _get(document, "machine")
        self._machine = dict(machine) if isinstance(machine, Mapping) else None
        if not present:
            unsaved.add("machine")
        gpu: Mapping[str, Any] = document["gpu"] if isinstance(document.get("gpu"), Mapping) else {}
        samples = gpu.get("samples")
        self._gpu_samples = (
            {k: np.asarray(v, dtype=np.float64) for k, v in samples.items()}
            if isinstance(samples, Mapping)
            else None
        )
        self._gpu_used = bool(gpu.get("used")) or summary.get("clock") == "gpu"
        present, host = _get(document, "resources.host")
        self.host = host_from_json(host)
        if not present:
            unsaved.add("host")
        self.finished = True
        self.unsaved = frozenset(unsaved)
        self._result = replace(self._freeze(), unsaved=self.unsaved)
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"a run read back from its file is a frozen result: {name} stays as saved")
        super().__setattr__(name, value)

    # -- what the renderers read, as saved -----------------------------------------------------
    def _analysis(self, cols: dict[str, np.ndarray]) -> tuple[dict[str, Any], Verdict]:
        return self._saved_summary, self._saved_verdict

    def _read_columns(self) -> dict[str, np.ndarray]:
        return dict(self._saved_columns)

    def _describe_machine(self) -> dict[str, Any] | None:
        return self._machine

    @property
    def n_steps(self) -> int:
        """The steps the saved run recorded."""
        return self._n_steps

    @property
    def key(self) -> tuple[str, float]:
        """What tells it apart from other runs: its name and when it started (run_key)."""
        return run_key(self)

    def to_dict(self) -> dict[str, Any]:
        """The document as it was read (saving it again writes the same run)."""
        return copy.deepcopy(self.document)

    def __repr__(self) -> str:
        where = f" from {self.path}" if self.path else ""
        return f"<traceml run {self.name!r}{where}: {self.verdict}, {self.n_steps} steps>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        """In a notebook, the report as the cell showed it; the text box elsewhere."""
        from .views.display import ReportDisplay

        return ReportDisplay(self)._repr_mimebundle_(include, exclude)


def run_key(run: Run) -> tuple[str, float]:
    """What tells runs apart across kernels and files: the name and when the run started."""
    return run.name, float(run.started_at)


def read_run(path: str | Path) -> SavedRun:
    """The run saved at `path` (LoadError: one line saying which file and why)."""
    shown = str(path)
    document = read_document(path)
    try:
        return SavedRun(document, shown)
    except LoadError:
        raise
    except Exception as exc:  # a field of an unexpected type: the file, not our code
        raise LoadError(f"{shown}: not a readable traceml run ({failure_text(exc)})") from None


def load(path: str | Path) -> SavedRun:
    """Read a run saved with `--save PATH.json`, `run.save(...)` or the history, in any schema
    version this package wrote. It joins this kernel's runs (`runs()`, and `compare` finds it
    by name), unless a run of the same name and start is there already."""
    __tracebackhide__ = True  # noqa: F841
    run = read_run(path)
    if all(run_key(other) != run.key for other in _RUNS):
        _RUNS.append(run)
    return run
