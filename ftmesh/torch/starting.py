"""The blocking driver of the start gate (``ftmesh.training.start``) over a ``SyncMesh``.

Theory of operation: :func:`wait_to_start` says the member is ready (role ``starting``; a
member that only joins a running mesh stays ``joining``), then polls the membership every
``POLL_S`` and feeds it to the :class:`~ftmesh.training.start.StartGate`, acting on its
decisions: it logs a warning with whom it found and what discovery saw whenever the gate says
to report, raises :class:`~ftmesh.errors.MeshNotFormedError` when the gate gives up and
:class:`~ftmesh.errors.TrainingFinishedError` when there is nothing left to join. Once the
start peers are ready it enters the ring (role ``train``) and waits for the view that holds
them all, or ``max_peers`` of them when that is fewer (the others are spares; those still
``starting`` may not have seen the count reached yet): until the gate's deadline, but at least
``ENTER_WAIT_S`` (a member that waited long for a slow one would otherwise go on at once
with the others missing), and with a WARNING naming the shortfall if it goes on without
them. A member asked to leave (``SyncMesh.leave_requested``) stops waiting at once; the
caller departs.
"""

from __future__ import annotations

import logging
import time

from ..errors import MeshNotFormedError, TrainingFinishedError
from ..membership.messages import MemberSnapshot, MemberState
from ..mesh.blocking import SyncMesh
from ..mesh.meta import advertises_state, role_of
from ..training.start import Decision, Peer, StartConfig, StartGate, StartStatus

log = logging.getLogger("ftmesh.start")

POLL_S = 0.1
"""How often a waiting member looks at the membership."""
ENTER_WAIT_S = 30.0
"""Once the start peers are ready, how long at least a member waits for all of them in the
ring (the gate's deadline may be nearer: a member that waited long for a slow one)."""


def peers_of(members: list[MemberSnapshot]) -> list[Peer]:
    """The gate's view of the membership."""
    return [
        Peer(
            node=m.node,
            name=m.name,
            alive=m.state == MemberState.ALIVE,
            left=m.state == MemberState.LEFT,
            role=role_of(m),
            started=advertises_state(m),
        )
        for m in members
    ]


def _found(mesh: SyncMesh, status: StartStatus) -> str:
    discovery = mesh.call_sync(mesh.mesh.node.discovery_status)
    return f"{status.describe()}; {discovery.describe()}; {discovery.hint()}"


def wait_to_start(
    mesh: SyncMesh, config: StartConfig, deadline: float = float("inf"), max_peers: int = 0
) -> None:
    """Wait as ``config`` says before the first step (see the module docstring); returns
    when the member may enter the ring. ``deadline`` (``time.monotonic()``) bounds it too.
    ``max_peers`` (0: no bound) caps the view waited for: the start peers beyond it are
    spares, never in the ring."""
    if not config.waits:
        return
    gate = StartGate(config, time.monotonic())
    end = min(gate.deadline, deadline)
    mesh.set_role("joining" if config.join_running else "starting")
    while True:
        if mesh.leave_requested():
            return
        status = gate.observe(time.monotonic(), peers_of(mesh.members()))
        decision = status.decision
        if decision is Decision.GIVE_UP:
            what = "no running mesh to join" if config.join_running else "not starting alone"
            raise MeshNotFormedError(
                f"{_found(mesh, status)}. {what}: a mesh of its own would train a separate "
                "model (fewer members: lower --start-peers / $FTMESH_START_PEERS)"
            )
        if decision is Decision.FINISHED:
            raise TrainingFinishedError("the training finished before this member could join")
        if decision is Decision.GO_AHEAD:
            log.warning("starting with more than half of the start peers: %s", _found(mesh, status))
            return
        if status.report:
            log.warning("waiting to start: %s", _found(mesh, status))
        if decision is Decision.JOIN:
            return
        if decision is Decision.ENTER:
            break
        if time.monotonic() >= end:
            return  # the caller's deadline came first
        time.sleep(POLL_S)
    mesh.set_role("train")
    ring = min(config.start_peers, max_peers) if max_peers else config.start_peers
    # The others saw the count reached too, but on a loaded host they may take seconds to
    # enter: give them ENTER_WAIT_S even when the gate's own deadline is nearer.
    end = min(max(end, time.monotonic() + ENTER_WAIT_S), deadline)
    while (view := mesh.view()) is None or view.size < ring:
        if time.monotonic() >= end:
            log.warning(
                "starting with %d of %d start peers: the others were ready but did not "
                "enter the ring within %.0fs (they join the running mesh when they do)",
                view.size if view else 1,
                ring,
                ENTER_WAIT_S,
            )
            return
        mesh.wait_view_change(view.epoch if view else "", timeout=POLL_S)
