"""A worker whose loop does slow work between steps (``tests/test_loop_between_steps.py``).

Trains a small linear model with the loop API on a same-host mesh (``--registry``), and after
chosen committed steps "evaluates": sleeps like a real evaluation would compute, either on the
leader only (``--leader-eval STEP:SECONDS``) or on every member with uneven durations
(``--all-eval STEP:S1,S2,S3``: member i of the start order sleeps Si). ``--die-in STEP`` makes
this worker SIGKILL itself inside the body of that step (before its gradients are reduced), so
the others' attempt fails for a real reason. Prints one JSON line per event: ``step`` (after
the block, with the report), ``eval`` (once per evaluation), ``done`` (the final digest and
weights). ``--single`` trains the same steps in one process (the plain run) and prints ``done``.

Timeouts come from the command line so that the test can make the evaluation longer than the
data plane's ``io_timeout`` and shorter than ``start_wait``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

from ftmesh.collective import CollectiveConfig
from ftmesh.membership.config import MembershipConfig
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.mesh.core import MeshConfig
from ftmesh.net.node import NodeConfig
from ftmesh.torch import ElasticSampler, ElasticTrainer

SAMPLES, FEATURES, CLASSES, BATCH = 96, 8, 3, 12


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(
        0, CLASSES, (SAMPLES,), generator=g
    )


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = torch.nn.Linear(FEATURES, CLASSES)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def schedule(items: list[str]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for item in items:
        step, seconds = item.split(":")
        out[int(step)] = [float(s) for s in seconds.split(",")]
    return out


def single(total: int) -> None:
    x, y = data()
    model, optimizer = model_and_optimizer()
    sampler = ElasticSampler(SAMPLES, BATCH, seed=1)
    for index in range(total):
        idx = torch.as_tensor(sampler.indices(index, ("x",), "x", None))
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    emit({"event": "done", "weights": [float(v) for v in model.weight.detach().flatten()]})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--registry", required=True)
    p.add_argument("--mesh", default="between-steps")
    p.add_argument("--name", default="w")
    p.add_argument("--order", type=int, default=0, help="0-based place in the start order")
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--total", type=int, default=16)
    p.add_argument("--io-timeout", type=float, default=2.0)
    p.add_argument("--start-wait", type=float, default=60.0)
    p.add_argument("--leader-eval", action="append", default=[])
    p.add_argument("--all-eval", action="append", default=[])
    p.add_argument("--die-in", type=int, default=0)
    p.add_argument("--single", action="store_true")
    args = p.parse_args()
    if args.single:
        single(args.total)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    leader_eval = schedule(args.leader_eval)
    all_eval = schedule(args.all_eval)
    config = MeshConfig(
        node=NodeConfig(
            mesh=args.mesh,
            name=args.name,
            discovery="local",
            registry_dir=args.registry,
            # lan: on a loaded CI host the local preset's short probe timeouts suspect members
            # falsely now and then, which fails an attempt as designed (not what is tested)
            membership=MembershipConfig.preset("lan"),
        ),
        collective=CollectiveConfig(
            io_timeout=args.io_timeout,
            view_timeout=5.0,
            max_cached_views=1,
            # (older trees lack the field: the script then shows what they did)
            **({"start_wait": args.start_wait} if hasattr(CollectiveConfig, "start_wait") else {}),
        ),
        role="joining",
    )
    mesh = SyncMesh.start(config)
    x, y = data()
    model, optimizer = model_and_optimizer()
    trainer = ElasticTrainer(
        mesh,
        model,
        optimizer,
        ElasticSampler(SAMPLES, BATCH, seed=1),
        start_peers=args.peers,
        start_timeout=120.0,
        quorum="any",
    )
    for step in trainer.steps(args.total):
        with step:
            if step.number == args.die_in:
                os.kill(os.getpid(), signal.SIGKILL)
            for idx in step.indices():
                i = torch.as_tensor(idx)  # the mean loss of a micro-batch, as in one process
                F.cross_entropy(model(x[i]), y[i]).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        # Code after the block: once per committed step.
        report = step.report
        emit(
            {
                "event": "step",
                "name": args.name,
                "step": step.number,
                "committed": report is not None,
                "attempts": report.attempts if report is not None else 0,
                "adopted": bool(report is not None and report.adopted),
                "leader": step.is_leader,
            }
        )
        seconds = 0.0
        if step.number in leader_eval and step.is_leader:
            seconds = leader_eval[step.number][0]
        elif step.number in all_eval:
            seconds = all_eval[step.number][args.order]
        if seconds:
            emit({"event": "eval", "name": args.name, "step": step.number, "seconds": seconds})
            time.sleep(seconds)  # an evaluation: the training thread is busy
    trainer.finish()
    emit(
        {
            "event": "done",
            "name": args.name,
            "committed": trainer.committed,
            "recoveries": trainer.recoveries,
            "digest": trainer.digest(),
            "weights": [float(v) for v in model.weight.detach().flatten()],
        }
    )
    trainer.close()
    mesh.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
