"""A training member for tests/test_ring_plan_lab.py, run inside a lab host (run as a script).

``plan_lab_worker.py BIND JOIN DIR SIZE NBYTES ROUNDS PAIRS PRESET``: joins mesh ``planlab``
with seeds (JOIN: ``HOST:PORT`` or ``-``) and membership preset PRESET, measuring its links
every half second (a packet pair every PAIRS seconds), and waits for a view of
SIZE members whose plan is measured and hierarchical and has held for two seconds; prints
``{"ready": ..., "plan": hash, "epoch": ..., "sites": [[ids]...]}``. Once ``DIR/go`` exists it
runs a small allreduce (every member in), then ROUNDS allreduces of NBYTES of float32, and
prints ``{"digests": [...], "sent": {peer: bytes}}`` (payload bytes it sent to each peer in
those ROUNDS); it leaves once ``DIR/done`` exists.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from ftmesh.membership.config import MembershipConfig
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.mesh.core import MeshConfig
from ftmesh.net.node import NodeConfig


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path.name} within {timeout}s")
        time.sleep(0.05)


def main() -> None:
    bind, join, where = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    size, nbytes, rounds = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    pairs, preset = float(sys.argv[7]), sys.argv[8]
    config = MeshConfig(
        node=NodeConfig(
            mesh="planlab",
            discovery="seeds",
            bind=bind,
            port=7946,
            join=() if join == "-" else (join,),
            name=f"h-{bind}",
            membership=MembershipConfig.preset(preset),
            pair_interval=pairs,
        ),
        links_interval=0.5,
    )
    with SyncMesh.start(config) as mesh:
        deadline = time.monotonic() + 90
        held = ("", time.monotonic())
        while True:
            assert time.monotonic() < deadline, "no measured hierarchical view"
            v = mesh.view()
            ok = v is not None and v.size == size and v.hierarchical
            epoch = v.epoch if ok and v is not None else ""
            if epoch != held[0]:
                held = (epoch, time.monotonic())
            elif epoch and time.monotonic() - held[1] >= 2.0:
                break
            time.sleep(0.1)
        assert v is not None and v.plan is not None
        sites = [list(s.members) for s in v.plan.sites]
        say(ready=mesh.node_id, plan=v.plan.hash, epoch=v.epoch, sites=sites,
            source=v.plan.source)  # fmt: skip
        wait_file(where / "go", 120)
        session = mesh.session(v)
        session.allreduce(np.ones(4, np.float32))
        before = mesh.mesh.data_plane.sent_bytes()
        digests = []
        for k in range(rounds):
            x = np.full(nbytes // 4, float(k + 1), np.float32)
            x[: size * 8] = np.arange(size * 8, dtype=np.float32) * (k + 1)
            out = session.allreduce(x).output
            digests.append(hashlib.sha256(out.tobytes()).hexdigest()[:16])
        after = mesh.mesh.data_plane.sent_bytes()
        sent = {p: after[p] - before.get(p, 0) for p in after if after[p] != before.get(p, 0)}
        say(digests=digests, sent=sent, right=bool(out[-1] == size * rounds))
        wait_file(where / "done", 120)


if __name__ == "__main__":
    main()
