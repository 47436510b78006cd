"""A model whose call costs about `ms`: the step-parts tests' forward, in a unit test or in a
traced cell's namespace."""

from __future__ import annotations

import time

import torch
from torch import nn


class Sleepy(nn.Module):
    """A model whose call costs about `ms`."""

    def __init__(self, ms: float = 0.0) -> None:
        super().__init__()
        self.ms = ms
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, extra_ms: float = 0.0) -> torch.Tensor:
        if self.ms or extra_ms:
            time.sleep((self.ms + extra_ms) / 1000)
        return self.fc(x)
