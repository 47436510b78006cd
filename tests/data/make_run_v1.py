"""How tests/data/run_v1.json was made: a real traced cell in an IPython shell, saved with
`--save` by the code of main at 75fa314 (schema_version 1), before saved runs could be loaded.

    git worktree add /tmp/v1 75fa314 && cd /tmp/v1 && python tests/data/make_run_v1.py OUT.json
"""

from __future__ import annotations

import sys

from IPython.testing.globalipapp import get_ipython

SETUP = """\
import time
import torch
from torch.utils.data import DataLoader, Dataset

class SlowDataset(Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        time.sleep(0.002)  # stands in for decoding an image
        return torch.randn(16), i % 2

loader = DataLoader(SlowDataset(), batch_size=4, num_workers=0)
model = torch.nn.Linear(16, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.CrossEntropyLoss()
"""

CELL = """\
for x, y in loader:
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
"""


def main(out: str) -> None:
    ip = get_ipython()
    ip.run_line_magic("load_ext", "traceml_jupyter")
    ip.run_cell(SETUP)
    ip.run_cell_magic("traceml", f"--name slow --no-live --save {out}", CELL)


if __name__ == "__main__":
    main(sys.argv[1])
