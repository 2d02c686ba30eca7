"""Liveness and readiness of a member, for ``/healthz`` and ``/readyz`` (Kubernetes probes).

Theory of operation: both are answered by the metrics server, which runs in the node's trio
thread. *Live* is therefore "this process answers and its mesh thread runs": a hung or dead
trio loop answers nothing, and the probe's timeout fails it; ``/healthz`` needs no further
check (a crashed node task cancels the whole node, the server with it). *Ready* is read from
membership at the moment of the request, as every member computes the ring
(``ftmesh.mesh.core``): we are ready when our role is ``train`` and the ring does not leave
us out, i.e. we are a member of the current view. Hot spares are in the ring (role
``train``, a share of 0), so they are ready; cold spares (``spare``), members still pulling
state (``joining``, ``starting``), observers, finished members (``done``), a leaving member
and a bare ``ftmesh node`` (no role) are not. The answer carries a one-line reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..membership.messages import MemberState
from ..mesh.meta import ROLE_KEY, ring_exclusions

if TYPE_CHECKING:
    from ..net.node import Node

_WHY_NOT = {
    "joining": "joining: pulling state, not in the ring yet",
    "starting": "starting: waiting for the mesh to start",
    "spare": "a cold spare (or paused as fail-slow): waiting for a slot in the ring",
    "observer": "an observer: never in the ring",
    "done": "done: the training finished",
    "leaving": "leaving: a planned departure",
}


@dataclass(frozen=True, slots=True)
class Readiness:
    """One answer of ``/readyz``."""

    ready: bool
    reason: str
    """One line: why (not)."""


def readiness(node: Node) -> Readiness:
    """Whether ``node`` is a training member of the current view (see the module docstring)."""
    me = node.me()
    if me.state != MemberState.ALIVE:
        return Readiness(False, "leaving the mesh")
    role = me.meta.get(ROLE_KEY)
    if role is None:
        return Readiness(False, "not a training member (no role: a bare node)")
    if role != "train":
        return Readiness(False, _WHY_NOT.get(str(role), f"role {role!r}: not in the ring"))
    members = node.members()
    out = ring_exclusions(members).get(node.node_id)
    if out is not None:
        return Readiness(False, f"left out of the ring: {out.reason}")
    n = sum(
        1
        for m in members
        if m.meta.get(ROLE_KEY) == "train" and m.state in (MemberState.ALIVE, MemberState.SUSPECT)
    )
    return Readiness(True, f"in the ring ({n} training members)")
