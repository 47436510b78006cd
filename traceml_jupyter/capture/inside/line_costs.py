"""Cost per line next to the code: a pure AST rewrite that times each top-level statement of the
step loop's body on sampled steps, and the clocks that sum those times while the loop runs (the
wall clock; on CUDA also events on some of those steps, for the GPU time per line).

The body `s0; s1` of the chosen loop becomes

    if __traceml_lines__.on:            # the first FULL_STEPS steps, then one in LINE_EVERY
        __traceml_lines__.start(TOKEN)
        try:
            s0
        finally:
            __traceml_lines__.lap(TOKEN, 0)
        try:
            s1
        finally:
            __traceml_lines__.lap(TOKEN, 1)
    else:
        s0
        s1

so `break`, `continue`, `return` and exceptions still end the statement's time, both copies
keep the statements' own line numbers (tracebacks are unchanged), and a step that is not
sampled pays one attribute read. `global` and `nonlocal` declarations move before the `if`. The
name lives in builtins (hooks.py): outside its run `.on` is False and the plain copy runs.
"""

from __future__ import annotations

import ast
import copy
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

from ...failures import failure_text
from ..gpu.cuda_graphs import capturing
from ..instrument.hooks import LINES
from ..instrument.locate import LoopChoice, find_node

FULL_STEPS = 64  # the first steps are all timed (short runs get every step)
# Sums are kept before each of the first timed steps, so that a warm-up of this many steps (the
# automatic one is a few) can be taken out once its length is known; a longer --warmup gives its own.
WARMUP_SNAPSHOTS = 5
LINE_EVERY = 16  # then one step in 16 (a timed step costs ~1.5 µs more than an untimed one)
GPU_EARLY_EVERY = 4  # CUDA: events on one step in 4 among the first FULL_STEPS (after the warm-up), then on every timed step


@dataclass(frozen=True)
class Statement:
    """One timed top-level statement of the loop body."""

    index: int
    line: int  # first line in the cell (the %%traceml line is 1)
    end_line: int
    text: str  # its first line, stripped


def _located(node: ast.AST, at: ast.stmt) -> ast.AST:
    for child in ast.walk(node):
        ast.copy_location(child, at)
    return node


def _call(name: str, method: str | None, args: list[ast.expr]) -> ast.Call:
    """`name(*args)` or `name.method(*args)`."""
    func: ast.expr = ast.Name(id=name, ctx=ast.Load())
    if method is not None:
        func = ast.Attribute(value=func, attr=method, ctx=ast.Load())
    return ast.Call(func=func, args=args, keywords=[])


def time_lines(
    tree: ast.Module,
    choice: LoopChoice,
    lines: list[str] | None = None,
    token: int = 0,
) -> tuple[ast.Module, list[Statement]]:
    """A copy of `tree` whose chosen loop times each top-level body statement on the steps
    the line sample picks (see the module docstring), and the statements timed, in order."""
    name, tok = LINES, ast.Constant(token)
    new = copy.deepcopy(tree)
    loop = find_node(new, choice)
    first = loop.body[0]
    declarations = [s for s in loop.body if isinstance(s, (ast.Global, ast.Nonlocal))]
    plain = [s for s in loop.body if not isinstance(s, (ast.Global, ast.Nonlocal))]
    statements: list[Statement] = []
    timed: list[ast.stmt] = [ast.Expr(value=_call(name, "start", [tok]))]
    _located(timed[0], first)
    for index, stmt in enumerate(plain):
        end = getattr(stmt, "end_lineno", None) or stmt.lineno
        text = lines[stmt.lineno - 1].strip() if lines and 0 < stmt.lineno <= len(lines) else ""
        statements.append(Statement(index, stmt.lineno, end, text))
        lap = _located(ast.Expr(value=_call(name, "lap", [ast.Constant(token), ast.Constant(value=index)])), stmt)
        wrapped = ast.Try(body=[copy.deepcopy(stmt)], handlers=[], orelse=[], finalbody=[lap])  # type: ignore[list-item]
        timed.append(ast.copy_location(wrapped, stmt))
    if not plain:
        return new, []
    flag = ast.Attribute(value=ast.Name(id=name, ctx=ast.Load()), attr="on", ctx=ast.Load())
    branch = ast.If(test=flag, body=timed, orelse=plain)
    _located(branch.test, first)
    loop.body = [*declarations, ast.copy_location(branch, first)]
    return ast.fix_missing_locations(new), statements


def schedule(full: int = FULL_STEPS, every: int = LINE_EVERY) -> Iterator[bool]:
    """Which steps are timed: the first `full`, then one in `every`."""
    return itertools.chain(itertools.repeat(True, full), itertools.cycle([True] + [False] * (every - 1)))


def step_of_sample(k: int, full: int = FULL_STEPS, every: int = LINE_EVERY) -> int:
    """The step index of the k-th timed step (0-based) under `schedule(full, every)`."""
    return k if k < full else full + (k - full) * every


def samples_before(step: int, full: int = FULL_STEPS, every: int = LINE_EVERY) -> int:
    """How many timed steps come before step index `step`."""
    if step <= full:
        return max(0, step)
    return full + -(-(step - full) // every)


class LineClock:
    """Sums each statement's wall time over the timed steps: `start()` when a timed step's body
    begins, `lap(i)` when statement i ends. Snapshots of the sums before each of the first timed
    steps let the warm-up be taken out once its length is known."""

    def __init__(
        self,
        statements: list[Statement],
        warmup_until: int = WARMUP_SNAPSHOTS,
        full: int = FULL_STEPS,
        every: int = LINE_EVERY,
    ) -> None:
        n = len(statements)
        self.statements = statements
        self.full, self.every = full, every
        self.position = 0  # steps of the loop the schedule has answered for
        self.ns = [0] * n
        self.runs = [0] * n
        self.timed = 0  # timed steps so far
        self._prev = 0
        self._snapshot_until = samples_before(warmup_until, full, every)
        self.snapshots: list[tuple[list[int], list[int]]] = []  # sums before timed step k

    def sample(self) -> bool:
        """Whether the next step of the loop is timed (`schedule`, one step at a time)."""
        return self.take(1)[0]

    def take(self, limit: int) -> tuple[bool, int]:
        """The next steps that share one answer: (timed or not, how many: 1 to `limit`). The
        capture sets the flag once for all of them."""
        i, full, every = self.position, self.full, self.every
        if i < full:
            on, n = True, (limit if every == 1 else full + 1 - i)
        else:
            r = (i - full) % every
            if r:
                on, n = False, every - r
            else:
                on, n = True, (limit if every == 1 else 1)
        if n > limit:
            n = limit
        self.position = i + n
        return on, n

    def untake(self, n: int) -> None:
        """The last `n` steps taken did not run (the capture looked again before them)."""
        self.position -= n

    def start(self) -> None:
        """A step of the body starts: the first line's time runs from now."""
        if self.timed <= self._snapshot_until:
            self.snapshots.append((list(self.ns), list(self.runs)))
        self.timed += 1
        self._prev = perf_counter_ns()

    def lap(self, i: int) -> None:
        """Line `i` of the body ended: its time since the previous lap is added to it."""
        now = perf_counter_ns()
        self.ns[i] += now - self._prev
        self.runs[i] += 1
        self._prev = now

    def finish(self) -> str | None:
        """Read what is pending (CUDA events); nothing to do for the wall clock. Returns why the
        GPU time per line is incomplete (for the run's notes), None when it is not."""
        return None

    def gpu_ms(self) -> tuple[list[float], int] | None:
        """GPU ms per statement summed over the event-sampled steps, and how many there were."""
        return None


class CudaLineClock(LineClock):
    """The wall clock, plus a CUDA event at every statement boundary of some steps after the
    warm-up (one in GPU_EARLY_EVERY of the first FULL_STEPS, then every timed step: one in
    LINE_EVERY): the GPU time between two events is the GPU time of the statement between
    them. Events are read once every one of a step's marks has completed, never waited for
    before the end of the cell.

    Events are made only once `on_gpu()` says the loop runs on a CUDA device: by
    `event_factory`, or by torch's CUDA that `api_for()` gives then (CUDA is initialised by
    the user's code by that time; nothing here initialises it). A step's marks all sit on the
    loop's stream as it was when the step's body began. Any error in the GPU bookkeeping turns
    the GPU timing per line off for the run (`gpu_off` says why; `finish()` returns it for the
    caller's note); nothing is raised into the user's code. The edge: every CUDA call of this
    clock (from `start`, `lap` and `finish`) goes through `_gpu`, its one guard.
    """

    def __init__(
        self,
        statements: list[Statement],
        event_factory: Callable[[], Any] | None,
        on_gpu: Callable[[], bool],
        warmup_until: int = WARMUP_SNAPSHOTS,
        full: int = FULL_STEPS,
        every: int = LINE_EVERY,
        api_for: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(statements, warmup_until, full, every)
        self._make = event_factory
        self._on_gpu = on_gpu
        self._api_for = api_for
        self._stream_of: Callable[[], Any] | None = None
        self.warmup_until = warmup_until
        self.gpu_sampled = 0  # steps with events
        self.gpu_read = 0  # ... whose events were read (all of them, after finish())
        self.gpu_sums = [0.0] * len(statements)
        self.gpu_off: str | None = None
        self._marks: list[tuple[int, Any]] | None = None
        self._mark_stream: Any = None
        self._pending: deque[list[tuple[int, Any]]] = deque()
        self._free: list[Any] = []
        self.own: Callable[[int], None] = lambda ns: None  # our event records' host time in a step

    def _ready(self) -> bool:
        """Events can be made: a factory was given, or torch's CUDA API for the loop's device."""
        if self._make is not None:
            return True
        api = self._api_for() if self._api_for is not None else None
        if api is None:
            return False
        device = api.device
        self._make = api.event_factory
        self._stream_of = lambda: api.current_stream(device)
        return True

    def _event(self, stream: Any) -> Any:
        assert self._make is not None
        ev = self._free.pop() if self._free else self._make()
        if stream is None:
            ev.record()
        else:
            ev.record(stream)
        return ev

    def _gpu(self, do: Callable[..., Any], *args: Any) -> bool:
        """`do(*args)`, the edge of the GPU clock per line: an error turns it off for the run
        (False), never reaches the user's loop (`lap` runs in their `finally`)."""
        try:
            do(*args)
        except Exception as exc:
            self._turn_off(exc)
            return False
        return True

    def _turn_off(self, exc: BaseException) -> None:
        if self.gpu_off is None:
            self.gpu_off = failure_text(exc)
        self._marks = None
        self._pending.clear()
        self._free.clear()

    def start(self) -> None:
        """A step of the body starts: the host clock as LineClock's, and on a sampled step an event
        opens the GPU's timing of its lines."""
        if self._marks is not None:
            self._pending.append(self._marks)
            self._marks = None
            self._gpu(self._poll)
        super().start()
        if self.gpu_off is not None or not self._on_gpu():  # the CPU path ends here
            return
        k = self.timed - 1
        step = step_of_sample(k, self.full, self.every)
        due = step >= self.full or step % GPU_EARLY_EVERY == 0
        if due and step > self.warmup_until and not capturing(True) and self._gpu(self._open_marks):
            self._prev = perf_counter_ns()  # the event's own cost is no statement's

    def _open_marks(self) -> None:
        """A sampled step's first event, on the loop's stream now (none until events can be made)."""
        if not self._ready():
            return
        stream = self._stream_of() if self._stream_of is not None else None
        first = self._event(stream)
        self.gpu_sampled += 1
        self._marks = [(-1, first)]
        self._mark_stream = stream

    def lap(self, i: int) -> None:
        """Line `i` of the body ended: its host time, and on a sampled step an event after it on the
        GPU."""
        now = perf_counter_ns()
        self.ns[i] += now - self._prev
        self.runs[i] += 1
        marks = self._marks
        if marks is not None and capturing(True):  # no event inside a CUDA graph capture: drop the step's
            self._free.extend(ev for _, ev in marks)
            self._marks = marks = None
        if marks is not None:
            self._gpu(self._mark, marks, i)
            after = perf_counter_ns()
            self.own(after - now)
            now = after
        self._prev = now

    def _mark(self, marks: list[tuple[int, Any]], i: int) -> None:
        marks.append((i, self._event(self._mark_stream)))

    def _poll(self) -> None:
        """Read the sampled steps whose events completed (through `_gpu`)."""
        pending, sums, free = self._pending, self.gpu_sums, self._free
        if capturing():
            return
        while pending:
            marks = pending[0]
            if not all(ev.query() for _, ev in marks):
                return
            pending.popleft()
            for (_, before), (i, after) in zip(marks, marks[1:], strict=False):
                sums[i] += float(before.elapsed_time(after))
            self.gpu_read += 1
            free.extend(ev for _, ev in marks)

    def _wait_for_marks(self) -> None:
        """Every pending mark done: a body that switched streams leaves them on several."""
        for marks in self._pending:
            for _, ev in marks:
                if hasattr(ev, "synchronize"):
                    ev.synchronize()
        self._poll()

    def finish(self) -> str | None:
        """Wait for the sampled steps' last marks, read them, and drop every event. Returns why
        the GPU timing per line turned itself off (the caller notes it), else None."""
        if self._marks is not None:
            self._pending.append(self._marks)
            self._marks = None
        if self._pending and self.gpu_off is None and capturing():
            self._turn_off(RuntimeError("a CUDA graph capture was still under way when the cell ended"))
        if self._pending and self.gpu_off is None:
            self._gpu(self._wait_for_marks)
        self._pending.clear()
        self._free.clear()
        return None if self.gpu_off is None else f"GPU time per line turned off: {self.gpu_off}"

    def gpu_ms(self) -> tuple[list[float], int] | None:
        """The GPU time per line summed over the sampled steps read, and how many were read; None
        when none was."""
        if self.gpu_off is not None or not self.gpu_read:
            return None
        return list(self.gpu_sums), self.gpu_read


def line_costs(
    clock: LineClock,
    warmup: int,
    step_ms: float | None = None,
    fetch_ms: float | None = None,
    loop_line: int | None = None,
) -> dict[str, Any]:
    """Per statement: mean ms per analysed step (over the timed steps after the warm-up), its
    share of the mean step, and on CUDA the GPU ms per event-sampled step. JSON-ready."""
    n = len(clock.statements)
    skip = min(samples_before(warmup, clock.full, clock.every), clock.timed)
    if clock.snapshots:
        skip = min(skip, len(clock.snapshots) - 1)
        base_ns, base_runs = clock.snapshots[skip]
    else:
        skip, base_ns, base_runs = 0, [0] * n, [0] * n
    timed = clock.timed - skip
    gpu = clock.gpu_ms()
    rows = []
    for st in clock.statements:
        ms = (clock.ns[st.index] - base_ns[st.index]) / 1e6 / timed if timed else None
        rows.append(
            {
                "line": st.line,
                "end_line": st.end_line,
                "text": st.text,
                "ms_per_step": ms,
                "share": ms / step_ms if ms is not None and step_ms else None,
                "runs": clock.runs[st.index] - base_runs[st.index],
                "gpu_ms_per_step": gpu[0][st.index] / gpu[1] if gpu else None,
            }
        )
    return {
        "statements": rows,
        "ms_per_step": {r["line"]: r["ms_per_step"] for r in rows},
        "gpu_ms_per_step": {r["line"]: r["gpu_ms_per_step"] for r in rows} if gpu else None,
        "timed_steps": timed,
        "warmup_steps": warmup,
        "step_ms": step_ms,
        "loop_line": loop_line,
        "fetch_ms_per_step": fetch_ms,
        "clock": "wall clock + CUDA events" if gpu else "wall clock",
        "sampling": f"every step for the first {clock.full}, then one in {clock.every}",
        "gpu_sampled_steps": gpu[1] if gpu else 0,
    }


def heat(costs: Mapping[str, Any]) -> dict[int, float]:
    """Bar length (0..1) per line for the report: each statement's ms per step over the
    costliest one's; the loop line's bar is its fetch time (data wait) on the same scale."""
    values = {int(r["line"]): float(r["ms_per_step"] or 0.0) for r in costs["statements"]}
    if costs.get("loop_line") is not None and costs.get("fetch_ms_per_step") is not None:
        values[int(costs["loop_line"])] = float(costs["fetch_ms_per_step"])
    top = max(values.values(), default=0.0)
    return {line: (v / top if top > 0 else 0.0) for line, v in values.items()}


def new_clock(statements: list[Statement], run: Any, warmup: int | None) -> LineClock:
    """The wall clock, with CUDA events on sampled steps once the loop runs on a CUDA device
    (`run.cuda_device`, decided by the capture). Nothing of CUDA is touched before: a CPU loop
    never initialises it."""
    from ..gpu import gpu_watch

    until = max(WARMUP_SNAPSHOTS, warmup or 0)

    def on_gpu() -> bool:
        return getattr(run, "cuda_device", None) is not None

    def api() -> Any:
        return gpu_watch.torch_cuda_api(getattr(run, "cuda_device", None))

    def own(ns: int) -> None:
        watch = getattr(run, "gpu_watch", None)
        if watch is not None and watch.syncs is not None:
            watch.own_time(ns)

    clock = CudaLineClock(statements, None, on_gpu, until, api_for=api)
    clock.own = own
    return clock
