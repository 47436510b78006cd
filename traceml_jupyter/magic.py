"""IPython glue: the `%%traceml` cell magic and the `%traceml` line commands."""

from __future__ import annotations

import re
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .failures import failure_text, never_raise
from .views.environment import live_mode


def split_line(line: str) -> list[str]:
    """The magic's line split as a shell splits it: quotes group and are removed
    (`--name "my run"` is one name), backslashes stay as typed (a Windows path in --save)."""
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    lexer.escape = ""
    try:
        return list(lexer)
    except ValueError as exc:  # an unclosed quote
        raise UsageError(f"%traceml: {exc}: {line.strip()}") from None


def cell_options(args: Any, line: str) -> Any:
    """The options of a `%%traceml` cell from its parsed line (UsageError on a bad one)."""
    from .traced_cell import CellOptions

    if args.budget is not None or args.workers is not None:
        raise UsageError("%traceml: --budget and --workers go with %traceml tune")
    if args.command:
        raise UsageError(f"%%traceml: unexpected argument(s): {' '.join(args.command)}")
    if args.warmup is not None and args.warmup < 0:
        raise UsageError("%%traceml: --warmup must be 0 or more")
    return CellOptions(
        name=args.name,
        warmup=args.warmup,
        live=not args.no_live,
        save=args.save,
        loop=args.loop,
        lines=args.lines == "on",
        lines_chosen="--lines" in line,
    )


def parse_cell_line(line: str) -> Any:
    """`cell_options` of a `%%traceml` line as typed."""
    return cell_options(TraceMLMagics.traceml.parser.parse_args(split_line(line)), line)


# In a kernel whose front-end draws widgets, what the first traced cell would import (our own
# modules, numpy, ipywidgets, bqplot and the pandas bqplot imports: about 0.9 s here) is
# imported on the kernel's event loop this long after `%load_ext`, between cells.
IMPORT_DELAY_S = 0.5


def import_views_when_idle(shell: Any) -> bool:
    """In a kernel that draws widgets, import what the first traced cell needs on the kernel's
    own event loop, IMPORT_DELAY_S from now: on the main thread, while no cell runs (or while
    an async cell awaits). No thread is started, so none can outlive a cell, hold the import
    lock when the user's code forks, or run concurrently with it. True when scheduled."""
    if live_mode(shell) != "widget":
        return False
    loop = getattr(getattr(shell, "kernel", None), "io_loop", None)
    call_later = getattr(loop, "call_later", None)
    if call_later is None:
        return False
    call_later(IMPORT_DELAY_S, import_views)
    return True


def import_views() -> None:
    """Import the traced cell's modules and the live chart's libraries; never raises."""
    with never_raise():  # the traced cell imports them again, and says what failed
        import bqplot  # noqa: F401
        import ipywidgets  # noqa: F401

        from . import traced_cell  # noqa: F401
        from .views import live, report  # noqa: F401


async def traced_cell_async(shell: Any, magic_line: str, cell: str) -> Any:
    """What a `%%traceml` cell that awaits at top level becomes (async_cells.route_async_cells):
    awaited where IPython awaits cells, on its event loop."""
    __tracebackhide__ = True  # noqa: F841
    from .traced_cell import prepare_cell, run_traced_async

    traced = prepare_cell(shell, magic_line, cell, parse_cell_line(magic_line))
    return await run_traced_async(traced)


@magics_class
class TraceMLMagics(Magics):
    """The `%%traceml` cell magic (trace a training cell: live chart, then the report) and the
    `%traceml` line magic (compare, tune, history, ...)."""

    @magic_arguments()
    @argument("--name", type=str, default=None, help="label of the run (default: 'run N')")
    @argument(
        "--warmup",
        type=int,
        default=None,
        help="steps kept out of the verdict (default: a few, at most a tenth of the run)",
    )
    @argument("--no-live", action="store_true", help="no live chart while the cell runs")
    @argument(
        "--save",
        type=str,
        default=None,
        metavar="PATH",
        help="write the run: PATH.html the report as one standalone page, else JSON "
        "(traceml_jupyter.load reads it back)",
    )
    @argument(
        "--loop",
        type=str,
        default=None,
        metavar="LINE",
        help="the loop whose iterations are steps: the `for` on this line of the cell (the "
        "%%%%traceml line is 1), FUNCTION:LINE for a loop in a function from another cell "
        "(the line as that cell shows it), or FILE:LINE for a loop in a script the cell runs "
        "(`!python train.py`)",
    )
    @argument(
        "--lines",
        choices=("on", "off"),
        nargs="?",
        const="on",
        default="on",
        help="ms per step next to each line of the loop body (default: on; sampled, "
        "about 0.3 µs a step)",
    )
    @argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="%%traceml tune only: the most seconds it may take (default 30)",
    )
    @argument(
        "--workers",
        type=str,
        default=None,
        metavar="0,1,2,4",
        help="%%traceml tune only: the num_workers to try (default: 0 up to the CPUs)",
    )
    @argument(
        "command",
        nargs="*",
        help="line form only: `compare [A B]`, `tune [LOADER]`, `history [DIR|off]`",
    )
    @line_cell_magic
    def traceml(self, line: str, cell: str | None = None) -> Any:
        """Time every step of the training loop in this cell: data wait vs compute.

        Usage::

            %%traceml [--name NAME] [--warmup N] [--no-live] [--save PATH] [--loop LINE] [--lines on|off]
            for x, y in loader:
                ...

        The loop is found for you: the `for` whose body calls `.backward()` (else
        `.step()`), else one inside a function that the cell calls, else the innermost
        `for` over something other than `range`, else every DataLoader iterator driven
        during the cell. Mark another with `# traceml: loop` on its line, or `--loop LINE`.

        While the cell runs, a live chart shows data wait and compute per step; when it
        ends, a report gives the verdict (INPUT-BOUND, INPUT STRAGGLER, COMPUTE-BOUND, ...),
        the numbers behind it and a checklist. `traceml_jupyter.last()` returns the run.
        Each top-level statement of the loop body is timed on sampled steps (every step for
        the first 64, then one in 16): ms per step next to each line (`--lines off`: not timed).

        `%traceml compare [A B]` puts two runs side by side (default: the last two): the
        speed-up with its 95 % interval, IMPROVEMENT / REGRESSION / NO CHANGE (within noise) /
        MIXED, data wait, compute and every part both runs measured, the verdict change, and
        first what differs between them (hardware, versions, batch size, step definition).
        A and B are run names (this kernel's, or the history's), JSON paths or globs.

        `%traceml history DIR` saves every run of this kernel to DIR from now on (as
        `TRACEML_HISTORY=DIR` does for every kernel), so that `%traceml compare` finds runs
        of earlier kernels by name; `%traceml history off` stops it; no DIR: where it is.

        `%traceml tune [LOADER] [--budget SECONDS] [--workers 0,1,2,4]` measures the
        DataLoader alone (default: the last run's training loader) at several settings, for
        at most 30 s, and says which keeps the model fed, with the predicted speed-up.

        Example::

            %load_ext traceml_jupyter

            %%traceml --name slow
            for epoch in range(2):
                for x, y in loader:
                    opt.zero_grad(); crit(model(x), y).backward(); opt.step()
        """
        __tracebackhide__ = True  # noqa: F841
        args = self.traceml.parser.parse_args(split_line(line))
        if cell is None and args.command[:1] == ["tune"]:
            return self._tune(line, args.budget, args.workers)
        if cell is None and not (args.budget is not None or args.workers is not None):
            return self._command(args.command)
        from .traced_cell import run_traced_cell

        return run_traced_cell(self.shell, line, cell or "", cell_options(args, line))

    def _command(self, words: list[str]) -> Any:
        """`%traceml compare [A B]`: run A against run B (names from --name; quote a name
        with spaces). No name: the last two runs; one name: that run against the latest."""
        if not words:
            raise UsageError(
                "%traceml needs a cell (%%traceml) or a command: compare [A B], tune [LOADER], "
                "history [DIR|off]"
            )
        if words[0] == "history":
            return self._history(words[1:])
        if words[0] != "compare":
            raise UsageError(
                f"%traceml: unknown command {words[0]!r} (known: compare, tune, history)"
            )
        names = words[1:]  # unquoted by split_line
        if len(names) > 2:
            raise UsageError(
                f"%traceml compare takes two run names at most, got {len(names)}: "
                + ", ".join(repr(n) for n in names)
                + ' (quote a name with spaces: %traceml compare "run 1" fixed)'
            )
        from .history import compare

        try:
            return compare(*names)
        except ValueError as exc:  # LoadError too: one line saying which and why
            raise UsageError(f"%traceml compare: {exc}") from None

    def _history(self, words: list[str]) -> None:
        """`%traceml history [DIR|off]`: where every run of this kernel is saved."""
        from .history import choose, describe, history_dir

        if len(words) > 1:
            raise UsageError(
                f"%traceml history takes one directory, got {len(words)} (quote a path with spaces)"
            )
        if words:
            try:
                choose(words[0])
            except ValueError as exc:
                raise UsageError(f"%traceml history: {exc}") from None
        print(describe(history_dir()))

    def _tune(self, line: str, budget: float | None, workers: str | None) -> Any:
        """`%traceml tune [LOADER] [--budget SECONDS] [--workers 0,1,2,4]`: LOADER is an
        expression in the notebook's namespace (default: the last run's training loader)."""
        from .tuning import DEFAULT_BUDGET_S, TuneError, tune

        expression = loader_expression(line)
        loader = None
        if expression and self.shell is not None:
            try:
                loader = self.shell.ev(expression)
            except Exception as exc:
                raise UsageError(
                    f"%traceml tune: {expression}: {failure_text(exc)}"
                ) from None
        try:
            counts = parse_workers(workers) if workers is not None else None
            return tune(
                loader,
                budget=DEFAULT_BUDGET_S if budget is None else budget,
                workers=counts,
                label=expression or None,
            )
        except (TuneError, ValueError) as exc:
            raise UsageError(f"%traceml tune: {exc}") from None


def parse_workers(text: str) -> list[int]:
    """`--workers 0,1,2,4` as sorted, distinct counts; ValueError with the reason otherwise."""
    counts = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"--workers takes counts like 0,1,2,4; got {text!r}")
        counts.add(int(part))
    if not counts:
        raise ValueError("--workers needs at least one count, like 0,1,2,4")
    return sorted(counts)


def loader_expression(line: str) -> str:
    """LOADER of `%traceml tune LOADER --budget 10` as typed (quotes kept: `loaders["train"]`):
    the line without the word `tune` and the options."""
    text = re.sub(r"(?<!\S)--(?:budget|workers)(?:=|\s+)\S+", " ", line)
    text = re.sub(r"^\s*tune(?:\s|$)", "", text)
    return text.strip()
