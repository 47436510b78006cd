"""Running one `%%traceml` cell: locate the loop, rewrite, exec in the user namespace,
report, and undo every patch, also on error and KeyboardInterrupt."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from IPython.core.error import UsageError

from . import kernel_state, ranks
from .analysis.loader_inside import stop_lines
from .analysis.summary import auto_warmup
from .capture.inside.line_costs import line_costs
from .capture.instrument.cell_functions import (
    FunctionLoop,
    called_cell_functions,
    compile_function_loop,
    find_function_loop,
    function_loop,
    named_cell_function,
    restore_definitions,
    swapped_code,
)
from .capture.instrument.locate import (
    LoopChoice,
    find_innermost_loop,
    find_marked_loop,
    find_node,
    find_training_loop,
    for_loop_lines,
    is_range,
    loop_at_line,
)
from .capture.instrument.rewrite import instrument_loop
from .capture.session import Capture
from .failures import failure_text, never_raise
from .processes import children
from .recording import Observer, Recording
from .result import RunResult
from .run import Run

if TYPE_CHECKING:
    from .analysis.summary_keys import LineCosts
    from .views.display import LiveView

NO_LOOP = (
    "traceml: no training loop found in this cell (no `for` loop calling .backward() or "
    "an optimizer's .step(), and no optimizer step, backward() or DataLoader was seen); mark it "
    "with `# traceml: loop` on its line or choose it with `--loop LINE`."
)


@dataclass
class CellOptions:
    """What `%%traceml`'s options asked for: the run's name, the warm-up steps, the live chart
    or not, where to save, the loop to time (--loop) and whether each line of its body is
    timed (--lines)."""

    name: str | None = None
    warmup: int | None = None
    live: bool = True
    save: str | None = None
    loop: int | str | None = None  # a line of the cell, or "FUNCTION:LINE"
    lines: bool = True  # time each top-level statement of the loop body (line_costs.py)
    lines_chosen: bool = False  # --lines was given explicitly


def _import_torch() -> None:
    """Import torch (if installed) so DataLoaders can be watched from the cell's first line."""
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401


def cell_number(shell: Any) -> int:
    """The number IPython gave the running cell (execution_count has already moved on when
    the cell is stored in history): read off the outer cell's code name on the stack."""
    names = getattr(shell.compile, "_filename_map", None) or {}
    frame = sys._getframe(1)
    while frame is not None:
        number = names.get(frame.f_code.co_filename)
        if number is not None:
            return int(number)
        frame = frame.f_back  # type: ignore[assignment]
    return int(getattr(shell, "execution_count", 0))


def cache_cell(shell: Any, code: str, raw: str) -> str:
    """Register the cell's source with IPython, so tracebacks show its lines as `Cell In[n]`."""
    number = cell_number(shell)
    try:
        return str(shell.compile.cache(code, number, raw_code=raw))
    except TypeError:  # IPython 7
        return str(shell.compile.cache(code, number))


def _keep_leading_blank_lines(cell: str, transformed: str) -> str:
    """IPython drops a cell's leading blank lines; put them back so line numbers match."""
    lines = cell.splitlines()
    blank = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    body = transformed.splitlines(keepends=True)
    while body and not body[0].strip():
        body.pop(0)
    return "\n" * blank + "".join(body)


def _split_last_expression(tree: ast.Module) -> tuple[ast.Module, ast.Expression | None]:
    """The cell without its last expression statement, and that expression (shown as Out[n])."""
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        body = ast.Module(body=tree.body[:-1], type_ignores=[])
        return body, ast.Expression(body=tree.body[-1].value)
    return tree, None


class CellSyntaxError(Exception):
    """A syntax error in the traced cell, shown as IPython shows one in a plain cell: the cell's
    line and caret, no frames of the magic (IPython renders it with `_render_traceback_`)."""

    def __init__(self, error: SyntaxError, shell: Any) -> None:
        super().__init__(str(error))
        self.error = error
        self.shell = shell
        # The fields a SyntaxError carries, as the error has them (a cell run through IPython
        # never gets here: syntax_cells.py hands IPython the plain cell, which raises the real
        # SyntaxError; this is for `run_cell_magic` called from code).
        for name in ("msg", "filename", "lineno", "offset", "text", "end_lineno", "end_offset"):
            setattr(self, name, getattr(error, name, None))

    def _render_traceback_(self) -> list[str]:
        err = self.error
        return list(self.shell.SyntaxTB.structured_traceback(type(err), err, []))


def syntax_error(error: SyntaxError, shell: Any) -> CellSyntaxError:
    """The error to raise for `error` (its class named like the original: SyntaxError,
    IndentationError, TabError), so the cell fails as a plain cell with that error would."""
    kind = type(error)
    cls = type(kind.__name__, (CellSyntaxError,), {"__module__": "builtins", "__qualname__": kind.__name__})
    made: CellSyntaxError = cls(error, shell)
    return made


def _loop_option(shell: Any, tree: ast.Module, opts: CellOptions) -> tuple[LoopChoice | None, FunctionLoop | None]:
    """--loop LINE (a line of this cell) or --loop FUNCTION:LINE (as shown in that function's
    cell)."""
    value = opts.loop
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        line = int(value)
        choice = loop_at_line(tree, line)
        if choice is None:
            starts = ", ".join(map(str, for_loop_lines(tree))) or "none"
            raise UsageError(
                f"--loop {line}: no for loop on line {line} of this cell "
                f"(for loops start on lines: {starts})"
            )
        return choice, None
    name, _, line_text = str(value).rpartition(":")
    if not name or not line_text.strip().isdigit():
        raise UsageError(f"--loop {value}: give a line of this cell (--loop 5) or FUNCTION:LINE (--loop train:7)")
    line = int(line_text)
    func = named_cell_function(name, tree, shell.user_ns)
    if func is None:
        raise UsageError(f"--loop {value}: no function {name!r} defined in a notebook cell was found")
    found = function_loop(func, lambda node, _lines: loop_at_line(node, line))
    if found is None:
        raise UsageError(f"--loop {value}: no for loop on line {line} of {name} (lines as its cell shows them)")
    return None, found


def _locate(
    shell: Any, tree: ast.Module, lines: list[str], opts: CellOptions
) -> tuple[LoopChoice | None, FunctionLoop | None]:
    """The loop the cell trains in: --loop; a marked loop (in the cell, then in the functions it
    calls); a training loop (same order); the innermost non-range loop (same order)."""
    if opts.loop is not None:
        try:
            if children.script_loop(opts.loop) is not None:  # FILE:LINE: a script the cell runs
                return None, None
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return _loop_option(shell, tree, opts)
    functions = called_cell_functions(tree, shell.user_ns)
    finders: list[Any] = [find_marked_loop, find_training_loop, lambda node, _lines: find_innermost_loop(node)]
    for finder in finders:
        choice = finder(tree, lines)
        if choice is not None:
            return choice, None
        found = find_function_loop(functions, finder)
        if found is not None:
            return None, found
    return None, None


def _describe_function_loop(shell: Any, found: FunctionLoop) -> str:
    label = found.func.__code__.co_filename
    fmt = getattr(shell.compile, "format_code_name", None)
    named = fmt(label) if fmt else None
    cell = named[1] if named else label
    return f"{found.where} ({cell})"


def _instrument(
    tree: ast.Module, choice: LoopChoice, lines: list[str], capture: Capture, where: str, opts: CellOptions
) -> tuple[ast.Module, list[Any]]:
    """The tree with the loop's iterator, fetch calls and (--lines) body statements hooked."""
    new, sites = instrument_loop(tree, choice, capture.token)
    capture.call_labels = {line: f"`{text}` on line {line}{where}" for line, text in sites.items()}
    capture.run.fetch_calls = dict(sites)
    capture.run.loop_iter_text = ast.unparse(find_node(tree, choice).iter)
    statements: list[Any] = []
    if opts.lines:
        from .capture.inside.line_costs import time_lines

        new, statements = time_lines(new, choice, lines, capture.token)
    return new, statements


@dataclass
class TracedCell:
    """A cell ready to run: its run and capture, and its code (compiled under IPython's name for
    the cell, so tracebacks show `Cell In[n]`), the last expression apart (it is `Out[n]`)."""

    shell: Any
    opts: CellOptions
    run: Run
    capture: Capture
    tree: ast.Module
    filename: str
    code: Any
    last_code: Any
    choice: LoopChoice | None
    func_loop: FunctionLoop | None
    flags: int

    @property
    def is_async(self) -> bool:
        """The cell awaits at top level (`await`, `async for`): IPython runs it on its loop."""
        return any(c is not None and c.co_flags & inspect.CO_COROUTINE for c in (self.code, self.last_code))


def prepare_cell(shell: Any, magic_line: str, cell: str, opts: CellOptions) -> TracedCell:
    """Locate the loop, rewrite it, compile the cell. Raises the cell's SyntaxError as IPython
    shows one, and UsageError for a --loop that names no loop."""
    __tracebackhide__ = True  # noqa: F841
    first_line = ("%%traceml " + magic_line).rstrip()
    transformed = _keep_leading_blank_lines(cell, shell.transform_cell(cell))
    filename = cache_cell(shell, first_line + "\n" + transformed, first_line + "\n" + cell)
    try:
        tree = ast.parse(transformed, filename)
    except SyntaxError as exc:
        exc.lineno = (exc.lineno or 0) + 1
        if getattr(exc, "end_lineno", None):
            exc.end_lineno = (exc.end_lineno or 0) + 1
        exc.filename = filename
        raise syntax_error(exc, shell) from None
    ast.increment_lineno(tree, 1)
    lines = [first_line] + transformed.splitlines()
    _import_torch()

    choice, func_loop = _locate(shell, tree, lines, opts)
    handle = Run(opts.name, opts.warmup)
    run = handle.recording
    capture = Capture(run)
    run.cell_source = first_line + "\n" + cell
    run.cell_filename = filename
    code_tree = tree
    statements: list[Any] = []
    if choice is not None:
        run.loop_line = choice.lineno
        run.loop_where = "this cell" if choice.function is None else f"function {choice.function}"
        run.loop_is_range = is_range(find_node(tree, choice))
        code_tree, statements = _instrument(tree, choice, lines, capture, "", opts)
    elif func_loop is not None:
        run.loop_line = func_loop.choice.lineno
        run.loop_where = _describe_function_loop(shell, func_loop)
        run.loop_is_range = is_range(find_node(func_loop.module, func_loop.choice))
        run.loop_cell_source = "\n".join(func_loop.lines)
        where = " of " + run.loop_where
        new_module, statements = _instrument(func_loop.module, func_loop.choice, func_loop.lines, capture, where, opts)
        if not compile_function_loop(func_loop, new_module):
            run.notes.append(f"The loop in {func_loop.where} could not be instrumented; its steps come from training events.")
            func_loop, statements = None, []
    if statements:
        from .capture.inside.line_costs import new_clock

        capture.lines = new_clock(statements, run, opts.warmup)
    elif opts.lines_chosen and choice is None and func_loop is None:
        run.notes.append("--lines: cost per line is measured for a loop written in a notebook cell.")
    body, last = _split_last_expression(code_tree)
    flags = getattr(shell.compile, "flags", 0) | getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
    try:
        code = compile(body, filename, "exec", flags, dont_inherit=True)
        last_code = compile(last, filename, "eval", flags, dont_inherit=True) if last else None
    except SyntaxError as exc:  # parses, but does not compile: `return` outside a function
        kernel_state.RUNS.remove(handle)
        raise syntax_error(exc, shell) from None
    return TracedCell(shell, opts, handle, capture, tree, filename, code, last_code, choice, func_loop, flags)


@contextmanager
def cell_traced(cell: TracedCell) -> Iterator[None]:
    """Everything that is on while the cell runs, undone (and the report shown) after it, also
    on an error or KeyboardInterrupt, which goes on up unchanged."""
    __tracebackhide__ = True  # noqa: F841
    handle, capture = cell.run, cell.capture
    run = handle.recording
    error: BaseException | None = None
    views: list[LiveView] = []
    try:
        with ExitStack() as stack:
            from .capture.gpu.gpu_watch import gpu_watched

            stack.enter_context(gpu_watched(run))
            stack.enter_context(children.followed(run, loop=children.script_loop(cell.opts.loop)))  # its processes
            stack.enter_context(ranks.followed(run, capture))  # the capture, across processes
            stack.enter_context(swapped_code(cell.func_loop))
            if capture.lines is not None:
                stack.enter_context(line_costs_kept(run, capture.lines))
            run.observe(_live_view_starter(run, cell.opts, views))
            yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        if cell.choice is not None and cell.choice.function is not None:
            # The cell's functions get their plain code back (never mask the user's error).
            with never_raise(run.notes, "The cell's functions keep their traced code"):
                plain = compile(cell.tree, cell.filename, "exec", cell.flags, dont_inherit=True)
                restore_definitions(cell.shell.user_ns, cell.code, plain)
        _finish(handle, error, cell.opts, views[0] if views else None, children.started_commands(cell.tree))


def run_traced_cell(shell: Any, magic_line: str, cell: str, opts: CellOptions) -> Any:
    """Execute `cell` as IPython would, timing its steps. Returns the last expression."""
    __tracebackhide__ = True  # noqa: F841
    traced = prepare_cell(shell, magic_line, cell, opts)
    if traced.is_async:  # called directly (not through the cell transformer): run it on IPython's loop
        return _run_coroutine(shell, run_traced_async(traced))
    g, ns = shell.user_global_ns, shell.user_ns
    with cell_traced(traced):
        exec(traced.code, g, ns)
        return eval(traced.last_code, g, ns) if traced.last_code else None


async def run_traced_async(traced: TracedCell) -> Any:
    """The same for a cell that awaits at top level, awaited where IPython awaits cells."""
    __tracebackhide__ = True  # noqa: F841
    g, ns = traced.shell.user_global_ns, traced.shell.user_ns
    with cell_traced(traced):
        result = eval(traced.code, g, ns)
        if inspect.iscoroutine(result):
            await result
        if traced.last_code is None:
            return None
        value = eval(traced.last_code, g, ns)
        return await value if inspect.isawaitable(value) else value


def _run_coroutine(shell: Any, coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return shell.loop_runner(coro)
    coro.close()
    raise UsageError(
        "%%traceml: this cell awaits at top level and an event loop is already running here; "
        "run the cell itself (`%%traceml` on its first line) so that IPython awaits it."
    )


def _live_view_starter(run: Recording, opts: CellOptions, views: list[LiveView]) -> Observer:
    """The live view starts with the first step (a cell without steps shows none)."""

    def start(_run: Recording) -> None:
        run.stop_observing(start)
        if run.n_steps == 0:  # the run ended without a step: nothing to chart
            return
        from .views.display import start_live_view

        view = start_live_view(run, show=opts.live)
        if view is not None:
            views.append(view)
            view.refresh(run)

    return start


def _finish(run: Run, error: BaseException | None, opts: CellOptions, view: LiveView | None, commands: list[str] | None = None) -> None:
    """Show the report, or one line when there is nothing to report; never mask the user's error
    (the edge at the cell's end: a failure of ours is one line on stderr)."""
    from .views.display import register_views

    register_views()  # --save x.html writes the report page
    try:
        if not _report(run, error, view, commands or []):
            return  # no step: nothing to save or keep
    except Exception as exc:  # the report must never hide what the cell did
        print(f"traceml: could not build the report: {failure_text(exc)}", file=sys.stderr)
    if opts.save:
        try:
            run.save(opts.save)
            print(f"traceml: saved {run.name} to {opts.save}")
        except Exception as exc:
            print(f"traceml: could not save {run.name} to {opts.save}: {failure_text(exc)}", file=sys.stderr)
    from .history import keep_in_history

    keep_in_history(run)  # into TRACEML_HISTORY when set (never raises)


def _report(run: Run, error: BaseException | None, view: LiveView | None, commands: list[str]) -> bool:
    """The run finished and its report shown (True), or the one line for a run without a step."""
    from .views.display import show_report

    result = run.finish(error).result
    if result.n_steps:
        show_report(run, view)
        return True
    if view is not None:
        view.close()
    if error is not None:
        print(
            f"traceml: no step ran: the cell stopped with {result.error} before its first "
            f"step ended.{_likely_cause(run)}"
        )
        if result.resources.oom:  # explained above the traceback, as a run's report would
            from .analysis.resources import finding_lines

            print("\n".join(f"traceml: {line}" for line in finding_lines(run.summary)))
        for line in stop_lines(result.data.inside):  # a DataLoader worker that died, raised, was late
            print(f"traceml: {line}")
    elif result.steps.kind == "none" and result.loop.line is None:
        kernel_state.RUNS.remove(run)
        print(children.no_training_line(result, commands) or NO_LOOP)
    else:
        print(f"traceml: {run.name}: no step ran ({_why_no_step(result)}).")
    return False


def _likely_cause(run: Run) -> str:
    """A checklist fix that explains an error before the first step (workers that cannot
    import a Dataset defined in a notebook cell), as the end of the one-line note."""
    from .kernel.code_facts import read_kernel_at_end

    reading = read_kernel_at_end(run)
    for item in reading.checklist if reading is not None else []:
        if item.key == "start_method" and item.status == "fix":
            where = f" ({item.site.label()})" if item.site is not None else ""
            return f" Likely cause: {item.seen}: {item.to_try}{where}."
    return ""


def _why_no_step(result: RunResult) -> str:
    line = result.loop.line
    if line is not None and not any(src.get("batches") for src in result.data.sources):
        return f"the loop on line {line} got no batch: its iterator is empty"
    return "no optimizer step, backward() or loop iteration ended"


@contextmanager
def line_costs_kept(run: Recording, clock: Any) -> Iterator[Any]:
    """At the end of the cell, `run.line_costs` gets the costs of the statements `clock` timed."""
    try:
        yield clock
    finally:
        off = clock.finish()  # its CUDA calls are guarded at the clock's edge (line_costs._gpu)
        if off is not None:
            run.notes.append(f"GPU time per line incomplete: {off}")
        # It runs as the cell ends: never mask the user's error.
        with never_raise(run.notes, "Cost per line not reported"):
            run.line_costs = _costs_of(run, clock)


def _costs_of(run: Recording, clock: Any) -> LineCosts:
    n = int(run.recorder.n_steps)
    warm = auto_warmup(n) if run.warmup is None else max(0, int(run.warmup))
    step, fetch = run.recorder.means_from(warm)
    return cast("LineCosts", line_costs(clock, warm, step, fetch, run.loop_line))
