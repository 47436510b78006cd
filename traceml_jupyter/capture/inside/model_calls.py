"""The outermost module calls of a step: which modules the training calls (the model, a GAN's
generator and discriminator), found without touching any module call, and their calls timed
on sampled steps only.

Candidates are read, never called: the nn.Modules in the user's namespace, and in the local
variables of the frames under the first sampled `backward()` or optimizer step (a library
trainer's `model`), one level deep in containers (`models["G"]`) and in the object whose method
a frame runs (`self.model` of a trainer). No other object's attributes are read: reading an
object's `__dict__` makes CPython keep its attributes in a real dict from then on, which slows
every later attribute access on it (our own objects, on the per-step path, are never read). A candidate counts when it holds parameters (a
loss module does not: its time is the rest of the step); the roots are the candidates that are
no submodule of another (`model`, not `model.encoder`). When no root is called in a step that
trained, the roots' children are tried once (a LightningModule is never called itself: its
`training_step` calls `self.net`); when none of them is called either, the forward is not
found and says so.

Timing patches the `__call__` of each root's class while a sampled step runs (and puts it back
after): no instance attribute, hook or wrapper is left on any module, so deep and shallow
copies, pickling, `inspect.signature(model.forward)`, DataParallel's replicas and
torch.compile (a compiled module is called from the user's code like any other; a module
called inside a compiled function is not seen, and no recompilation is caused) see the module
as it is. Calls of other instances of the class, on other threads, or nested in a root call
pass straight through.

Everything here reads the user's objects (isinstance on their values, a module's parameters and
children, a frame's locals) through `failures.read_or`, and patches their classes with
`type.__setattr__` (a class that refuses it is skipped): no broad guard of its own. Its edges are
the step parts' (step_parts.py): the sampled step's hook that calls it turns the parts off.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from itertools import islice
from types import FrameType, ModuleType
from typing import Any

from ...failures import read_or
from ..instrument.dynamo import compile_check

MAX_FRAMES = 64  # frames read above the first sampled backward() or optimizer step
MAX_SCAN = 4096  # values looked at per place (a namespace, a frame, an object)
MAX_INNER = MAX_SCAN  # values looked at inside containers, per scan (a session's lists add up)
# Roots taken from the notebook's namespace (a long session holds many models, most of them
# not this cell's); the frames of the training event and the roots' children are always taken.
MAX_NAMESPACE_ROOTS = 32

SEARCHING, FOUND, NOT_FOUND = "searching", "found", "not found"


def module_class() -> type | None:
    """torch.nn.Module when torch is imported, else None (torch is never imported here)."""
    module = getattr(getattr(sys.modules.get("torch"), "nn", None), "Module", None)
    return module if isinstance(module, type) else None


def is_instance(value: Any, cls: type | tuple[type, ...]) -> bool:
    """isinstance, False where it raises (a proxy whose __class__ raises)."""
    return read_or(False, isinstance, value, cls)


def has_parameters(module: Any) -> bool:
    """The module holds at least one parameter (False when they cannot be read)."""
    return read_or(False, _has_parameters, module)


def _has_parameters(module: Any) -> bool:
    return next(iter(module.parameters()), None) is not None


OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package's directory


CONTAINERS = (dict, list, tuple)  # looked into, one level


def inner_values(value: Any) -> list[Any]:
    """One level into a container (dict, list, tuple)."""
    if type(value) is dict:
        return list(value.values())[:MAX_SCAN]
    if type(value) in (list, tuple):
        return list(value[:MAX_SCAN])
    return []


def own_attributes(value: Any) -> list[Any]:
    """The attributes of the object whose method a user's frame runs (`self`): plain objects
    only, never ours, never through a getattr that could run a property."""
    if isinstance(value, (type, ModuleType)) or str(getattr(type(value), "__module__", "")).startswith("traceml_jupyter"):
        return []
    own = read_or(None, object.__getattribute__, value, "__dict__")
    return list(own.values())[:MAX_SCAN] if type(own) is dict else []


def instances_in(values: Iterable[Any], classes: type | tuple[type, ...]) -> list[Any]:
    """The instances of `classes` among `values` (the first MAX_SCAN of them), and one level
    inside the containers among them (MAX_INNER values in all): one pass, however many kinds
    are looked for (a long session's namespace holds thousands of values)."""
    found: list[Any] = []
    inner_left = MAX_INNER
    for value in islice(values, MAX_SCAN):  # in order: the cell's own names come first
        if type(value) in CONTAINERS:  # (a plain dict, list or tuple is none of the classes looked for)
            if inner_left > 0:
                inner = inner_values(value)[:inner_left]
                inner_left -= len(inner)
                found += _instances(inner, classes)
        elif is_instance(value, classes):
            found.append(value)
    return found


def _instances(values: list[Any], classes: type | tuple[type, ...]) -> list[Any]:
    found = read_or(None, _all_instances, values, classes)  # at once: a guard per value costs
    if found is None:  # a proxy whose __class__ raises: the values one by one
        found = [v for v in values if is_instance(v, classes)]
    return found


def _all_instances(values: list[Any], classes: type | tuple[type, ...]) -> list[Any]:
    return [v for v in values if isinstance(v, classes)]


def frame_values(
    frame: FrameType | None, cls: type | None = None, seen: Mapping[str, Any] | None = None
) -> list[Any]:
    """The local variables of `frame` and of the frames that called it (MAX_FRAMES of them, ours
    skipped, up to the first module-level one: the cell or script that runs the training, not
    the shell's and kernel's frames above it), with the attributes of each frame's `self` when
    it is no module (`cls`). Of a namespace looked at before (`seen`: its names and values then,
    e.g. the notebook's at the run's start) only what is new or rebound since: a long session's
    globals are looked at once."""
    values: list[Any] = []
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        if not frame.f_code.co_filename.startswith(OURS) and read_or(False, _frame_values, frame, cls, seen, values):
            break
        frame = frame.f_back
    return values


def _frame_values(frame: FrameType, cls: type | None, seen: Mapping[str, Any] | None, values: list[Any]) -> bool:
    """Add a frame's local values (and its `self`'s attributes) to `values`: its locals are
    the user's (a key's `__eq__`). True when it is a module-level frame."""
    local = frame.f_locals
    module_level = frame.f_globals is local
    if seen is not None and module_level:
        values.extend([v for k, v in islice(local.items(), MAX_SCAN) if k not in seen or seen[k] is not v])
    else:
        values.extend(list(local.values())[:MAX_SCAN])
    me = local.get("self")
    if me is not None and cls is not None and not is_instance(me, cls):
        values.extend(own_attributes(me))
    return module_level


def _submodule_ids(module: Any) -> set[int]:
    return {id(sub) for sub in module.modules() if sub is not module}


def roots_of(candidates: Iterable[Any]) -> list[Any]:
    """The candidates that hold parameters and are no submodule of another candidate."""
    unique: dict[int, Any] = {}
    for m in candidates:
        if id(m) not in unique and has_parameters(m):
            unique[id(m)] = m
    inner: set[int] = set()
    for m in unique.values():
        inner |= read_or(set(), _submodule_ids, m)  # the user's module: none when it raises
    return [m for key, m in unique.items() if key not in inner]


def named_children(module: Any) -> list[tuple[str, Any]]:
    """The module's (name, child) pairs; none when they cannot be read."""
    return read_or([], _named_children, module)


def _named_children(module: Any) -> list[tuple[str, Any]]:
    return list(module.named_children())


def describe(module: Any, namespace: Mapping[str, Any] | None) -> str:
    """"model (Net)": the name it has in the notebook, if any, and its class."""
    cls = type(module).__name__
    for name, value in list((namespace or {}).items()):
        if value is module and not name.startswith("_"):
            return f"{name} ({cls})"
    return cls


Call = Callable[..., Any]


class ModuleCalls:
    """The roots found so far, the state of the search, and the patches of their classes'
    `__call__` (installed while a sampled step runs). `timed(orig, module, args, kwargs)` is
    what a patched `__call__` runs: the step parts' forward timing."""

    def __init__(self, timed: Callable[[Call, Any, Any, Any], Any]) -> None:
        self.timed = timed
        self.state = SEARCHING
        self.walked = False  # the frames of a training event were read
        self.widened = False  # the roots' children were tried
        self.attempts = 0  # steps searched
        self.last_index = -1  # the last step searched
        self.roots: list[weakref.ReferenceType[Any]] = []
        self.index: dict[int, int] = {}  # id(root) -> its index in `roots`
        self.labels: list[str] = []
        self._classes: dict[type, tuple[Any, Call]] = {}  # class -> (its own __call__ or None, our patch)
        self.installed = False

    # -- finding them ---------------------------------------------------------------------
    def add(self, candidates: Iterable[Any], from_namespace: bool = False) -> bool:
        """Take the roots among `candidates` (with the roots already known; from the namespace,
        MAX_NAMESPACE_ROOTS at most). True when a new root was added."""
        known = [r() for r in self.roots]
        found = roots_of([m for m in known if m is not None] + list(candidates))
        new = [m for m in found if id(m) not in self.index]
        return self._take(new[:MAX_NAMESPACE_ROOTS] if from_namespace else new)

    def _take(self, new: list[Any], labels: list[str] | None = None) -> bool:
        for i, m in enumerate(new):
            self.index[id(m)] = len(self.roots)
            self.roots.append(weakref.ref(m))
            self.labels.append(labels[i] if labels else type(m).__name__)
            self._patch_for(type(m))
        return bool(new)

    def root(self, module: Any) -> int:
        """The root index of `module`, or -1 (another instance of a patched class)."""
        i = self.index.get(id(module), -1)
        return i if i >= 0 and self.roots[i]() is module else -1

    def widen(self, called: set[int]) -> bool:
        """No root was called in a step that trained: try the children of the roots that were
        not called (once). True when there are any."""
        self.widened = True
        children: dict[int, tuple[Any, str]] = {}
        for i, ref in enumerate(list(self.roots)):
            m = ref()
            if m is None or i in called:
                continue
            for name, child in named_children(m):
                if id(child) not in self.index and has_parameters(child):
                    children[id(child)] = (child, f"{self.labels[i]}.{name} ({type(child).__name__})")
        return self._take([c for c, _ in children.values()], [label for _, label in children.values()])

    # -- the patches ------------------------------------------------------------------------
    def _patch_for(self, cls: type) -> None:
        if cls in self._classes:
            return
        own_and_orig = read_or(None, self._own_and_original, cls)  # the user's class: its mro
        own, orig = own_and_orig if own_and_orig is not None else (None, None)
        if orig is None:
            return
        timed = self.timed
        compiling = compile_check(sys.modules.get("torch"))

        def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
            if compiling():  # Dynamo traces it (instrument/dynamo.py): the class's own call
                return orig(module, *args, **kwargs)
            return timed(orig, module, args, kwargs)

        __call__.__wrapped__ = orig  # type: ignore[attr-defined]
        self._classes[cls] = (own, __call__)
        if self.installed:
            self._set(cls, __call__)

    def _own_and_original(self, cls: type) -> tuple[Any, Call | None]:
        return cls.__dict__.get("__call__"), self._original_call(cls)

    def _original_call(self, cls: type) -> Call | None:
        """`cls.__call__` as it resolves without our patches (a root's class may inherit from
        another root's class)."""
        for klass in cls.__mro__:
            value = klass.__dict__.get("__call__")
            if klass in self._classes:
                value = self._classes[klass][0]
            if value is not None:
                return value  # type: ignore[no-any-return]
        return None

    @staticmethod
    def _set(cls: type, value: Any) -> None:
        try:
            type.__setattr__(cls, "__call__", value)
        except (TypeError, AttributeError):  # an immutable (builtin or extension) class
            pass

    def install(self) -> None:
        """Put our `__call__` on each root's class (while a sampled step runs)."""
        self.installed = True
        for cls, (_, patch) in self._classes.items():
            self._set(cls, patch)

    def remove(self) -> None:
        """Put back each class's own `__call__` (or inherit it again), where ours is still there."""
        self.installed = False
        for cls, (own, patch) in self._classes.items():
            if cls.__dict__.get("__call__") is not patch:
                continue
            try:
                if own is None:
                    type.__delattr__(cls, "__call__")
                else:
                    type.__setattr__(cls, "__call__", own)
            except (TypeError, AttributeError):  # an immutable class (never patched, then)
                pass

    def keep_called(self, called: set[int]) -> None:
        """The forward is found: only the classes of the roots called stay patched (a long
        session's other models cost nothing on the sampled steps to come)."""
        classes = {type(m) for i, ref in enumerate(self.roots) if i in called and (m := ref()) is not None}
        unused = [cls for cls in self._classes if cls not in classes]
        installed = self.installed
        self.remove()
        for cls in unused:
            del self._classes[cls]
        for i, ref in enumerate(self.roots):
            m = ref()
            if i not in called and m is not None and type(m) not in classes:
                self.index.pop(id(m), None)
        if installed:
            self.install()

    def forget(self) -> None:
        """Not found: no patch any more."""
        self.remove()
        self._classes.clear()

    def found_labels(self, called: set[int], namespace: Mapping[str, Any] | None) -> list[str]:
        """The roots called, as the summary names them: "model (Net)" when the notebook holds
        them under a name, else their label (the class, or "Net.encoder (Encoder)" for a root's child)."""
        out = []
        for i in sorted(called):
            m = self.roots[i]() if i < len(self.roots) else None
            named = describe(m, namespace) if m is not None else None
            out.append(named if named is not None and " (" in named else self.labels[i])
        return out
