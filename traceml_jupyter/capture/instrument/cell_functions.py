"""Loops inside functions that earlier notebook cells defined: find them through the calls of
the traced cell (a method on the class of its receiver, also an object the cell makes itself:
the class is read off the code, which never runs for it), and swap in instrumented code for the
duration of the cell."""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import os
import re
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .locate import SCOPES, LoopChoice

MAX_DEPTH = 2


def names_in(code: str) -> set[str]:
    """The names `code` reads or binds (`model` in `loss = model(x)`), not attribute names
    (`trainer.train`) nor keyword arguments (`Trainer(model=lm)`). IPython's `%` and `!` lines
    (the `%%traceml` line) are left out; code that still does not parse gives every identifier
    that does not follow a dot."""
    python = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(python)
    except (SyntaxError, ValueError):
        return set(re.findall(r"(?<![.\w])[A-Za-z_][A-Za-z0-9_]*", code))
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def is_cell_file(filename: str) -> bool:
    """True for code compiled from a notebook cell or an IPython prompt (source in linecache)."""
    if filename.startswith("<ipython-input-"):
        return True
    return filename in linecache.cache and not os.path.exists(filename)


def as_cell_function(obj: Any) -> types.FunctionType | None:
    """The plain function behind `obj` (a function or a bound method) when a notebook cell defined
    it; else None."""
    func = obj.__func__ if isinstance(obj, types.MethodType) else obj  # bound methods
    if isinstance(func, types.FunctionType) and is_cell_file(func.__code__.co_filename):
        return func
    return None


def _lookup(obj: Any, attrs: Sequence[str]) -> Any:
    """`obj.a.b` read without running the user's code (no descriptors, no `__getattr__`): a
    class's attribute is found along its MRO, a static or class method gives its function; None
    when an attribute is missing."""
    for attr in attrs:
        try:
            obj = inspect.getattr_static(obj, attr)
        except AttributeError:
            return None
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
    return obj


def _resolve(name: tuple[str, ...], namespace: Mapping[str, Any], owner: type | None) -> Any:
    head, *rest = name
    if head == "self" and owner is not None:
        obj: Any = owner
    elif head in namespace:
        obj = namespace[head]
    else:
        return None
    obj = _lookup(obj, rest)
    if isinstance(obj, type):  # calling a class runs its __init__
        return None
    return obj


def _owner_class(func: types.FunctionType) -> type | None:
    parts = func.__qualname__.split(".")
    if len(parts) >= 2 and "<locals>" not in parts:
        owner = func.__globals__.get(parts[0])
        return owner if isinstance(owner, type) else None
    return None


@functools.lru_cache(maxsize=16)
def _cell_tree(source: str) -> tuple[ast.Module, dict[tuple[str, int], ast.AST]] | None:
    """A cell's tree and its functions' nodes by (name, first line, decorators' lines too),
    parsed once for all the calls that lead into the cell (shared: never changed in place;
    the rewrite works on a copy)."""
    try:
        module = ast.parse(source)
    except SyntaxError:
        return None
    nodes: dict[tuple[str, int], ast.AST] = {}
    for node in ast.walk(module):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for line in [node.lineno] + [d.lineno for d in node.decorator_list]:
                nodes.setdefault((node.name, line), node)
    return module, nodes


def _function_tree(func: types.FunctionType) -> tuple[ast.Module, ast.AST] | None:
    """The whole cell's tree and the function's node in it."""
    code = func.__code__
    lines = linecache.getlines(code.co_filename)
    parsed = _cell_tree("".join(lines)) if lines else None
    if parsed is None:
        return None
    node = parsed[1].get((func.__name__, code.co_firstlineno))
    return None if node is None else (parsed[0], node)


# -- what a call calls, read off the code before it runs (receivers made in the cell) ---------

MAX_HOPS = 12  # assignments, calls and returns followed to find a receiver's class
Assigned = Mapping[str, list[tuple[tuple[int, int], ast.expr]]]


@dataclass(frozen=True)
class Scope:
    """What the names of a cell, or of a function's body, mean before it runs: the namespace,
    the values the code itself assigns to names (each with the position where its statement
    ends), the class `self` is (a method's receiver) and the name of `self` (or `cls`)."""

    namespace: Mapping[str, Any]
    assigned: Assigned
    owner: type | None = None
    self_name: str | None = None
    self_is_class: bool = False  # a classmethod's `cls`
    known: dict[int, type | None] = field(default_factory=dict, compare=False)  # assigned values' classes


def _local_nodes(root: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `root`'s own code, not inside a nested definition, in source order."""
    stack = list(reversed(list(ast.iter_child_nodes(root))))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, SCOPES):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))


UNKNOWN = ast.Constant(value=None)  # a name bound to what the code does not tell (`for t in ...`)


def _end(node: ast.expr | ast.stmt) -> tuple[int, int]:
    return (node.end_lineno or node.lineno, node.end_col_offset or 0)


def _target_names(target: ast.expr) -> Iterator[str]:
    """The names an assignment target binds (`a`, `a, (b, *c)`; not `a.b`, `a[i]`)."""
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for item in target.elts:
            yield from _target_names(item)
    elif isinstance(target, ast.Starred):
        yield from _target_names(target.value)


def _bindings(node: ast.AST) -> Iterator[tuple[str, tuple[int, int], ast.expr]]:
    """The names one node of the code binds: (name, where the binding is done, its value, or
    UNKNOWN). `with Cls(...) as t` binds what `Cls(...).__enter__()` returns (`__aenter__`'s
    awaited result for `async with`)."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            value = node.value if isinstance(target, ast.Name) else UNKNOWN  # `a, b = ...`
            yield from ((name, _end(node), value) for name in _target_names(target))
    elif isinstance(node, ast.NamedExpr):
        yield node.target.id, _end(node), node.value
    elif isinstance(node, (ast.For, ast.AsyncFor)):
        first: ast.expr = ast.Subscript(node.iter, ast.Constant(0), ast.Load())  # `for t in trainers`
        value = first if isinstance(node.target, ast.Name) else UNKNOWN
        yield from ((name, _end(node.target), value) for name in _target_names(node.target))
    elif isinstance(node, ast.AugAssign):
        yield from ((name, _end(node.target), UNKNOWN) for name in _target_names(node.target))
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        for item in node.items:
            if isinstance(item.optional_vars, ast.Name):
                method = "__aenter__" if isinstance(node, ast.AsyncWith) else "__enter__"
                enter = ast.Call(ast.Attribute(item.context_expr, method, ast.Load()), [], [])
                yield item.optional_vars.id, _end(item.optional_vars), enter
            elif item.optional_vars is not None:
                yield from ((name, _end(item.optional_vars), UNKNOWN) for name in _target_names(item.optional_vars))
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name, _end(node), UNKNOWN  # defined again by the code itself
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        yield from ((a.asname or a.name.split(".")[0], _end(node), UNKNOWN) for a in node.names)


def _assignments(root: ast.AST) -> Assigned:
    """The names `root`'s own code binds (`name = value`, `name: T = value`, `(name := value)`,
    `with ... as name`, `for name in items` (an item); UNKNOWN for unpacking, definitions,
    imports): by name, the values with the position where the binding is done, in source order."""
    out: dict[str, list[tuple[tuple[int, int], ast.expr]]] = {}
    for node in _local_nodes(root):
        for name, end, value in _bindings(node):
            out.setdefault(name, []).append((end, value))
    for values in out.values():
        values.sort(key=lambda item: item[0])
    return out


# A function's own code, read once for all the calls that lead into it (its node is one of a
# cached cell tree's, `_cell_tree`); the traced cell's own tree is read uncached, once.
_function_assignments = functools.lru_cache(maxsize=64)(_assignments)


@functools.lru_cache(maxsize=64)
def _returned(root: ast.AST) -> tuple[ast.expr, ...]:
    """What the `return` statements of `root`'s own code return, in source order."""
    return tuple(n.value for n in _local_nodes(root) if isinstance(n, ast.Return) and n.value is not None)


def _method_owner(func: types.FunctionType, receiver: type | None) -> type | None:
    """The class `self` is in `func`'s body: the receiver's class when the method was found on it
    (a subclass's overrides count), else the class that defines it."""
    defined = _owner_class(func)
    if defined is not None and receiver is not None and defined in receiver.__mro__:
        return receiver
    return defined


def function_scope(func: types.FunctionType, node: ast.AST, owner: type | None) -> Scope:
    """The scope of a cell function's body (`node`); `owner`: the class its `self` or `cls` is."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return Scope(func.__globals__, {})
    params = [*node.args.posonlyargs, *node.args.args]
    decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
    bound = owner is not None and bool(params) and "staticmethod" not in decorators
    return Scope(
        func.__globals__,
        _function_assignments(node),
        owner,
        params[0].arg if bound else None,
        "classmethod" in decorators,
    )


def _bound_here(name: ast.Name, scope: Scope) -> ast.expr | None:
    """The value the scope's own code last assigned to `name` before reading it."""
    where = (name.lineno, name.col_offset)
    earlier = [value for end, value in scope.assigned.get(name.id, []) if end <= where]
    return earlier[-1] if earlier else None


def _dotted(node: ast.expr) -> tuple[ast.Name, list[str]] | None:
    """`a.b.c` as its head name and the attributes read off it; None for anything else."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node, attrs[::-1]) if isinstance(node, ast.Name) else None


def class_of(expr: ast.expr, scope: Scope, hops: int = 0) -> type | None:
    """The class of the object `expr` gives, read off the code without running it: `Cls(...)`, a
    name the scope assigned one earlier, an instance in the namespace, `self`, what a cell
    function or method returns (`make_trainer()`, `Cls(...).setup()`: `returned_class`), an item
    of a list (`_item_class`). None when the code does not tell."""
    if hops > MAX_HOPS:
        return None
    if isinstance(expr, ast.NamedExpr):
        return class_of(expr.value, scope, hops + 1)
    if isinstance(expr, ast.Name):
        if expr.id == scope.self_name:
            return None if scope.self_is_class else scope.owner
        value = _bound_here(expr, scope)
        if value is not None:  # each assignment's class read once (`t.a()`, `t.b()`, ...)
            if id(value) not in scope.known:
                scope.known[id(value)] = class_of(value, scope, hops + 1)
            return scope.known[id(value)]
        obj = scope.namespace.get(expr.id)
        return None if obj is None or isinstance(obj, (type, types.ModuleType)) else type(obj)
    if isinstance(expr, ast.Call):
        callee, receiver = callee_of(expr.func, scope, hops + 1)
        if isinstance(callee, type):
            return callee
        func = as_cell_function(callee)
        return None if func is None else returned_class(func, receiver, hops + 1)
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and type(expr.slice.value) is int:
        return _item_class(expr.value, scope, hops + 1)  # `trainers[0]`, and `for t in trainers`
    return None


def _item_class(expr: ast.expr, scope: Scope, hops: int) -> type | None:
    """The class all items of a list or tuple are (`[Trainer(a), Trainer(b)]`, `[Trainer(lr) for
    lr in rates]`, a list from an earlier cell); None when they differ or the code does not tell."""
    if hops > MAX_HOPS:
        return None
    if isinstance(expr, ast.Name) and expr.id != scope.self_name:
        value = _bound_here(expr, scope)
        if value is not None:
            return _item_class(value, scope, hops + 1)
        obj = scope.namespace.get(expr.id)
        items = obj[:100] if type(obj) in (list, tuple) and isinstance(obj, (list, tuple)) else ()
        classes: set[type | None] = {type(item) for item in items}  # a builtin list runs no user code
    elif isinstance(expr, (ast.List, ast.Tuple)):
        classes = {class_of(item, scope, hops + 1) for item in expr.elts}
    elif isinstance(expr, (ast.ListComp, ast.GeneratorExp)):
        classes = {class_of(expr.elt, scope, hops + 1)}
    else:
        return None
    return classes.pop() if len(classes) == 1 else None


def callee_of(func: ast.expr, scope: Scope, hops: int = 0) -> tuple[Any, type | None]:
    """What a call's function expression names, and the class of the receiver when it is a method
    read off an instance or a class (`Cls(...).fit` -> (the function `fit` found along Cls's MRO,
    Cls)); (None, None) when the code does not tell."""
    if isinstance(func, ast.Name):
        if func.id == scope.self_name:
            return (scope.owner if scope.self_is_class else None), None  # `cls(...)`
        if _bound_here(func, scope) is not None:
            return None, None
        return scope.namespace.get(func.id), None
    if not isinstance(func, ast.Attribute):
        return None, None
    dotted = _dotted(func.value)
    if dotted is not None and dotted[0].id != scope.self_name and _bound_here(dotted[0], scope) is None:
        head = scope.namespace.get(dotted[0].id)  # a module, a class, an instance from earlier cells
        obj = _lookup(head, dotted[1]) if head is not None else None
        if obj is not None:
            receiver = None if isinstance(obj, types.ModuleType) else obj if isinstance(obj, type) else type(obj)
            return _lookup(obj, [func.attr]), receiver
    cls = class_of(func.value, scope, hops + 1)
    if cls is None and isinstance(func.value, ast.Name) and func.value.id == scope.self_name:
        cls = scope.owner  # `cls.build(...)` in a classmethod
    return (None, None) if cls is None else (_lookup(cls, [func.attr]), cls)


def _annotated_class(annotation: ast.expr, scope: Scope) -> type | None:
    """The class a return annotation names (`-> Trainer`, `-> "Trainer"`, `-> Self`)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    dotted = _dotted(annotation)
    if dotted is None:
        return None
    head, attrs = dotted
    if (attrs or [head.id])[-1] == "Self":
        return scope.owner
    obj = _lookup(scope.namespace[head.id], attrs) if head.id in scope.namespace else None
    return obj if isinstance(obj, type) else None


def returned_class(func: types.FunctionType, receiver: type | None = None, hops: int = 0) -> type | None:
    """The class of what a cell function returns: its first `return` whose value's class the code
    tells (`return self`: the receiver's class; `return Cls(...)`, `return cls(...)`, `return t`
    after `t = Cls(...)`), else its return annotation."""
    located = _function_tree(func)
    if located is None or hops > MAX_HOPS:
        return None
    node = located[1]
    scope = function_scope(func, node, _method_owner(func, receiver))
    for value in _returned(node):
        cls = class_of(value, scope, hops + 1)
        if cls is not None:
            return cls
    returns = getattr(node, "returns", None)
    return _annotated_class(returns, scope) if returns is not None else None


def _calls(tree: ast.AST) -> list[ast.Call]:
    """The tree's calls in the order they start (a call before the calls it is made of)."""
    return sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Call)),
        key=lambda n: (n.lineno, n.col_offset, n.end_lineno or n.lineno, n.end_col_offset or 0),
    )


def called_cell_functions(tree: ast.AST, namespace: Mapping[str, Any]) -> list[types.FunctionType]:
    """Cell-defined functions the tree calls, then the ones they call (breadth first). A method
    is found on the class of its receiver, also when the cell makes that object
    (`Trainer(...).fit()`, `t = Trainer(...)` then `t.fit()`, `make_trainer().fit()`,
    `Trainer(...).setup().fit()`): `callee_of`."""
    found: list[types.FunctionType] = []
    frontier: list[tuple[ast.AST, Scope]] = [(tree, Scope(namespace, _assignments(tree)))]
    for _ in range(MAX_DEPTH):
        nxt: list[tuple[ast.AST, Scope]] = []
        for node, scope in frontier:
            for call in _calls(node):
                callee, receiver = callee_of(call.func, scope)
                func = as_cell_function(callee)
                if func is None or func in found:
                    continue
                found.append(func)
                located = _function_tree(func)
                if located is not None:
                    nxt.append((located[1], function_scope(func, located[1], _method_owner(func, receiver))))
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
