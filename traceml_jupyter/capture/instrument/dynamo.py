"""Our hooks under torch.compile: Dynamo traces none of our code.

Dynamo traces into what a compiled function calls: our patched `__call__` of a model's class,
our `torch.autograd.backward`, our optimizer hooks. Traced, they would guard on our state (a
flag that changes between sampled steps: a recompilation each time) and break the graph where
they read a clock or a thread id. So each of them first asks `compiling()` (torch's
`torch.compiler.is_dynamo_compiling`, which Dynamo folds to True while it traces, and which
costs a call returning False otherwise: 40 ns) and, while Dynamo traces, returns the call it
wraps at once:
Dynamo sees torch's own call, as without the magic.

When a compiled function calls one of them eagerly (after a graph break), Dynamo would compile
that frame of ours on its own, with `compiling()` folded in, and every frame of ours it calls:
`keep_out()` tells Dynamo to run every frame of the package's code as written (torch's
`skip_code`, frame by frame: what our frames call of the user's or torch's code is compiled as
without us).

Nothing here imports torch: the check is read off an imported torch, and the frames are kept
out once torch's Dynamo is imported (by the user's first `torch.compile`).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from types import CodeType, FunctionType, ModuleType
from typing import Any

PACKAGE = __name__.split(".")[0]


def _never() -> bool:
    return False


def compile_check(torch: Any) -> Callable[[], bool]:
    """This torch's `torch.compiler.is_dynamo_compiling` (a function that returns False, 40 ns,
    which Dynamo folds to True), else its `is_compiling` (200 ns: it asks TorchScript first);
    a torch that never compiles: always False."""
    compiler = getattr(torch, "compiler", None)
    for name in ("is_dynamo_compiling", "is_compiling"):
        check = getattr(compiler, name, None)
        if callable(check):
            return check  # type: ignore[no-any-return]
    return _never


def compiled_function(value: Any) -> bool:
    """`value` is a function `torch.compile` made (its attribute read without running anything)."""
    return type(value) is FunctionType and "_torchdynamo_orig_callable" in value.__dict__


def reaches_compiled(value: Any) -> bool:
    """`value` is a compiled function, or a plain function whose code names one among its
    globals (`def train(): ... train_step(x, y)` with `train_step` compiled): its code read,
    nothing run."""
    if compiled_function(value):
        return True
    if type(value) is not FunctionType:
        return False
    names: set[str] = set()
    codes = [value.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, CodeType)]
    found = value.__globals__
    return any(compiled_function(found.get(name)) for name in names)


def compiled_model(value: Any) -> bool:
    """`value` is a `torch.compile`d module (an OptimizedModule)."""
    return type(value).__name__ == "OptimizedModule"


MAX_INSIDE = 1000  # the values looked at inside one object


def holds(value: Any, test: Callable[[Any], bool]) -> bool:
    """One of the values `value` holds passes `test`: its attributes, and the values of the
    dicts among them (a trainer's `__dict__`, a module's `_modules` in it), as the garbage collector's
    traversal sees them: no attribute is read, no code of the user's runs, no `__dict__` is made
    (which would slow every later attribute access on the object). Objects of the builtins,
    modules, classes and functions are not looked into."""
    if type(value).__module__ == "builtins" or isinstance(value, (type, ModuleType, FunctionType)):
        return False
    found = [(v, 0) for v in gc.get_referents(value)]
    seen = 0
    while found and seen < MAX_INSIDE:
        v, depth = found.pop()
        seen += 1
        if type(v) is dict and depth < 2:  # its `__dict__`, and a dict in it (`_modules`)
            found += [(inner, depth + 1) for inner in gc.get_referents(v)]
        elif test(v):
            return True
    return False


# The code of the package's modules read so far, by module: kept out of Dynamo again at each
# call, since `torch._dynamo.reset()` (a cell may call it) forgets what was skipped.
_codes_of: dict[str, list[CodeType]] = {}


def keep_out() -> None:
    """Dynamo never compiles a frame of the package's code (its modules imported so far), if
    Dynamo is loaded; a look at `sys.modules` otherwise. Called where the capture starts and a
    located loop starts (never per step): marked again each time, as `torch._dynamo.reset()`
    unmarks the code Dynamo has seen."""
    skip = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
    if skip is None:
        return
    for name, module in list(sys.modules.items()):
        if module is not None and name not in _codes_of and (name == PACKAGE or name.startswith(PACKAGE + ".")):
            _codes_of[name] = list(_codes(vars(module), name))
    for codes in _codes_of.values():
        for code in codes:
            skip(code)


def _codes(namespace: dict[str, Any], module: str) -> Iterator[CodeType]:
    """The code of the functions and methods defined in `module`, with the code nested in it
    (closures, comprehensions)."""
    for value in list(namespace.values()):
        if isinstance(value, type) and value.__module__ == module:
            yield from _codes(dict(vars(value)), module)
            continue
        value = getattr(value, "__func__", value)  # staticmethod, classmethod
        if isinstance(value, property):
            functions = [value.fget, value.fset, value.fdel]
        else:
            functions = [value]
        for function in functions:
            if isinstance(function, FunctionType) and function.__module__ == module:
                yield from _nested(function.__code__)


def _nested(code: CodeType) -> Iterator[CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _nested(const)


class CompileStarts:
    """`heard()` is called when Dynamo starts compiling a frame, before it traces anything
    (torch's compile start callback, `torch._dynamo.callback.callback_handler`, torch >= 2.5;
    outermost compiles only), on the thread that compiles, while registered. Whatever compiled
    code the cell reaches (a compiled function two calls down, a library's `torch.compile`) is
    heard of here, in time for our patches to leave before Dynamo guards on them."""

    def __init__(self, heard: Callable[[], None]) -> None:
        self.heard = heard
        self.handler: Any = None

    def _started(self, args: object) -> None:
        self.heard()

    def register(self) -> None:
        """Listen, if Dynamo is loaded (again after `torch._dynamo.reset()`, which removes every
        callback: called where the capture starts and where a located loop starts)."""
        handler = getattr(getattr(sys.modules.get("torch._dynamo"), "callback", None), "callback_handler", None)
        if handler is None or not hasattr(handler, "register_start_callback"):
            return
        if self._started not in getattr(handler, "start_callbacks", ()):
            handler.register_start_callback(self._started)
        self.handler = handler

    def remove(self) -> None:
        """Listen no more (the capture ends)."""
        handler, self.handler = self.handler, None
        if handler is not None and self._started in getattr(handler, "start_callbacks", ()):
            handler.remove_start_callback(self._started)
