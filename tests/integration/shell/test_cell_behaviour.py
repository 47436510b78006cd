"""A traced cell behaves as the plain cell does, also for hostile cells: threads, instrumented code
that outlives its cell, batches and lengths that lie or raise, `await`, syntax errors, a failed
--save, steps too short to time. Through a real shell; each compared with the plain cell."""

from __future__ import annotations

import re
import sys
import textwrap
import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers import run as run_cell

import traceml_jupyter
from traceml_jupyter.capture.instrument import hooks

run = partial(run_cell, store_history=True)


def both(ip: Any, setup: str, cell: str, names: list[str], options: str = "--no-live") -> tuple[dict[str, Any], dict[str, Any]]:
    """The values of `names` after the plain cell and after the traced one (same setup)."""
    values = []
    for prefix in ("", f"%%traceml {options}\n"):
        assert run(ip, setup).error_in_exec is None
        result = run(ip, prefix + textwrap.dedent(cell))
        assert result.error_in_exec is None, result.out.stdout + result.out.stderr
        values.append({n: ip.user_ns[n] for n in names})
    return values[0], values[1]


@pytest.mark.slow
def test_a_loop_started_on_a_thread_runs_to_the_end_after_the_cell(ip: Any) -> None:
    errors: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment]
    try:
        for lines in ("--no-live", "--no-live --lines off"):
            r = run(
                ip,
                f"""\
                %%traceml {lines}
                import threading, time
                done = []
                def train(n):
                    for step in range(n):  # traceml: loop
                        time.sleep(0.002)
                        done.append(step)
                worker = threading.Thread(target=train, args=(30,))
                worker.start()
                """,
            )
            assert r.error_in_exec is None
            assert run(ip, "worker.join(10)").error_in_exec is None  # a later, plain cell
            assert ip.user_ns["done"] == list(range(30)) and not errors
    finally:
        threading.excepthook = previous


def test_instrumented_code_that_outlives_its_cell_stays_harmless(ip: Any) -> None:
    r = run(
        ip,
        """\
        %%traceml --no-live
        import functools
        def logged(f):
            @functools.wraps(f)
            def wrapper(*args, **kwargs):
                return f(*args, **kwargs)
            return wrapper
        @logged
        def fit(xs):
            total = 0
            for x in xs:  # traceml: loop
                total += x
            return total
        def batches(xs):
            for x in xs:  # traceml: loop
                yield x * 2
        class Holder: pass
        holder = Holder()
        holder.fn = fit
        registry = {"fit": fit}
        part = functools.partial(fit, [1, 2, 3])
        gen = batches([1, 2, 3])
        first = fit([1, 2])
        """,
    )
    assert r.error_in_exec is None and ip.user_ns["first"] == 3
    later = run(ip, "out = (fit([4]), registry['fit']([5]), part(), holder.fn([6]), list(gen))")
    assert later.error_in_exec is None, later.out.stdout
    assert ip.user_ns["out"] == (4, 5, 6, 6, [2, 4, 6])
    assert hooks.active is None


def test_the_hook_names_pass_through_outside_their_run() -> None:
    import builtins

    hooks.install()
    items = [1, 2]
    assert getattr(builtins, hooks.LOOP)(items, 12345) is items
    assert getattr(builtins, hooks.FETCH)(12345, 3, next, iter(items)) == 1
    assert getattr(builtins, hooks.LINES).on is False
    getattr(builtins, hooks.LINES).start(12345)
    getattr(builtins, hooks.LINES).lap(12345, 0)


SETUP = """
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
"""


@pytest.mark.parametrize(
    "batch",
    [
        "torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])",
        "type('Odd', (), {'shape': (float('nan'),)})()",
        "type('Raises', (), {'shape': property(lambda self: 1 / 0)})()",
        "type('Huge', (), {'shape': (10**30,)})()",
    ],
)
def test_batches_whose_shape_lies_or_raises_never_break_the_loop(ip: Any, batch: str) -> None:
    cell = f"""\
    items = [{batch} for _ in range(4)]
    seen = 0
    for b in items:
        seen += 1
    """
    plain, traced = both(ip, SETUP, cell, ["seen"])
    assert plain == traced == {"seen": 4}
    got = traceml_jupyter.last()
    assert got is not None and got.result.steps.batch_size is None


def test_a_nested_tensor_collate_runs_as_without_the_magic(ip: Any) -> None:
    setup = SETUP + """
class Ragged(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.ones(i + 1)
loader = DataLoader(Ragged(), batch_size=2, collate_fn=torch.nested.nested_tensor)
"""
    plain, traced = both(ip, setup, "total = 0\nfor b in loader:\n    total += 1\n", ["total"])
    assert plain == traced == {"total": 4}


@pytest.mark.parametrize(
    "length",
    ["raise NotImplementedError", "raise RuntimeError('no len')", "return -1", "return 10**30", "return float('nan')"],
)
def test_lengths_that_raise_or_lie_never_break_a_loop_that_never_asks(ip: Any, length: str) -> None:
    setup = SETUP + f"""
class Stream(IterableDataset):
    def __iter__(self):
        return iter([torch.ones(2)] * 6)
    def __len__(self):
        {length}
class Wrapper:
    def __init__(self, inner):
        self.inner = inner
    def __iter__(self):
        return iter(self.inner)
    def __len__(self):
        {length}
loader = DataLoader(Stream(), batch_size=None)
wrapped = Wrapper([1, 2, 3])
"""
    cell = "n = 0\nfor b in loader:\n    n += 1\nfor w in wrapped:  # traceml: loop\n    n += w\n"
    plain, traced = both(ip, setup, cell, ["n"])
    assert plain == traced == {"n": 12}
    got = traceml_jupyter.last()
    assert got is not None and got.result.steps.expected is None


def test_await_and_async_for_run_as_ipython_runs_them(ip: Any) -> None:
    setup = """
import asyncio, time
async def batches(n):
    for i in range(n):
        await asyncio.sleep(0.003)
        yield i
"""
    cell = """\
    total = 0
    async for b in batches(10):
        time.sleep(0.001)
        total += b
    later = await asyncio.sleep(0.001, result="awaited")
    """
    plain, traced = both(ip, setup, cell, ["total", "later"])
    assert plain == traced == {"total": 45, "later": "awaited"}
    got = traceml_jupyter.last()
    assert got is not None and got.n_steps == 10 and got.result.loop.line == 3
    assert got.summary["data_wait_ms"] == pytest.approx(3.0, abs=2.0)


def test_an_error_in_an_awaiting_cell_keeps_its_traceback(ip: Any) -> None:
    run(ip, "import asyncio")
    r = run(ip, "%%traceml --no-live\nawait asyncio.sleep(0)\nfor v in [1]:\n    1 / 0\n")
    assert isinstance(r.error_in_exec, ZeroDivisionError)
    assert "line 4" in r.out.stdout and "1 / 0" in r.out.stdout


def shown_error(result: Any) -> str:
    return result.out.stdout + result.out.stderr


COMPILE_ERRORS = [
    ("x = (\ny = 1\n", SyntaxError),
    ("x = 1 +\n", SyntaxError),
    ("for x in [1]:\ny = 1\n", IndentationError),
    ("if True:\n        x = 1\n\ty = 2\n", TabError),
    ("print('ran')\nreturn 5\n", SyntaxError),  # parses; compiling fails after line 1 ran
    ("for i in range(2):\n    pass\nawait = 3\n", SyntaxError),
]
FIELDS = ("text", "offset", "end_offset")


def one_line_down(msg: str) -> str:
    """A message that quotes a line of the cell ("... after 'for' statement on line 1") quotes
    it as the traced cell numbers it: one line down, under the %%traceml line."""
    return re.sub(r"on line (\d+)", lambda m: f"on line {int(m.group(1)) + 1}", msg)


@pytest.mark.parametrize(("body", "kind"), COMPILE_ERRORS, ids=lambda v: getattr(v, "__name__", None))
def test_a_compile_error_is_the_plain_cells_error_object_field_by_field(ip: Any, body: str, kind: type) -> None:
    plain = run(ip, body)
    plain_err = plain.error_before_exec
    assert type(plain_err) is kind and sys.last_value is plain_err
    traced = run(ip, "%%traceml --no-live\n" + body)
    err = traced.error_before_exec
    assert type(err) is kind and traced.error_in_exec is None and sys.last_value is err
    for field in FIELDS:
        assert getattr(err, field) == getattr(plain_err, field), field
    assert err.msg == one_line_down(plain_err.msg)
    assert err.lineno == plain_err.lineno + 1 and err.end_lineno == plain_err.end_lineno + 1
    assert str(err).startswith(f"{err.msg} (") and str(err).endswith(f", line {err.lineno})")
    assert plain.out.stdout.count("ran") == traced.out.stdout.count("ran")  # the same lines ran
    shown = shown_error(traced)
    assert f"line {err.lineno}" in shown and f"{kind.__name__}: {err.msg}" in shown
    for word in ("Traceback", "magic.py", "traced_cell.py", "interactiveshell.py", "run_cell_magic"):
        assert word not in shown


def test_a_compile_error_with_a_bad_option_is_the_options_usage_error(ip: Any) -> None:
    r = run(ip, "%%traceml --budget 3\nx = (\n")
    assert type(r.error_in_exec).__name__ == "UsageError" and "go with %traceml tune" in str(r.error_in_exec)


def test_a_compile_error_through_run_cell_magic_carries_the_fields(ip: Any) -> None:
    """Called from code, the magic raises its own error, shown as IPython shows a plain cell's,
    with the SyntaxError's fields (lineno counting the %%traceml line as line 1)."""
    plain = run(ip, "x = 1 +\n").error_before_exec
    with pytest.raises(Exception) as info:
        ip.run_cell_magic("traceml", "--no-live", "x = 1 +\n")
    err = info.value
    assert type(err).__name__ == "SyntaxError"
    assert (err.msg, err.text, err.offset, err.lineno) == (
        plain.msg,
        plain.text,
        plain.offset,
        plain.lineno + 1,
    )


def test_a_failed_save_says_so_and_keeps_the_report_and_the_run(ip: Any, tmp_path: Path) -> None:
    for target in (tmp_path, tmp_path / "missing" / "run.json"):
        r = run(ip, f"%%traceml --no-live --save {target}\nfor v in [1, 2, 3]:\n    pass\n")
        assert r.error_in_exec is None
        lines = [line for line in shown_error(r).splitlines() if "traceml:" in line]
        assert len(lines) == 1 and "could not save" in lines[0] and str(target) in lines[0]
        assert "could not build the report" not in shown_error(r)
        assert any("text/html" in o.data for o in r.out.outputs)  # the report was shown
        got = traceml_jupyter.last()
        assert got is not None and got.n_steps == 3


@pytest.mark.slow
def test_steps_too_short_to_time_are_not_called_input_bound(ip: Any) -> None:
    r = run(ip, "%%traceml --no-live\ncount = 0\nfor i in iter(range(20000)):\n    count += 1\n")
    assert r.error_in_exec is None and ip.user_ns["count"] == 20000
    got = traceml_jupyter.last()
    assert got is not None and got.verdict == "TOO SHORT"
    assert "too short" in got.verdict_detail.why


def test_a_failure_of_ours_while_the_cell_ends_never_replaces_the_users_error(
    ip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from traceml_jupyter.recording import Recording

    def broken(self: Any, capture: Any, wall_ns: int) -> None:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(Recording, "read_capture", broken)
    r = run(ip, "%%traceml --no-live\nfor v in [1, 2, 3]:\n    if v == 2:\n        raise ValueError('the user')\n")
    assert isinstance(r.error_in_exec, ValueError) and str(r.error_in_exec) == "the user"
    got = traceml_jupyter.last()
    assert got is not None and any("a bug of ours" in note for note in got.notes)
