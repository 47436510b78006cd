"""The kernel's cells as the report reads them: the history (or, for a run read back from its
file, the cells it quoted), where the traced cell is in it, and what an earlier cell holds
(DataLoader calls, loops in functions), each cell parsed at most once per kernel and within a
budget per report."""

from __future__ import annotations

import ast
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..analysis.cell_code import (
    SampleCode,
    assign_targets,
    is_dataloader_call,
    loop_at,
    parse_cell,
    sample_code_in,
    target_names,
)

if TYPE_CHECKING:
    from ..analysis.checklist.facts import ItemRow
    from ..analysis.summary_keys import Straggler, Summary
    from ..result import RunResult


class FinishedRun(Protocol):
    """What the kernel's reading takes of a finished run (run.Run, the handle users hold): its
    result, whether it was read back from its file, what of the live kernel it still points at
    (the training loader, the passes begun), and keep_reading (the reading kept with its
    result, as a new value)."""

    @property
    def name(self) -> str:
        """The run's name."""
    @property
    def result(self) -> RunResult:
        """The run's frozen result."""
    @property
    def read_back(self) -> bool:
        """The run was read back from its file (nothing of it is live)."""
    @property
    def loader_ref(self) -> Callable[[], Any] | None:
        """The training DataLoader, while it lives (None: none)."""
    @property
    def loops_started(self) -> int:
        """Passes begun over the located loop."""
    @property
    def notes(self) -> list[str]:
        """A copy of the result's notes (what a failure of the reading appends goes nowhere)."""
    @property
    def summary(self) -> Summary:
        """The result's summary, as a plain dict."""
    @property
    def verdict(self) -> str:
        """The verdict's label."""
    @property
    def straggler(self) -> Straggler | None:
        """The rank that holds the others back, else None."""
    @property
    def n_steps(self) -> int:
        """The steps recorded."""
    def keep_reading(self, checklist: Sequence[ItemRow] | None, quoted_cells: dict[str, str] | None) -> None:
        """Keep what the kernel read with the run's result (a new value)."""

MAX_HISTORY = 1000  # earlier cells searched for the DataLoader, newest first
SEARCH_BUDGET_S = 0.02  # a report parses earlier cells it has not read before for this long


def history_cells(shell: Any) -> list[str]:
    """The kernel's cells as typed, indexed like `In` (entry 0 is empty)."""
    if shell is None:
        return []
    raw = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if not isinstance(raw, list) or not raw:
        raw = getattr(shell, "user_ns", {}).get("In")
    return [str(cell) for cell in raw] if isinstance(raw, list) else []


CELL_LABEL = re.compile(r"In \[(\d+)\]$")


def run_cells(run: FinishedRun, shell: Any) -> list[str]:
    """The cells a run's report reads: the kernel's history; for a run read back from its file,
    the cells it quoted (`run.result.reading.quoted_cells`), at their numbers (the others empty)."""
    if not run.read_back:
        return history_cells(shell)
    numbers = {}
    for label, text in (run.result.reading.quoted_cells or {}).items():
        match = CELL_LABEL.match(str(label))
        if match is not None:
            numbers[int(match.group(1))] = str(text)
    cells = [""] * (max(numbers, default=0) + 1)
    for number, text in numbers.items():
        cells[number] = text
    return cells




def _body(source: str) -> str:
    return source.partition("\n")[2].rstrip() if source.startswith("%%") else source.rstrip()


def current_cell_index(cells: Sequence[str], cell_source: str | None) -> int | None:
    """Where the traced cell is in the history (the last cell with the same code)."""
    if not cell_source:
        return None
    body = _body(cell_source)
    for i in range(len(cells) - 1, 0, -1):
        if cells[i].startswith("%%traceml") and _body(cells[i]) == body:
            return i
    return None


def cell_transform(shell: Any) -> Any:
    """The shell's transform_cell (magics and `!cmd` to Python), or None."""
    return getattr(shell, "transform_cell", None) if shell is not None else None


def earlier_numbers(cells: Sequence[str], current: int | None) -> range:
    """Cell numbers before the traced one, newest first."""
    end = current if current is not None else len(cells)
    return range(end - 1, 0, -1)


def cell_label(i: int) -> str:
    """The label a cell's number has in the history: "In [3]"."""
    return f"In [{i}]"


@dataclass(frozen=True)
class CellFacts:
    """What the report looks up in an earlier cell, read off its tree once per kernel (the
    tree itself is not kept: a 300-line cell's tree weighs about 2 MiB)."""

    loader_sites: tuple[tuple[int, frozenset[str]], ...]  # DataLoader(...) lines, names bound
    loader_lines: tuple[int, ...]
    first_assigned: Mapping[str, int]  # name -> first line that assigns it
    samples: Mapping[str, SampleCode]  # dataset classes defined in the cell, by name
    loop_functions: frozenset[str]  # functions defined in the cell that hold a `for`


def read_cell(text: str, transform: Any = None) -> ast.Module | None:
    """An earlier cell's tree: plain Python is parsed as typed (most cells, and the line
    numbers stay the user's); IPython's transform (magics, `!cmd`) only when that fails."""
    return parse_cell(text) or parse_cell(text, transform)


def _within(inner: ast.expr, outer: ast.stmt | ast.expr) -> bool:
    """`inner` is part of `outer` (nodes' source spans nest as the nodes do)."""
    start = (outer.lineno, outer.col_offset)
    end = (outer.end_lineno or outer.lineno, outer.end_col_offset or 0)
    return start <= (inner.lineno, inner.col_offset) and (
        inner.end_lineno or inner.lineno,
        inner.end_col_offset or 0,
    ) <= end


def cell_facts(tree: ast.AST, label: str) -> CellFacts:
    """The facts of one cell's tree (`label`: "In [3]") in one walk over it: the DataLoader
    lines and sites as `dataloader_lines` and `dataloader_sites` read them, each name's first
    assignment as `assigned_line` reads it, the dataset classes as `sample_code_in` does."""
    nodes = list(ast.walk(tree))
    calls = [node for node in nodes if isinstance(node, ast.Call) and is_dataloader_call(node)]
    sites: dict[int, set[str]] = {call.lineno: set() for call in calls}
    first: dict[str, int] = {}
    samples: dict[str, SampleCode] = {}
    loops: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ClassDef) and node.name not in samples:
            found = sample_code_in(node, node.name, label)
            if found is not None:
                samples[node.name] = found
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in loops:
            if any(isinstance(inner, (ast.For, ast.AsyncFor)) for inner in ast.walk(node)):
                loops.add(node.name)
        targets = assign_targets(node)
        if targets is None or not isinstance(node, (ast.stmt, ast.expr)):
            continue
        names = target_names(targets)
        if not isinstance(node, ast.AugAssign):  # `x += 1` does not bring x in
            line = targets[0].lineno
            for name in names:
                first[name] = min(first.get(name, line), line)
        for call in calls:
            if _within(call, node):
                sites[call.lineno] |= names
    return CellFacts(
        tuple((line, frozenset(names)) for line, names in sorted(sites.items())),
        tuple(sorted(sites)),
        first,
        samples,
        frozenset(loops),
    )


# Read once per kernel: each earlier cell's facts, by number and text (the text too: numbers
# start again after a history reset); and, for the few functions whose loop a run used, that
# loop and its function (the report shows the loop's line and reads its transfers).
LoopInFunction = tuple[ast.For | ast.AsyncFor, ast.AST]
_CELL_FACTS: dict[tuple[int, str], CellFacts | None] = {}
_MENTIONS: dict[tuple[int, str, str], bool] = {}  # (number, text, word): the word is in it
_FUNCTION_LOOPS: dict[tuple[int, str, str, int], LoopInFunction | None] = {}
FUNCTION_LOOPS_KEPT = 16


class EarlierCells:
    """The cells before the traced one, newest first, as one report reads them.

    A cell is parsed only when its text can hold what is looked for (a cheap substring test),
    at most once per kernel (the facts are cached), and a report spends at most `budget_s`
    parsing cells not read before: the report's cost does not grow with the session. Cells
    left unread are read by a later report.
    """

    def __init__(
        self,
        shell: Any,
        cells: Sequence[str],
        current: int | None,
        budget_s: float | None = None,
    ) -> None:
        self.cells = cells
        self.numbers = earlier_numbers(cells, current)
        self.transform = cell_transform(shell)
        self.budget_s = SEARCH_BUDGET_S if budget_s is None else budget_s
        self.spent_s = 0.0

    def mentions(self, i: int, word: str) -> bool:
        """Whether cell i's text holds `word` (cached: a session's cells are scanned once)."""
        key = (i, self.cells[i], word)
        found = _MENTIONS.get(key)
        if found is None:
            found = _MENTIONS[key] = word in key[1]
        return found

    def facts(self, i: int, *needles: str) -> CellFacts | None:
        """Cell i's facts; None when its text holds none of `needles`, it is not Python, or
        reading it would pass the report's budget."""
        if needles and not any(self.mentions(i, needle) for needle in needles):
            return None
        text = self.cells[i]
        key = (i, text)
        if key in _CELL_FACTS:
            return _CELL_FACTS[key]
        if self.spent_s >= self.budget_s:
            return None
        began = time.perf_counter()
        tree = read_cell(text, self.transform)
        _CELL_FACTS[key] = cell_facts(tree, cell_label(i)) if tree is not None else None
        self.spent_s += time.perf_counter() - began
        return _CELL_FACTS[key]

    def function_loop(
        self, i: int, name: str, line: int, named: bool = False
    ) -> LoopInFunction | None:
        """The `for` on `line` of function `name` in cell i, and that function; cached. The
        cell the run names (`named`) is read whatever the budget: the report shows that loop."""
        text = self.cells[i]
        key = (i, text, name, line)
        if key in _FUNCTION_LOOPS:
            return _FUNCTION_LOOPS[key]
        known = _CELL_FACTS.get((i, text))
        if not self.mentions(i, f"def {name}") or (
            known is not None and name not in known.loop_functions
        ):
            return None
        if not named and self.spent_s >= self.budget_s:
            return None
        began = time.perf_counter()
        tree = read_cell(text, self.transform)
        found = None
        if tree is not None:
            if (i, text) not in _CELL_FACTS:
                _CELL_FACTS[(i, text)] = cell_facts(tree, cell_label(i))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    loop = loop_at(node, line)
                    if loop is not None:
                        found = loop, node
                        break
        self.spent_s += time.perf_counter() - began
        while len(_FUNCTION_LOOPS) >= FUNCTION_LOOPS_KEPT:
            _FUNCTION_LOOPS.pop(next(iter(_FUNCTION_LOOPS)))
        _FUNCTION_LOOPS[key] = found
        return found


def forget_cells() -> None:
    """Drop what was read of earlier cells (tests; a kernel whose history was reset)."""
    _CELL_FACTS.clear()
    _MENTIONS.clear()
    _FUNCTION_LOOPS.clear()

