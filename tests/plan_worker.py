"""Worker process for tests/test_ring_plan_mesh.py's kill test (run as a script).

``plan_worker.py REGISTRY SITE SIZE``: joins mesh ``plan-kill`` (same-host discovery in
REGISTRY, the ``local`` preset) with site label SITE, waits for a hierarchical view of SIZE
members, then runs allreduces of 1 Mi float32 ones on it, printing one JSON line per outcome
(``{"ok": k, "epoch": ...}``, ``{"error": class name, "peer": ...}``, each with the wall-clock
time ``t``); after an error it goes on with the next view of SIZE members (a hiccup of a
loaded host) or, once the file ``REGISTRY/killed`` exists, stops when the view has SIZE - 1
(the kill). Then it runs allreduces on
that view (retried while neighbours still converge), printing ``{"after": ...,
"hierarchical": ..., "right": ...}`` for each, until the file ``REGISTRY/stop`` exists (the
test writes it once every survivor has one), and exits 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from ftmesh.collective import RingView
from ftmesh.collective.config import CollectiveConfig
from ftmesh.errors import CollectiveError, PeerLostError
from ftmesh.membership.config import MembershipConfig
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.mesh.core import MeshConfig
from ftmesh.net.node import NodeConfig

N = 1 << 20


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def view_of(
    mesh: SyncMesh, size: int | None, hierarchical: bool | None, timeout: float, full: int = 0
) -> RingView:
    """The current view once it has ``size`` members (None: ``full - 1``, or ``full`` and
    hierarchical) and is ``hierarchical`` (None: either)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = mesh.view()
        if v is not None:
            if size is None and (v.size == full - 1 or (v.size == full and v.hierarchical)):
                return v
            if v.size == size and hierarchical in (None, v.hierarchical):
                return v
        time.sleep(0.05)
    raise SystemExit(f"no view of {size} members")


def after_error(mesh: SyncMesh, size: int, killed: Path) -> RingView:
    """The view to go on with: of ``size - 1`` members once a member was killed, else the
    hierarchical one of ``size`` members again."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.1)
        v = mesh.view()
        if v is not None and mesh.node_id in v:
            if killed.exists() and v.size == size - 1:
                return v
            if not killed.exists() and v.size == size and v.hierarchical:
                return v
    raise SystemExit("no view to go on with")


def main() -> None:
    registry, site, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = MeshConfig(
        node=NodeConfig(
            mesh="plan-kill",
            discovery="local",
            registry_dir=registry,
            membership=MembershipConfig.preset("local"),
        ),
        collective=CollectiveConfig(io_timeout=60.0, view_timeout=5.0, max_cached_views=1),
        site=site,
        links_interval=0.0,
    )
    with SyncMesh.start(config) as mesh:
        view = view_of(mesh, size, True, 60.0)
        time.sleep(1.0)  # every member holds it too
        k = 0
        while True:
            try:
                out = mesh.session(view).allreduce(np.ones(N, np.float32)).output
            except (CollectiveError, PeerLostError) as exc:  # the session's typed errors
                say(error=type(exc).__name__, peer=getattr(exc, "peer", ""), t=time.time())
                # the kill (the test says so in a file), or a hiccup of a loaded host (a
                # suspicion refuted, a neighbour left out for a while): the next view
                view = after_error(mesh, size, Path(registry, "killed"))
                if view.size < size:
                    break
                continue
            k += 1
            say(ok=k, epoch=view.epoch, right=bool(np.all(out == size)), t=time.time())
        # Allreduces on that view until the test says stop: one member may finish a round
        # that the others fail (a view of the same members with a new epoch supersedes it
        # between their phases), and their retry needs it again.
        stop, until = Path(registry, "stop"), time.monotonic() + 60
        while not stop.exists() and time.monotonic() < until:
            new = view_of(mesh, size - 1, None, 60.0)
            try:
                out = mesh.session(new).allreduce(np.full(1000, 2.0, np.float32)).output
            except (CollectiveError, PeerLostError) as exc:  # neighbours still converging
                if not stop.exists():
                    say(retry=type(exc).__name__, peer=getattr(exc, "peer", ""), t=time.time())
                time.sleep(0.2)
                continue
            say(
                after=float(out[0]),
                hierarchical=new.hierarchical,
                right=bool(np.all(out == 2 * (size - 1))),
            )
            time.sleep(0.05)


if __name__ == "__main__":
    main()
