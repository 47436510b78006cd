"""Runs that outlive the kernel: a run read back from the JSON that `--save` (or the history)
wrote — a `Run` holding the `RunResult` its file holds (result/codec.py reads every schema
version this package wrote), shown by the same renderers (the text box, the HTML report in a
cell or as a file, JSON) and compared like a run of this kernel. A file that is not a saved run
(another JSON, an HTML report, a truncated write) is refused with one line that says which
file and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import kernel_state
from .failures import failure_text
from .result.codec import LoadError, from_dict
from .run import Run

__all__ = ["LoadError", "load", "read_document", "read_run", "run_key"]


def read_document(path: str | Path) -> Any:
    """The JSON a file holds (LoadError: one line on why it is not JSON to read)."""
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
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise LoadError(f"{shown}: not valid JSON ({exc.msg} at {where})") from None
    except RecursionError:
        raise LoadError(f"{shown}: not valid JSON (nested too deep)") from None


def run_key(run: Run) -> tuple[str, float]:
    """What tells runs apart across kernels and files: the name and when the run started."""
    return run.name, float(run.started_at)


def read_run(path: str | Path) -> Run:
    """The run saved at `path`, holding the result its file holds (LoadError: one line saying
    which file and why)."""
    shown = str(path)
    document = read_document(path)
    try:
        result = from_dict(document, shown)
    except LoadError:
        raise
    except Exception as exc:  # a field of an unexpected type: the file, not our code
        raise LoadError(f"{shown}: not a readable traceml run ({failure_text(exc)})") from None
    return Run(result=result, path=shown)


def load(path: str | Path) -> Run:
    """Read a run saved with `--save PATH.json`, `run.save(...)` or the history, in any schema
    version this package wrote. It joins this kernel's runs (`runs()`, and `compare` finds it
    by name), unless a run of the same name and start is there already."""
    __tracebackhide__ = True  # noqa: F841
    run = read_run(path)
    if all(run_key(other) != run_key(run) for other in kernel_state.RUNS):
        kernel_state.RUNS.append(run)
    return run
