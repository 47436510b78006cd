"""A plain DistributedDataParallel script (no traceml in it); rank 1 reads a slow shard.

    torchrun --nproc_per_node 2 tests/child_scripts/ddp_train.py

Traced from a cell (`!torchrun ...` under %%traceml) or `traceml-jupyter run -- torchrun ...`:
rank 0 waits for rank 1 in backward's all-reduce, RANK STRAGGLER names rank 1 (input).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

STEPS = 24
SLOW_RANK = 1


class Shard(Dataset):
    """Each sample takes `sleep_s` to read (a slow disk on one rank)."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return STEPS * 8

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.randn(64), i % 2


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Shard(0.005 if rank == SLOW_RANK else 0.0), batch_size=8)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
