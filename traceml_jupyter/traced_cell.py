"""Running one `%%traceml` cell: locate the loop, rewrite, exec in the user namespace,
report, and undo every patch, also on error and KeyboardInterrupt."""

from __future__ import annotations

import ast
import importlib.util
import sys
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError

from .cell_functions import (
    FunctionLoop,
    called_cell_functions,
    find_function_loop,
    restore_definitions,
    swapped_code,
)
from .dataloader_watch import LoaderSteps, describe_loader, time_loader_iterators, watch_loaders
from .locate import find_innermost_loop, find_training_loop, for_loop_lines, loop_at_line
from .rewrite import HOOK, instrument_loop
from .run import _RUNS, Run

NO_LOOP = (
    "traceml: no training loop found in this cell (no `for` loop calling .backward() or "
    ".step(), and no DataLoader was iterated); mark it with `# traceml: loop` on its line "
    "or choose it with `--loop LINE`."
)


@dataclass
class CellOptions:
    name: str | None = None
    warmup: int | None = None
    live: bool = True
    save: str | None = None
    loop: int | None = None
    lines: bool = True  # time each top-level statement of the loop body (line_costs.py)


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


@contextmanager
def name_in(namespace: dict[str, Any], name: str, value: Any) -> Iterator[None]:
    had, previous = name in namespace, namespace.get(name)
    namespace[name] = value
    try:
        yield
    finally:
        if had:
            namespace[name] = previous
        else:
            namespace.pop(name, None)


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


def _locate(
    shell: Any, tree: ast.Module, lines: list[str], opts: CellOptions
) -> tuple[Any, FunctionLoop | None]:
    """The loop in this cell, or in a function the cell calls (cell first, training first)."""
    if opts.loop is not None:
        choice = loop_at_line(tree, opts.loop)
        if choice is None:
            starts = ", ".join(map(str, for_loop_lines(tree))) or "none"
            raise UsageError(
                f"--loop {opts.loop}: no for loop on line {opts.loop} of this cell "
                f"(for loops start on lines: {starts})"
            )
        return choice, None
    choice = find_training_loop(tree, lines)
    if choice is not None:
        return choice, None
    functions = called_cell_functions(tree, shell.user_ns)
    found = find_function_loop(functions, lambda node, ls: find_training_loop(node, ls), HOOK)
    if found is not None:
        return None, found
    choice = find_innermost_loop(tree)
    if choice is not None:
        return choice, None
    return None, find_function_loop(functions, lambda node, ls: find_innermost_loop(node), HOOK)


def _describe_function_loop(shell: Any, found: FunctionLoop) -> str:
    label = found.func.__code__.co_filename
    fmt = getattr(shell.compile, "format_code_name", None)
    named = fmt(label) if fmt else None
    cell = named[1] if named else label
    return f"{found.where} ({cell})"


def run_traced_cell(shell: Any, magic_line: str, cell: str, opts: CellOptions) -> Any:
    """Execute `cell` as IPython would, timing its step loop. Returns the last expression."""
    __tracebackhide__ = True  # noqa: F841
    first_line = ("%%traceml " + magic_line).rstrip()
    transformed = _keep_leading_blank_lines(cell, shell.transform_cell(cell))
    filename = cache_cell(shell, first_line + "\n" + transformed, first_line + "\n" + cell)
    try:
        tree = ast.parse(transformed, filename)
    except SyntaxError as exc:
        exc.lineno = (exc.lineno or 0) + 1
        exc.filename = filename
        raise
    ast.increment_lineno(tree, 1)
    lines = [first_line] + transformed.splitlines()
    _import_torch()

    choice, func_loop = _locate(shell, tree, lines, opts)
    run = Run(opts.name, opts.warmup)
    run.cell_source = first_line + "\n" + cell
    run.cell_filename = filename
    if choice is not None:
        run.loop_line = choice.lineno
        run.loop_where = "this cell" if choice.function is None else f"function {choice.function}"
    elif func_loop is not None:
        run.loop_line = func_loop.choice.lineno
        run.loop_where = _describe_function_loop(shell, func_loop)

    code_tree = instrument_loop(tree, choice, HOOK) if choice is not None else tree
    line_clock = None
    if opts.lines and choice is not None:
        from .line_costs import new_clock, time_lines

        code_tree, statements = time_lines(code_tree, choice, lines)
        line_clock = new_clock(statements, run, opts.warmup)
    elif opts.lines:
        run.notes.append("--lines: cost per line is measured only for a loop written in this cell.")
    body, last = _split_last_expression(code_tree)
    flags = getattr(shell.compile, "flags", 0)
    code = compile(body, filename, "exec", flags, dont_inherit=True)
    last_code = compile(last, filename, "eval", flags, dont_inherit=True) if last else None

    fallback = LoaderSteps() if choice is None and func_loop is None else None
    seen: list[Any] = []

    def remember(loader: Any) -> None:
        try:
            seen[:] = [weakref.ref(loader)]
        except TypeError:
            pass

    run.loader_seen = lambda: seen[0]() if seen else None
    ns = shell.user_ns
    error: BaseException | None = None
    view = None
    try:
        with ExitStack() as patches:
            patches.enter_context(name_in(ns, HOOK, run.loop))
            patches.enter_context(swapped_code(func_loop, run.loop, HOOK))
            if fallback is not None:
                patches.enter_context(time_loader_iterators(fallback))
            else:
                patches.enter_context(watch_loaders(remember))
                from .sync_stalls import gpu_watched

                patches.enter_context(gpu_watched(run))
            if line_clock is not None:
                from .line_costs import LINES, SAMPLE, line_costs_kept

                patches.enter_context(name_in(ns, LINES, line_clock))
                patches.enter_context(name_in(ns, SAMPLE, line_clock.sample))
                patches.enter_context(line_costs_kept(run, line_clock))
            if fallback is None:
                from .display import start_live_view

                view = start_live_view(run, show=opts.live)
            exec(code, shell.user_global_ns, ns)
            return eval(last_code, shell.user_global_ns, ns) if last_code else None
    except BaseException as exc:
        error = exc
        raise
    finally:
        if choice is not None and choice.function is not None:
            plain = compile(tree, filename, "exec", flags, dont_inherit=True)
            restore_definitions(ns, code, plain)
        _finish(run, fallback, error, opts, view)


def _finish(
    run: Run, fallback: LoaderSteps | None, error: BaseException | None, opts: CellOptions, view: Any
) -> None:
    """Show the report (or the one-line 'no loop' message); never mask the user's error."""
    from .display import show_report

    try:
        if fallback is not None:
            recorder, loader = fallback.busiest()
            if recorder is None or recorder.n_steps == 0:
                _RUNS.remove(run)
                print(NO_LOOP)
                return
            run.recorder = recorder
            run.loop_where = "DataLoader iterator (no loop in the cell: timed next() on the loader)"
            if loader is not None:
                run.loader_info = describe_loader(loader)
        run.finish(error)
        show_report(run, view)
        if opts.save:
            run.save(opts.save)
            print(f"traceml: saved {run.name} to {opts.save}")
    except Exception as exc:  # the report must never hide what the cell did
        print(f"traceml: could not build the report: {type(exc).__name__}: {exc}", file=sys.stderr)
