"""A training loop that prints nothing: what ``ftmesh launch`` shows of it comes from the mesh.

Each step waits ``SILENT_DELAY`` seconds (the "compute"), then allreduces its step number with
``max`` on the view: every member of a round leaves it with the same step (a joiner takes the
mesh's), and the round's members are the step's world. After each committed step it reports
``Progress`` to the mesh (``report_progress``) and appends ``{"step", "world"}`` to its own
record file ``$SILENT_RECORDS/<name>.jsonl``, for the test to compare with the launcher's view.
A round that fails (a member was killed) is retried on the next view. It ends at step
``SILENT_STEPS``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

import ftmesh
from ftmesh import FtmeshError, Progress

STEPS = int(os.environ.get("SILENT_STEPS", "30"))
DELAY = float(os.environ.get("SILENT_DELAY", "0.25"))
DEADLINE_S = 120.0
"""The whole run's bound: a test's worker must never hang."""

with ftmesh.connect() as mesh:
    name = mesh.mesh.config.node.name
    records = Path(os.environ["SILENT_RECORDS"]) / f"{name}.jsonl"
    mesh.wait_view(min_members=max(1, mesh.start_config.start_peers), timeout=60)
    deadline = time.monotonic() + DEADLINE_S
    step = 0
    fault = ""
    with records.open("w") as out:
        while step < STEPS and time.monotonic() < deadline:
            started = time.monotonic()
            time.sleep(DELAY)
            x = np.array([float(step)])
            try:
                res = mesh.allreduce(x, op="max")
            except FtmeshError as exc:
                fault = f"{type(exc).__name__}: {exc}"
                time.sleep(0.05)
                continue
            step = int(x[0]) + 1
            world = len(res.members)
            took = time.monotonic() - started
            out.write(json.dumps({"step": step, "world": world}) + "\n")
            out.flush()
            mesh.report_progress(Progress(step, took, 1, 1 / took, world, "tcp", fault))
    mesh.set_role("done")
