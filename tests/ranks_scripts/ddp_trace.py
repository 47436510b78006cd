"""A torchrun script traced with `trace()` on every rank; rank 1 reads a slow shard.

    torchrun --nproc_per_node 2 tests/ranks_scripts/ddp_trace.py

With `--plain` it is the same DDP script with nothing of traceml in it (traced from a cell's
`!torchrun` by the start-up hook: tests/integration/children/test_children.py).

Rank 0 prints the report with the per-rank table (rank 1 holds the others back: input); every
rank prints one `RANKS <rank> <json>` line with what its `run` holds, and how many collectives
torch.distributed's Python API ran during the steps and at the end of trace().
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

STEPS = 24
SLOW_RANK = 1


class Shard(Dataset[tuple[torch.Tensor, int]]):
    """Each sample takes `sleep_s` to read (a slow disk on one rank)."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return STEPS * 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.randn(64), i % 2


COLLECTIVES = ("all_gather", "all_gather_object", "all_reduce", "broadcast", "barrier", "gather", "reduce", "all_to_all")
calls: list[str] = []


def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return original(*args, **kwargs)

    return collective


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Shard(0.005 if rank == SLOW_RANK else 0.0), batch_size=8)
    if "--plain" in sys.argv:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        dist.destroy_process_group()
        return
    import traceml_jupyter
    from traceml_jupyter.views.display import print_whole

    for name in COLLECTIVES:
        setattr(dist, name, counted(name, getattr(dist, name)))
    with traceml_jupyter.trace("ddp") as run:
        for x, y in run.loop(loader):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        during = list(calls)
    at_end = calls[len(during) :]
    steps = [r["n_steps"] for r in run.result.ranks or []]
    facts = {"straggler": run.straggler, "steps": steps, "during_steps": during, "at_end": at_end}
    # One write: every rank shares torchrun's stdout pipe (see print_whole).
    print_whole(f"RANKS {rank} " + json.dumps(facts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
