"""The package's layout shows the flow, and its imports point one way: capture (what runs while
the cell runs) and analysis (pure) import nothing above them, kernel reads what the kernel holds
(and the run), views read the run, the kernel and the analysis, the run never imports its views,
and no import cycle exists anywhere. tuning/ and ranks/ orchestrate, as magic.py does: nothing
below them imports them; failures.py (the guard that turns a failure of ours into a note) is
under every layer and imports nothing of the package. No module grows past MAX_MODULE_LINES, no
function past MAX_FUNCTION_LINES, but for the few listed (each with why it is still over)."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

PACKAGE = REPO / "traceml_jupyter"
# Packages and modules that drive the others (the top layer): nothing in capture, analysis,
# kernel, run or views imports them.
ORCHESTRATION = ("ranks", "tuning", "processes", "traced_cell", "tracing", "magic", "demo", "cli")
# Modules under every layer: any module may import them; they import nothing of the package
# (facts/: the shapes of what a run measures, shared by the capture, the result and the views).
BASE = ("failures", "kernel_state", "facts")

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# What is still over, at most its size today (it may shrink, not grow), and why it remains.
# An entry that falls under the limit must leave the list.
LONG_MODULES: dict[str, int] = {}
LONG_FUNCTIONS: dict[str, int] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def imports_of(path: Path, for_types: bool = False) -> set[str]:
    """Package modules `path` imports at run time: at top level or inside functions; with
    `for_types`, also those under `if TYPE_CHECKING:` (for the type checker only)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()

    def resolve(level: int, module: str | None) -> str:
        base = package.split(".") if package else []
        if level > 1:
            base = base[: len(base) - (level - 1)]
        return ".".join([*base, *([module] if module else [])])

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not for_types and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    target = resolve(child.level, child.module)
                    for alias in child.names:
                        sub = f"{target}.{alias.name}" if target else alias.name
                        found.add(sub if (PACKAGE / sub.replace(".", "/")).with_suffix(".py").exists()
                                  or (PACKAGE / sub.replace(".", "/") / "__init__.py").exists() else target)
                elif child.module and child.module.startswith("traceml_jupyter"):
                    found.add(child.module.removeprefix("traceml_jupyter").lstrip("."))
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    found.discard(here)
    return found


@functools.lru_cache(maxsize=2)
def _graph(for_types: bool) -> tuple[tuple[str, frozenset[str]], ...]:
    return tuple((module_name(p), frozenset(imports_of(p, for_types))) for p in PACKAGE.rglob("*.py"))


def graph(for_types: bool = False) -> dict[str, set[str]]:
    """The package's imports, module by module (read once a test session; a fresh copy each call)."""
    return {module: set(targets) for module, targets in _graph(for_types)}


def layer(module: str) -> str:
    if module.split(".")[0] in BASE:
        return "base"
    head = module.split(".")[0]
    if head in ("capture", "analysis", "result", "kernel", "views"):
        return head
    return "run" if module in ("run", "recording", "run_summary") else "top"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among `edges`, each as the modules around it (the first one again last)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt in edges and state.get(nxt) is None:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if state.get(node) is None:
            walk(node)
    return found


def test_no_module_of_the_package_imports_itself_back() -> None:
    """No import cycle, counting the imports for the type checker too (`if TYPE_CHECKING:`)."""
    found = cycles(graph(for_types=True))
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_imports_point_one_way_capture_analysis_run_views() -> None:
    allowed = {
        "base": set(),
        "capture": {"base", "capture"},
        "analysis": {"base", "analysis"},
        # A finished run as a value: nothing of the capture, torch or IPython.
        "result": {"base", "analysis", "result"},
        "run": {"base", "capture", "analysis", "result", "run"},
        "kernel": {"base", "capture", "analysis", "result", "run", "kernel"},
        "views": {"base", "capture", "analysis", "result", "run", "kernel", "views"},
        "top": {"base", "capture", "analysis", "result", "run", "kernel", "views", "top"},
    }
    wrong = [
        f"{module} ({layer(module)}) imports {target} ({layer(target)})"
        for module, targets in graph().items()
        for target in targets
        if layer(target) not in allowed[layer(module)]
    ]
    assert not wrong, "\n".join(wrong)


# What reads a finished run reads its result (result/), never the recording or the capture: the
# views, the kernel's reading, the history and compare, the files, tune. Counting imports for the
# type checker too. The live view reads the live recording through a read-only protocol
# (views/live_header.LiveRecording), the kernel's reading the finished handle through another
# (kernel/cells.FinishedRun).
READS_RESULTS = ("views", "kernel", "tuning", "history", "saved")
NOT_FOR_READERS = ("capture", "recording", "run_summary", "run")
# Edges that still break the rule, each with why (the list may only shrink).
READERS_ALLOWED = {
    # load() hands out the handle users hold, a Run holding the RunResult its file holds.
    "saved -> run": "load() returns a Run (the handle) holding the file's RunResult",
    # compare and resolve name this kernel's runs and hand out Run handles.
    "history -> run": "resolve/compare take and return Run handles (runs, find_run)",
    # One CPU count helper for the package, written once, in the capture's host sampler.
    "history -> capture.resources.host": "compare's CPU count (usable_cpus)",
    "tuning.sweep -> capture.resources.host": "tune's CPU count (usable_cpus)",
    # Pure helpers of the capture that the kernel's reading and the report use (to move to
    # analysis/ with their capture halves split off).
    "kernel.code_facts -> capture.data.dataloaders": "the loader's settings and site, read as the capture reads them",
    "kernel.code_facts -> capture.data.sources": "the training source's label",
    "kernel.code_facts -> capture.gpu.gpu_watch": "the copies' and syncs' facts for the checklist",
    "kernel.code_facts -> capture.gpu.syncs": "the sync calls' names",
    "kernel.code_facts -> capture.resources.host": "the CPU count for the workers' advice",
    "views.loop_passes -> capture.instrument.locate": "range_call: the pass count read off the loop",
    "views.report_code -> capture.inside.line_costs": "heat: the cost-per-line bars' scale",
}


def readers_importing_the_recording(edges: dict[str, set[str]]) -> list[str]:
    """The imports of a module that reads results (READS_RESULTS) of the recording, the capture,
    the run summary or the run's module, as "module -> target"."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in edges.items()
        if module.split(".")[0] in READS_RESULTS
        for target in targets
        if target.split(".")[0] in NOT_FOR_READERS
    )


def test_what_reads_a_run_reads_its_result_not_the_recording() -> None:
    found = readers_importing_the_recording(graph(for_types=True))
    wrong = [edge for edge in found if edge not in READERS_ALLOWED]
    stale = [edge for edge in READERS_ALLOWED if edge not in found]
    assert not wrong, "import the result package (result/) instead: " + "; ".join(wrong)
    assert not stale, "no longer imported: take off READERS_ALLOWED: " + "; ".join(stale)


def test_the_readers_rule_bites_on_new_code() -> None:
    edges = {"views.live": {"recording", "result.value"}, "kernel.cells": {"run"}, "capture.session": {"run"}}
    assert readers_importing_the_recording(edges) == ["kernel.cells -> run", "views.live -> recording"]


def test_the_tree_reads_as_the_flow() -> None:
    subpackages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert subpackages == ["analysis", "capture", "facts", "kernel", "processes", "ranks", "result", "tuning", "views"]
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top == [
        "__init__", "__main__", "async_cells", "cli", "demo", "failures", "history", "kernel_state", "magic",
        "recording", "run", "run_summary", "saved", "syntax_cells", "traced_cell", "tracing",
    ]


# capture/'s parts by job, each with the parts it may import (imports for the type checker
# too). The modules at capture/'s top are the capture itself (Capture, its per-step hooks, their
# stamping): they drive the parts, and no part imports them; nor does a part import anything of
# the package above the capture, not even for types.
CAPTURE_PARTS: dict[str, set[str]] = {
    "instrument": set(),  # the user's code reached into: the rewrites, the hooks' names, patches
    "steps": set(),  # the steps as recorded: timestamps only, no torch, no GPU, no loader
    "data": {"steps"},  # what fed the steps: a data source is the step model's Source
    "gpu": {"instrument", "steps"},  # patches and the cell's lines; per-step columns
    "resources": {"data", "gpu", "steps"},  # is CUDA initialised; the namespace; the steps' level
    "inside": {"data", "gpu", "instrument", "steps"},  # the parts and lines of a sampled step
    "compiled": set(),  # torch.compile's own record: callbacks, compilation metrics, counters
    "loader": {"instrument"},  # inside the DataLoader's workers: the patches it sets go through instrument/
}
MAX_CAPTURE_TOP = 8  # modules at capture/'s top, besides __init__


def capture_part(module: str) -> str | None:
    """The part of capture/ that holds `module` ("top" for capture/'s own modules); None
    outside capture/."""
    names = module.split(".")
    if names[0] != "capture":
        return None
    return names[1] if len(names) > 1 and (PACKAGE / "capture" / names[1]).is_dir() else "top"


def capture_parts_broken(edges: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(edges.items()):
        part = capture_part(module)
        if part is None or part == "top":
            continue
        for target in sorted(targets):
            to = capture_part(target)
            if to == part or (to is None and layer(target) == "base"):
                continue
            if to is None or to == "top" or to not in CAPTURE_PARTS.get(part, set()):
                where = "capture/'s top" if to == "top" else f"{to}/" if to else "above the capture"
                wrong.append(f"{module} ({part}/) imports {target} ({where})")
    return wrong


def test_capture_is_grouped_by_job() -> None:
    capture = PACKAGE / "capture"
    parts = sorted(p.name for p in capture.iterdir() if (p / "__init__.py").exists())
    assert parts == sorted(CAPTURE_PARTS)
    top = sorted(p.stem for p in capture.glob("*.py") if p.stem != "__init__")
    assert len(top) <= MAX_CAPTURE_TOP, f"capture/'s top holds {top}: place a module in the part of its job"


def test_each_part_of_capture_imports_only_the_parts_under_it() -> None:
    wrong = capture_parts_broken(graph(for_types=True))
    assert not wrong, "\n".join(wrong)


def test_the_capture_parts_rule_bites_on_new_code() -> None:
    assert capture_parts_broken({"capture.steps.step_model": {"capture.gpu.cuda_state"}}) == [
        "capture.steps.step_model (steps/) imports capture.gpu.cuda_state (gpu/)"
    ]
    assert capture_parts_broken({"capture.gpu.h2d": {"capture.session"}}) == [
        "capture.gpu.h2d (gpu/) imports capture.session (capture/'s top)"
    ]
    assert capture_parts_broken({"capture.gpu.h2d": {"run"}}) == ["capture.gpu.h2d (gpu/) imports run (above the capture)"]
    assert not capture_parts_broken({"capture.gpu.h2d": {"capture.steps.step_tally", "failures", "capture.gpu.syncs"}})
    assert not capture_parts_broken({"capture.session": {"capture.gpu.h2d", "run"}})  # the top drives the parts


def layout_names(tree: str) -> set[str]:
    """The package's files and folders that docs/layout.md's tree names, by their path in the
    package: a name on a folder's line, or on a line under it (indented deeper) but under no
    folder deeper in it, is that folder's ("views/live.py"; "capture/gpu/")."""
    names: set[str] = set()
    folders: list[tuple[int, str | None]] = []  # (indent, path in the package; None: outside it)
    for line in tree.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while folders and folders[-1][0] >= indent:
            folders.pop()
        folder = folders[-1][1] if folders else None
        first = line.split()[0]
        if first.endswith("/"):
            folder = "" if indent == 0 and first == "traceml_jupyter/" else None if folder is None else folder + first
            folders.append((indent, folder))
            if folder:
                names.add(folder)
        if folder is not None:
            names.update(folder + name for name in re.findall(r"(?<![\w/.])\w+\.py\b", line))
    return names


def test_docs_layout_names_every_module() -> None:
    """docs/layout.md's tree names each module of the package, in its folder, and each folder."""
    text = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    named = layout_names(text.split("```\n")[1])
    files = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent == PACKAGE]
    wanted = {str(p.relative_to(PACKAGE)) for p in files}
    wanted |= {f"{p.parent.relative_to(PACKAGE)}/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    missing = sorted(wanted - named)
    assert not missing, "docs/layout.md does not name: " + ", ".join(missing)


def test_the_layout_reading_bites() -> None:
    tree = (
        "traceml_jupyter/\n  run.py   the run\n  capture/   while it runs: session.py\n"
        "    gpu/   the GPU\n      h2d.py syncs.py   copies;\n                    and h2d_more.py\n"
        "    finder.py   which loop\ntests/\n  helpers.py\n"
    )
    assert layout_names(tree) == {
        "run.py", "capture/", "capture/session.py", "capture/gpu/", "capture/gpu/h2d.py",
        "capture/gpu/syncs.py", "capture/gpu/h2d_more.py", "capture/finder.py",
    }


@pytest.mark.slow
def test_importing_the_package_loads_no_heavy_library() -> None:
    code = (
        "import sys, traceml_jupyter\n"
        "print(sorted(m for m in ('torch', 'ipywidgets', 'bqplot', 'pynvml') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def module_sizes() -> dict[str, int]:
    return {
        str(p.relative_to(PACKAGE)): len(p.read_text(encoding="utf-8").splitlines())
        for p in PACKAGE.rglob("*.py")
    }


def function_sizes() -> dict[str, int]:
    """Every function and method, as "path:Class.name", with its length in lines."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                sizes[name] = (child.end_lineno or child.lineno) - child.lineno + 1
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    for path in PACKAGE.rglob("*.py"):
        visit(ast.parse(path.read_text(encoding="utf-8")), f"{path.relative_to(PACKAGE)}:")
    return sizes


def over(sizes: dict[str, int], limit: int, allowed: dict[str, int]) -> list[str]:
    wrong = []
    for name, size in sorted(sizes.items()):
        if size > limit and name not in allowed:
            wrong.append(f"{name}: {size} lines (at most {limit}): split it along its jobs")
        elif name in allowed and size > allowed[name]:
            wrong.append(f"{name}: {size} lines, more than the {allowed[name]} it is allowed: it may shrink, not grow")
    for name in allowed:
        if name not in sizes:
            wrong.append(f"{name}: listed but not found: take it off the list")
        elif sizes[name] <= limit:
            wrong.append(f"{name}: {sizes[name]} lines, under {limit} now: take it off the list")
    return wrong


def test_no_module_is_over_the_size_that_reads_as_one_job() -> None:
    wrong = over(module_sizes(), MAX_MODULE_LINES, LONG_MODULES)
    assert not wrong, "\n".join(wrong)


def test_no_function_is_over_the_size_that_reads_at_once() -> None:
    wrong = over(function_sizes(), MAX_FUNCTION_LINES, LONG_FUNCTIONS)
    assert not wrong, "\n".join(wrong)


def test_the_size_rule_bites_on_new_code() -> None:
    assert over({"new.py": MAX_MODULE_LINES + 1}, MAX_MODULE_LINES, {}) == [
        f"new.py: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES}): split it along its jobs"
    ]
    assert over({"old.py": 700}, MAX_MODULE_LINES, {"old.py": 650})  # grew past its allowance
    assert over({"old.py": 500}, MAX_MODULE_LINES, {"old.py": 650})  # shrank: off the list


def test_orchestration_is_imported_by_nothing_below_it() -> None:
    below = ("capture", "analysis", "kernel", "run", "views")
    wrong = [
        f"{module} imports {target}"
        for module, targets in graph().items()
        if layer(module) in below
        for target in targets
        if target.split(".")[0] in ORCHESTRATION
    ]
    assert not wrong, "\n".join(wrong)


def test_every_relative_import_names_a_module_of_the_package() -> None:
    """mypy (ignore_missing_imports) does not see a relative import that names nothing; a
    function-level one fails only when it runs (a module moved into a package keeps `from .x`)."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        here = module_name(path)
        package = here if path.name == "__init__.py" else here.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package.split(".") if package else []
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            target = "/".join([*base, *(node.module.split(".") if node.module else [])])
            found = (PACKAGE / target).with_suffix(".py").exists() or (PACKAGE / target / "__init__.py").exists()
            if not found:
                wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {'.' * node.level}{node.module or ''}")
    assert not wrong, "\n".join(wrong)


def undocumented(source: str) -> list[str]:
    """The public functions, classes and methods of public classes in `source` without a
    docstring, as "LINE Class.name"."""
    missing: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name.startswith("_"):
                    continue
                if ast.get_docstring(child) is None:
                    missing.append(f"{child.lineno} {prefix}{child.name}")
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return missing


def test_every_public_name_has_a_docstring() -> None:
    """Every public function, class and method of the package has one (help() finds it)."""
    missing = [
        f"{path.relative_to(PACKAGE)}:{name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in undocumented(path.read_text(encoding="utf-8"))
    ]
    assert not missing, "no docstring: " + ", ".join(missing)


def test_the_docstring_rule_bites_on_new_code() -> None:
    source = "def f():\n    pass\nclass A:\n    def m(self):\n        pass\n    def _p(self):\n        pass\nclass _B:\n    def m(self):\n        pass\n"
    assert undocumented(source) == ["1 f", "3 A", "4 A.m"]
    assert undocumented('def f():\n    """What f does."""\n') == []


# -- broad guards sit at the edges -----------------------------------------------------------
# A broad guard (`except Exception`, `except BaseException`, a bare `except:`,
# `with never_raise(...)`, `suppress(Exception)`) belongs at an edge where a failure of ours must
# not reach the user's code: a hook's entry, the live view's tick, finish, a sampler thread, a
# child's start-up hook and its end frame, the user-facing error translation. Code under an edge
# raises to it. Reads of the user's objects (which may raise anything) go through
# `failures.read_or`, the one guard for them. Each module at most as many as listed (it may
# shrink, not grow); the package at most MAX_BROAD_GUARDS.
MAX_BROAD_GUARDS = 60
BROAD_GUARDS = {
    "capture/data/dataloaders.py": 1,  # note_site: the edge of a DataLoader's construction in the user's code
    "capture/gpu/cuda_graphs.py": 1,  # the replay's bookkeeping (per replay): the edge
    "capture/gpu/cuda_state.py": 1,  # cuda_or: a query of CUDA's state answered with CUDA's own sticky error
    "capture/gpu/gpu_activity.py": 1,  # a probed wait (look): the edge
    "capture/gpu/gpu_watch.py": 4,  # edges: loop_started, step_ended, merged, close (twice: patches off, report)
    "capture/gpu/h2d.py": 1,  # CopyWatch.guarded: every copy and wait hook's edge
    "capture/gpu/syncs.py": 1,  # SyncWatch.synced: every sync hook's edge
    "capture/inside/line_costs.py": 1,  # _gpu: the per-line GPU clock's edge
    # edges of a sampled step's parts: sampler, merge, a part's end, optimizer hooks, GPU time, the walk
    "capture/inside/step_parts.py": 3,
    "capture/loop_gpu.py": 2,  # the GPU clock's one guard (it turns itself off), the GPU watch's (it stops)
    "capture/resources/gpu_memory.py": 2,  # the memory watch's entries: the loop's start, per step
    "capture/resources/samples.py": 1,  # the sampler thread's loop
    "capture/resources/watch.py": 3,  # the watch's start, what earlier cells hold, the cell's error, its stop
    "capture/session.py": 1,  # the capture's edges: the loop's start and end, the listeners
    "capture/stamping.py": 1,  # the stamps' replay: stamping off for the run
    "cli.py": 2,  # the error in the command line's own words on stderr
    "failures.py": 1,  # read_or: the one guard for reading the user's objects
    "history.py": 1,  # the error in the user's words on stderr
    "kernel/code_facts.py": 1,  # the kernel's reading at the cell's end
    "magic.py": 2,  # `%traceml tune EXPR`: the error in the user's words (UsageError)
    "processes/child_run.py": 1,  # the script's run in a child: its error goes into the END frame's note
    "processes/startup_hook.py": 1,  # guarded(): the children's sitecustomize imports nothing of the package
    "ranks/collector.py": 2,  # the reader thread; a broken stream is dropped with a note
    "ranks/follow.py": 1,  # the capture's end in a rank
    "ranks/forks.py": 3,  # the two fork hooks and the rank function's error
    "ranks/gather.py": 1,  # a fallback (no process group)
    "ranks/sender.py": 2,  # finish in the rank; the END's note
    "recording.py": 2,  # the observer tick (the live view), finish's observers, the machine's description
    "saved.py": 1,  # a field of an unexpected type: the file's one-line LoadError
    "syntax_cells.py": 2,  # someone else's input transformer fails: the magic decides
    "traced_cell.py": 5,  # finish: the report, --save and the history, each in the user's words on stderr
    "tracing.py": 1,  # trace()'s end: the report
    "tuning/measure.py": 1,  # a candidate's error (the user's dataset failing) becomes its row
    "tuning/progress.py": 2,  # tune's progress view (start, each refresh)
    "views/display.py": 1,  # the live view's last refresh
    "views/environment.py": 1,  # a fallback (False: no Colab widgets)
    "views/live.py": 2,  # the live view's start; release_charts (public)
}
GUARD_CALLS = ("never_raise", "suppress")


def broad_guards(source: str) -> int:
    """The broad guards in a module's source: handlers of Exception or BaseException (alone or
    in a tuple), bare `except:`, and `never_raise(...)` / `suppress(...)` calls."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler):
            if node.type is None:
                count += 1
                continue
            kinds = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            count += any(isinstance(k, ast.Name) and k.id in ("Exception", "BaseException") for k in kinds)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in GUARD_CALLS:
            count += 1
    return count


def guards_over(counts: dict[str, int], allowed: dict[str, int]) -> list[str]:
    wrong = [
        f"{name}: {n} broad guards (at most {allowed.get(name, 0)}): guard at the edge, "
        "read the user's objects with failures.read_or, let code under an edge raise"
        for name, n in sorted(counts.items())
        if n > allowed.get(name, 0)
    ]
    wrong += [f"{name}: listed but has none: take it off the list" for name in allowed if not counts.get(name)]
    return wrong


def test_broad_guards_sit_at_the_edges() -> None:
    counts = {str(p.relative_to(PACKAGE)): broad_guards(p.read_text(encoding="utf-8")) for p in PACKAGE.rglob("*.py")}
    wrong = guards_over(counts, BROAD_GUARDS)
    assert not wrong, "\n".join(wrong)
    assert sum(BROAD_GUARDS.values()) <= MAX_BROAD_GUARDS


def test_the_guard_count_bites_on_new_code() -> None:
    source = (
        "try:\n    f()\nexcept Exception:\n    pass\ntry:\n    g()\nexcept (ValueError, BaseException):\n    pass\n"
        "try:\n    h()\nexcept:\n    pass\nwith never_raise(notes, 'x'):\n    i()\n"
    )
    assert broad_guards(source) == 4
    assert broad_guards("try:\n    f()\nexcept ValueError:\n    pass\nread_or(None, len, x)\n") == 0
    assert guards_over({"new.py": 1}, {}) == [
        "new.py: 1 broad guards (at most 0): guard at the edge, read the user's objects with "
        "failures.read_or, let code under an edge raise"
    ]
    assert guards_over({"old.py": 0}, {"old.py": 2}) == ["old.py: listed but has none: take it off the list"]
    assert not guards_over({"old.py": 1}, {"old.py": 2})  # fewer than allowed: fine
