"""Ground truth measured by hand, independently of traceml's capture: a plain run of the same cell
with `next()` of every DataLoader iterator (and any function we choose) timed by a wrapper the test
installs, and every optimizer step seen through torch's global hook."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data.dataloader import _BaseDataLoaderIter


@dataclass
class Truth:
    fetches: list[tuple[Any, float, float]] = field(default_factory=list)  # (key, t0, t1)
    steps: list[tuple[int, float]] = field(default_factory=list)  # (id(optimizer), t)

    def timed(self, key: Any, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func` with each call recorded as a fetch of `key` (for `get_batch` and the like)."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.fetches.append((key, t0, time.perf_counter()))

        return wrapper

    def step_ends(self) -> list[float]:
        """End times of the first optimizer's steps."""
        first = self.steps[0][0]
        return [t for opt, t in self.steps if opt == first]

    def wait_share(self, key: Any, skip: int = 2, phases: tuple[Any, ...] = ()) -> float:
        """Median over the steps (from one optimizer step to the next) of the time in `key`'s
        fetches over the step's time, the span of `phases`' fetches taken out of the step."""
        ends = self.step_ends()
        shares = []
        for a, b in zip(ends, ends[1:], strict=False):
            wait = sum(t1 - t0 for k, t0, t1 in self.fetches if k == key and a <= t0 < b)
            kept_out = [(t0, t1) for k, t0, t1 in self.fetches if k in phases and a <= t0 < b]
            span = max(t1 for _, t1 in kept_out) - min(t0 for t0, _ in kept_out) if kept_out else 0.0
            shares.append(wait / (b - a - span))
        return statistics.median(shares[skip:])

    def passes(self, key: Any) -> list[tuple[float, float, float]]:
        """Each pass over `key`: (start, end, time in its fetches), a pass being its fetches
        with no other loader's fetch and no optimizer step between them (its last fetch is the
        one that raised StopIteration)."""
        events = sorted(
            [(t0, t1, k == key) for k, t0, t1 in self.fetches] + [(t, t, False) for _, t in self.steps]
        )
        out: list[tuple[float, float, float]] = []
        current: list[float] | None = None
        for t0, t1, mine in events:
            if mine:
                current = [t0, t1, 0.0] if current is None else current
                current[1] = t1
                current[2] += t1 - t0
            elif current is not None:
                out.append((current[0], current[1], current[2]))
                current = None
        if current is not None:
            out.append((current[0], current[1], current[2]))
        return out

    def span(self) -> float:
        """From the first fetch or step to the last."""
        times = [t for _, t0, t1 in self.fetches for t in (t0, t1)] + [t for _, t in self.steps]
        return max(times) - min(times)

    def total(self, key: Any) -> float:
        return sum(t1 - t0 for k, t0, t1 in self.fetches if k == key)


def dataset_key(iterator: Any) -> Any:
    return id(getattr(iterator, "_dataset", None))


@contextmanager
def hand_timed() -> Iterator[Truth]:
    """Record every DataLoader `next()` (keyed by the id of its dataset) and optimizer step."""
    truth = Truth()
    original = _BaseDataLoaderIter.__dict__["__next__"]

    def __next__(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            truth.fetches.append((dataset_key(self), t0, time.perf_counter()))

    def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
        truth.steps.append((id(optimizer), time.perf_counter()))

    _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]
    handle = register_optimizer_step_post_hook(stepped)
    try:
        yield truth
    finally:
        _BaseDataLoaderIter.__next__ = original  # type: ignore[method-assign]
        handle.remove()
