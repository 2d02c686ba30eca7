"""A training loop that prints nothing and leaves when asked (SIGTERM/SIGINT through
``ftmesh.connect``'s handlers): what ``ftmesh launch`` shows of it comes from the mesh.

Each step waits ``LEAVING_DELAY`` seconds (the "compute"), then allreduces its step number
with ``max`` on the view (every member of a round leaves it with the same step; a joiner takes
the mesh's). After each committed step it reports ``Progress`` to the mesh and appends
``{"step", "world"}`` to its own record file ``$LEAVING_RECORDS/<name>.jsonl``; a failed round
is retried on the next view. At a step boundary where a leave was requested it writes
``{"left": step}`` and leaves the mesh (a planned departure, exit status 0). It ends at step
``LEAVING_STEPS``. A joiner waits for a view with another member before its first step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

import ftmesh
from ftmesh import FtmeshError, Progress

STEPS = int(os.environ.get("LEAVING_STEPS", "30"))
DELAY = float(os.environ.get("LEAVING_DELAY", "0.1"))
DEADLINE_S = 120.0
"""The whole run's bound: a test's worker must never hang."""

with ftmesh.connect() as mesh:
    name = mesh.mesh.config.node.name
    records = Path(os.environ["LEAVING_RECORDS"]) / f"{name}.jsonl"
    # A joiner (``join_running``) waits for a member to join: with a view of itself alone it
    # would "train" on its own before discovery finds the others.
    start = mesh.start_config
    least = 2 if start.join_running else max(1, start.start_peers)
    mesh.wait_view(min_members=least, settle=0.5 if start.join_running else 0.0, timeout=60)
    deadline = time.monotonic() + DEADLINE_S
    step = 0
    fault = ""
    with records.open("w") as out:
        while step < STEPS and time.monotonic() < deadline:
            if mesh.leave_requested():
                out.write(json.dumps({"left": step}) + "\n")
                break
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
        else:
            mesh.set_role("done")
