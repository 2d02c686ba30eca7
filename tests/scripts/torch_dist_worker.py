"""Worker for tests/test_torch_distributed.py: library code written for torch.distributed (a
metric synced with ``dist.all_reduce``, an eval ``all_gather_object``) inside steps bound to
the mesh's session of the view.

Usage: ``torch_dist_worker.py REGISTRY``. Prints JSON lines: ``phase1`` (on the 3-member
view: rank, world size, the synced metric, the gathered evals, a broadcast object, and what
a call outside a step raised); the member of rank 2 then waits to be killed, the others
start a step whose ``all_reduce`` waits for it (``failed``: the typed error it raised), then
``done`` with the same syncs on the 2-member view.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from session_adapter import mesh_session
from tests_support import local_mesh_config

from ftmesh.errors import FtmeshError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch.distributed import bound


def emit(event: str, **kw: object) -> None:
    print(json.dumps({"event": event, **kw}), flush=True)


def syncs(samples: int) -> dict[str, object]:
    """What a metric library and an eval loop do, unchanged."""
    rank = dist.get_rank()
    metric = torch.tensor([10.0 * (rank + 1), float(samples)])  # correct, seen
    dist.all_reduce(metric)
    evals: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(evals, {"rank": rank, "loss": 1.0 / (rank + 1)})
    return {"metric": metric.tolist(), "evals": evals}


def main() -> None:
    with SyncMesh.start(local_mesh_config(Path(sys.argv[1]), "torch-dist")) as mesh:
        view = mesh.wait_view(min_members=3, settle=0.5, timeout=60)
        with bound(mesh_session(mesh, view)):
            out = syncs(100)
            objs: list[object] = [f"from {dist.get_rank()}"]
            dist.broadcast_object_list(objs, src=1)
            rank, world = dist.get_rank(), dist.get_world_size()
        try:
            dist.all_reduce(torch.ones(1))
            outside = "none"
        except FtmeshError as exc:
            outside = type(exc).__name__
        emit("phase1", rank=rank, world=world, bcast=objs, outside=outside, **out)
        if rank == 2:
            time.sleep(120)  # killed by the test
            return
        try:
            with bound(mesh_session(mesh, view)):
                dist.all_reduce(torch.ones(1))  # waits for rank 2, until it dies
            emit("failed", error="none")
        except FtmeshError as exc:
            emit("failed", error=type(exc).__name__)
        deadline = time.monotonic() + 60
        small = mesh.wait_view(min_members=1, timeout=60)
        while small.size != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            small = mesh.wait_view(min_members=1, timeout=60)
        with bound(mesh_session(mesh, small)):
            out = syncs(100)
            emit("done", rank=dist.get_rank(), world=dist.get_world_size(), **out)


if __name__ == "__main__":
    main()
