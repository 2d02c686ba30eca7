"""The steady-state path of one collective (a gradient bucket's allreduce on an open ring), as
it runs: the modules the calling thread enters, traced with ``sys.setprofile`` on two real
mesh members. It holds the walk written down in docs/DESIGN-NOTES.md ("One collective session
per view"): the session, its order (``jobs``), the host's ring lookup, the planner, the
engine, and the plan's leaf helpers -- and nothing else (no trio hop, no facade)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
from test_sync_mesh import common_view, meshes

from ftmesh.collective.ops import CollectiveOp

MAIN_LINE = [
    "ftmesh.collective.session",
    "ftmesh.collective.dataplane",
    "ftmesh.collective.engine",
]
ALLOWED = {
    *MAIN_LINE,
    "ftmesh.collective.jobs",  # the member's order of collectives
    "ftmesh.mesh.core",  # the host: is the view's ring open and in use?
    "ftmesh.collective.transport",  # ... the cached ring
    "ftmesh.collective.ops",  # the plan's pure helpers
    "ftmesh.collective.schedule",
    "ftmesh.collective.view",
    "ftmesh.collective.wire",  # frame headers
    "ftmesh.collective.statistics",  # a timer
    "ftmesh.collective.links",  # the kernel's figures of the connection, after the round
    "ftmesh.stats",
    "ftmesh.compression.feedback",  # CollectiveOp.allreduce's compression=None
}


def test_one_allreduce_on_an_open_ring_stays_on_the_session_path(tmp_path: Path) -> None:
    with meshes(2, tmp_path) as (_, ms):
        view = common_view(ms, 2)
        entered: list[str] = []

        def profile(frame: FrameType, event: str, _arg: Any) -> None:
            name = frame.f_globals.get("__name__", "")
            if event == "call" and name.startswith("ftmesh") and name not in entered:
                entered.append(name)

        def on_both(fn: Callable[[int], object]) -> None:
            threads = [threading.Thread(target=fn, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads)

        on_both(lambda i: ms[i].session(view).allreduce(np.ones(64, np.float32)))  # opens it

        def traced(i: int) -> None:
            ring, x = ms[i].session(view), np.full(1000, i + 1.0, np.float32)
            if i == 0:
                sys.setprofile(profile)
            try:
                ring.run(CollectiveOp.allreduce(), x)
            finally:
                sys.setprofile(None)
            assert (x == 3.0).all()

        on_both(traced)
    assert set(entered) <= ALLOWED, sorted(set(entered) - ALLOWED)
    main = [m for m in entered if m in MAIN_LINE]
    assert main == MAIN_LINE, entered  # session -> dataplane -> engine, in that order
