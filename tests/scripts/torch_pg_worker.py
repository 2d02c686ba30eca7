"""Worker for tests/test_torch_pg.py: a mesh member whose GPU-path collectives run on torch's
gloo process group, built per view epoch on the ring store (the CI stand-in for NCCL).

Usage: ``torch_pg_worker.py REGISTRY NAME``. Prints one JSON line per event: ``step``
(the digest of each allreduce's result), ``phase1`` (three steps on the 3-member view; the
last member of the view is the ``victim`` and then waits to be frozen and killed), and on
the others ``aborted`` (the collective in flight when the victim froze: its error type and
how long the abort took), then ``done`` after two steps on the view without the victim.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed  # noqa: F401 (loaded before the mesh starts: an import holds the GIL
import trio  # for seconds on a busy host, and a member that stops answering gets suspected)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from session_adapter import mesh_session
from tests_support import local_mesh_config

from ftmesh.collective import RingView
from ftmesh.collective.epochs import EpochConfig, EpochManager
from ftmesh.collective.torch_pg import SessionControl, TorchPGFactory
from ftmesh.errors import FtmeshError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.mesh.gpu import follow_membership

T0 = time.monotonic()


def emit(event: str, **kw: object) -> None:
    print(json.dumps({"event": event, "t": round(time.monotonic() - T0, 3), **kw}), flush=True)


def step(mgr: EpochManager, view: RingView, k: int) -> None:
    rank = view.rank_of(mgr.node_id)
    x = np.random.default_rng(1000 * k + rank).standard_normal(1 << 16).astype(np.float32)
    mgr.allreduce(view, x)
    emit("step", k=k, sha=hashlib.sha256(x.tobytes()).hexdigest())


def main() -> None:
    registry, name = sys.argv[1], sys.argv[2]
    with SyncMesh.start(local_mesh_config(Path(registry), "torch-pg")) as mesh:
        view = mesh.wait_view(min_members=3, settle=0.5, timeout=60)
        sessions = lambda v: mesh_session(mesh, v)  # noqa: E731
        factory = TorchPGFactory(sessions, "gloo", init_timeout=20.0, op_timeout=120.0)
        mgr = EpochManager(
            mesh.node_id,
            factory,
            SessionControl(sessions),
            config=EpochConfig(init_timeout=30.0, op_timeout=120.0),
        )
        inner = mesh.mesh
        mesh.call_sync(
            trio.lowlevel.spawn_system_task, follow_membership, inner.node, mgr, inner.view
        )
        for k in range(3):
            step(mgr, view, k)
        victim = view.node_ids[-1] == mesh.node_id
        emit("phase1", victim=victim, name=name)
        if victim:
            time.sleep(120)  # frozen, then killed, by the test
            return
        t0 = time.monotonic()
        try:
            step(mgr, view, 3)  # waits in gloo for the victim, until the suspicion aborts it
            emit("error", why="the collective with a frozen member completed")
            return
        except FtmeshError as exc:
            emit("aborted", error=type(exc).__name__, seconds=round(time.monotonic() - t0, 3))
        deadline = time.monotonic() + 60
        small = view
        while time.monotonic() < deadline:  # until both survivors run on the new view
            small = mesh.wait_view(min_members=1, timeout=60)
            if small.size != 2:
                time.sleep(0.05)
                continue
            mgr.view_changed(small)
            try:
                step(mgr, small, 4)
                break
            except FtmeshError:  # the other survivor was not on this view yet
                continue
        step(mgr, small, 5)
        emit("done", size=small.size, setups=mgr.statistics().setups)
        mgr.close()


if __name__ == "__main__":
    main()
