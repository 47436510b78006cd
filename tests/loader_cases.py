"""Loaders built to each case of the inside-the-loader watch (tests/integration/shell/
test_loader_inside.py, tests/benchmarks/bench_loader_inside.py): a module, so that spawned
workers import it. Each dataset and collate writes its own timings (monotonic ns, the clock
the watch uses) to a file of its process in `log_dir`: the figures the tests judge ours by."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info


def _log(log_dir: str | None, kind: str, key: int, t0: int, t1: int) -> None:
    if log_dir is None:
        return
    with open(os.path.join(log_dir, f"{kind}-{os.getpid()}.txt"), "a") as f:
        f.write(f"{key} {t0} {t1}\n")


def own_timings(log_dir: str, kind: str) -> list[tuple[int, int, int]]:
    """(key, start, end) of every call the test's own code timed (kind: getitem or collate)."""
    out = []
    for name in os.listdir(log_dir):
        if name.startswith(kind + "-"):
            with open(os.path.join(log_dir, name)) as f:
                out += [tuple(int(v) for v in line.split()) for line in f if line.strip()]
    return out  # type: ignore[return-value]


class Samples(Dataset[Any]):
    """`n` samples of `shape` (float32, random: torch's generator in the worker), each `ms` of
    sleep; the `slow` indices `slow_ms`; worker `slow_worker` (its id) `worker_ms` more."""

    def __init__(self, n: int, ms: float = 0.0, shape: tuple[int, ...] = (8,), slow: tuple[int, ...] = (),
                 slow_ms: float = 0.0, slow_worker: int | None = None, worker_ms: float = 0.0,
                 log_dir: str | None = None) -> None:  # fmt: skip
        self.n, self.ms, self.shape, self.slow, self.slow_ms = n, ms, shape, set(slow), slow_ms
        self.slow_worker, self.worker_ms, self.log_dir = slow_worker, worker_ms, log_dir

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        t0 = time.monotonic_ns()
        wait = self.ms + (self.slow_ms if i in self.slow else 0.0)
        info = get_worker_info()
        if info is not None and info.id == self.slow_worker:
            wait += self.worker_ms
        if wait:
            time.sleep(wait / 1000)
        x = torch.rand(self.shape)  # the worker's random state: the same batches bit for bit
        _log(self.log_dir, "getitem", i, t0, time.monotonic_ns())
        return x, i % 2


class Batched(Samples):
    """Samples read a batch at a time (`__getitems__`, as a database query reads them)."""

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        return [self[i] for i in indices]


class Stream(IterableDataset[Any]):
    """An IterableDataset whose shards are uneven: worker k gets `sizes[k]` items of `ms` each."""

    def __init__(self, sizes: tuple[int, ...], ms: float, log_dir: str | None = None) -> None:
        self.sizes, self.ms, self.log_dir = sizes, ms, log_dir

    def __iter__(self) -> Any:
        info = get_worker_info()
        k = info.id if info is not None else 0
        for i in range(self.sizes[k]):
            t0 = time.monotonic_ns()
            time.sleep(self.ms / 1000)
            _log(self.log_dir, "getitem", k * 100_000 + i, t0, time.monotonic_ns())
            yield torch.full((8,), float(i)), k


class Dying(Dataset[Any]):
    """`n` samples of 1 ms; the worker that loads sample `at` fails there as `how` says: "exit"
    (os._exit(3)), "kill" (SIGKILL itself, as the OOM killer does), "segv" (SIGSEGV, as a native
    library's crash), "raise" (ValueError), "hang" (sleeps `hang_s`). Before it fails it writes
    its pid and worker id to `log_dir`/dying-<pid>.txt (the test knows who it was), then waits
    `delay_s`: the loop waits for that batch in torch's code by then, as in a run without traceml."""

    def __init__(self, n: int, at: int, how: str, log_dir: str, hang_s: float = 30.0, delay_s: float = 0.5) -> None:
        self.n, self.at, self.how, self.log_dir, self.hang_s, self.delay_s = n, at, how, log_dir, hang_s, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.001)
        if i == self.at:
            info = get_worker_info()
            with open(os.path.join(self.log_dir, f"dying-{os.getpid()}.txt"), "w") as f:
                f.write(f"{os.getpid()} {info.id if info is not None else -1} {i}\n")
            time.sleep(self.delay_s)  # (the loop is waiting for this batch by then, in torch's code)
            if self.how == "exit":
                os._exit(3)
            if self.how in ("kill", "segv"):
                os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGSEGV)
            if self.how == "hang":
                time.sleep(self.hang_s)
            raise ValueError(f"sample {i} is corrupt")
        return torch.full((4,), float(i))


class SlowCollate:
    """torch's default collate, then `ms` of sleep (padding, tokenising)."""

    def __init__(self, ms: float, log_dir: str | None = None) -> None:
        self.ms, self.log_dir = ms, log_dir

    def __call__(self, batch: Any) -> Any:
        t0 = time.monotonic_ns()
        out = torch.utils.data.default_collate(batch)
        time.sleep(self.ms / 1000)
        _log(self.log_dir, "collate", len(batch), t0, time.monotonic_ns())
        return out


class CountInits:
    """A user's worker_init_fn: notes each call in `log_dir` (the test counts them)."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def __call__(self, worker_id: int) -> None:
        with open(os.path.join(self.log_dir, f"init-{os.getpid()}.txt"), "a") as f:
            f.write(f"{worker_id}\n")


class Buckets(Sampler[list[int]]):
    """A batch sampler of the kind that groups samples by length: batches of `sizes` in turn
    over `n` samples, in an order of its own (odd indices first), as lists of indices."""

    def __init__(self, n: int, sizes: tuple[int, ...]) -> None:
        self.n, self.sizes = n, sizes

    def __iter__(self) -> Iterator[list[int]]:
        order = [*range(1, self.n, 2), *range(0, self.n, 2)]
        k = 0
        while order:
            size = self.sizes[k % len(self.sizes)]
            yield order[:size]
            order, k = order[size:], k + 1

    def __len__(self) -> int:
        return sum(1 for _ in self)


def loader(dataset: Any, **settings: Any) -> DataLoader[Any]:
    """A DataLoader over `dataset` with a seeded generator: the same batches each time it is built."""
    settings.setdefault("generator", torch.Generator().manual_seed(0))
    return DataLoader(dataset, **settings)
