"""Cells that await at top level: a `%%traceml` cell with `await` or `async for` is handed to
IPython as one `await`, so that IPython runs it on its event loop as it runs a plain cell that
awaits. Light on purpose: it runs on every cell (an IPython input transformer)."""

from __future__ import annotations

import ast


def has_top_level_await(source: str) -> bool:
    """`await`, `async for` or `async with` outside any function."""
    if "await" not in source and "async" not in source:
        return False
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))
    return False


def route_async_cells(lines: list[str]) -> list[str]:
    """An IPython input transformer: a `%%traceml` cell that awaits at top level becomes one
    `await` of `traced_cell_async(...)`, so that IPython runs it on its event loop (in a kernel,
    the kernel's), as it runs a plain cell that awaits. Every other cell is left as it is."""
    if not lines or not lines[0].startswith("%%traceml"):
        return lines
    magic_line = lines[0][len("%%traceml") :].strip()
    body = "".join(lines[1:])
    if not has_top_level_await(body):
        return lines
    return [
        "await __import__('traceml_jupyter.magic').magic.traced_cell_async("
        f"get_ipython(), {magic_line!r}, {body!r})\n"
    ]
