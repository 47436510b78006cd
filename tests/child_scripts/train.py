"""A training script written the way tutorials write one (argparse, main(), its DataLoader local
to main), run by the tests as a child process: `python train.py --sleep-ms 2 --steps 30`.

--sleep-ms    each sample sleeps this long in __getitem__ (a slow loader: input-bound)
--work        matrix products per step (compute)
--crash-at N  raise at step N (a crashing child)
--exit N      sys.exit(N) after training
--linger S    sleep S seconds after training (a child that outlives its cell)
--forever     train until stopped (the stop button)
--workers N   DataLoader num_workers
--done FILE   write "done" to FILE at the end (the child finished normally)
--quit N      open the loader, then sys.exit(N) before the first batch (a child that exits early)
--truth FILE  time each fetch and step by hand and write them to FILE as JSON (ground truth)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowSamples(Dataset):
    def __init__(self, n: int, sleep_s: float) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.sleep_s)  # stands in for decoding an image
        return torch.randn(32), i % 2


def timed(loader, waits: list) -> object:
    """The loader's batches, the time blocked in each next() appended to `waits` (ms)."""
    it = iter(loader)
    while True:
        began = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        waits.append((time.perf_counter() - began) * 1e3)
        yield batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--work", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--forever", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--done", default=None)
    parser.add_argument("--truth", default=None)
    parser.add_argument("--quit", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(SlowSamples(args.steps * args.batch, args.sleep_ms / 1000), batch_size=args.batch, num_workers=args.workers)
    if args.quit is not None:
        iter(loader)
        sys.exit(args.quit)
    heavy = torch.randn(256, 256)
    step = 0
    waits: list[float] = []
    ends = [time.perf_counter()]
    while True:
        for x, y in timed(loader, waits) if args.truth else loader:
            if step == args.crash_at:
                raise RuntimeError(f"corrupt batch at step {step}")
            for _ in range(args.work):
                heavy = torch.tanh(heavy @ heavy / 256)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            ends.append(time.perf_counter())
        if not args.forever:
            break
    print(f"trained {step} steps", flush=True)
    if args.truth:
        steps = [(b - a) * 1e3 for a, b in zip(ends, ends[1:], strict=False)]
        with open(args.truth, "w") as fh:
            json.dump({"wait_ms": waits, "step_ms": steps}, fh)
    time.sleep(args.linger)
    if args.done:
        with open(args.done, "w") as fh:
            fh.write("done")
    if args.exit:
        sys.exit(args.exit)


if __name__ == "__main__":
    main()
