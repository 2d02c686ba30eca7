"""The smallest custom training loop on ftmesh: a linear model fitted with NumPy, gradients
averaged by hand with the mesh's allreduce. No torch, no trainer class, no fault tolerance
beyond what the collective gives (use ``ftmesh.torch.ElasticTrainer`` for that).

Run two or more copies on one host (they find each other with no configuration):

    python examples/embed_minimal.py & python examples/embed_minimal.py

After each step it reports its progress to the mesh (``report_progress``, published in its
member metadata about once a second): what ``ftmesh status`` and ``ftmesh launch`` show.
"""

from __future__ import annotations

import time

import ftmesh
import numpy as np


def main() -> None:
    rng = np.random.default_rng(0)
    true_w = np.array([2.0, -3.0, 0.5], dtype=np.float32)
    x = rng.normal(size=(4096, 3)).astype(np.float32)
    y = x @ true_w
    w = np.zeros(3, dtype=np.float32)
    with ftmesh.connect(mesh="embed-minimal") as mesh:
        view = mesh.wait_view(min_members=2, settle=1.0, timeout=60)
        rank, size = view.rank_of(mesh.node_id), view.size
        mine = slice(rank * len(x) // size, (rank + 1) * len(x) // size)
        share = mine.stop - mine.start
        for step in range(100):
            started = time.perf_counter()
            err = x[mine] @ w - y[mine]
            grad = (2 * x[mine].T @ err / len(x)).astype(np.float32)
            mesh.allreduce(grad, op="sum")  # in place: now the full-data gradient
            w -= 0.1 * grad
            took = max(time.perf_counter() - started, 1e-9)
            mesh.report_progress(ftmesh.Progress(step + 1, took, share, share / took, size))
        mesh.barrier()
    print(f"member {rank} of {size}: w = {np.round(w, 3).tolist()} (true {true_w.tolist()})")


if __name__ == "__main__":
    main()
