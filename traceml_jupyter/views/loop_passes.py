"""How many times the step loop runs, read off the cell (pure AST): the `for ... in range(...)` loops
around it, with the counts the user's namespace holds."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..analysis.cell_code import parse_cell
from ..capture.instrument.locate import range_call
from ..failures import read_or

if TYPE_CHECKING:
    pass


def _index(value: Any) -> int:
    return int(value.__index__())


def _int_value(node: ast.expr, names: Mapping[str, Any]) -> int | None:
    """An int from a literal, a name bound to an int, or + - * // of those."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return int(node.value)
    if isinstance(node, ast.Name):
        value = names.get(node.id)
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            return None
        return read_or(None, _index, value)  # the user's value: its __index__ may raise
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_value(node.operand, names)
        return None if inner is None else -inner
    if isinstance(node, ast.BinOp):
        a, b = _int_value(node.left, names), _int_value(node.right, names)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if isinstance(node.op, ast.FloorDiv) and b:
            return a // b
    return None


def range_length(node: ast.expr, names: Mapping[str, Any]) -> int | None:
    """len() of `range(...)`, `trange(...)`, `tqdm(range(...))` or `enumerate(range(...))`."""
    call = range_call(node)
    if call is None or not 1 <= len(call.args) <= 3 or call.keywords:
        return None
    args = [_int_value(arg, names) for arg in call.args]
    if any(a is None for a in args) or (len(args) == 3 and not args[2]):
        return None
    return len(range(*args))  # type: ignore[arg-type]


def _path_to(node: ast.AST, line: int) -> list[ast.AST] | None:
    """The nodes from `node` down to the `for` statement on `line` (that statement excluded)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.For) and child.lineno == line:
            return [node]
        end = getattr(child, "end_lineno", None)
        if end is not None and not child.lineno <= line <= end:  # type: ignore[attr-defined]
            continue
        found = _path_to(child, line)
        if found is not None:
            return [node] + found
    return None


def loops_around(source: str | None, loop_line: int | None) -> list[ast.For] | None:
    """The `for` statements of the cell that enclose the step loop on `loop_line`, outermost
    first; None when that is unknowable (not in the cell's own code, inside a while or a def)."""
    if not source or loop_line is None:
        return None
    tree = parse_cell(source)
    if tree is None:
        return None
    path = _path_to(tree, loop_line)
    if path is None:
        return None
    unknown = (ast.While, ast.AsyncFor, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    if any(isinstance(node, unknown) for node in path):
        return None
    return [node for node in path if isinstance(node, ast.For)]


def passes_of(loops: list[ast.For] | None, names: Mapping[str, Any]) -> int | None:
    """How many times the step loop runs: the product of the range loops around it."""
    if loops is None:
        return None
    total = 1
    for loop in loops:
        n = range_length(loop.iter, names)
        if n is None:
            return None
        total *= max(n, 0)
    return total
