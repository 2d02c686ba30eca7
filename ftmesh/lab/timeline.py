"""The timeline of a chaos run, as its summary carries it (``timeline`` in ``--json``).

Theory of operation: at the end of a run the runner reads every record each member process
printed (``NodeProcess.records``, stamped with the runner's monotonic clock on arrival) and
keeps two things, in seconds since the first fault's start (negative: during startup), the
clock of ``FaultRecord.started_s``:

* ``commits``: per process (``"h<host>.<k>"``, the k-th process that ran on that host), points
  ``[t, step, n]`` of its ``commit`` records: the committed step and ``n``, how many commits
  the process had printed by then, so throughput (commits per second) can be read between
  any two points. A membership-only workload (``ftmesh node``) commits nothing: empty.
* ``views``: view changes, ``[t, kind, proc]``: the first time any member reported that
  ``proc`` ``joined``, was declared ``dead`` or ``left`` (once per kind, member and
  incarnation: every member reports the same change); ``proc`` is ``"other"`` for a member
  that is none of the lab's (a ``bad_meta`` rogue).

Both are thinned to caps so that a long soak keeps a summary of bounded size; thinning keeps
the first and last point of each process, and ``n`` keeps throughput exact between the points
kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .mesh import HostSlot

COMMIT_POINTS = 500
"""Points kept per process (bounds the summary of a long training soak: at 20 steps/s a
10-minute run prints 12,000 commits per member)."""

VIEW_CHANGES = 1000
"""View changes kept (bounds the summary when members flap for a long time)."""

VIEW_KINDS = ("joined", "dead", "left")
"""Events that change a member's view (``suspect`` and ``alive`` keep the member in it)."""


def _thin(points: list[list[Any]], cap: int) -> list[list[Any]]:
    if len(points) <= cap:
        return points
    stride = -(-len(points) // (cap - 1))  # ceil: at most cap - 1 points, then the last
    return [*points[:-1:stride], points[-1]]


def chaos_timeline(slots: Sequence[HostSlot], t0: float) -> dict[str, Any]:
    """See the module docstring; ``slots`` are ``LabMesh.slots``, ``t0`` the monotonic time
    of the first fault's start."""
    proc_of = {
        node.node_id: f"h{h}.{k}"
        for h, slot in enumerate(slots)
        for k, node in enumerate(slot.history)
    }
    commits: dict[str, list[list[Any]]] = {}
    first: dict[tuple[str, str, str], list[Any]] = {}
    for h, slot in enumerate(slots):
        for k, node in enumerate(slot.history):
            with node._cond:
                seen = list(node.records)
            points: list[list[Any]] = []
            for rec in seen:
                r, t = rec.record, round(rec.mono - t0, 3)
                kind = r.get("event")
                if kind == "commit" and isinstance(r.get("step"), int):
                    points.append([t, r["step"], len(points) + 1])
                elif kind in VIEW_KINDS and r.get("node") != node.node_id:
                    who = proc_of.get(str(r.get("node")), "other")  # a rogue
                    key = (str(kind), who, str(r.get("incarnation")))
                    if key not in first or t < first[key][0]:
                        first[key] = [t, kind, who]
            if points:
                commits[f"h{h}.{k}"] = _thin(points, COMMIT_POINTS)
    views = sorted(first.values(), key=lambda v: float(v[0]))
    return {"commits": commits, "views": _thin(views, VIEW_CHANGES)}
