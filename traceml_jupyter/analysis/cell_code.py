"""The user's code read as a tree, pure AST: a cell parsed with the user's line numbers (the
`%%traceml` line is line 1), its loops, its DataLoader calls and the names they are bound to, the
copies to the GPU in a loop body, a dataset class's costly calls per sample."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from ..failures import read_or

# Calls in __getitem__ that usually cost per sample and could be done once and cached.
COSTLY_CALL = re.compile(
    r"decode|open|read|load|imread|tokeni[sz]|encode|augment|transform|sleep|resize|crop|"
    r"flip|rotate|jitter|normal",
    re.IGNORECASE,
)
# Augmentations that differ each time they run: caching them would change the training.
RANDOM_CALL = re.compile(r"random|rand_|jitter|autoaugment|randaugment|trivialaugment|mixup|cutmix|erasing", re.IGNORECASE)
DTYPES = re.compile(r"^(torch\.)?(u?int\d*|float\d*|bfloat16|half|double|long|bool|complex\d*)$")


@dataclass(frozen=True)
class CodeSite:
    """A line as the user sees it: in the traced cell (`cell` None), another cell ("In [3]"),
    or a file ("mydata.py")."""

    line: int
    cell: str | None = None

    def label(self) -> str:
        """Where the code is, as the report says it: "line 4", or "cell 3, line 4" for an earlier
        cell."""
        return f"line {self.line}" if self.cell is None else f"{self.cell}, line {self.line}"


@dataclass(frozen=True)
class Transfer:
    """A `.to(...)` or `.cuda(...)` call in the loop body."""

    site: CodeSite
    text: str
    non_blocking: bool


@dataclass(frozen=True)
class SampleCode:
    """What the dataset's `__getitem__` does per sample, read from its source."""

    dataset: str
    calls: tuple[tuple[str, CodeSite], ...]  # costly calls seen, with their lines
    site: CodeSite | None  # the `def __getitem__` line
    class_site: CodeSite | None  # the `class ...` line


def parse_cell(source: str, transform: Callable[[str], str] | None = None) -> ast.Module | None:
    """A cell's tree with lines numbered as the user sees them: a first `%%traceml` line is
    line 1 and the code starts on line 2. Other cell magics are not Python: None."""
    offset = 0
    if source.startswith("%%"):
        first, _, source = source.partition("\n")
        if not re.match(r"%%traceml\b", first):
            return None
        offset = 1
    # IPython's input transformers (an extension's too) may fail on odd input: no tree
    code = read_or(None, transform, source) if transform is not None else source
    if code is None:
        return None
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    if offset:
        ast.increment_lineno(tree, offset)
    return tree


def call_name(call: ast.Call) -> str | None:
    """The name a call is made by (`loader` in `loader(...)`, `to` in `x.to(...)`); None for
    anything else."""
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def short_code(node: ast.AST, width: int = 48) -> str:
    """The node's code on one line, cut to `width` characters with "..." when longer."""
    text = ast.unparse(node)
    return text if len(text) <= width else text[: width - 3] + "..."


def loop_at(tree: ast.AST, line: int) -> ast.For | ast.AsyncFor | None:
    """The `for` statement that starts on `line`."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)) and node.lineno == line:
            return node
    return None


def nested_in_loop(tree: ast.AST, line: int) -> bool:
    """True when the `for` on `line` runs inside another loop (an epoch loop, usually)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and node.lineno != line:
            for inner in ast.walk(node):
                if inner is not node and isinstance(inner, (ast.For, ast.AsyncFor)):
                    if inner.lineno == line:
                        return True
    return False


def iter_names(loop: ast.For | ast.AsyncFor) -> set[str]:
    """Names in the loop's iterable: `enumerate(train_loader)` -> {"enumerate", "train_loader"}."""
    return {n.id for n in ast.walk(loop.iter) if isinstance(n, ast.Name)}


def is_dataloader_call(node: ast.AST) -> TypeGuard[ast.Call]:
    """`DataLoader(...)` or `data.DataLoader(...)`."""
    return isinstance(node, ast.Call) and call_name(node) == "DataLoader"


def dataloader_lines(tree: ast.AST) -> list[int]:
    """Lines that construct a DataLoader."""
    return sorted({node.lineno for node in ast.walk(tree) if is_dataloader_call(node)})


def assign_targets(node: ast.AST) -> list[ast.expr] | None:
    """What a statement assigns to (`a = b = ...`, `a: T = ...`, `a += ...`, `(a := ...)`);
    None for a node that assigns nothing."""
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
        return [node.target]
    return None


def target_names(targets: Sequence[ast.expr]) -> set[str]:
    """The names assignment targets bind (`a, (b, c)` -> {a, b, c}; `x.y`, `x[0]`: x)."""
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def dataloader_sites(tree: ast.AST) -> list[tuple[int, frozenset[str]]]:
    """Lines that construct a DataLoader, each with the names its statement assigns."""
    sites: dict[int, set[str]] = {line: set() for line in dataloader_lines(tree)}
    for node in ast.walk(tree):
        targets = assign_targets(node)
        if targets is None:
            continue
        names = target_names(targets)
        for inner in ast.walk(node):
            if isinstance(inner, ast.Call) and is_dataloader_call(inner):
                sites[inner.lineno] |= names
    return [(line, frozenset(names)) for line, names in sorted(sites.items())]


def pick_loader_line(sites: Sequence[tuple[int, frozenset[str]]], names: set[str]) -> int | None:
    """The construction whose statement assigns one of `names`, if any."""
    for line, assigned in sites:
        if assigned & names:
            return line
    return None


def assigned_line(tree: ast.AST, names: set[str]) -> int | None:
    """The first statement that assigns one of `names` (where a loader built elsewhere, by a
    function or a library, comes into the notebook)."""
    lines = []
    for node in ast.walk(tree):
        targets = assign_targets(node)
        if targets and not isinstance(node, ast.AugAssign) and target_names(targets) & names:
            lines.append(targets[0].lineno)
    return min(lines) if lines else None


def _own_nodes(body: Sequence[ast.stmt]) -> Iterator[ast.AST]:
    """Nodes of a body, not inside a nested function or class definition."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _is_dtype_only(call: ast.Call) -> bool:
    """`x.to(torch.float16)` or `x.to(dtype=...)` changes the type, not the device."""
    if call.keywords and all(k.arg == "dtype" for k in call.keywords) and not call.args:
        return True
    if len(call.args) == 1 and not call.keywords:
        return bool(DTYPES.match(ast.unparse(call.args[0])))
    return False


def transfers_in(loop: ast.For | ast.AsyncFor, cell: str | None = None) -> list[Transfer]:
    """The loop body's `.to(...)` / `.cuda(...)` calls, with whether they pass non_blocking."""
    found = []
    for node in _own_nodes(loop.body):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in ("to", "cuda") or _is_dtype_only(node):
            continue
        non_blocking = any(
            k.arg == "non_blocking" and not (isinstance(k.value, ast.Constant) and not k.value.value)
            for k in node.keywords
        )
        found.append(Transfer(CodeSite(node.lineno, cell), short_code(node), non_blocking))
    return sorted(found, key=lambda t: t.site.line)


def class_def(tree: ast.AST, name: str) -> ast.ClassDef | None:
    """The first class named `name` defined in the tree, or None."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def method_def(tree: ast.AST, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function defined on `line` (its `def` line or one of its decorators' lines)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if line == node.lineno or line in [d.lineno for d in node.decorator_list]:
                return node
    return None


def costly_calls(
    func: ast.FunctionDef | ast.AsyncFunctionDef, cell: str | None = None
) -> list[tuple[str, CodeSite]]:
    """Calls in a `__getitem__` that decode, read, tokenize, augment or sleep, in line order."""
    found: dict[str, CodeSite] = {}
    for node in _own_nodes(func.body):
        if isinstance(node, ast.Call):
            name = call_name(node)
            if name and COSTLY_CALL.search(name):
                text = short_code(node.func, 32) + "()"
                if text not in found or node.lineno < found[text].line:
                    found[text] = CodeSite(node.lineno, cell)
    return sorted(found.items(), key=lambda kv: kv[1].line)


def sample_code_in(tree: ast.AST, class_name: str, cell: str | None = None) -> SampleCode | None:
    """Read `class_name.__getitem__` in a cell's tree (when the class is defined there)."""
    cls = class_def(tree, class_name)
    if cls is None:
        return None
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in (
            "__getitem__",
            "__getitems__",
        ):
            return SampleCode(
                class_name,
                tuple(costly_calls(node, cell)),
                CodeSite(node.lineno, cell),
                CodeSite(cls.lineno, cell),
            )
    return SampleCode(class_name, (), None, CodeSite(cls.lineno, cell))
