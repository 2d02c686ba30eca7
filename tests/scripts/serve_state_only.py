"""A training script that joins the mesh and serves its state (no torch), as a trainer does
first: the door of a worker's state server (``--state-port``). Prints the addresses it
published: ``published data HOST:PORT state HOST:PORT``."""

from __future__ import annotations

import numpy as np

import ftmesh
from ftmesh.mesh.meta import DATA_KEY
from ftmesh.state import State

state = State(arrays={"w": np.zeros(4)}, rng=False)
state.commit(step=0)
with ftmesh.connect() as mesh:
    host, port = mesh.serve_state(lambda step, digest: state.committed)
    data = mesh.call_sync(mesh.mesh.node.me).meta[DATA_KEY]
    print(f"published data {data} state {host}:{port}", flush=True)
