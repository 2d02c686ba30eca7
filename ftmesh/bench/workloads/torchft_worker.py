"""The torchft side of ``ftmesh bench recovery``: one torchft replica group of one process,
training the same MLP on the same synthetic data with the same global batch, split and
optimizer as ``mlp_worker``; or, with ``--lighthouse``, torchft's lighthouse.

Standalone. This file runs under the interpreter of a *separate* virtual environment where
torchft is installed (``--torchft-python``), which has torch and NumPy but not ftmesh: the
model, data and sample order of ``ftmesh.bench.workloads`` / ``ElasticSampler`` are repeated
here (same seeds, same arithmetic, so the same numbers), and nothing from ftmesh is imported.

Theory of operation. torchft's contract per step (``torchft.Manager``): ``start_quorum`` asks
the replica's ``ManagerServer`` (in this process) for a quorum, which asks the lighthouse; the
lighthouse answers once every member of the previous quorum has asked again ("fast quorum"),
or, when one is missing, once it stops heartbeating (``heartbeat_timeout_ms``) or
``join_timeout_ms`` after the first asked, whichever comes first. On a new quorum the
reconfigurable gloo process group (``torchft.ProcessGroupGloo``: torchft's CPU choice in its
``train_ddp`` example; ``ProcessGroupBabyGloo`` would start a subprocess at every
reconfiguration, seconds of torch import here) is rebuilt on a store of the quorum, and a
replica behind the others heals: it fetches the state from a peer over HTTP
(``HTTPTransport``) and loads it. Then forward, backward, one flat gradient allreduce through
``Manager.allreduce`` (averaged over the participants: one bucket, as DDP's would be for this
model), and ``should_commit``: the step commits (the optimizer steps) only when nothing failed.
A killed peer makes the allreduce fail (its sockets close) or time out (the process group's
``--pg-timeout``); the step does not commit and the next ``start_quorum`` waits for the
lighthouse to drop the dead replica.

Tuned settings (what the bench passes; torchft's defaults in brackets), chosen for fast
recovery on one host from the knobs torchft documents (``torchft_lighthouse --help``, the
``Manager`` docstring; its own lighthouse tests use a 100 ms join timeout): lighthouse
``min_replicas=1`` (a quorum of the survivors is valid), ``quorum_tick_ms=10`` [100],
``join_timeout_ms=100`` [60000] (how long a quorum waits for a replica that heartbeats but has
not asked), ``heartbeat_timeout_ms=500`` [5000]; manager ``heartbeat_interval=50 ms`` [100 ms],
``min_replica_size=1``, ``use_async_quorum=False`` (a joiner heals *before* its first forward
pass and trains in its first committed step, as an ftmesh joiner does; with the async default
its first step would only heal), ``init_sync=False`` (every replica builds the same model from
the same seed), ``timeout=5 s`` [60 s] for RPCs and the checkpoint fetch, process group timeout
``1 s`` [60 s]: a survivor whose ring neighbour is alive but gave up on the step waits for it
(that neighbour's sockets stay open until its next quorum), so this timeout bounds the wait;
the lighthouse's majority rule (a quorum needs more than half the heartbeating replicas) makes
the others wait for such a survivor too.

Records (``FTMESH {json}`` lines on stdout, each with ``t``, this process's
``time.monotonic()``): a ``hello`` with ``t_start`` (before importing torch), ``t_imported``
(torch and torchft imported), ``t_model`` (model, optimizer and data built: torch's first
operations) and ``t_connected`` (the store, the process group and the manager with its server
up); then one record per committed step: ``step`` (torchft's step count after it), ``world``
(participating replicas), ``participating``, ``healed`` (this step's quorum made it fetch the
state), ``attempts`` (this step's tries, 1: no failed try before it), ``quorum_id`` and
``pid``. The lighthouse prints ``{"lighthouse": address}`` once it listens.
"""

from __future__ import annotations

import time

T_START = time.monotonic()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # noqa: E402
from torchft import Manager, ProcessGroupGloo  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

T_IMPORTED = time.monotonic()

PROGRESS_PREFIX = "FTMESH "
IN_DIM = 256  # as ftmesh.bench.workloads
CLASSES = 10
LR = 0.01
MOMENTUM = 0.9


def progress(record: dict[str, Any]) -> None:
    """One progress record on stdout, in one write."""
    sys.stdout.write(PROGRESS_PREFIX + json.dumps({"t": time.monotonic(), **record}) + "\n")
    sys.stdout.flush()


def mlp_hidden_for(state_mb: float) -> int:
    """``ftmesh.bench.workloads.mlp_hidden_for``: the hidden width for ``state_mb`` MiB."""
    params = max(state_mb, 0.05) * (1 << 20) / 8
    a, b, c = 1.0, IN_DIM + CLASSES + 2.0, CLASSES - params
    return max(8, round((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))


def make_model(state_mb: float, seed: int) -> nn.Module:
    """``make_model("mlp", state_mb, seed)``."""
    torch.manual_seed(seed)
    h = mlp_hidden_for(state_mb)
    return nn.Sequential(
        nn.Linear(IN_DIM, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, CLASSES)
    )


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_data("mlp", n, seed)``."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, IN_DIM, generator=g)
    teacher = torch.randn(x[0].numel(), CLASSES, generator=g)
    return x, (x.flatten(1) @ teacher).argmax(1)


def global_indices(step: int, dataset: int, batch: int, seed: int) -> np.ndarray:
    """``ElasticSampler(dataset, batch, seed=seed).global_indices(step)`` (shuffled, drop
    last): step ``step``'s samples, for all replicas together."""
    epoch, k = divmod(step, dataset // batch)
    perm = np.random.default_rng((seed, epoch)).permutation(dataset)
    return perm[k * batch : (k + 1) * batch]


def run_lighthouse(args: argparse.Namespace) -> int:
    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    progress({"lighthouse": server.address(), "pid": os.getpid()})
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.shutdown()
    return 0


def run_replica(args: argparse.Namespace) -> int:
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    model = make_model(args.state_mb, args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params = [p for p in model.parameters()]
    x, y = make_data(args.dataset, args.seed)
    t_model = time.monotonic()

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    healed = False

    def load_state_dict(sd: dict[str, Any]) -> None:
        nonlocal healed
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])
        healed = True

    # This replica group's own store (one process: rank 0 of 1); the quorum picks one of
    # the replicas' stores for the gloo rendezvous.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=False,
        init_sync=False,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"tft_{args.index}",
        heartbeat_interval=timedelta(milliseconds=args.heartbeat_ms),
    )
    first: dict[str, Any] = {"t_start": T_START, "t_imported": T_IMPORTED}
    first.update(t_model=t_model, t_connected=time.monotonic())
    progress({"hello": True, "pid": os.getpid(), **first})
    deadline = time.monotonic() + args.max_seconds
    attempts = 0
    while time.monotonic() < deadline:
        attempts += 1
        healed = False
        optimizer.zero_grad()
        manager.start_quorum()  # waits for the quorum (sync quorum) and heals if behind
        world = manager.num_participants()
        rank = manager.participating_rank()
        step = manager.current_step()
        if rank is not None and world:
            idx = np.array_split(
                global_indices(step, args.dataset, args.global_batch, args.seed), world
            )[rank]
            i = torch.from_numpy(idx)
            # Manager.allreduce averages over the participants; weight by the share so the
            # update is the mean over the global batch, as ElasticTrainer's.
            loss = F.cross_entropy(model(x[i]), y[i]) * (len(idx) * world / args.global_batch)
            loss.backward()  # type: ignore[no-untyped-call]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()
        if manager.should_commit():
            off = 0
            for p in params:
                n = p.numel()
                p.grad = flat[off : off + n].view_as(p).clone()
                off += n
            optimizer.step()
            progress(
                {
                    "step": manager.current_step(),
                    "world": world,
                    "participating": manager.is_participating(),
                    "healed": healed,
                    "attempts": attempts,
                    "quorum_id": manager._quorum_id,
                    "pid": os.getpid(),
                }
            )
            attempts = 0
            if args.step_delay:
                time.sleep(args.step_delay)
    manager.shutdown(wait=False)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lighthouse-server", action="store_true", help="run the lighthouse")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--join-timeout-ms", type=int, default=100)
    p.add_argument("--quorum-tick-ms", type=int, default=10)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=500)
    p.add_argument("--lighthouse", default="", help="the lighthouse's address (a replica)")
    p.add_argument("--index", type=int, default=0, help="replica number (its replica id)")
    p.add_argument("--heartbeat-ms", type=int, default=50)
    p.add_argument("--pg-timeout", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--state-mb", type=float, default=16.0)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--dataset", type=int, default=4096)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=900.0)
    args = p.parse_args()
    if args.lighthouse_server:
        return run_lighthouse(args)
    if not args.lighthouse:
        p.error("a replica needs --lighthouse ADDRESS")
    return run_replica(args)


if __name__ == "__main__":
    sys.exit(main())
