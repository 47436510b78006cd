"""The names that instrumented code calls, kept in `builtins` so they always resolve.

A traced cell's code is rewritten to call `__traceml_loop__(it, token)`, `__traceml_fetch__(token,
func, *args)`, `__traceml_line_sample__(token)` and `__traceml_lines__.start/lap(token, ...)`. Code
built that way can outlive its cell (a decorated function, a thread, a generator, a function kept
in a dict), so the names are installed once in `builtins` and stay there: each one passes straight
through unless a capture is recording *on the calling thread* with the same token (the serial
number of the cell's run). After the cell they are plain pass-throughs: `__traceml_loop__` returns
its iterable unchanged, `__traceml_fetch__` calls the function, the line sample is False.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any, Protocol

LOOP = "__traceml_loop__"
ALOOP = "__traceml_aloop__"
FETCH = "__traceml_fetch__"
SAMPLE = "__traceml_line_sample__"
LINES = "__traceml_lines__"
NAMES = (LOOP, ALOOP, FETCH, SAMPLE, LINES)


class Recording(Protocol):
    """What a capture offers the hooks (capture.Capture)."""

    token: int
    lines: Any  # the line clock (line_costs.LineClock) or None

    def loop(self, iterable: Iterable[Any]) -> Iterable[Any]: ...

    def aloop(self, iterable: AsyncIterable[Any]) -> AsyncIterable[Any]: ...

    def fetch(self, site: int, func: Callable[..., Any], args: Any, kwargs: Any) -> Any: ...


class _Active(threading.local):
    """The capture recording on this thread (None on every other thread)."""

    capture: Recording | None = None


ACTIVE = _Active()


def current() -> Recording | None:
    return ACTIVE.capture


def loop(iterable: Any, token: int) -> Any:
    """`for x in __traceml_loop__(it, token)`: the located loop's iterator."""
    __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
    capture = ACTIVE.capture
    if capture is None or capture.token != token:
        return iterable
    return capture.loop(iterable)


def aloop(iterable: Any, token: int) -> Any:
    """`async for x in __traceml_aloop__(it, token)`: the located `async for` loop's iterator."""
    capture = ACTIVE.capture
    if capture is None or capture.token != token:
        return iterable
    return capture.aloop(iterable)


def fetch(token: int, site: int, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`__traceml_fetch__(token, line, next, it)` for `next(it)`, `get_batch(...)` in a loop body."""
    __tracebackhide__ = True  # noqa: F841
    capture = ACTIVE.capture
    if capture is None or capture.token != token:
        return func(*args, **kwargs)
    return capture.fetch(site, func, args, kwargs)


def sample(token: int) -> bool:
    """Whether this step's body lines are timed (line_costs.py)."""
    capture = ACTIVE.capture
    if capture is None or capture.token != token:
        return False
    lines = capture.lines
    return lines is not None and bool(lines.sample())


class _Lines:
    """`__traceml_lines__.start(token)` / `.lap(token, i)` on the sampled steps."""

    __slots__ = ()

    def start(self, token: int) -> None:
        capture = ACTIVE.capture
        if capture is not None and capture.token == token and capture.lines is not None:
            capture.lines.start()

    def lap(self, token: int, index: int) -> None:
        capture = ACTIVE.capture
        if capture is not None and capture.token == token and capture.lines is not None:
            capture.lines.lap(index)


def install() -> None:
    """Put the hook names in builtins (once per process; they stay, see the module docstring)."""
    values = {LOOP: loop, ALOOP: aloop, FETCH: fetch, SAMPLE: sample, LINES: _Lines()}
    for name, value in values.items():
        setattr(builtins, name, value)
