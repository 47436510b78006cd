"""The package's layout shows the flow, and its imports point one way: capture (what runs while
the cell runs) and analysis (pure) import nothing above them, views read the run and the
analysis, the run never imports its views, and no import cycle exists anywhere."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

PACKAGE = REPO / "traceml_jupyter"
ORCHESTRATION = {"traced_cell", "tracing", "magic", "tune", "demo", "async_cells", ""}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def imports_of(path: Path) -> set[str]:
    """Package modules `path` imports at run time: at top level or inside functions, not under
    `if TYPE_CHECKING:` (those are for the type checker only)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()

    def resolve(level: int, module: str | None) -> str:
        base = package.split(".") if package else []
        if level > 1:
            base = base[: len(base) - (level - 1)]
        return ".".join([*base, *([module] if module else [])])

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    target = resolve(child.level, child.module)
                    for alias in child.names:
                        sub = f"{target}.{alias.name}" if target else alias.name
                        found.add(sub if (PACKAGE / sub.replace(".", "/")).with_suffix(".py").exists()
                                  or (PACKAGE / sub.replace(".", "/") / "__init__.py").exists() else target)
                elif child.module and child.module.startswith("traceml_jupyter"):
                    found.add(child.module.removeprefix("traceml_jupyter").lstrip("."))
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    found.discard(here)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> str:
    head = module.split(".")[0]
    if head in ("capture", "analysis", "views"):
        return head
    return "run" if module == "run" else "top"


def test_no_module_of_the_package_imports_itself_back() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt in edges and state.get(nxt) is None:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if state.get(node) is None:
            walk(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_point_one_way_capture_analysis_run_views() -> None:
    allowed = {
        "capture": {"capture"},
        "analysis": {"analysis"},
        "run": {"capture", "analysis"},
        "views": {"capture", "analysis", "run", "views"},
        "top": {"capture", "analysis", "run", "views", "top"},
    }
    wrong = [
        f"{module} ({layer(module)}) imports {target} ({layer(target)})"
        for module, targets in graph().items()
        for target in targets
        if layer(target) not in allowed[layer(module)]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_tree_reads_as_the_flow() -> None:
    subpackages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert subpackages == ["analysis", "capture", "processes", "views"]
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top == [
        "__init__", "__main__", "async_cells", "cli", "demo", "history", "magic", "ranks", "run", "saved",
        "syntax_cells", "traced_cell", "tracing", "tune",
    ]


@pytest.mark.slow
def test_importing_the_package_loads_no_heavy_library() -> None:
    code = (
        "import sys, traceml_jupyter\n"
        "print(sorted(m for m in ('torch', 'ipywidgets', 'bqplot', 'pynvml') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
