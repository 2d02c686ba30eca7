"""``ViewCollectives`` (the collective session of one view) on today's blocking faces.

The one place the tests adapt ``SyncMesh`` and ``SyncDataPlane`` to the session interface;
once ``mesh.session(view)`` exists, ``mesh_session`` becomes that call.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ftmesh.collective import CollectiveResult, RingView, SyncDataPlane
from ftmesh.mesh.blocking import SyncMesh

T = TypeVar("T")


class MeshSession:
    """The collectives of exactly ``view`` on a ``SyncMesh`` member."""

    def __init__(self, mesh: SyncMesh, view: RingView) -> None:
        self._mesh = mesh
        self._view = view

    @property
    def view(self) -> RingView:
        return self._view

    @property
    def node_id(self) -> str:
        return self._mesh.node_id

    def allreduce(self, x: T, op: str = "sum") -> CollectiveResult[T]:
        return self._mesh.allreduce_on(self._view, x, op)

    def allgather(self, x: T) -> CollectiveResult[T]:
        return self._mesh.allgather_on(self._view, x)

    def broadcast(self, x: T, root: str) -> CollectiveResult[T]:
        return self._mesh.broadcast_on(self._view, x, root)

    def barrier(self) -> CollectiveResult[None]:
        self._mesh.barrier_on(self._view)
        return CollectiveResult(self._view.epoch, self._view.node_ids, None)


def mesh_session(mesh: SyncMesh, view: RingView) -> MeshSession:
    return MeshSession(mesh, view)


class PlaneSession:
    """The collectives of exactly ``view`` on an in-process ``SyncDataPlane``."""

    def __init__(self, dp: SyncDataPlane, view: RingView) -> None:
        self._dp = dp
        self._view = view

    @property
    def view(self) -> RingView:
        return self._view

    @property
    def node_id(self) -> str:
        return self._dp.node_id

    def allreduce(self, x: T, op: str = "sum") -> CollectiveResult[T]:
        return self._dp.allreduce(self._view, x, op)

    def allgather(self, x: T) -> CollectiveResult[T]:
        return self._dp.allgather(self._view, x)

    def broadcast(self, x: T, root: str) -> CollectiveResult[T]:
        return self._dp.broadcast(self._view, x, root)

    def barrier(self) -> CollectiveResult[None]:
        return self._dp.barrier(self._view)


def plane_sessions(dp: SyncDataPlane) -> Any:
    """``Sessions`` of one in-process member: any view, on its data plane."""
    return lambda view: PlaneSession(dp, view)
