"""One member of the NAT lab test (``test_lab_nat.py``), run by ``ftmesh worker``: serve a
state (the same on every member), wait for ``NAT_MEMBERS`` members in the ring, run an
allreduce over the data plane, fetch the state from the member named ``NAT_FETCH_FROM``
(when set) over its state server, and print one ``NATLAB {json}`` line with what it saw."""

from __future__ import annotations

import json
import os
import time

import numpy as np

import ftmesh
from ftmesh.mesh.meta import DATA_KEY, STATE_KEY
from ftmesh.state import State

members = int(os.environ["NAT_MEMBERS"])
source = os.environ.get("NAT_FETCH_FROM", "")
state = State(arrays={"w": np.arange(100_000, dtype=np.float64)}, rng=False)
snap = state.commit(step=1)
with ftmesh.connect() as mesh:
    mesh.serve_state(lambda step, digest: state.committed)
    view = mesh.wait_view(min_members=members, timeout=60)
    total = mesh.allreduce(np.ones(1 << 16, np.float32)).output
    fetched = ""
    if source:
        deadline = time.monotonic() + 30
        while True:  # its state address arrives with its metadata
            found = [m for m in mesh.members() if m.name == source and STATE_KEY in m.meta]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        fetched = mesh.fetch_state([found[0].node], 1, snap.digest).digest
    mesh.barrier()  # nobody leaves before everyone is done
    seen = {m.name: {k: m.meta.get(k) for k in (DATA_KEY, STATE_KEY)} for m in mesh.members()}
    gossip = {m.name: f"{m.addr[0]}:{m.addr[1]}" for m in mesh.members()}
    record = {
        "view": view.size,
        "sum": float(total[0]),
        "fetched": fetched == snap.digest,
        "meta": seen,
        "gossip": gossip,
    }
    print("NATLAB " + json.dumps(record), flush=True)
