"""The notebook cell that defines forked DDP training (two gloo ranks on 127.0.0.1, rank 1's
shard slow to read when asked): shared by the kernel tests (integration/ranks/test_ranks.py)
and the browser's (integration/browser/test_ranks_browser.py)."""

from __future__ import annotations

SETUP = '''\
%load_ext traceml_jupyter
import json, os, socket, threading, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
import traceml_jupyter

STEPS = 30

class Shard(Dataset):
    """Each sample takes `sleep_s` to read (a slow disk on one rank)."""
    def __init__(self, sleep_s):
        self.sleep_s = sleep_s
    def __len__(self):
        return STEPS * 8
    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.randn(64), i % 2

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def train(rank, world, port, sleep_s, fail_at=None):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step, (x, y) in enumerate(DataLoader(Shard(sleep_s[rank]), batch_size=8)):
            if step == fail_at and rank == 1:
                raise ValueError("rank 1 cannot read its shard")
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    finally:
        dist.destroy_process_group()'''
