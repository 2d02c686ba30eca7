"""A training script that only joins the mesh and leaves (no torch): the door of a worker."""

from __future__ import annotations

import ftmesh

with ftmesh.connect() as mesh:
    print(f"connected {mesh.node_id} as {mesh.mesh.config.node.name}", flush=True)
