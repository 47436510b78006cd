"""Cells that do not compile: a `%%traceml` cell whose code has a syntax error fails exactly as
the plain cell does. An IPython input transformer hands IPython the plain cell, under a comment
where the `%%traceml` line was, so IPython compiles it and raises the error itself: the same
type, `msg`, `text` and `offset` as the plain cell's, `lineno` counting the `%%traceml` line as
line 1, in `sys.last_value`, `ExecutionResult.error_before_exec` and a kernel's `evalue`, shown
with the cell's line and caret and no frame of the magic. Light on purpose: every other cell
is left as it is at the cost of a prefix test."""

from __future__ import annotations

import ast
import re
from typing import Any

MAGIC_LINE = re.compile(r"%%traceml(\s|$)")
# What the `%%traceml` line becomes: a comment, so the cell's lines keep their numbers.
COMMENT = "# %%traceml\n"


def compile_error(shell: Any, source: str) -> SyntaxError | ValueError | None:
    """The error compiling `source` (IPython's transform applied, top-level await allowed, the
    shell's `from __future__` flags) raises, as the traced cell would meet it; None: it compiles."""
    flags = getattr(getattr(shell, "compile", None), "flags", 0) | getattr(
        ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0
    )
    try:
        compile(shell.transform_cell(source), "<traceml-check>", "exec", flags, dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: a null byte, before Python 3.12
        return exc
    except Exception:  # an input transformer of someone else's that fails: not ours to judge
        return None
    return None


def plain_lines(lines: list[str]) -> list[str]:
    """The cell without its magic: the comment, the body's leading blank lines as they are (the
    traced cell keeps them), the rest dedented as IPython dedents a cell."""
    from IPython.core.inputtransformer2 import leading_indent

    body = lines[1:]
    blank = next((i for i, line in enumerate(body) if line.strip()), len(body))
    return [COMMENT, *body[:blank], *leading_indent(body[blank:])]


def route_syntax_errors(lines: list[str]) -> list[str]:
    """An IPython input transformer: a `%%traceml` cell whose options parse but whose code does
    not compile becomes the plain cell (see the module docstring). Every other cell, and a cell
    with a bad option (the magic says so, as before), is left as it is."""
    if not lines or not MAGIC_LINE.match(lines[0]):
        return lines
    try:
        from IPython import get_ipython

        from .magic import parse_cell_line

        shell = get_ipython()
        if shell is None:
            return lines
        parse_cell_line(lines[0][len("%%traceml") :].strip())
        if compile_error(shell, "".join(lines[1:])) is None:
            return lines
        plain = plain_lines(lines)
        # Hand over only what fails as the traced cell would: IPython then raises that error.
        return plain if compile_error(shell, "".join(plain)) is not None else lines
    except Exception:  # a bad option (UsageError), or anything else: the magic decides
        return lines


# IPython's completeness check (the terminal's "is this cell finished?") skips transformers
# with side effects; this one would hide an unfinished cell's magic from it.
route_syntax_errors.has_side_effects = True  # type: ignore[attr-defined]
