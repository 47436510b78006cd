"""Finding the step loop in a cell's (or a function's) syntax tree. Pure functions."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

MARK = re.compile(r"#\s*traceml\s*:\s*loop\b")
LOOPS = (ast.For, ast.While, ast.AsyncFor)
FOR_LOOPS = (ast.For, ast.AsyncFor)
ForLoop = ast.For | ast.AsyncFor
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(frozen=True)
class LoopChoice:
    """A `for` statement chosen as the step loop: where it is, and why it was chosen."""

    lineno: int
    col_offset: int
    reason: str  # "--loop", "marked", "replays", "trains", "steps", "innermost"
    function: str | None = None  # name of the enclosing function, if any


def _for_loops(tree: ast.AST) -> Iterator[tuple[ForLoop, int, str | None]]:
    """Every `for` statement with its loop depth and its enclosing function name."""

    def visit(node: ast.AST, depth: int, func: str | None) -> Iterator[tuple[ForLoop, int, str | None]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, 0, child.name)
            elif isinstance(child, FOR_LOOPS):
                yield child, depth, func
                yield from visit(child, depth + 1, func)
            elif isinstance(child, LOOPS):
                yield from visit(child, depth + 1, func)
            else:
                yield from visit(child, depth, func)

    yield from visit(tree, 0, None)


def _own_calls(loop: ForLoop) -> Iterator[ast.Call]:
    """Calls in the loop's body and else, not inside a nested loop or definition."""
    stack: list[ast.AST] = [*loop.body, *loop.orelse]
    while stack:
        node = stack.pop()
        if isinstance(node, LOOPS + SCOPES):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _calls_method(loop: ForLoop, name: str) -> bool:
    return any(
        isinstance(call.func, ast.Attribute) and call.func.attr == name for call in _own_calls(loop)
    )


# `.step()` of these is not an optimizer step: LR schedulers, AMP's GradScaler, warm-up helpers.
NOT_OPTIMIZERS = re.compile(r"sched|scaler|warmup|^lr$|swa", re.IGNORECASE)


def _receiver_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _receiver_name(node.value)
    return None


def _steps_an_optimizer(loop: ForLoop) -> bool:
    """The loop's own body calls `.step()` on something that is not a scheduler or a scaler."""
    for call in _own_calls(loop):
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "step":
            name = _receiver_name(func.value)
            if name is None or not NOT_OPTIMIZERS.search(name):
                return True
    return False


def range_call(node: ast.expr) -> ast.Call | None:
    """The `range(...)` or `trange(...)` call a loop iterates, also through tqdm() or
    enumerate() (two wrappers at most); None when it iterates something else."""
    for _ in range(3):
        if not isinstance(node, ast.Call):
            return None
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in ("range", "trange"):
            return node
        if name not in ("tqdm", "enumerate") or not node.args:
            return None
        node = node.args[0]
    return None


def is_range(loop: ForLoop) -> bool:
    """The loop counts steps: `range(...)`, `trange(...)`, or tqdm/enumerate of one."""
    return range_call(loop.iter) is not None


def _has_nested_for(loop: ForLoop) -> bool:
    return any(isinstance(n, (ast.For, ast.AsyncFor)) for b in loop.body for n in ast.walk(b))


def _choice(loop: ForLoop, reason: str, func: str | None) -> LoopChoice:
    return LoopChoice(loop.lineno, loop.col_offset, reason, func)


def for_loop_lines(tree: ast.AST) -> list[int]:
    """The lines of the cell's `for` loops, in order (where `--loop LINE` may point)."""
    return sorted(loop.lineno for loop, _, _ in _for_loops(tree))


def find_marked_loop(tree: ast.AST, lines: Sequence[str] = ()) -> LoopChoice | None:
    """The loop marked `# traceml: loop` on its line."""
    loops = sorted(_for_loops(tree), key=lambda t: (t[0].lineno, t[0].col_offset))
    for loop, _, func in loops:
        if 0 < loop.lineno <= len(lines) and MARK.search(lines[loop.lineno - 1]):
            return _choice(loop, "marked", func)
    return None


def find_training_loop(tree: ast.AST, lines: Sequence[str] = ()) -> LoopChoice | None:
    """A loop marked `# traceml: loop`; else the first whose own body replays a CUDA graph
    (`g.replay()`: the training step was captured, and warm-up loops before the capture call
    `.backward(` too); else the first whose own body calls `.backward(`; else the innermost
    whose own body steps an optimizer (`.step(` of anything that is not a scheduler or a
    GradScaler)."""
    marked = find_marked_loop(tree, lines)
    if marked is not None:
        return marked
    loops = sorted(_for_loops(tree), key=lambda t: (t[0].lineno, t[0].col_offset))
    for loop, _, func in loops:
        if _calls_method(loop, "replay"):
            return _choice(loop, "replays", func)
    for loop, _, func in loops:
        if _calls_method(loop, "backward"):
            return _choice(loop, "trains", func)
    stepping = [(loop, depth, func) for loop, depth, func in loops if _steps_an_optimizer(loop)]
    if stepping:
        loop, _, func = max(stepping, key=lambda t: t[1])
        return _choice(loop, "steps", func)
    return None


def find_innermost_loop(tree: ast.AST) -> LoopChoice | None:
    """The first innermost `for` over something other than `range(...)`."""
    loops = sorted(_for_loops(tree), key=lambda t: (t[0].lineno, t[0].col_offset))
    for loop, _, func in loops:
        if not is_range(loop) and not _has_nested_for(loop):
            return _choice(loop, "innermost", func)
    return None


def loop_at_line(tree: ast.AST, line: int) -> LoopChoice | None:
    """The `for` starting on `line`, else the innermost `for` whose lines contain it."""
    best: tuple[ForLoop, str | None] | None = None
    for loop, _, func in _for_loops(tree):
        if loop.lineno == line:
            return _choice(loop, "--loop", func)
        end = getattr(loop, "end_lineno", loop.lineno) or loop.lineno
        if loop.lineno <= line <= end and (best is None or loop.lineno > best[0].lineno):
            best = (loop, func)
    return _choice(best[0], "--loop", best[1]) if best else None


def find_node(tree: ast.AST, choice: LoopChoice) -> ForLoop:
    """The loop node `choice` names (by line and column) in `tree`."""
    for node in ast.walk(tree):
        if (
            isinstance(node, FOR_LOOPS)
            and node.lineno == choice.lineno
            and node.col_offset == choice.col_offset
        ):
            return node
    raise LookupError(f"no for loop at line {choice.lineno}")
