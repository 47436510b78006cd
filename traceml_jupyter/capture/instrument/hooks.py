"""The names that instrumented code calls, kept in `builtins` so they always resolve.

A traced cell's code is rewritten to call `__traceml_loop__(it, token)`, `__traceml_fetch__(token,
func, *args)`, and to read `__traceml_lines__.on` (this step's body lines are timed) and call
`__traceml_lines__.start/lap(token, ...)`. Code
built that way can outlive its cell (a decorated function, a thread, a generator, a function kept
in a dict), so the names are installed once in `builtins` and stay there: each one passes straight
through unless a capture is recording *on the calling thread* with the same token (the serial
number of the cell's run). After the cell they are plain pass-throughs: `__traceml_loop__` returns
its iterable unchanged, `__traceml_fetch__` calls the function, `.on` is False.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, Callable, Iterable
from threading import get_ident
from typing import Any, Protocol

LOOP = "__traceml_loop__"
ALOOP = "__traceml_aloop__"
FETCH = "__traceml_fetch__"
LINES = "__traceml_lines__"
NAMES = (LOOP, ALOOP, FETCH, LINES)


class HookTarget(Protocol):
    """What a capture offers the hooks (capture.Capture)."""

    token: int
    thread: int  # threading.get_ident() of the thread it records
    lines: Any  # the line clock (line_costs.LineClock) or None

    def loop(self, iterable: Iterable[Any]) -> Iterable[Any]:
        """The located loop's iterable, wrapped so that each iteration is a step."""

    def aloop(self, iterable: AsyncIterable[Any]) -> AsyncIterable[Any]:
        """The located `async for` loop's iterable, wrapped so that each iteration is a step."""

    def fetch(self, site: int, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Call `func(*args, **kwargs)` (a fetch call the rewrite found at `site`), timed as data
        wait."""


# The capture recording now, on its own thread (`active.thread`); None between runs. One at a
# time in a process (a nested one puts the outer one back when it ends). A module global, not a
# threading.local: a global read and get_ident() cost a third of a thread-local lookup, and this
# runs on every step.
active: HookTarget | None = None


def loop(iterable: Any, token: int) -> Any:
    """`for x in __traceml_loop__(it, token)`: the located loop's iterator."""
    __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
    capture = active
    if capture is None or capture.token != token or capture.thread != get_ident():
        return iterable
    return capture.loop(iterable)


def aloop(iterable: Any, token: int) -> Any:
    """`async for x in __traceml_aloop__(it, token)`: the located `async for` loop's iterator."""
    capture = active
    if capture is None or capture.token != token or capture.thread != get_ident():
        return iterable
    return capture.aloop(iterable)


def fetch(token: int, site: int, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`__traceml_fetch__(token, line, next, it)` for `next(it)`, `get_batch(...)` in a loop body."""
    __tracebackhide__ = True  # noqa: F841
    capture = active
    if capture is None or capture.token != token or capture.thread != get_ident():
        return func(*args, **kwargs)
    return capture.fetch(site, func, args, kwargs)


class Lines:
    """`__traceml_lines__`: `.on` says whether the located loop's step now running has its body
    lines timed (the capture sets it before each iteration: a plain read is all an untimed step
    pays); `.start(token)` / `.lap(token, i)` on the timed ones go to the line clock of the
    capture that set `.on`, on its thread only."""

    __slots__ = ("on", "token", "thread", "clock")

    def __init__(self) -> None:
        self.on = False
        self.token = 0
        self.thread = 0
        self.clock: Any = None

    def start(self, token: int) -> None:
        """The loop body starts (for the traced cell's own token, on the training thread): the line
        clock starts the step."""
        if token == self.token and get_ident() == self.thread:
            self.clock.start()

    def lap(self, token: int, index: int) -> None:
        """The body's line `index` ended (for the traced cell's own token, on the training thread)."""
        if token == self.token and get_ident() == self.thread:
            self.clock.lap(index)

    def use(self, token: int, thread: int, clock: Any) -> tuple[int, int, Any]:
        """Report to `clock` from now on; returns what was used before (to put back)."""
        before = (self.token, self.thread, self.clock)
        self.token, self.thread, self.clock = token, thread, clock
        self.on = False
        return before


lines = Lines()


def install() -> None:
    """Put the hook names in builtins (once per process; they stay, see the module docstring)."""
    values = {LOOP: loop, ALOOP: aloop, FETCH: fetch, LINES: lines}
    for name, value in values.items():
        setattr(builtins, name, value)
