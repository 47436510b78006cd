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
# Modules under every layer: any module may import them; they import nothing of the package.
BASE = ("failures", "kernel_state")

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# What is still over, at most its size today (it may shrink, not grow), and why it remains.
# An entry that falls under the limit must leave the list.
LONG_MODULES: dict[str, int] = {}
LONG_FUNCTIONS = {
    # The step model's transitions written out on locals for the per-step replay (the hot path:
    # a call per transition would cost what the bulk replay saves); one loop, one state machine.
    "capture/steps/stamps.py:Stamps._steady": 98,
    # Training iterations in bulk with numpy: one vectorised pass over the window's stamps.
    "capture/steps/stamps.py:Stamps._training_window": 114,
}


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
    if module in BASE:
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


# Imports for the type checker alone (under `if TYPE_CHECKING:`) that still close an import
# cycle, outside capture/: the cycle check counts every other import. Each is a cycle to open (a
# protocol where the type is needed, say): the list may only shrink.
TYPE_ONLY_CYCLES = {
    "tuning.render -> tuning.result",  # the views name TuneResult; TuneResult renders through them
}


def without_type_only_cycles(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    kept = {module: set(targets) for module, targets in edges.items()}
    for edge in TYPE_ONLY_CYCLES:
        module, _, target = edge.partition(" -> ")
        kept.get(module, set()).discard(target)
    return kept


def test_no_module_of_the_package_imports_itself_back() -> None:
    """No import cycle, counting the imports for the type checker too (but for the listed few)."""
    found = cycles(without_type_only_cycles(graph(for_types=True)))
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_type_only_cycles_listed_are_still_there() -> None:
    """Each listed edge is still an import for the type checker alone, and still closes a cycle:
    else it leaves the list."""
    at_run_time, for_types = graph(), graph(for_types=True)
    wrong = []
    for edge in sorted(TYPE_ONLY_CYCLES):
        module, _, target = edge.partition(" -> ")
        if target in at_run_time.get(module, set()) or target not in for_types.get(module, set()):
            wrong.append(f"{edge}: no longer an import for the type checker alone")
            continue
        others = without_type_only_cycles(for_types)
        others[module].add(target)
        if not any(module in cycle and target in cycle for cycle in cycles(others)):
            wrong.append(f"{edge}: closes no cycle now: take it off the list")
    assert not wrong, "\n".join(wrong)


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
    assert subpackages == ["analysis", "capture", "kernel", "processes", "ranks", "result", "tuning", "views"]
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


# -- the "never raise; add a note" guard ------------------------------------------------------
# A block whose only job is to swallow a failure of ours (and maybe note it) is
# `with never_raise(notes, "what"):` (failures.py). What remains hand-written, per module, at
# most as many as today (it may shrink, not grow): blocks that fall back to another value (a
# guarded read answers None, False, 0 or {}), translate the error into the user's message,
# re-raise, retry, or run on the per-step hot path (where a `with` would cost every step).
HAND_WRITTEN_EXCEPTS = {
    "analysis/cell_code.py": 1,  # a transformer that fails: no tree (None)
    "capture/gpu/copy_calls.py": 2,  # per copy: a tensor's size and pinning, a fallback each
    "capture/gpu/cuda_clock.py": 3,  # fallbacks: no device, no stats
    "capture/gpu/cuda_graphs.py": 2,  # a fallback (False); per replay: one note at most
    "capture/gpu/cuda_state.py": 1,  # a fallback (False)
    "capture/data/dataloaders.py": 5,  # guarded reads of the user's loader: None, or the next item
    "capture/gpu/gpu_activity.py": 5,  # fallbacks; per sync (look); patches undone on failure
    "capture/resources/gpu_memory.py": 11,  # guarded reads of the user's namespace and of torch; per step
    "capture/gpu/gpu_watch.py": 5,  # patches undone on failure; per step (backlog); a fallback
    "capture/gpu/h2d.py": 5,  # per copy / per wait: the watch turns itself off
    "capture/gpu/hidden_waits.py": 1,  # a fallback (False)
    "capture/resources/host.py": 2,  # fallbacks (None)
    "capture/inside/line_costs.py": 4,  # per step: the GPU clock turns itself off
    "capture/resources/nvml.py": 9,  # fallbacks; NVML's failure kept as the sampler's note and detail
    "capture/data/probes.py": 6,  # guarded reads of the user's objects (the module's job)
    "capture/data/sources.py": 4,  # guarded reads of the user's objects
    "capture/gpu/syncs.py": 2,  # per sync: the watch turns itself off; a fallback
    "cli.py": 2,  # the error in the command line's own words on stderr
    "history.py": 1,  # the error in the user's words on stderr
    "kernel/code_facts.py": 3,  # guarded reads of the user's loader and dataset (None)
    "processes/child_run.py": 1,  # the error goes into the end frame's note
    # The children's sitecustomize imports nothing of the package (not even failures.py).
    "processes/startup_hook.py": 9,
    "syntax_cells.py": 2,  # someone else's input transformer fails: the magic decides
    "tuning/measure.py": 2,  # a fallback (None); a candidate's error becomes its row
    "tuning/model_rate.py": 3,  # fallbacks: no loader, no summary, no model rate
    "tuning/recipe.py": 1,  # a fallback (the sampler itself)
    "magic.py": 1,  # `%traceml tune EXPR`: the error in the user's words (UsageError)
    "ranks/collector.py": 1,  # a broken stream is dropped: closed, unregistered, a note
    "ranks/follow.py": 1,  # a guarded read of the user's namespace (False)
    "ranks/gather.py": 1,  # a fallback (no process group)
    "ranks/sender.py": 1,  # the error goes into the end frame's note
    "saved.py": 1,  # a field of an unexpected type: the file's one-line LoadError
    "traced_cell.py": 2,  # the report or --save failed: the error in the user's words on stderr
    "views/environment.py": 1,  # a fallback (False: no Colab widgets)
    "views/live.py": 1,  # no bqplot (ImportError) is silent, another failure a note: two outcomes
    "views/live_svg.py": 1,  # a fallback (None: no parts in the window), on each refresh
    "views/loop_passes.py": 1,  # a guarded read of the user's value (None)
    # Fallbacks (None, False, []); a class that cannot be patched is skipped; the patches are
    # set and taken off at each sampled step (install/remove); the scan of a session's values
    # at once (one by one when a value's isinstance raises: a per-value guard costs 0.2 µs).
    "capture/inside/model_calls.py": 9,
    # Per step: the GPU clock's events and the GPU watch (the clock turns itself off); the GPU
    # clock off at its start and end too; the probe stops; no patch without torch's hooks.
    "capture/session.py": 10,
    # Per sampled step (timing a part, the sampler, the optimizer's hooks, merges): the parts or
    # their GPU time turn themselves off; fallbacks (no torch.optim, `on` off); GPU parts off.
    "capture/inside/step_parts.py": 12,
    "capture/step_hooks.py": 3,  # per fetch: the GPU clock turns itself off; a fallback (True)
    "capture/stamping.py": 1,  # the stamps' replay (per-step path): stamping off for the run
}


def hand_written_excepts(source: str) -> int:
    """The `except Exception` handlers (alone or in a tuple) in a module's source."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            kinds = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            count += any(isinstance(k, ast.Name) and k.id == "Exception" for k in kinds)
    return count


def excepts_over(counts: dict[str, int], allowed: dict[str, int]) -> list[str]:
    wrong = [
        f"{name}: {n} hand-written `except Exception` (at most {allowed.get(name, 0)}): "
        "use `with never_raise(notes, ...)` from failures.py"
        for name, n in sorted(counts.items())
        if n > allowed.get(name, 0)
    ]
    wrong += [f"{name}: listed but has none: take it off the list" for name in allowed if not counts.get(name)]
    return wrong


def test_failures_of_ours_go_through_the_one_guard() -> None:
    counts = {str(p.relative_to(PACKAGE)): hand_written_excepts(p.read_text(encoding="utf-8")) for p in PACKAGE.rglob("*.py")}
    wrong = excepts_over(counts, HAND_WRITTEN_EXCEPTS)
    assert not wrong, "\n".join(wrong)


def test_the_guard_count_bites_on_new_code() -> None:
    source = "try:\n    f()\nexcept Exception:\n    pass\ntry:\n    g()\nexcept (ValueError, Exception):\n    pass\n"
    assert hand_written_excepts(source) == 2
    assert hand_written_excepts("try:\n    f()\nexcept ValueError:\n    pass\n") == 0
    assert excepts_over({"new.py": 1}, {}) == [
        "new.py: 1 hand-written `except Exception` (at most 0): use `with never_raise(notes, ...)` from failures.py"
    ]
    assert excepts_over({"old.py": 0}, {"old.py": 2}) == ["old.py: listed but has none: take it off the list"]
    assert not excepts_over({"old.py": 1}, {"old.py": 2})  # fewer than allowed: fine
