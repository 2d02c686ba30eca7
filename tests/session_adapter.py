"""The collective sessions the torch process-group tests use: ``mesh.session(view)`` on a mesh
member, ``dp.session(view)`` on a bare in-process data plane (``ViewSession`` satisfies
``ring_store.ViewCollectives``)."""

from __future__ import annotations

from collections.abc import Callable

from ftmesh.collective import RingView, SyncDataPlane
from ftmesh.collective.session import ViewSession
from ftmesh.mesh.blocking import SyncMesh


def mesh_session(mesh: SyncMesh, view: RingView) -> ViewSession:
    return mesh.session(view)


def PlaneSession(dp: SyncDataPlane, view: RingView) -> ViewSession:
    return dp.session(view)


def plane_sessions(dp: SyncDataPlane) -> Callable[[RingView], ViewSession]:
    """Sessions of one in-process member: any view, on its data plane."""
    return dp.session
