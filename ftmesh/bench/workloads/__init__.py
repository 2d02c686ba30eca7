"""Models, synthetic data and progress records shared by the benchmark workers.

The worker scripts in this package run as separate processes started by ``ftmesh bench
recovery`` and ``ftmesh bench train``; they report to the benchmark with lines
``FTMESH {json}`` on stdout (the ``ftmesh launch`` convention), each record carrying ``t``, the
worker's ``time.monotonic()``, which on Linux is the same clock in every process of the host.

Models:

* ``mlp``: a 3-layer MLP on ``IN_DIM``-dimensional synthetic inputs whose hidden width is
  chosen so that model + SGD momentum state serialize to about ``state_mb`` MiB
  (:func:`mlp_hidden_for`).
* ``digits``: the small CNN of ``examples/train_digits.py`` (about 14k parameters) on
  synthetic 8x8 images: a model where communication hardly matters.
* ``wide``: a 4-layer 1024-wide MLP (about 4.2M parameters): a model where it does.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import LocalUsageError

PROGRESS_PREFIX = "FTMESH "
IN_DIM = 256
CLASSES = 10
LR = 0.01
MOMENTUM = 0.9


def progress(record: dict[str, Any]) -> None:
    """Print one progress record, stamped with this process's monotonic clock."""
    line = PROGRESS_PREFIX + json.dumps({"t": time.monotonic(), **record}) + "\n"
    sys.stdout.write(line)  # one write: print() writes the newline separately
    sys.stdout.flush()


def mlp_hidden_for(state_mb: float) -> int:
    """Hidden width ``h`` of :func:`make_mlp` whose model + momentum state is ``state_mb``
    MiB: params = IN_DIM*h + h + h*h + h + h*CLASSES + CLASSES, state = 2 * 4 * params."""
    params = max(state_mb, 0.05) * (1 << 20) / 8
    a, b, c = 1.0, IN_DIM + CLASSES + 2.0, CLASSES - params
    return max(8, round((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))


class DigitsNet(nn.Module):
    """The CNN of ``examples/train_digits.py``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        out: torch.Tensor = self.fc2(F.relu(self.fc1(x.flatten(1))))
        return out


def make_model(kind: str, state_mb: float = 16.0, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        h = mlp_hidden_for(state_mb)
        return nn.Sequential(
            nn.Linear(IN_DIM, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, CLASSES)
        )
    if kind == "wide":
        w = 1024
        return nn.Sequential(
            nn.Linear(w, w),
            nn.ReLU(),
            nn.Linear(w, w),
            nn.ReLU(),
            nn.Linear(w, w),
            nn.ReLU(),
            nn.Linear(w, w),
            nn.ReLU(),
            nn.Linear(w, CLASSES),
        )
    if kind == "digits":
        return DigitsNet()
    raise LocalUsageError(f"unknown model {kind!r}; use mlp, wide or digits")


def make_data(kind: str, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic, learnable classification set for ``kind`` (labels from a fixed random
    linear teacher), identical in every process for the same seed."""
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "digits":
        x = torch.rand(n, 1, 8, 8, generator=g)
    elif kind == "wide":
        x = torch.randn(n, 1024, generator=g)
    else:
        x = torch.randn(n, IN_DIM, generator=g)
    teacher = torch.randn(x[0].numel(), CLASSES, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    return x, y


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
