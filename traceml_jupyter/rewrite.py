"""Rewriting a loop so that its iterator goes through the run's hook. A pure AST -> AST function.

`for x in it: body` becomes `for x in HOOK(it): body`. Only the iterator expression changes,
so targets, `break`, `continue`, `else:`, `return` and exceptions keep their meaning, and every
line number stays where it was.
"""

from __future__ import annotations

import ast
import copy

from .locate import LoopChoice, find_node

HOOK = "__traceml_loop__"


def instrument_loop(tree: ast.Module, choice: LoopChoice, hook: str = HOOK) -> ast.Module:
    """A copy of `tree` whose chosen loop iterates `hook(<original iterator>)`."""
    new = copy.deepcopy(tree)
    loop = find_node(new, choice)
    original = loop.iter
    call = ast.Call(func=ast.Name(id=hook, ctx=ast.Load()), args=[original], keywords=[])
    loop.iter = ast.copy_location(call, original)
    ast.copy_location(call.func, original)
    return ast.fix_missing_locations(new)
