"""``train_digits.py``'s model and data, written as a Lightning Fabric script, elastic on the
mesh through ``ftmesh.lightning.FtmeshStrategy``:

    ftmesh launch -n 3 --kill-at 20 --join-at 40 examples/fabric_digits.py

The script keeps its own loop, Fabric-style (``fabric.setup``, ``fabric.backward``,
``fabric.all_reduce``); the strategy turns it into ``ElasticTrainer`` steps: each step's
global batch is split over the members alive, a member that dies mid-step has its share redone
by the others, a joiner fetches the state and goes on where the mesh is. Each step's global
batch holds the samples ``train_digits.py --single`` trains on at that step, so it ends at
that accuracy, up to float summation order (the last line is ``test accuracy: 0.NNN``). With
``--single`` it runs on Fabric's default single-device strategy in one process, no mesh.
Needs Lightning: ``pip install 'ftmesh[lightning]'``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from ftmesh.lightning import FtmeshStrategy
from ftmesh.state import State
from ftmesh.torch import ElasticSampler, ElasticTrainer, StepReport
from lightning.fabric import Fabric

from train_digits import DigitsNet, evaluation, load_data


def progress(record: dict[str, object]) -> None:
    """A line ``ftmesh launch`` reads (kills and joins by step) and tests check."""
    sys.stdout.write("FTMESH " + json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.03, help="seconds to sleep per step")
    p.add_argument("--single", action="store_true", help="one process, no mesh")
    args = p.parse_args()
    logging.basicConfig(level=os.environ.get("FTMESH_LOG", "WARNING"))

    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    sampler = ElasticSampler(len(x_train), args.global_batch, seed=args.seed)
    total = args.epochs * sampler.steps_per_epoch

    def loss_of(model: torch.nn.Module, idx: np.ndarray) -> torch.Tensor:
        i = torch.from_numpy(idx)
        return F.cross_entropy(model(x_train[i]), y_train[i])

    strategy = None if args.single else FtmeshStrategy(sampler)
    fabric = Fabric(accelerator="cpu", **({"strategy": strategy} if strategy else {}))
    fabric.launch()
    net = DigitsNet()
    model, optimizer = fabric.setup(
        net, torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    )

    if strategy is None:
        for n in range(total):
            optimizer.zero_grad()
            fabric.backward(loss_of(model, sampler.global_indices(n)))
            optimizer.step()
    else:
        seen: list[int] = []  # the step's all-reduced sample count (computed in its body)

        def report(trainer: ElasticTrainer, r: StepReport) -> None:
            """One line per step committed or adopted (a joiner's first step is adopted by
            its sync, before any body runs)."""
            progress(
                {
                    "step": r.step,
                    "total": total,
                    "loss": round(r.loss, 4),
                    "samples": r.samples,
                    "seen": None if r.adopted or not seen else seen[-1],
                    "members": len(r.members),
                    "share": r.share,
                    "synced": r.synced,
                    "adopted": r.adopted,
                    "rank": fabric.global_rank,
                    "world": fabric.world_size,
                    "node": trainer.mesh.node_id,
                    "digest": trainer.digest(),
                }
            )
            seen.clear()

        strategy.trainer.add_step_hook(report)
        for step in strategy.steps(total):
            with step:
                for idx in step.indices():  # this member's share (redone on a retry)
                    loss = loss_of(model, idx)
                    step.record_loss(loss)
                    fabric.backward(loss)
                # a metric synced over the step's members (a failure fails the attempt)
                n = fabric.all_reduce(torch.tensor([float(step.share)]), reduce_op="sum")
                seen[:] = [int(n[0])]
                optimizer.step()  # the gradients are the mean over the whole global batch
            if step.report is None:  # the attempt failed in the all_reduce: it comes back
                continue
            if args.step_delay:
                time.sleep(args.step_delay)
        trainer = strategy.trainer
        trainer.finish()
        progress({"done": True, "step": trainer.committed, "digest": trainer.digest()})
    final = State(model=net, optimizer=optimizer.optimizer, rng=False).live_digest()
    print(f"trained {total} steps; final digest {final}")
    print(f"test accuracy: {evaluation(net, x_test, y_test)['accuracy']:.3f}", flush=True)
    if strategy is not None:
        strategy.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
