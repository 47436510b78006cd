"""What fed a run's steps, read off the capture once it closed: its data sources (which one is
the training loader), the passes kept out of the steps (validation, test, eval) and their kind,
the batch size, and which kind of event ended the steps. analysis/phases.py puts it in words.

It runs once, as the run closes (finish is its edge). What it reads of the user's objects (their
names in the namespace, what an iterable is) goes through `failures.read_or`."""

from __future__ import annotations

import ast
import inspect
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ...facts.loader import LoaderFacts, PhaseRow, SourceRow
from ...failures import read_or
from ..steps.step_model import LEVEL_NAMES, Source
from .probes import attribute, user_namespace

PHASE_WORDS = (("val", "validation"), ("test", "test"), ("eval", "evaluation"), ("dev", "validation"))


@dataclass
class SourceFacts:
    """What fed the steps, read while the cell ran: the sources and phases, the kind of step, the
    optimizer, batches per step and the batch's size and kind."""

    sources: list[SourceRow] = field(default_factory=list)
    phases: list[PhaseRow] = field(default_factory=list)
    step_kind: str = "none"
    optimizer: str | None = None  # the class of the first optimizer seen stepping
    batches_per_step: float | None = None
    batch_size: int | None = None
    batch_kind: str | None = None
    loader_info: LoaderFacts | None = None
    loader_ref: Any = None
    loader_name: str | None = None
    notes: list[str] = field(default_factory=list)
    model_compiled: bool = False
    pass_steps: list[int] = field(default_factory=list)  # where each pass over the training loader began


def bound_name(obj: Any, namespace: Mapping[str, Any] | None) -> str | None:
    """The (first public) name `obj` is bound to in the user's namespace: `val_loader`, or an
    entry of a dict there (`dataloaders['val']`)."""
    if obj is None or not namespace:
        return None
    return read_or(None, _bound_name, obj, namespace)  # a key's repr is the user's code


def _bound_name(obj: Any, namespace: Mapping[str, Any]) -> str | None:
    items = [(k, v) for k, v in list(namespace.items()) if not k.startswith("_")]
    for name, value in items:
        if value is obj:
            return name
    for name, value in items:
        if type(value) is dict and len(value) <= 64:
            for key, entry in list(value.items()):
                if entry is obj:
                    return f"{name}[{key!r}]"
    return None


def has_compiled_model(namespace: Mapping[str, Any] | None) -> bool:
    """A `torch.compile`d module is in the user's namespace (its class is OptimizedModule)."""
    return read_or(False, _has_compiled_model, namespace or {})


def _has_compiled_model(namespace: Mapping[str, Any]) -> bool:
    return any(type(v).__name__ == "OptimizedModule" for v in list(namespace.values()))


def phase_kind(name: str | None, grad_disabled: bool) -> str:
    """"validation", "test", "evaluation" from the loader's name, else from autograd being off."""
    lowered = (name or "").lower()
    for word, kind in PHASE_WORDS:
        if word in lowered:
            return kind
    return "evaluation" if grad_disabled else "other passes"


def training_source(sources: list[Source]) -> Source | None:
    """The source that fed the training steps most: the DataLoader with the most wait (the slow
    one of a `zip`), else the busiest other source (a `get_batch()` call, the loop's iterator)."""
    fed = [s for s in sources if s.batches or s.wait_ns]
    loaders = [s for s in fed if s.kind == "dataloader"]
    return max(loaders or fed, key=lambda s: (s.wait_ns, s.batches), default=None)


# -- what a source that is no DataLoader is: a generator, a list, an iterator, a function --------

# Calls around the iterable that leave it what it is: `enumerate(slow())` is fed by `slow()`.
PASS_THROUGH = frozenset({"enumerate", "tqdm", "trange", "iter", "islice"})
# Iterators of the standard library that wrap another (zip, map, enumerate...): their own type
# says nothing of what feeds them.
WRAPPER_MODULES = frozenset({"builtins", "itertools"})


def object_type(obj: Any) -> str | None:
    """What an iterable is, in the user's words: "dataloader", "generator", "list", "tuple",
    "iterator" (it has __next__), "iterable", "function"; None for a standard wrapper (zip,
    map, enumerate: what it wraps decides) or anything else."""
    return read_or(None, _object_type, obj)  # hasattr and isinstance run the user's code


def _object_type(obj: Any) -> str | None:
    if type(obj).__name__ == "DataLoader" or any(c.__name__ == "DataLoader" for c in type(obj).__mro__):
        return "dataloader"
    if isinstance(obj, (types.GeneratorType, types.AsyncGeneratorType)):
        return "generator"
    if isinstance(obj, list):
        return "list"
    if isinstance(obj, tuple):
        return "tuple"
    if inspect.isgeneratorfunction(obj) or inspect.isasyncgenfunction(obj):
        return "generator"
    if inspect.isclass(obj):
        return "iterator" if hasattr(obj, "__next__") else "iterable" if hasattr(obj, "__iter__") else None
    if callable(obj) and not hasattr(obj, "__iter__"):
        return "function"
    if type(obj).__module__ in WRAPPER_MODULES and not isinstance(obj, (range, dict, set, str)):
        return None if hasattr(obj, "__next__") else "iterable"
    if hasattr(obj, "__next__"):
        return "iterator"
    if hasattr(obj, "__iter__"):
        return "iterable"
    return None


def loop_iterable_type(iterable: Any) -> str | None:
    """`object_type` of the located loop's iterable as it ran (a tqdm bar: what it wraps)."""
    inner = attribute(iterable, "iterable") if "tqdm" in type(iterable).__name__ else None
    return object_type(inner if inner is not None else iterable)


def fed_expression(text: str | None) -> ast.expr | None:
    """The expression that feeds a loop or a fetch call, as written: `slow()` for
    `enumerate(tqdm(slow()))`, `gen` for `next(gen)`; None when it does not parse."""
    if not text:
        return None
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    while isinstance(node, ast.Call) and node.args:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name not in PASS_THROUGH and not (name == "next" and not isinstance(func, ast.Attribute)):
            break
        node = node.args[0]
    return node


def resolve_name(node: ast.expr, namespace: Mapping[str, Any]) -> Any:
    """The object a name or a dotted name refers to in the namespace (None if it does not)."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = resolve_name(node.value, namespace)
        return getattr(owner, node.attr, None) if owner is not None else None
    return None


def expression_type(node: ast.expr | None, namespace: Mapping[str, Any] | None) -> str | None:
    """`object_type` of what an expression feeds, read off its form (a generator expression, a
    list display) or off the names it calls or names in the namespace (after the cell)."""
    if node is None:
        return None
    if isinstance(node, ast.GeneratorExp):
        return "generator"
    if isinstance(node, (ast.List, ast.ListComp)):
        return "list"
    if isinstance(node, ast.Tuple):
        return "tuple"
    if isinstance(node, ast.Call):
        called = read_or(None, resolve_name, node.func, namespace or {})  # getattr: the user's code
        if called is None:
            return None
        kind = object_type(called)
        return kind if kind in ("generator", "iterator", "iterable", "dataloader") else "function"
    return object_type(read_or(None, resolve_name, node, namespace or {}))


class Feeder(TypedDict):
    """What fed a source, as the report names it (`describe_feeder`)."""

    expression: str | None  # `slow()`, as written
    line: int | None
    type: str | None  # object_type's word: "generator", "list", ...
    label: str | None  # "`slow()` on line 3"


def describe_feeder(run: Any, src: Source, namespace: Mapping[str, Any] | None) -> Feeder:
    """A source that is no DataLoader by its expression and line (`slow()` on line 3) and what it
    is (a generator...): {"expression", "line", "type", "label"}; for a DataLoader, its type."""
    if src.kind == "dataloader":
        return {"expression": None, "line": None, "type": "dataloader", "label": None}
    if src.kind == "loop":
        text, line = getattr(run, "loop_iter_text", None), getattr(run, "loop_line", None)
        seen = getattr(run, "loop_iterable_type", None)
    else:
        line = src.key[1] if isinstance(src.key, tuple) and len(src.key) > 1 else None
        text = (getattr(run, "fetch_calls", None) or {}).get(line)
        seen = None
    node = fed_expression(text)
    kind = seen or expression_type(node, namespace)
    if src.kind == "call" and kind is None and text and not text.startswith("next("):
        kind = "function"
    expression = ast.unparse(node) if node is not None and src.kind == "loop" else text
    label = None
    if expression and line is not None:
        where = getattr(run, "loop_where", None)
        label = f"`{expression}` on line {line}" + (f" of {where}" if where and where != "this cell" else "")
    return {"expression": expression, "line": line, "type": kind, "label": label}


def _label(src: Source, name: str | None, feeder: Feeder | None = None) -> str:
    if src.kind == "dataloader":
        return f"`{name}`" if name else "a DataLoader"
    return str((feeder["label"] if feeder else None) or src.label)


def describe_run_sources(run: Any, capture: Any) -> SourceFacts:
    """The facts the run keeps of its capture (see the module docstring)."""
    model = capture.model
    namespace = user_namespace()
    facts = SourceFacts(step_kind=LEVEL_NAMES[model.level], model_compiled=has_compiled_model(namespace))
    sources = list(model.sources.values())
    training = training_source(sources)
    n_steps = run.recorder.n_steps - model.steps_at_start
    for src in sources:
        obj = src.ref() if src.ref is not None else None
        name = bound_name(obj, namespace)
        info = run.loader_settings(src.key)
        feeder = describe_feeder(run, src, namespace)
        row: SourceRow = {
            "label": _label(src, name, feeder),
            "kind": src.kind,
            "type": feeder["type"],
            "expression": feeder["expression"],
            "line": feeder["line"],
            "name": name,
            "training": src is training,
            "wait_ms": src.wait_ns / 1e6,
            "batches": src.batches,
            "passes": src.passes,
            "num_workers": info.get("num_workers"),
        }
        facts.sources.append(row)
        if src.phase_passes:
            time_ms = src.phase_span_ns / 1e6
            facts.phases.append(
                {
                    "label": row["label"],
                    "source_kind": src.kind,
                    "kind": phase_kind(name, src.grad_disabled),
                    "passes": src.phase_passes,
                    "batches": src.phase_batches,
                    "time_ms": time_ms,
                    "wait_ms": src.phase_wait_ns / 1e6,
                    "wait_share": src.phase_wait_ns / src.phase_span_ns if src.phase_span_ns > 0 else None,
                    "share_of_cell": time_ms / run.wall_ms if run.wall_ms else None,
                    "num_workers": info.get("num_workers"),
                }
            )
        if training is not None and src is training:
            if src.kind == "dataloader":
                facts.loader_info = info or None
                facts.loader_ref = src.ref
                facts.loader_name = name
            facts.batches_per_step = src.batches / n_steps if n_steps > 0 and src.batches else None
            facts.batch_size, facts.batch_kind = src.batch_size, src.batch_kind
    if any(p["source_kind"] != "loop" for p in facts.phases):  # the loop's passes over a loader
        facts.phases = [p for p in facts.phases if p["source_kind"] != "loop"]  # are the loader's
    facts.phases.sort(key=lambda p: -p["time_ms"])
    facts.optimizer = capture.optimizer_name
    facts.pass_steps = [k for src, k in getattr(capture, "pass_starts", ()) if src is training]
    if n_steps <= 0:
        facts.step_kind = "none"
    if training is not None and facts.batch_size is None and facts.batch_kind and _is_data(training, run):
        facts.notes.append(f"Batches are {facts.batch_kind}, not tensors: samples/s is not shown.")
    return facts


def _is_data(src: Source, run: Any) -> bool:
    """Whether the source's items are batches (a loop over range() yields step numbers)."""
    return not (src.kind == "loop" and run.loop_is_range)
