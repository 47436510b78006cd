"""never_raise: a failure of ours inside the block becomes a note (or nothing); the user's
interrupts and exits pass through; the block's own result is untouched."""

from __future__ import annotations

import pytest

from traceml_jupyter.failures import failure_text, never_raise, read_or


def test_an_error_in_the_block_becomes_a_note_in_the_words_users_read() -> None:
    notes: list[str] = []
    with never_raise(notes, "Resources not reported") as guard:
        raise ValueError("no psutil handle")
    assert notes == ["Resources not reported: ValueError: no psutil handle"]
    assert isinstance(guard.error, ValueError)


def test_without_notes_the_error_is_dropped_and_without_what_the_note_is_the_error() -> None:
    with never_raise() as guard:
        {}["missing"]
    assert isinstance(guard.error, KeyError)
    notes: list[str] = []
    with never_raise(notes):
        raise OSError("gone")
    assert notes == ["OSError: gone"]


def test_a_block_that_runs_through_leaves_no_note_and_its_result_stands() -> None:
    notes: list[str] = []

    def read() -> int:
        with never_raise(notes, "not read"):
            return 42
        return -1  # only after a failure

    def fails() -> int:
        with never_raise(notes, "not read"):
            raise RuntimeError("nvml")
        return -1

    assert read() == 42
    assert notes == []
    assert fails() == -1
    assert notes == ["not read: RuntimeError: nvml"]
    with never_raise(notes, "unused") as guard:
        pass
    assert guard.error is None and len(notes) == 1


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_the_users_interrupts_and_exits_pass_through(kind: type[BaseException]) -> None:
    notes: list[str] = []
    with pytest.raises(kind), never_raise(notes, "never written"):
        raise kind()
    assert notes == []


def test_failure_text_is_the_kind_and_the_message() -> None:
    assert failure_text(TypeError("bad operand")) == "TypeError: bad operand"
    assert failure_text(KeyError("x")) == "KeyError: 'x'"


class Loader:
    """A user's object whose reads fail the way users' objects do."""

    @property
    def num_workers(self) -> int:
        raise RuntimeError("not set up yet")

    def __len__(self) -> int:
        raise TypeError("an IterableDataset has no len")


def test_a_read_of_the_users_object_that_raises_gives_the_default() -> None:
    loader = Loader()
    assert read_or(None, lambda: loader.num_workers) is None
    assert read_or(-1, len, loader) == -1
    assert read_or(None, len, [1, 2, 3]) == 3  # a read that works gives its value


def test_a_read_lets_the_users_interrupt_through() -> None:
    def interrupted() -> int:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        read_or(None, interrupted)


def test_an_error_a_signal_handler_raised_inside_the_block_is_the_users() -> None:
    # torch's SIGCHLD handler raises "DataLoader worker (pid X) is killed by signal" wherever the
    # main thread is when a worker dies: inside a block of ours, it must reach the user's cell.
    import signal

    def handler(signum: int, frame: object) -> None:
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")

    previous = signal.signal(signal.SIGUSR1, handler)
    notes: list[str] = []
    try:
        with pytest.raises(RuntimeError, match="pid 4242"), never_raise(notes, "The live view stopped"):
            signal.raise_signal(signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert notes == []
    with never_raise(notes, "still ours"):  # (the handler gone: an error of ours is ours again)
        raise RuntimeError("ours")
    assert notes == ["still ours: RuntimeError: ours"]
