"""GPU collectives of a mesh member: NCCL per view epoch where the whole view can, host
staging otherwise, TCP for host buffers.

Theory of operation: ``GpuCollectives.attach(sync_mesh)`` composes, through the mesh's
public API only, the pieces of ``ftmesh.collective``:

* it advertises this member's devices (``backend.local_devices``) in its member metadata;
* an ``epochs.EpochManager`` whose control channel is the mesh's ring of the view
  (``SyncMesh.broadcast_on`` / ``allreduce_on``: authenticated, ordered with the view's other
  collectives), whose root chooses the view's backend from every member's validated
  metadata (``backend.view_backend``) and whose fallback is host staging on that ring;
* ``follow_membership``, a task in the mesh's trio thread that forwards membership's
  verdicts: a member suspected, dead or gone aborts the GPU collectives of its views at once,
  and every view change aborts the communicator of the view left.

This is the GPU path of the mesh, usable today next to ``SyncMesh``. Folding it into the one
collective object per view that the mesh's collective layer is being reshaped into (and
into the trainer's gradient buckets) is left to that change: the mesh would own the manager
and call ``peer_suspected`` / ``view_changed`` from ``Mesh._watch`` where it aborts the data
plane's views today, and ``ftmesh status`` would print the devices key.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import trio

from ..collective import CollectiveResult, RingView
from ..collective.backend import (
    DEVICES_KEY,
    Backend,
    DeviceInfo,
    call_backend,
    local_devices,
    parse_devices,
    view_backend,
)
from ..collective.epochs import CollectiveOp, CommFactory, EpochConfig, EpochManager, Kind
from ..collective.tcp_backend import TcpControl
from ..net.node import Node
from .blocking import SyncMesh


def is_device_buffer(x: Any) -> bool:
    """A torch CUDA tensor or a CuPy array (looked up without importing either)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return bool(x.is_cuda)
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def _dtype_of(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.") if hasattr(x, "dtype") else ""


async def follow_membership(
    node: Node, manager: EpochManager, current_view: Callable[[], RingView | None]
) -> None:
    """Forward membership events to ``manager`` until cancelled (see the module doc). Both
    calls only mark epochs aborted; the manager's own thread runs NCCL's aborts."""
    async for ev in node.events():
        if ev.kind in ("suspect", "dead", "left") and ev.member.node != node.node_id:
            manager.peer_suspected(ev.member.node, f"membership: {ev.member.name} is {ev.kind}")
        manager.view_changed(current_view())


class MeshRing:
    """``tcp_backend.RingOps`` on a ``SyncMesh``: collectives on exactly the view given."""

    def __init__(self, mesh: SyncMesh) -> None:
        self._mesh = mesh

    def allreduce(self, view: RingView, x: Any, op: str = "sum") -> Any:
        return self._mesh.allreduce_on(view, x, op)

    def broadcast(self, view: RingView, x: Any, root: str) -> Any:
        return self._mesh.broadcast_on(view, x, root)


class GpuCollectives:
    """GPU collectives on the views of one ``SyncMesh`` member. Use ``attach``."""

    def __init__(
        self,
        mesh: SyncMesh,
        factory: CommFactory,
        *,
        config: EpochConfig | None = None,
        is_device: Callable[[Any], bool] = is_device_buffer,
    ) -> None:
        self.mesh = mesh
        self._is_device = is_device
        self.manager = EpochManager(
            mesh.node_id,
            factory,
            TcpControl(MeshRing(mesh)),
            choose=self._choose,
            fallback=self._staging,
            config=config,
        )
        self.bad_meta = 0
        """Members whose devices metadata did not parse (treated as having no GPU)."""

    @classmethod
    def attach(
        cls,
        mesh: SyncMesh,
        *,
        factory: CommFactory | None = None,
        devices: DeviceInfo | None = None,
        config: EpochConfig | None = None,
        is_device: Callable[[Any], bool] = is_device_buffer,
    ) -> GpuCollectives:
        """Advertise ``devices`` (default: probed), build the manager on ``factory``
        (default: NCCL, which must then be loadable) and follow membership."""
        if factory is None:
            from ..collective.nccl import NcclFactory

            factory = NcclFactory()
        info = devices if devices is not None else local_devices()
        self = cls(mesh, factory, config=config, is_device=is_device)
        inner = mesh.mesh
        node = inner.node
        mesh.call_sync(lambda: node.update_meta({**node.me().meta, DEVICES_KEY: info.to_meta()}))
        mesh.call_sync(
            trio.lowlevel.spawn_system_task, follow_membership, node, self.manager, inner.view
        )
        return self

    def allreduce(self, view: RingView, x: Any, op: str = "sum") -> CollectiveResult[Any]:
        """``x`` reduced in place over ``view``, on the backend the view and ``x`` call for."""
        return self._run(view, CollectiveOp(Kind.ALLREDUCE, x, op))

    def broadcast(self, view: RingView, x: Any, root: str) -> CollectiveResult[Any]:
        return self._run(view, CollectiveOp(Kind.BROADCAST, x, root=view.rank_of(root)))

    def backend_for(self, view: RingView, x: Any) -> Backend:
        """The backend a collective of ``x`` on ``view`` runs on now (NCCL if the view is
        set up on it or not set up yet and the dtype allows)."""
        chosen = self.manager.backend_of(view) or Backend.NCCL
        return call_backend(chosen, self._is_device(x), _dtype_of(x))

    def close(self) -> None:
        self.manager.close()

    def _run(self, view: RingView, op: CollectiveOp) -> CollectiveResult[Any]:
        if self.backend_for(view, op.buffer) is Backend.NCCL:
            if self.manager.aborted(view.epoch) is not None:
                current = self.mesh.view()
                if current is not None and current.epoch == view.epoch:
                    # the view is current again (a suspect refuted): as ``Mesh._in_use``
                    # does for the data plane, it loses its abort
                    self.manager.clear_abort(view.epoch)
            return self.manager.run(view, op)
        self._staging(view, op)  # host buffers (TCP) and dtypes NCCL lacks (int16)
        return CollectiveResult(view.epoch, view.node_ids, op.buffer)

    def _staging(self, view: RingView, op: CollectiveOp) -> None:
        if op.kind is Kind.ALLREDUCE:
            self.mesh.allreduce_on(view, op.buffer, op.op)
        else:
            self.mesh.broadcast_on(view, op.buffer, view.members[op.root].node_id)

    def _choose(self, view: RingView) -> Backend:
        metas = {m.node: m.meta for m in self.mesh.members()}
        infos = [parse_devices(metas.get(nid, {})) for nid in view.node_ids]
        self.bad_meta += sum(
            1
            for nid, info in zip(view.node_ids, infos, strict=True)
            if info is None and DEVICES_KEY in metas.get(nid, {})
        )
        return view_backend(infos)
