"""A failure of ours never reaches the user's code: `never_raise` runs a block of ours and turns
an Exception it raises into a note on the run (or drops it, where a note would be noise).

It imports nothing of the package, so every layer (capture, analysis, the run, the views, the
orchestration) uses the same guard. Not for the per-step hot path: a `with` costs about 0.1 µs,
so hooks that run every step keep their own try/except."""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")
D = TypeVar("D")


def raised_by_a_signal_handler(exc: BaseException) -> bool:
    """`exc` came out of a Python signal handler (torch's SIGCHLD handler when a DataLoader
    worker dies, a user's alarm): the user's, wherever it interrupted a block of ours."""
    codes = set()
    tb = exc.__traceback__
    while tb is not None:
        codes.add(tb.tb_frame.f_code)
        tb = tb.tb_next
    for number in signal.valid_signals():
        handler = signal.getsignal(number)
        if getattr(getattr(handler, "__func__", handler), "__code__", None) in codes:
            return True
    return False


def failure_text(exc: BaseException) -> str:
    """An error as notes quote it: "TypeError: what it said"."""
    return f"{type(exc).__name__}: {exc}"


class never_raise:  # lower case: it reads as a statement, `with never_raise(run.notes, "..."):`
    """Run a block of ours so that no Exception leaves it.

    `with never_raise(run.notes, "Resources not reported"):` appends "Resources not reported:
    TypeError: ..." to `run.notes` when the block raises; `with never_raise():` drops the error.
    KeyboardInterrupt, SystemExit and other BaseExceptions pass through: they are the user's, as
    is an error a signal handler raised while the block ran (a DataLoader worker died).
    After the block, `guard.error` is the Exception it swallowed (None when the block ran
    through), for a caller that must do one more thing on failure."""

    __slots__ = ("error", "notes", "what")

    def __init__(self, notes: list[str] | None = None, what: str | None = None) -> None:
        self.notes = notes
        self.what = what
        self.error: Exception | None = None

    def __enter__(self) -> never_raise:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if not isinstance(exc, Exception) or raised_by_a_signal_handler(exc):
            return False
        self.error = exc
        if self.notes is not None:
            self.notes.append(f"{self.what}: {failure_text(exc)}" if self.what else failure_text(exc))
        return True


def read_or(default: D, read: Callable[..., T], *args: Any) -> T | D:
    """`read(*args)`, or `default` when it raises an Exception: the one guard for reading the
    user's objects (a loader's settings, a dataset's `__len__`, a property of the user's class),
    whose code may raise anything. Not for our own code: a failure of ours raises to the edge
    that guards it (a hook's entry, the live view's tick, finish, a sampler thread)."""
    try:
        return read(*args)
    except Exception:
        return default
