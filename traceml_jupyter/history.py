"""Where runs are found across kernels: the history directory every finished run is saved to
(`TRACEML_HISTORY=DIR`, or `%traceml history DIR` for this kernel), and what `compare` is given
(run names, JSON paths, globs) resolved to runs: this kernel's, a file's, the history's."""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

from .analysis.compare import Comparison, compare_summaries
from .analysis.loader_inside import compare_lines
from .capture.resources.host import usable_cpus
from .failures import failure_text
from .run import Run, find_run, runs
from .saved import LoadError, read_run, run_key

ENV = "TRACEML_HISTORY"
GLOB = re.compile(r"[*?\[]")
SLUG = re.compile(r"[^A-Za-z0-9._-]+")
# A history file: when the run started, then its name made safe for a file name.
FILE = re.compile(r"^\d{8}-\d{6}-\d{3}-(?P<slug>.+?)(?:~\d+)?\.json$")
# `%traceml history DIR` (or `off`) for this kernel: it wins over the environment variable.
_CHOSEN: dict[str, str | None] = {}


def history_dir() -> Path | None:
    """The directory runs are saved to, or None when there is none."""
    chosen = _CHOSEN["dir"] if "dir" in _CHOSEN else os.environ.get(ENV) or None
    return Path(chosen).expanduser() if chosen else None


def choose(directory: str | None) -> Path | None:
    """Save every run of this kernel to `directory` from now on (made if missing); None or
    "off": no more. Returns the directory."""
    if directory is None or directory.strip().lower() == "off":
        _CHOSEN["dir"] = None
        return None
    path = Path(directory).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{directory}: a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{directory}: cannot be made ({exc.strerror or exc})") from None
    _CHOSEN["dir"] = str(path)
    return path


def slug(name: str) -> str:
    """A run's name as a file name may hold it."""
    return SLUG.sub("_", name).strip("_")[:60] or "run"


def file_name(run: Run) -> str:
    """The run's file name in the history: its start time, then its name
    ("20250101-120000-123-run-3.json")."""
    started = run.started_at
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    return f"{stamp}-{int(started * 1000) % 1000:03d}-{slug(run.name)}.json"


def keep(run: Run, directory: Path) -> Path:
    """Save `run` into `directory` (compact JSON); a name taken already gets `~2`, `~3`..."""
    path = directory / file_name(run)
    n = 1
    while path.exists():
        n += 1
        path = directory / file_name(run).replace(".json", f"~{n}.json")
    text = json.dumps(run.to_dict(), separators=(",", ":"), allow_nan=False)
    partial = path.with_name(path.name + ".part")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)  # whole or not at all: a kernel killed mid-write leaves no torn run
    return path


def keep_in_history(run: Run) -> Path | None:
    """At the end of a run: save it into the history directory if there is one. Never raises;
    a failure is one line on stderr (the run and its report are unaffected)."""
    directory = history_dir()
    if directory is None or run.read_back:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return keep(run, directory)
    except Exception as exc:
        print(
            f"traceml: could not save {run.name} to the history {directory}: "
            f"{failure_text(exc)}",
            file=sys.stderr,
        )
        return None


def saved_runs(directory: Path) -> list[Path]:
    """The history's run files in `directory`, oldest first."""
    return sorted(p for p in directory.glob("*.json") if FILE.match(p.name))


def named_in_history(name: str, directory: Path) -> Run | None:
    """The latest run named `name` in the history (the files whose name can hold it are read)."""
    found: list[Run] = []
    for path in saved_runs(directory):
        match = FILE.match(path.name)
        if match is None or match.group("slug") != slug(name):
            continue
        try:
            run = read_run(path)
        except LoadError:
            continue  # a torn or foreign file among the history's: not this name
        if run.name == name:
            found.append(run)
    return max(found, key=lambda r: r.started_at) if found else None


# -- names, paths and globs -> runs ---------------------------------------------------------------


def _when(run: Run) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.started_at))


def _by_glob(pattern: str) -> Run:
    matches = sorted(glob.glob(os.path.expanduser(pattern)))
    directory = history_dir()
    if not matches and directory is not None and not os.path.isabs(pattern):
        matches = sorted(glob.glob(str(directory / pattern)))
    files = [m for m in matches if os.path.isfile(m)]
    if not files:
        raise LoadError(f"{pattern}: no file matches")
    if len(files) > 1:
        shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        raise LoadError(f"{pattern}: matches {len(files)} files ({shown}): name one")
    return read_run(files[0])


def _looks_like_path(text: str) -> bool:
    return text.lower().endswith(".json") or "/" in text or os.sep in text


def resolve(which: Run | str) -> Run:
    """A run itself; else the run a name, a JSON path or a glob stands for: a saved file, the
    latest run of this kernel with that name, the latest in the history with it. A name that
    stands for two different runs in two of those places is refused (ValueError, one line)."""
    if not isinstance(which, str):
        return which
    text = which.strip()
    if not text:
        raise ValueError("an empty run name")
    if GLOB.search(text) and not os.path.exists(os.path.expanduser(text)):
        return _by_glob(text)
    places: list[tuple[str, Run]] = []
    if os.path.isfile(os.path.expanduser(text)):
        places.append((f"the file {text}", read_run(text)))
    elif _looks_like_path(text) and find_run(text) is None:
        read_run(text)  # raises: no such file, or why it cannot be read
    here = find_run(text)
    if here is not None:
        places.append(("this kernel", here))
    directory = history_dir()
    saved = named_in_history(text, directory) if directory is not None else None
    if saved is not None:
        places.append((f"the history ({saved.path})", saved))
    distinct: dict[tuple[str, float], tuple[str, Run]] = {}
    for place, run in places:
        distinct.setdefault(run_key(run), (place, run))
    if len(distinct) > 1:
        (p1, r1), (p2, r2) = list(distinct.values())[:2]
        raise ValueError(
            f"{text!r} stands for two runs: in {p1} (started {_when(r1)}) and in {p2} "
            f"(started {_when(r2)}); name the file, or give the runs different --name"
        )
    if distinct:
        # The same run in several places: this kernel's object (it holds the most), else the file.
        return here if here is not None else next(iter(distinct.values()))[1]
    known = ", ".join(repr(r.name) for r in runs()) or "none yet"
    where = (
        f"nor in the history {directory}"
        if directory is not None
        else f"and no history directory is set ({ENV}=DIR or %traceml history DIR)"
    )
    raise ValueError(f"no run named {text!r} in this kernel (known: {known}) {where}")


def compare(a: Run | str | None = None, b: Run | str | None = None) -> Comparison:
    """Compare two runs given as Run objects, names, JSON paths or globs (see `resolve`): no
    argument, the last two runs of this kernel; one, that run against the latest."""
    __tracebackhide__ = True  # noqa: F841
    all_runs = runs()
    if a is None and b is None:
        if len(all_runs) < 2:
            raise ValueError(f"compare needs two runs; this kernel has {len(all_runs)}")
        run_a, run_b = all_runs[-2], all_runs[-1]
    elif a is None or b is None:
        run_a = resolve(a if a is not None else b)  # type: ignore[arg-type]
        if not all_runs:
            raise ValueError(f"compare {run_a.name!r} with what? This kernel has no run: name two")
        run_b = all_runs[-1]
        if run_a is run_b:
            raise ValueError(f"{run_a.name!r} is the latest run: name a second run to compare")
    else:
        run_a, run_b = resolve(a), resolve(b)
    workers = (run_b.result.data.loader or {}).get("num_workers")
    cpus = (run_b.machine or {}).get("cpus")
    comparison = compare_summaries(
        run_a.name, run_a.summary, run_a.verdict, run_b.name, run_b.summary, run_b.verdict,
        workers_b=workers if isinstance(workers, int) else None,
        cpus=cpus if isinstance(cpus, int) else usable_cpus(),
        steps_a=run_a.steps, steps_b=run_b.steps, machine_a=run_a.machine, machine_b=run_b.machine,
    )
    inside = compare_lines(run_a.result.data.inside, run_b.result.data.inside)  # docs/loader-inside.md
    return replace(comparison, notes=[*comparison.notes, *(f"inside the loader: {line}" for line in inside)])


def describe(directory: Path | None) -> str:
    """One line on where runs are saved."""
    if directory is None:
        return f"traceml: no history: runs are not saved (set {ENV}=DIR or %traceml history DIR)"
    n = len(saved_runs(directory)) if directory.is_dir() else 0
    return f"traceml: every run is saved to {directory} ({n} run{'s' if n != 1 else ''} there)"
