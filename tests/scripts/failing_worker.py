"""A training script whose worker w1 crashes with a traceback at its first step."""

from __future__ import annotations

import os

import numpy as np

import ftmesh


def main() -> None:
    with ftmesh.connect() as mesh:
        mesh.wait_view(min_members=1, settle=0.5, timeout=30)
        if os.environ.get("FTMESH_WORKER_NAME") == "w1":
            raise RuntimeError("boom: the model diverged in w1")
        x = np.ones(4, np.float32)
        mesh.allreduce(x)


if __name__ == "__main__":
    main()
