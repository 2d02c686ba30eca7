"""A training script whose step body uses ``torch.distributed`` the way library code does,
unchanged, run by ``ftmesh launch``: a metric synced with ``dist.all_reduce`` (torchmetrics'
``sync_dist``) and an evaluation gathered with ``dist.all_gather_object``, both inside the
step. Prints one JSON line per committed step (``DIST {...}``) with what torch.distributed
said there, for tests/test_torch_distributed.py."""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

import ftmesh
from ftmesh.torch import ElasticSampler, ElasticTrainer

STEPS = 60
BATCH = 24
PACE_S = 0.05
"""A short pause per step, so that the launcher's kill (it acts on published progress, about
once a second) lands mid-run."""


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(480, 8)
    y = x.sum(1, keepdim=True)
    trainer = ElasticTrainer(ftmesh.connect(), model, optimizer, ElasticSampler(480, BATCH))
    for step in trainer.steps(STEPS):
        with step:
            for idx in step.indices():
                loss = ((model(x[idx]) - y[idx]) ** 2).mean()
                loss.backward()
            # (after the loop: a failed attempt is retried inside it, with a new share)
            seen = step.share
            metric = torch.tensor([float(seen)])
            dist.all_reduce(metric)  # the metric's sync: every member's samples
            gathered: list[object] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, {"rank": dist.get_rank(), "seen": seen})
            optimizer.step()
            time.sleep(PACE_S)
        if step.report is not None and not step.report.adopted:
            print("DIST " + json.dumps({
                "step": step.report.step,
                "initialized": dist.is_initialized(),
                "world": dist.get_world_size(),
                "rank": dist.get_rank(),
                "metric": float(metric[0]),
                "gathered": gathered,
            }), flush=True)  # fmt: skip
    trainer.close()


if __name__ == "__main__":
    main()
