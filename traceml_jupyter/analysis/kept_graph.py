"""Tensors the loop body keeps across steps with their autograd graph (pure AST): `total_loss +=
loss`, `total = total + loss`, `losses.append(loss)`, `history.append(out)`, where `loss` or `out`
comes from the model or the criterion and is not `.item()`-ed, `.detach()`-ed or `float()`-ed.
Each such statement keeps every step's graph alive (the FAQ's "accumulating history across your
training loop"): memory that grows by a step's worth every step, on the GPU and on the host.

How a value is classified, statement by statement in the body's order:
- graph: the result of calling the model or the criterion (a name the caller knows is a module,
  else a callee named like one: model, net, criterion, loss_fn, ...), and anything computed from a
  graph value (`out.mean()`, `outputs.loss`, `loss * 2`, `F.cross_entropy(out, y)`);
- data: the loop's own targets (the batch) and what is computed from them alone (`x.to(dev)`);
- clean: `.item()`, `.detach()`, `.tolist()`, `float()`, `int()`, comparisons, `argmax`..., and
  everything computed inside `with torch.no_grad()` / `torch.inference_mode()`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .cell_code import loop_at, parse_cell

GRAPH, DATA, CLEAN, OTHER = "graph", "data", "clean", "other"
# Methods whose result has no autograd history.
CLEAN_METHODS = frozenset(
    {
        "item", "detach", "detach_", "tolist", "numpy", "argmax", "argmin", "argsort", "long",
        "int", "bool", "byte", "eq", "ne", "gt", "ge", "lt", "le", "nonzero", "size", "dim",
        "numel", "data_ptr", "sign", "round", "floor", "ceil", "isnan", "isfinite",
    }
)
CLEAN_FUNCTIONS = frozenset({"float", "int", "len", "bool", "round", "str", "repr", "print", "isinstance"})
NO_GRAD = re.compile(r"no_grad|inference_mode|set_grad_enabled\(\s*False")
MODEL_LIKE = re.compile(
    r"(^|[._])(model|net|network|criterion|loss_fn|loss_func|lossfn|forward|encoder|decoder|"
    r"generator|discriminator|classifier|head|backbone|module|crit)\w*$",
    re.IGNORECASE,
)
APPENDS = frozenset({"append", "extend", "insert", "add", "appendleft"})


@dataclass(frozen=True)
class KeptGraph:
    """A statement that keeps a step's graph beyond the step."""

    line: int
    text: str  # the statement as written
    value: str  # what is kept: "loss"
    holder: str  # where it is kept: "total_loss", "losses"
    accumulates: bool  # `+=` / `total = total + loss` (else a container keeps each step's)

    def fix(self) -> str:
        """What to write instead, in a few words."""
        if self.accumulates:
            return f"`{self.value}.item()` (or `{self.value}.detach()`)"
        return f"`{self.value}.detach()` (or `{self.value}.item()` for a number)"

    def sentence(self) -> str:
        """The finding in one sentence: the line that keeps every step's graph, and what to write
        instead."""
        return f"line {self.line} keeps every step's graph (`{self.text}`): use {self.fix()}"

    def to_dict(self) -> dict[str, object]:
        """The finding as JSON-ready values."""
        return {
            "line": self.line,
            "text": self.text,
            "value": self.value,
            "holder": self.holder,
            "accumulates": self.accumulates,
            "fix": self.fix(),
            "sentence": self.sentence(),
        }


def _names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def _short(node: ast.AST, width: int = 60) -> str:
    text = ast.unparse(node)
    return text if len(text) <= width else text[: width - 3] + "..."


class _Body:
    """The loop body read statement by statement, each name's kind as it was last assigned."""

    def __init__(self, data: Iterable[str], modules: frozenset[str]) -> None:
        self.kind: dict[str, str] = dict.fromkeys(data, DATA)
        self.modules = modules
        self.found: list[KeptGraph] = []

    # -- what an expression holds ------------------------------------------------------------
    def model_call(self, func: ast.expr) -> bool:
        text = ast.unparse(func)
        root = text.split(".")[0]
        return text in self.modules or root in self.modules or bool(MODEL_LIKE.search(text))

    def of(self, node: ast.AST | None) -> str:
        if node is None:
            return OTHER
        if isinstance(node, ast.Name):
            return self.kind.get(node.id, OTHER)
        if isinstance(node, ast.Constant | ast.Compare | ast.JoinedStr):
            return CLEAN
        if isinstance(node, ast.Attribute):
            return CLEAN if node.attr in ("data", "shape", "dtype", "device") else self.of(node.value)
        if isinstance(node, ast.Subscript | ast.Starred):
            return self.of(node.value)
        if isinstance(node, ast.Call):
            return self.call(node)
        parts: list[ast.AST] = []
        if isinstance(node, ast.BinOp):
            parts = [node.left, node.right]
        elif isinstance(node, ast.UnaryOp):
            parts = [node.operand]
        elif isinstance(node, ast.BoolOp | ast.Tuple | ast.List | ast.Set):
            parts = list(node.values if isinstance(node, ast.BoolOp) else node.elts)
        elif isinstance(node, ast.IfExp):
            parts = [node.body, node.orelse]
        elif isinstance(node, ast.Dict):
            parts = [v for v in node.values if v is not None]
        return self.strongest(parts)

    def strongest(self, parts: Iterable[ast.AST]) -> str:
        kinds = {self.of(p) for p in parts}
        for kind in (GRAPH, DATA, OTHER):
            if kind in kinds:
                return kind
        return CLEAN

    def call(self, node: ast.Call) -> str:
        func = node.func
        args = [*node.args, *(k.value for k in node.keywords)]
        if isinstance(func, ast.Name) and func.id in CLEAN_FUNCTIONS:
            return CLEAN
        if isinstance(func, ast.Attribute):
            if func.attr in CLEAN_METHODS:
                return CLEAN
            base = self.of(func.value)
            if base == GRAPH:
                return GRAPH
            inputs = self.strongest(args)
            if base == DATA:
                return GRAPH if inputs == GRAPH else DATA
        else:
            inputs = self.strongest(args)
        if inputs == GRAPH:
            return GRAPH
        if self.model_call(func):
            return GRAPH
        return DATA if inputs == DATA else OTHER

    # -- statements ----------------------------------------------------------------------------
    def assign(self, targets: Iterable[ast.AST], kind: str) -> None:
        for target in targets:
            for name in _names(target) if isinstance(target, ast.Name | ast.Tuple | ast.List) else []:
                self.kind[name] = kind

    def statements(self, body: Iterable[ast.stmt], grad: bool) -> None:
        for stmt in body:
            self.statement(stmt, grad)

    def statement(self, stmt: ast.stmt, grad: bool) -> None:
        if isinstance(stmt, ast.With | ast.AsyncWith):
            off = any(NO_GRAD.search(ast.unparse(item.context_expr)) for item in stmt.items)
            self.statements(stmt.body, grad and not off)
            return
        if isinstance(stmt, ast.If | ast.For | ast.AsyncFor | ast.While | ast.Try):
            for block in ("body", "orelse", "finalbody"):
                self.statements(getattr(stmt, block, []) or [], grad)
            for handler in getattr(stmt, "handlers", []) or []:
                self.statements(handler.body, grad)
            return
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
            kind = self.of(stmt.value) if grad else CLEAN
            if kind == GRAPH and isinstance(stmt.target, ast.Name):
                self.keep(stmt, stmt.value, stmt.target.id, True)
            return
        if isinstance(stmt, ast.Assign | ast.AnnAssign):
            value = stmt.value
            targets: list[ast.expr] = list(stmt.targets) if isinstance(stmt, ast.Assign) else [stmt.target]
            kind = self.of(value) if grad and value is not None else CLEAN
            if kind == GRAPH and value is not None:
                self.kept_by_assign(stmt, targets, value)
            self.assign(targets, kind)
            return
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            call = stmt.value
            func = call.func
            if grad and isinstance(func, ast.Attribute) and func.attr in APPENDS and call.args:
                kept = call.args[-1]
                if self.of(kept) == GRAPH:
                    self.keep(stmt, kept, _short(func.value, 40), False)

    def kept_by_assign(self, stmt: ast.stmt, targets: list[ast.expr], value: ast.expr) -> None:
        """`total = total + loss` (the target feeds its own new value), or `hist[i] = out`."""
        used = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
        for target in targets:
            if isinstance(target, ast.Name) and target.id in used and isinstance(value, ast.BinOp):
                other = [p for p in (value.left, value.right) if not (isinstance(p, ast.Name) and p.id == target.id)]
                self.keep(stmt, other[0] if other else value, target.id, True)
            elif isinstance(target, ast.Subscript):
                self.keep(stmt, value, _short(target.value, 40), False)

    def keep(self, stmt: ast.stmt, value: ast.expr, holder: str, accumulates: bool) -> None:
        self.found.append(KeptGraph(stmt.lineno, _short(stmt), _short(value, 30), holder, accumulates))


def kept_graphs(
    source: str | None, loop_line: int | None, modules: Iterable[str] = ()
) -> list[KeptGraph]:
    """The statements of the loop on `loop_line` (a line of `source`, a cell whose `%%traceml`
    line is line 1) that keep a step's graph beyond the step, in line order. `modules`: the names
    the caller knows are bound to torch modules (the model, the criterion)."""
    if not source or loop_line is None:
        return []
    tree = parse_cell(source)
    loop = loop_at(tree, loop_line) if tree is not None else None
    if loop is None:
        return []
    body = _Body(_names(loop.target), frozenset(modules))
    body.statements(loop.body, grad=True)
    seen: set[int] = set()
    out = []
    for kept in sorted(body.found, key=lambda k: k.line):
        if kept.line not in seen:
            seen.add(kept.line)
            out.append(kept)
    return out
