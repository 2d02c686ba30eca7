"""The GPU path of a mesh member's collective sessions: NCCL per view epoch where the whole
view can, host staging otherwise.

Theory of operation: ``enable_gpu(sync_mesh, ...)`` (``SyncMesh.enable_gpu``) composes the
pieces of ``ftmesh.collective``:

* it advertises this member's devices (``backend.local_devices``) in its member metadata;
* an ``epochs.EpochManager`` whose control channel is the view's TCP ring, reached through the
  view's session (authenticated, on the view's agreed ring), whose root chooses the view's
  backend from every member's validated metadata (``backend.view_backend``), whose library is
  torch's ``ProcessGroupNCCL`` per view epoch, rendezvousing on that ring
  (``torch_pg.TorchPGFactory``: ftmesh's one NCCL binding), and whose fallback is host
  staging on that ring. All three -- control channel, store rounds, staging -- run inside a
  collective of this member (the session's call that reached the GPU path), so they use the
  sessions through ``session.nested_sessions``, outside the order of ``ViewSession.run``;
* the members of a view that declare themselves busy between steps (``Mesh``'s reading of
  their published progress), for which a GPU collective waits up to
  ``EpochConfig.start_wait`` as the TCP ring does;
* ``follow_membership``, a task in the mesh's trio thread that forwards membership's
  verdicts: a member suspected, dead or gone aborts the GPU collectives of its views at once,
  and every view change aborts the communicator of the view left.

The sessions then send each device buffer to the manager when its view is set up on NCCL
(``collective.session.GpuPath``); everything else runs on the TCP ring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from ..collective import RingView
from ..collective.backend import (
    DEVICES_KEY,
    Backend,
    DeviceInfo,
    local_devices,
    parse_devices,
    view_backend,
)
from ..collective.epochs import CommFactory, EpochConfig, EpochManager, GpuCall
from ..collective.ops import Kind
from ..collective.session import GpuPath, NestedSession, SessionRing, nested_sessions
from ..collective.tcp_backend import TcpControl
from ..net.node import Node

if TYPE_CHECKING:
    from .blocking import SyncMesh


async def follow_membership(
    node: Node, manager: EpochManager, current_view: Callable[[], RingView | None]
) -> None:
    """Forward membership events to ``manager`` until cancelled (see the module doc). Both
    calls only mark epochs aborted; the manager's own thread runs NCCL's aborts."""
    async for ev in node.events():
        if ev.kind in ("suspect", "dead", "left") and ev.member.node != node.node_id:
            manager.peer_suspected(ev.member.node, f"membership: {ev.member.name} is {ev.kind}")
        manager.view_changed(current_view())


def torch_factory(
    sessions: Callable[[RingView], NestedSession], config: EpochConfig
) -> CommFactory:
    """The default library: torch's ``ProcessGroupNCCL`` per view epoch, its rendezvous
    deadline inside the manager's (``TorchPGFactory.init_timeout``), its own collective timeout
    the longest the manager may wait (``op_timeout`` plus ``start_wait`` for a member busy
    between steps): the manager aborts first. ``torch_pg`` is imported here, when a member
    enables its GPU path."""
    from ..collective.torch_pg import TorchPGFactory

    return TorchPGFactory(
        sessions,
        "nccl",
        init_timeout=config.init_timeout * 5 / 6,
        op_timeout=config.op_timeout + config.start_wait,  # the manager's deadline is tighter
    )


def enable_gpu(
    mesh: SyncMesh,
    factory: CommFactory | None,
    devices: DeviceInfo | None,
    config: EpochConfig | None,
    is_device: Callable[[Any], bool],
) -> GpuPath:
    """See ``SyncMesh.enable_gpu``."""
    config = config or EpochConfig()
    sessions = nested_sessions(mesh.session)
    if factory is None:
        factory = torch_factory(sessions, config)
    ring = SessionRing(sessions)

    def staging(view: RingView, call: GpuCall) -> None:
        if call.kind is Kind.ALLREDUCE:
            ring.allreduce(view, call.buffer, call.op)
        else:
            ring.broadcast(view, call.buffer, view.members[call.root].node_id)

    def choose(view: RingView) -> Backend:
        metas = {m.node: m.meta for m in mesh.members()}
        infos = [parse_devices(metas.get(nid, {})) for nid in view.node_ids]
        return view_backend(infos)

    inner = mesh.mesh

    def busy(view: RingView) -> list[str]:
        named = (inner.busy_between_steps(n) for n in view.node_ids if n != mesh.node_id)
        return [name for name in named if name is not None]

    manager = EpochManager(
        mesh.node_id,
        factory,
        TcpControl(ring),
        choose=choose,
        fallback=staging,
        config=config,
        busy=busy,
    )
    info = devices if devices is not None else local_devices()
    node = inner.node
    mesh.call_sync(lambda: node.update_meta({**node.me().meta, DEVICES_KEY: info.to_meta()}))
    mesh.call_sync(trio.lowlevel.spawn_system_task, follow_membership, node, manager, inner.view)
    return GpuPath(manager, is_device, mesh.view)


__all__ = ["enable_gpu", "follow_membership", "torch_factory"]
