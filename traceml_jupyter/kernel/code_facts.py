"""The facts the checklist reads, gathered from the run and the kernel (reads only): the cell
history (where the DataLoader was built, the loop in an earlier cell), the loader and its
dataset's code, the copies and syncs the run saw, and the evaluated checklist itself."""

from __future__ import annotations

import ast
import linecache
import multiprocessing
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import CodeType
from typing import TYPE_CHECKING, Any, TypedDict

from ..analysis.cell_code import (
    CodeSite,
    SampleCode,
    assigned_line,
    class_def,
    costly_calls,
    dataloader_lines,
    dataloader_sites,
    iter_names,
    loop_at,
    method_def,
    nested_in_loop,
    parse_cell,
    pick_loader_line,
    sample_code_in,
    transfers_in,
)
from ..analysis.checklist import CopySeen, Facts, Item, LineSeen, default_start_method, evaluate
from ..analysis.checklist.facts import ItemRow
from ..analysis.data_sources import Feeder, feeder
from ..analysis.rank_verdict import checklist_verdict
from ..analysis.resources import cpu_sentence
from ..analysis.summary_keys import Summary
from ..capture.data.dataloaders import dataset_site, inner_dataset
from ..capture.data.sources import fed_expression, resolve_name
from ..capture.resources.host import usable_cpus
from ..failures import failure_text, never_raise, read_or
from ..kernel_state import tuned_for
from .cells import (
    CELL_LABEL,
    MAX_HISTORY,
    EarlierCells,
    cell_label,
    cell_transform,
    current_cell_index,
    run_cells,
)
from .shell import ipython_shell

if TYPE_CHECKING:
    from .cells import FinishedRun

CELL_IN = re.compile(r"\((?:Cell )?In ?\[(\d+)\]\)")  # "(In [3])", "(Cell In[3])": a cell
FUNCTION = re.compile(r"^function ([\w.<>]+)")



# -- facts from the run and the kernel (reads only) ------------------------------------------


def quoted_cells(ctx: CodeContext, items: Sequence[Item]) -> dict[str, str]:
    """The earlier cells the report quotes, by label ("In [2]"): the loop's, the DataLoader's,
    and those of the lines the checklist points at."""
    labels = {ctx.loop_cell, ctx.loader_site.cell if ctx.loader_site is not None else None}
    labels |= {item.site.cell for item in items if item.site is not None}
    out = {}
    for label in sorted(x for x in labels if x):
        match = CELL_LABEL.match(label)
        if match is not None and 0 < int(match.group(1)) < len(ctx.cells):
            out[label] = ctx.cells[int(match.group(1))]
    return out



def _loader_object(run: FinishedRun) -> Any:
    """The loop's DataLoader if it is still alive; else the last one the cell started
    iterating (a loader whose first batch failed was never noted by the run)."""
    for ref in (run.loader_ref, getattr(run, "loader_seen", None)):
        loader = ref() if ref is not None else None
        if loader is not None:
            return loader
    return None


def loader_settings(run: FinishedRun) -> Mapping[str, Any] | None:
    """The run's loader settings, read from the loader object when the run has none."""
    if run.result.data.loader is not None:
        return run.result.data.loader
    loader = _loader_object(run)
    if loader is None:
        return None
    from ..capture.data.dataloaders import describe_loader

    return read_or(None, describe_loader, loader)  # the user's loader: any of its properties may raise


def _names_bound_to(obj: Any, namespace: Mapping[str, Any]) -> set[str]:
    if obj is None:
        return set()
    return {name for name, value in list(namespace.items()) if value is obj}


def _loop_in_other_cell(
    run: FinishedRun, earlier: EarlierCells
) -> tuple[ast.For | ast.AsyncFor, str, ast.AST] | None:
    """The step loop when it lives in a function defined in an earlier cell: the loop, the
    cell's label and the function."""
    where, line = run.result.loop.where or "", run.result.loop.line
    func = FUNCTION.match(where)
    if func is None or line is None:
        return None
    name = func.group(1).split(".")[-1]
    named = CELL_IN.search(where)
    numbers = [int(named.group(1))] if named else []
    numbers += [i for i in earlier.numbers if i not in numbers]
    for i in numbers:
        if not 0 < i < len(earlier.cells):
            continue
        found = earlier.function_loop(i, name, line, named=named is not None and i == numbers[0])
        if found is not None:
            return found[0], cell_label(i), found[1]
    return None


def _loader_site(
    earlier: EarlierCells, tree: ast.Module | None, names: set[str]
) -> CodeSite | None:
    """Where the loop's DataLoader is built: the construction assigned to the name the loop
    iterates (this cell first, then earlier cells, newest first); else the first construction
    found that way; else the line that assigns the loader (built by a function or library)."""
    numbers = earlier.numbers[:MAX_HISTORY]
    if tree is not None:
        line = pick_loader_line(dataloader_sites(tree), names)
        if line is not None:
            return CodeSite(line, None)
    first_built: CodeSite | None = None
    for i in numbers:
        facts = earlier.facts(i, "DataLoader")
        if facts is None:
            continue
        line = pick_loader_line(facts.loader_sites, names)
        if line is not None:
            return CodeSite(line, cell_label(i))
        if first_built is None and facts.loader_lines:
            first_built = CodeSite(facts.loader_lines[0], cell_label(i))
    if tree is not None and dataloader_lines(tree):
        return CodeSite(dataloader_lines(tree)[0], None)
    if first_built is not None:
        return first_built
    if not names:
        return None
    line = assigned_line(tree, names) if tree is not None else None
    if line is not None:
        return CodeSite(line, None)
    for i in numbers:
        facts = earlier.facts(i, *names)
        assigned = facts.first_assigned if facts is not None else {}
        seen = [assigned[n] for n in names if n in assigned]
        if seen:
            return CodeSite(min(seen), cell_label(i))
    return None


def source_label(run: FinishedRun, shell: Any, filename: str) -> str | None:
    """None for the traced cell itself, "In [3]" for another cell, the file name else."""
    return file_label(run.result.loop.cell_filename, shell, filename)


def file_label(cell_filename: str | None, shell: Any, filename: str) -> str | None:
    """None for the traced cell's file (`cell_filename`), "In [3]" for another cell, the file
    name else."""
    if filename == cell_filename:
        return None
    fmt = getattr(getattr(shell, "compile", None), "format_code_name", None)
    named = fmt(filename) if fmt is not None else None
    if named:
        number = re.search(r"\d+", str(named[1]))
        return cell_label(int(number.group())) if number else str(named[1])
    return os.path.basename(filename)


def _dataset_of(loader: Any) -> Any:
    """The dataset behind a loader, through wrappers such as Subset."""
    return inner_dataset(getattr(loader, "dataset", None))


# `__getitem__` read from its source file or cell, by (file, line, class, source text).
_SOURCE_SAMPLES: dict[tuple[str, int, str, str], SampleCode | None] = {}
SOURCE_SAMPLES_KEPT = 16


def _sample_code_from_object(run: FinishedRun, shell: Any, dataset: Any) -> SampleCode | None:
    site = read_or(None, dataset_site, dataset)  # the user's dataset
    if site is None:
        return None
    return _sample_code_at(run, shell, site["dataset_file"], site["dataset_line"], site["dataset_class"])


def _sample_code_at(
    run: FinishedRun, shell: Any, filename: str, first_line: int, class_name: str, name: str | None = None
) -> SampleCode | None:
    """The `__getitem__` of class `class_name` defined at `first_line` of `filename` (a cell or
    a file), read from its source; or (`name`, no class) the function defined there: a
    generator, a `get_batch()`, an iterator's `__next__`, named `name` in the checklist."""
    lines = linecache.getlines(filename)
    if not lines:
        return None
    text = "".join(lines)
    key = (filename, first_line, class_name or str(name), text)
    if key in _SOURCE_SAMPLES:
        return _SOURCE_SAMPLES[key]
    tree = parse_cell(text)
    node = method_def(tree, first_line) if tree is not None else None
    found = None
    if tree is not None and node is not None:
        label = source_label(run, shell, filename)
        owner = class_def(tree, class_name) if class_name else None
        found = SampleCode(
            name or class_name,
            tuple(costly_calls(node, label)),
            CodeSite(node.lineno, label),
            CodeSite(owner.lineno, label) if owner is not None else None,
        )
    while len(_SOURCE_SAMPLES) >= SOURCE_SAMPLES_KEPT:
        _SOURCE_SAMPLES.pop(next(iter(_SOURCE_SAMPLES)))
    _SOURCE_SAMPLES[key] = found
    return found


def _sample_code(run: FinishedRun, shell: Any, ctx: CodeContext) -> SampleCode | None:
    site = run.result.data.dataset_site
    if site:  # a child process's dataset: read from its file
        return _sample_code_at(run, shell, site["file"], site["line"], site.get("class") or "")
    dataset = _dataset_of(_loader_object(run))
    if dataset is not None:
        found = _sample_code_from_object(run, shell, dataset)
        if found is not None:
            return found
    name = (loader_settings(run) or {}).get("dataset_type")
    if not name:
        return None
    if ctx.tree is not None:
        found = sample_code_in(ctx.tree, str(name))
        if found is not None:
            return found
    earlier = ctx.earlier or EarlierCells(shell, ctx.cells, ctx.current)
    for i in earlier.numbers:
        facts = earlier.facts(i, str(name))
        if facts is not None and str(name) in facts.samples:
            return facts.samples[str(name)]
    return SampleCode(str(name), (), None, None)


def _feeder_code(run: FinishedRun, shell: Any) -> SampleCode | None:
    """The code behind a source that is no DataLoader: the generator function (`slow` of
    `slow()`), the `get_batch` function, or an iterator's `__next__`, looked up in the
    namespace after the cell; None when it cannot be found or read."""
    row = next((r for r in run.result.data.sources if r.get("training")), None)
    if row is None or row.get("kind") == "dataloader":
        return None
    node = fed_expression(row.get("expression"))
    namespace = getattr(shell, "user_ns", None) or {}
    target = node.func if isinstance(node, ast.Call) else node
    obj = read_or(None, resolve_name, target, namespace) if target is not None else None
    found = read_or(None, _code_behind, obj) if obj is not None else None
    if found is None:
        return None
    code, owner, label = found
    return _sample_code_at(run, shell, code.co_filename, code.co_firstlineno, owner, label)


def _code_behind(obj: Any) -> tuple[CodeType, str, str] | None:
    """The code behind the user's feeder `obj` (a generator's or a function's, else its class's
    `__next__` or `__iter__`), the class that holds it ("" for a function) and its label in the
    checklist; None without one. Reads the user's object: its attributes may raise (read_or)."""
    name = getattr(obj, "__name__", None) or type(obj).__name__
    code = getattr(obj, "gi_code", None) or getattr(obj, "__code__", None)
    if isinstance(code, CodeType):
        return code, "", f"{name}()"
    cls = obj if isinstance(obj, type) else type(obj)
    step = getattr(cls, "__next__", None) or getattr(cls, "__iter__", None)
    code = getattr(step, "__code__", None)
    if not isinstance(code, CodeType):
        return None
    return code, cls.__name__, f"{cls.__name__}.{getattr(step, '__name__', '')}"


def _process_start_method() -> str:
    """The start method workers get when the loader does not choose one."""
    chosen = multiprocessing.get_start_method(allow_none=True)
    return chosen or default_start_method(
        (sys.version_info.major, sys.version_info.minor), sys.platform
    )


@dataclass
class CodeContext:
    """The code around a run: this cell's tree, where the loop and the DataLoader are."""

    cells: list[str] = field(default_factory=list)
    current: int | None = None
    tree: ast.Module | None = None
    loop: ast.For | ast.AsyncFor | None = None
    loop_cell: str | None = None  # None: the loop is in this cell
    loop_tree: ast.AST | None = None  # this cell's tree, or the function around the loop
    loader_site: CodeSite | None = None
    earlier: EarlierCells | None = None
    cell_filename: str | None = None  # the traced cell's file name (linecache's)
    shell: Any = None

    @classmethod
    def of(cls, run: FinishedRun, shell: Any) -> CodeContext:
        """Read the run's cells once: the history, the traced cell's tree, the loop and its cell."""
        ctx = cls(run_cells(run, shell), cell_filename=run.result.loop.cell_filename, shell=shell)
        ctx.current = current_cell_index(ctx.cells, run.result.loop.cell_source)
        ctx.earlier = EarlierCells(shell, ctx.cells, ctx.current)
        ctx.tree = parse_cell(run.result.loop.cell_source, cell_transform(shell)) if run.result.loop.cell_source else None
        in_cell = "(" not in (run.result.loop.where or "")
        if run.result.loop.line is not None and ctx.tree is not None and in_cell:
            ctx.loop, ctx.loop_tree = loop_at(ctx.tree, run.result.loop.line), ctx.tree
        if ctx.loop is None:
            other = _loop_in_other_cell(run, ctx.earlier)
            if other is not None:
                ctx.loop, ctx.loop_cell, ctx.loop_tree = other
        names = iter_names(ctx.loop) if ctx.loop is not None else set()
        names |= _names_bound_to(_loader_object(run), getattr(shell, "user_ns", {}) or {})
        names -= {"enumerate", "zip", "tqdm", "iter", "range", "len"}
        ctx.loader_site = script_site(run, shell)
        if ctx.loader_site is None and not run.result.processes:
            ctx.loader_site = _loader_site(ctx.earlier, ctx.tree, names)
        return ctx

    def label(self, filename: str) -> str | None:
        """None for the traced cell itself, "In [3]" for another cell, the file name else."""
        return file_label(self.cell_filename, self.shell, filename)

    def cell_line(self, site: CodeSite) -> str | None:
        """The text of `site` when it is a line of an earlier cell."""
        match = CELL_LABEL.match(site.cell or "")
        if match is None or not 0 < int(match.group(1)) < len(self.cells):
            return None
        lines = self.cells[int(match.group(1))].splitlines()
        return lines[site.line - 1] if 0 < site.line <= len(lines) else None


def script_site(run: FinishedRun, shell: Any) -> CodeSite | None:
    """Where the run's loader was built when that is a file (`train.py, line 54`: a script run
    as a child process or with `%run`); None in a notebook cell (the cells are read for it)."""
    site = run.result.data.loader_site
    if not site:
        return None
    label = source_label(run, shell, str(site["file"]))
    if label is None or label.startswith("In ["):
        return None
    return CodeSite(int(site["line"]), label)


def _site_text(run: FinishedRun, filename: str, line: int) -> str:
    """The call on a line of the traced cell (`x.to("cuda")`), else the line's text."""
    from ..capture.gpu.syncs import call_text

    text = call_text(run.result.loop.cell_source, line) if filename == run.result.loop.cell_filename else None
    return text or linecache.getline(filename, line).strip() or f"line {line}"


def copies_seen(run: FinishedRun, shell: Any = None) -> tuple[CopySeen, ...] | None:
    """The measured copies to the GPU by line (run.result.gpu.h2d), costliest first; None if not watched."""
    h2d = run.result.gpu.h2d
    if not h2d:
        return None
    out = []
    for s in h2d.get("sites") or []:
        filename, line, copies = str(s["filename"]), int(s["line"]), max(1, int(s["copies"]))
        site = CodeSite(line, source_label(run, shell, filename)) if line > 0 else None
        out.append(
            CopySeen(
                site,
                _site_text(run, filename, line),
                float(s["bytes_per_step"]),
                s.get("ms_per_step"),
                s.get("gb_per_s"),
                int(s["pinned"]) / copies,
                int(s["non_blocking"]) / copies,
            )
        )
    return tuple(out)


def busiest_line(run: FinishedRun) -> LineSeen | None:
    """The loop body's statement with the most host time per step (run.line_costs)."""
    from ..capture.gpu.gpu_watch import costliest_host_line

    top = costliest_host_line(run.result.line_costs)
    if top is None:
        return None
    return LineSeen(CodeSite(int(top["line"])), str(top["text"]), float(top["ms_per_step"]))


def facts_for(
    run: FinishedRun, shell: Any = None, start_method: str | None = None, context: CodeContext | None = None
) -> Facts:
    """Read what the checklist needs from the run, its loader, its code and the kernel."""
    ctx = context or CodeContext.of(run, shell)
    loader = loader_settings(run)
    summary = run.summary
    passes = run.loops_started
    several = passes >= 2
    if ctx.loop is not None and ctx.loop_tree is not None and run.result.loop.line is not None:
        several = several or nested_in_loop(ctx.loop_tree, run.result.loop.line)
    if run.result.steps.expected and run.n_steps > run.result.steps.expected:
        several = True
    method = (loader or {}).get("multiprocessing_context") or start_method
    wait = (summary.get("stats") or {}).get("data_wait_ms")
    return Facts(
        verdict=checklist_verdict(run.verdict, run.straggler),  # a rank straggler: its cause
        loader=loader,
        cpu_count=usable_cpus(),
        on_gpu=run.result.gpu.used or summary.get("clock") == "gpu",
        several_passes=several,
        loader_site=ctx.loader_site,
        transfers=tuple(transfers_in(ctx.loop, ctx.loop_cell)) if ctx.loop is not None else None,
        sample_code=_sample_code(run, shell, ctx),
        inside=run.result.data.inside,
        start_method=method or _process_start_method(),
        straggler_steps=int(summary.get("straggler_steps") or 0),
        wait_median_ms=summary.get("data_wait_ms"),
        wait_p99_ms=wait["p99"] if wait else None,
        pinned_share=summary.get("h2d_pinned_share"),
        non_blocking_share=summary.get("h2d_non_blocking_share"),
        copies=copies_seen(run, shell),
        sync_top=summary.get("sync_top"),
        batch_size=run.result.steps.batch_size or (loader or {}).get("batch_size"),
        step_ms=summary.get("step_ms"),
        host_issue_ms=summary.get("host_issue_ms"),
        gpu_idle_share=summary.get("host_share"),
        busiest_line=busiest_line(run),
        tuned=tuned_for(_loader_object(run)),
        epoch_startup=summary.get("epoch_startup"),
        cpu_saturated=summary.get("cpu_saturated"),
        cpu_sentence=cpu_sentence(summary) if summary.get("cpu_cores") is not None and summary.get("cpu_usable_cores") else None,
        workers_cores=summary.get("cpu_workers_cores"),
        oversubscription=summary.get("cpu_oversubscription"),
        **_feeder_facts(run, shell, summary, ctx),
    )


class FeederFacts(TypedDict, total=False):
    """The checklist's facts (Facts' fields) about a source that is no DataLoader."""

    feeder: Feeder
    feeder_site: CodeSite | None
    feeder_code: SampleCode | None


def _feeder_facts(run: FinishedRun, shell: Any, summary: Summary, ctx: CodeContext) -> FeederFacts:
    """What fed the steps when it is no DataLoader, where, and the code behind it."""
    source = feeder(summary)
    if source is None:
        return {}
    site = CodeSite(source.line, ctx.loop_cell) if source.line is not None else None
    return {"feeder": source, "feeder_site": site, "feeder_code": _feeder_code(run, shell)}


def checklist_items(run: FinishedRun, shell: Any = None, context: CodeContext | None = None) -> list[Item]:
    """The checklist evaluated on what the run, its loader, its code and the kernel hold."""
    return evaluate(facts_for(run, shell, context=context))


def checklist_for(run: FinishedRun) -> list[ItemRow]:
    """The evaluated checklist as JSON-ready dicts."""
    return [item.to_dict() for item in checklist_items(run, ipython_shell())]


def read_kernel_at_end(run: FinishedRun) -> KernelReading | None:
    """Read the code around the run and evaluate the checklist once, leave the checklist on the
    run (`run.result.reading.checklist`, what `to_dict` and `--save` write) and return both for the report (the
    kernel's history is read once a run). A failure to read the kernel is a note (and None)."""
    reading = kernel_reading(run)
    if reading.problem is not None:
        run.notes.append(reading.problem)
        return None
    run.keep_reading([item.to_dict() for item in reading.checklist], quoted_cells(reading.code, reading.checklist))
    return reading


@dataclass(frozen=True)
class KernelReading:
    """What a run's report shows that its result does not hold, read from the kernel: the code
    around the run (`code`: the history, where the loop and the DataLoader are), the checklist
    as evaluated, and why it could not be evaluated (`problem`, shown with the notes)."""

    code: CodeContext
    checklist: list[Item]
    problem: str | None = None


def kernel_reading(run: FinishedRun, checklist: Sequence[Item] | None = None) -> KernelReading:
    """What the report of `run` reads from the kernel: the code around it and the checklist
    (`checklist` when given; for a run read back from its file, the one it saved; else
    evaluated now). Never raises: a failure leaves the code unread, the checklist as given,
    and says why."""
    shell = ipython_shell()
    if checklist is None and run.read_back:  # read back from its file: the checklist as evaluated
        checklist = [Item.from_dict(item) for item in run.result.reading.checklist or []]
    guard = never_raise()
    with guard:  # the checklist reads live objects and history: never let it cost the report
        ctx = CodeContext.of(run, shell)
        items = list(checklist) if checklist is not None else checklist_items(run, shell, ctx)
        return KernelReading(ctx, items)
    problem = f"The checklist could not be evaluated: {failure_text(guard.error)}" if guard.error else None
    return KernelReading(CodeContext(cell_filename=run.result.loop.cell_filename, shell=shell), list(checklist or []), problem)
