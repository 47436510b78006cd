"""Loops inside functions that earlier notebook cells defined: find them through the calls of
the traced cell, and swap in instrumented code for the duration of the cell."""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .locate import LoopChoice, called_names

MAX_DEPTH = 2


def is_cell_file(filename: str) -> bool:
    """True for code compiled from a notebook cell or an IPython prompt (source in linecache)."""
    if filename.startswith("<ipython-input-"):
        return True
    return filename in linecache.cache and not os.path.exists(filename)


def as_cell_function(obj: Any) -> types.FunctionType | None:
    """The plain function behind `obj` (a function or a bound method) when a notebook cell defined
    it; else None."""
    func = getattr(obj, "__func__", obj)  # bound methods
    if isinstance(func, types.FunctionType) and is_cell_file(func.__code__.co_filename):
        return func
    return None


def _resolve(name: tuple[str, ...], namespace: Mapping[str, Any], owner: type | None) -> Any:
    head, *rest = name
    if head == "self" and owner is not None:
        obj: Any = owner
    elif head in namespace:
        obj = namespace[head]
    else:
        return None
    for attr in rest:
        try:
            obj = inspect.getattr_static(obj, attr)
        except AttributeError:
            return None
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
    if isinstance(obj, type):  # calling a class runs its __init__
        return None
    return obj


def _owner_class(func: types.FunctionType) -> type | None:
    parts = func.__qualname__.split(".")
    if len(parts) >= 2 and "<locals>" not in parts:
        owner = func.__globals__.get(parts[0])
        return owner if isinstance(owner, type) else None
    return None


def _function_tree(func: types.FunctionType) -> tuple[ast.Module, ast.AST] | None:
    """The whole cell's tree and the function's node in it."""
    code = func.__code__
    lines = linecache.getlines(code.co_filename)
    if not lines:
        return None
    try:
        module = ast.parse("".join(lines))
    except SyntaxError:
        return None
    first = code.co_firstlineno
    for node in ast.walk(module):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func.__name__:
            starts = [node.lineno] + [d.lineno for d in node.decorator_list]
            if first in starts:
                return module, node
    return None


def called_cell_functions(tree: ast.AST, namespace: Mapping[str, Any]) -> list[types.FunctionType]:
    """Cell-defined functions the tree calls, then the ones they call (breadth first)."""
    found: list[types.FunctionType] = []
    frontier: list[tuple[ast.AST, Mapping[str, Any], type | None]] = [(tree, namespace, None)]
    for _ in range(MAX_DEPTH):
        nxt: list[tuple[ast.AST, Mapping[str, Any], type | None]] = []
        for node, ns, owner in frontier:
            for name in called_names(node):
                func = as_cell_function(_resolve(name, ns, owner))
                if func is None or func in found:
                    continue
                found.append(func)
                located = _function_tree(func)
                if located is not None:
                    nxt.append((located[1], func.__globals__, _owner_class(func)))
        frontier = nxt
    return found


def named_cell_function(name: str, tree: ast.AST, namespace: Mapping[str, Any]) -> types.FunctionType | None:
    """A function defined in a notebook cell, by name (`train`, `Trainer.fit`): one the traced
    cell calls, else one in the namespace."""
    for func in called_cell_functions(tree, namespace):
        if name in (func.__name__, func.__qualname__):
            return func
    return as_cell_function(_resolve(tuple(name.split(".")), namespace, None))


@dataclass
class FunctionLoop:
    """A loop found in a function defined in another cell: the function, the loop, the cell's
    tree and lines (the function's own cell numbering)."""

    func: types.FunctionType
    choice: LoopChoice
    module: ast.Module
    lines: list[str]
    code: types.CodeType | None = None  # the instrumented code object, once built

    @property
    def where(self) -> str:
        """Where the loop is, as notes say it: "function train_epoch"."""
        return f"function {self.func.__qualname__}"


def _find_code(code: types.CodeType, name: str, firstlineno: int) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name and const.co_firstlineno == firstlineno:
                return const
            inner = _find_code(const, name, firstlineno)
            if inner is not None:
                return inner
    return None


Finder = Callable[[ast.AST, list[str]], "LoopChoice | None"]


def function_loop(func: types.FunctionType, finder: Finder) -> FunctionLoop | None:
    """The loop `finder` picks in `func` (searched in the function's own node)."""
    located = _function_tree(func)
    if located is None:
        return None
    module, node = located
    lines = [line.rstrip("\n") for line in linecache.getlines(func.__code__.co_filename)]
    choice = finder(node, lines)
    if choice is None:
        return None
    return FunctionLoop(func, choice, module, lines)


def find_function_loop(functions: list[types.FunctionType], finder: Finder) -> FunctionLoop | None:
    """The first of `functions` in which `finder` picks a loop."""
    for func in functions:
        found = function_loop(func, finder)
        if found is not None:
            return found
    return None


def compile_function_loop(found: FunctionLoop, tree: ast.Module) -> bool:
    """Compile the instrumented cell `tree` and keep the function's new code; False when it
    cannot replace the old one (a closure that changed shape)."""
    func = found.func
    compiled = compile(tree, func.__code__.co_filename, "exec", dont_inherit=True)
    code = _find_code(compiled, func.__code__.co_name, func.__code__.co_firstlineno)
    if code is None or code.co_freevars != func.__code__.co_freevars:
        return False
    found.code = code
    return True


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const
            yield from _code_objects(const)


def restore_definitions(namespace: dict[str, Any], instrumented: types.CodeType, original: types.CodeType) -> None:
    """Functions (and methods of classes) that the traced cell defined with an instrumented
    loop get their plain code back, so they run unpatched after the cell."""
    plain = {(c.co_name, c.co_firstlineno): c for c in _code_objects(original)}
    swap = {
        c: plain[(c.co_name, c.co_firstlineno)]
        for c in _code_objects(instrumented)
        if (c.co_name, c.co_firstlineno) in plain and c.co_freevars == plain[(c.co_name, c.co_firstlineno)].co_freevars
    }
    candidates: list[Any] = list(namespace.values())
    candidates += [v for obj in list(candidates) if isinstance(obj, type) for v in vars(obj).values()]
    for obj in candidates:
        func = getattr(obj, "__func__", obj)
        code = getattr(func, "__code__", None)
        if isinstance(func, types.FunctionType) and code in swap:
            func.__code__ = swap[code]


@contextmanager
def swapped_code(found: FunctionLoop | None) -> Iterator[None]:
    """Run with the function's instrumented code in place; its own code is back on exit (and
    code still running the instrumented version is harmless: see hooks.py)."""
    if found is None or found.code is None:
        yield
        return
    func, original = found.func, found.func.__code__
    func.__code__ = found.code
    try:
        yield
    finally:
        func.__code__ = original
