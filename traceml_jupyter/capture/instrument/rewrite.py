"""Rewriting the located loop so that its fetches go through the hooks. A pure AST -> AST function.

`for x in it: body` becomes `for x in __traceml_loop__(it, TOKEN): body` (`async for`:
`__traceml_aloop__`), and in the body each
fetch call — `next(it)`, `get_batch(...)`, `loader.next_batch()` — becomes
`__traceml_fetch__(TOKEN, LINE, next, it)`. Only those expressions change, so targets, `break`,
`continue`, `else:`, `return` and exceptions keep their meaning, the call's arguments are
evaluated in the same order, and every line number stays where it was. The names resolve in
builtins (hooks.py) and pass through outside their run.
"""

from __future__ import annotations

import ast
import copy
import re

from .hooks import ALOOP, FETCH, LOOP
from .locate import LoopChoice, find_node

HOOK = LOOP
# Calls that fetch a batch: the builtin next(), and functions or methods named like
# get_batch / next_batch / fetch_batch / load_batch / sample_batch / get_batches.
FETCH_NAME = re.compile(r"^(get|next|fetch|load|sample|read)_?batch(es)?$", re.IGNORECASE)


def fetch_call_name(call: ast.Call) -> str | None:
    """The name a call fetches a batch with (`next`, `get_batch`), else None."""
    func = call.func
    if isinstance(func, ast.Name):
        if func.id == "next" and 1 <= len(call.args) <= 2 and not call.keywords:
            return "next"
        return func.id if FETCH_NAME.match(func.id) else None
    if isinstance(func, ast.Attribute) and FETCH_NAME.match(func.attr):
        return func.attr
    return None


class _Fetches(ast.NodeTransformer):
    """Wraps the fetch calls of a loop body; nested definitions run elsewhere and stay as they are."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.sites: dict[int, str] = {}

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if fetch_call_name(node) is None:
            return node
        line = node.lineno
        self.sites.setdefault(line, ast.unparse(node))
        hook = ast.Name(id=FETCH, ctx=ast.Load())
        args: list[ast.expr] = [ast.Constant(self.token), ast.Constant(line), node.func, *node.args]
        new = ast.Call(func=hook, args=args, keywords=node.keywords)
        for part in (new, hook, args[0], args[1]):
            ast.copy_location(part, node)
        return new

    def _scope(self, node: ast.AST) -> ast.AST:
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = _scope


def instrument_loop(tree: ast.Module, choice: LoopChoice, token: int) -> tuple[ast.Module, dict[int, str]]:
    """A copy of `tree` whose chosen loop iterates `__traceml_loop__(<iterator>, token)` and
    whose body's fetch calls go through `__traceml_fetch__`; and those calls by line."""
    new = copy.deepcopy(tree)
    loop = find_node(new, choice)
    fetches = _Fetches(token)
    loop.body = [fetches.visit(stmt) for stmt in loop.body]
    original = loop.iter
    hook = ALOOP if isinstance(loop, ast.AsyncFor) else HOOK
    call = ast.Call(func=ast.Name(id=hook, ctx=ast.Load()), args=[original, ast.Constant(token)], keywords=[])
    loop.iter = ast.copy_location(call, original)
    ast.copy_location(call.func, original)
    ast.copy_location(call.args[1], original)
    return ast.fix_missing_locations(new), fetches.sites
