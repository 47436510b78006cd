"""A failure of ours never reaches the user's code: `never_raise` runs a block of ours and turns
an Exception it raises into a note on the run (or drops it, where a note would be noise).

It imports nothing of the package, so every layer (capture, analysis, the run, the views, the
orchestration) uses the same guard. Not for the per-step hot path: a `with` costs about 0.1 µs,
so hooks that run every step keep their own try/except."""

from __future__ import annotations

from types import TracebackType


def failure_text(exc: BaseException) -> str:
    """An error as notes quote it: "TypeError: what it said"."""
    return f"{type(exc).__name__}: {exc}"


class never_raise:  # lower case: it reads as a statement, `with never_raise(run.notes, "..."):`
    """Run a block of ours so that no Exception leaves it.

    `with never_raise(run.notes, "Resources not reported"):` appends "Resources not reported:
    TypeError: ..." to `run.notes` when the block raises; `with never_raise():` drops the error.
    KeyboardInterrupt, SystemExit and other BaseExceptions pass through: they are the user's.
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
        if not isinstance(exc, Exception):
            return False
        self.error = exc
        if self.notes is not None:
            self.notes.append(f"{self.what}: {failure_text(exc)}" if self.what else failure_text(exc))
        return True
