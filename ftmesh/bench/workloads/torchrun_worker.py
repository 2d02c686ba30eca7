"""The torchrun side of ``ftmesh bench recovery``: the same MLP, data, batch split and
optimizer as ``mlp_worker``, under torch DistributedDataParallel on gloo, started by
``torchrun`` (``env://`` rendezvous), resuming from the newest checkpoint after a restart.

Rank 0 writes a checkpoint every ``--checkpoint-every`` steps (write, fsync, rename). Every
step prints a record ``{"step", "rank", "world", "pid", "restart", "resumed_from"}``; the first
record of a process also carries its start-up timeline: ``t_start`` (process start, before
importing torch), ``t_imported``, ``t_pg`` (process group ready), ``t_loaded`` (checkpoint
loaded), all on the monotonic clock.
"""

from __future__ import annotations

import time

T_START = time.monotonic()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from ftmesh.bench.workloads import make_data, make_model, make_optimizer, progress  # noqa: E402
from ftmesh.torch.sampler import ElasticSampler  # noqa: E402

T_IMPORTED = time.monotonic()


def save_atomic(path: Path, blob: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(blob, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-mb", type=float, default=16.0)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--dataset", type=int, default=4096)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=900.0)
    args = p.parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    dist.init_process_group("gloo")
    t_pg = time.monotonic()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("mlp", args.state_mb, seed=args.seed)
    optimizer = make_optimizer(model)
    ckpt = Path(args.checkpoint_dir) / "ckpt.pt"
    step = 0
    if ckpt.exists():
        blob = torch.load(ckpt, weights_only=True)
        model.load_state_dict(blob["model"])
        optimizer.load_state_dict(blob["optimizer"])
        step = int(blob["step"])
    resumed_from = step
    t_loaded = time.monotonic()
    ddp = DistributedDataParallel(model)
    x, y = make_data("mlp", args.dataset, seed=args.seed)
    sampler = ElasticSampler(args.dataset, args.global_batch, seed=args.seed)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    first: dict[str, Any] = {
        "t_start": T_START,
        "t_imported": T_IMPORTED,
        "t_pg": t_pg,
        "t_loaded": t_loaded,
    }
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        idx = np.array_split(sampler.global_indices(step), world)[rank]
        i = torch.from_numpy(idx)
        optimizer.zero_grad()
        # DDP averages gradients over ranks; weight by the share so that the update is the
        # mean over the global batch, like ElasticTrainer's.
        loss = F.cross_entropy(ddp(x[i]), y[i]) * (len(idx) * world / args.global_batch)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        step += 1
        if rank == 0 and args.checkpoint_every and step % args.checkpoint_every == 0:
            blob = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            save_atomic(ckpt, blob)
        progress(
            {
                "step": step,
                "rank": rank,
                "world": world,
                "pid": os.getpid(),
                "restart": restart,
                "resumed_from": resumed_from,
                **first,
            }
        )
        first = {}
        if args.step_delay:
            time.sleep(args.step_delay)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
