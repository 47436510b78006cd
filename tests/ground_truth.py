"""Ground truth measured by hand, independently of traceml's capture: a plain run of the same cell
with `next()` of every DataLoader iterator (and any function we choose) timed by a wrapper the test
installs, and every optimizer step seen through torch's global hook. On request also the parts of
the step: the calls of the modules of the classes named (torch's global module hooks, in the plain
run only), every `torch.autograd.backward`, and every optimizer step from its global pre hook to
its post hook (a closure passed to it timed apart, as forward and backward run inside it)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data.dataloader import _BaseDataLoaderIter

PART_KINDS = ("forward", "backward", "optimizer")


@dataclass
class Truth:
    fetches: list[tuple[Any, float, float]] = field(default_factory=list)  # (key, t0, t1)
    steps: list[tuple[int, float]] = field(default_factory=list)  # (id(optimizer), t)
    parts: list[tuple[str, float, float]] = field(default_factory=list)  # (kind, t0, t1); kind "closure" is no part

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

    def _own_parts(self) -> list[tuple[str, float, float]]:
        """Each timed call's own time: its span less the spans of the calls nested in it."""
        calls = sorted(self.parts, key=lambda p: (p[1], -p[2]))
        own = [t1 - t0 for _, t0, t1 in calls]
        open_: list[int] = []
        for i, (_, t0, t1) in enumerate(calls):
            while open_ and calls[open_[-1]][2] <= t0:
                open_.pop()
            if open_:
                own[open_[-1]] -= t1 - t0
            open_.append(i)
        return [(kind, t0, o) for (kind, t0, _), o in zip(calls, own, strict=True)]

    def part_shares(self, skip: int = 2) -> dict[str, float]:
        """Median over the steps (from one step of the first optimizer to the next) of each
        part's own time over the step's time; "rest" is the step less data wait and the parts."""
        ends = self.step_ends()
        own = self._own_parts()
        shares: dict[str, list[float]] = {k: [] for k in (*PART_KINDS, "rest")}
        for a, b in zip(ends, ends[1:], strict=False):
            step = b - a
            wait = sum(t1 - t0 for _, t0, t1 in self.fetches if a <= t0 < b)
            parts = {k: sum(o for kind, t0, o in own if kind == k and a <= t0 < b) for k in PART_KINDS}
            for k, v in parts.items():
                shares[k].append(v / step)
            shares["rest"].append((step - wait - sum(parts.values())) / step)
        return {k: statistics.median(v[skip:]) for k, v in shares.items()}


def dataset_key(iterator: Any) -> Any:
    return id(getattr(iterator, "_dataset", None))


@contextmanager
def hand_timed(forward_of: Iterable[str] = ()) -> Iterator[Truth]:
    """Record every DataLoader `next()` (keyed by the id of its dataset) and optimizer step;
    with `forward_of` (class names) also the parts of the steps (see the module docstring)."""
    truth = Truth()
    original = _BaseDataLoaderIter.__dict__["__next__"]
    classes = set(forward_of)
    handles: list[Any] = []
    if classes:
        handles = _time_parts(truth, classes)

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
        for h in handles:
            h.remove()


def _time_parts(truth: Truth, classes: set[str]) -> list[Any]:
    """Hooks and a wrapper that time forward, backward and optimizer steps into `truth`; the
    handles to remove (the backward wrapper is one of them)."""
    started: dict[int, float] = {}
    optimizers: list[float] = []

    def pre(module: Any, args: Any) -> None:
        if type(module).__name__ in classes:
            started[id(module)] = time.perf_counter()

    def post(module: Any, args: Any, out: Any) -> None:
        t0 = started.pop(id(module), None)
        if t0 is not None:
            truth.parts.append(("forward", t0, time.perf_counter()))

    original_backward = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original_backward(*args, **kwargs)
        finally:
            truth.parts.append(("backward", t0, time.perf_counter()))

    def opt_pre(optimizer: Any, args: Any, kwargs: Any) -> Any:
        optimizers.append(time.perf_counter())
        closure = kwargs.get("closure") if kwargs else (args[1] if len(args) > 1 else None)
        if closure is None:
            return None

        def timed() -> Any:
            t0 = time.perf_counter()
            try:
                return closure()
            finally:
                truth.parts.append(("closure", t0, time.perf_counter()))

        if kwargs.get("closure") is not None:
            return args, {**kwargs, "closure": timed}
        return (args[0], timed, *args[2:]), kwargs

    def opt_post(optimizer: Any, args: Any, kwargs: Any) -> None:
        truth.parts.append(("optimizer", optimizers.pop(), time.perf_counter()))

    class Restore:
        def remove(self) -> None:
            torch.autograd.backward = original_backward

    torch.autograd.backward = backward
    return [
        register_module_forward_pre_hook(pre),
        register_module_forward_hook(post, always_call=True),
        register_optimizer_step_pre_hook(opt_pre),
        register_optimizer_step_post_hook(opt_post),
        Restore(),
    ]
