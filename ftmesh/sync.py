"""Blocking facade over :class:`ftmesh.mesh.Mesh` for training loops not written in trio.

Theory of operation: :meth:`SyncMesh.start` runs ``open_mesh`` inside ``trio.run`` on a private
daemon thread and waits until the member has joined. Each blocking call is handed to that
thread with ``trio.from_thread.run`` and waits for its result; exceptions travel back
unchanged. Collectives on a given view (``*_on``, ``submit_on_view``) skip trio once their
ring is open (``Mesh.ring_in_use``): they drive the ring's sockets straight from the caller's
thread, or, when submitted, from one job thread that runs them in submission order.
``close()`` (or leaving the ``with`` block) leaves the mesh gracefully and joins the thread,
bounded by a timeout.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import trio

from .collective import CollectiveResult, RingPeerLostError, RingView
from .errors import MeshClosedError
from .job_thread import JobThread
from .membership.messages import MemberSnapshot
from .mesh import Mesh, MeshConfig, open_mesh
from .state import Lookup, Snapshot, TransferStats

T = TypeVar("T")


class SyncMesh:
    """Blocking twin of :class:`Mesh`. Create with :meth:`start` or :func:`ftmesh.connect`."""

    def __init__(self) -> None:
        self._mesh: Mesh | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._jobs = JobThread("ftmesh-collectives")

    @classmethod
    def start(cls, config: MeshConfig | None = None, start_timeout: float = 30.0) -> SyncMesh:
        self = cls()

        async def main() -> None:
            try:
                async with open_mesh(config) as mesh:
                    self._mesh = mesh
                    self._token = trio.lowlevel.current_trio_token()
                    self._stop = trio.Event()
                    self._ready.set()
                    await self._stop.wait()
            except BaseException as exc:
                self._error = exc
                raise
            finally:
                self._ready.set()

        def thread_main() -> None:
            with contextlib.suppress(BaseException):  # reported through self._error
                trio.run(main)

        self._thread = threading.Thread(target=thread_main, name="ftmesh-mesh", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise MeshClosedError(f"mesh did not start within {start_timeout}s")
        if self._error is not None or self._mesh is None:
            raise MeshClosedError(f"mesh failed to start: {self._error!r}") from self._error
        return self

    @property
    def mesh(self) -> Mesh:
        if self._mesh is None or self._stop is None or self._stop.is_set():
            raise MeshClosedError("the mesh is closed")
        return self._mesh

    @property
    def node_id(self) -> str:
        return self.mesh.node_id

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in the mesh's trio thread and return its result."""
        self.mesh  # noqa: B018 - raises if closed
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled) as exc:  # closed meanwhile
            raise MeshClosedError(f"mesh closed: {exc!r}") from None

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
        """Queue ``await fn(*args)`` in the mesh's trio thread without waiting; the returned
        future completes with its result or exception. Submitted calls (these and
        ``submit_on_view``) run one at a time, in submission order: members must issue their
        collectives in the same order."""
        self.mesh  # noqa: B018 - raises if closed
        return self._jobs.submit(self.call, fn, *args)

    def submit_on_view(
        self, view: RingView, kind: str, x: T, op: str = "sum", compression: Any = None
    ) -> Future[CollectiveResult[T]]:
        """``Mesh.on_view`` without waiting (in order with ``submit``): e.g. a gradient
        bucket's allreduce launched during backward."""
        self.mesh  # noqa: B018 - raises if closed
        return self._jobs.submit(self._on_view, view, kind, x, op, "", None, compression)

    def _on_view(
        self,
        view: RingView,
        kind: str,
        x: T,
        op: str,
        root: str,
        io_timeout: float | None,
        compression: Any = None,
    ) -> CollectiveResult[T]:
        mesh = self.mesh
        ring = mesh.ring_in_use(view)
        if ring is None:  # a new view (or a broken ring): trio opens it
            return self.call(mesh.on_view, view, kind, x, op, root, io_timeout, compression)
        plan = mesh.data_plane.plan_on(view, kind, x, op, root, io_timeout, compression)
        try:
            return mesh.data_plane.run_plan_blocking(ring, plan)
        except RingPeerLostError as exc:
            self.call_sync(mesh.node.report_unreachable, exc.peer)
            raise

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the non-blocking ``fn(*args)`` in the mesh's trio thread."""
        self.mesh  # noqa: B018 - raises if closed
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def view(self) -> RingView | None:
        return self.call_sync(self.mesh.view)

    def members(self) -> list[MemberSnapshot]:
        return self.call_sync(self.mesh.node.members)

    def wait_view(
        self, *, min_members: int = 1, settle: float = 0.0, timeout: float = 60.0
    ) -> RingView:
        """See :meth:`Mesh.wait_view`. Without ``settle``, a view that collectives already run
        on (``Mesh.view_in_use``) is returned straight away, from this thread."""
        view = self.mesh.view_in_use() if settle == 0 else None
        if view is not None and view.size >= min_members and self.node_id in view:
            return view

        async def wait() -> RingView:
            return await self.mesh.wait_view(
                min_members=min_members, settle=settle, timeout=timeout
            )

        return self.call(wait)

    def set_role(self, role: str) -> None:
        self.call_sync(self.mesh.set_role, role)

    @property
    def role(self) -> str:
        return self.call_sync(lambda: self.mesh.role)

    def wait_quiet(self, settle: float, timeout: float = 60.0) -> None:
        self.call(self.mesh.wait_quiet, settle, timeout)

    def allreduce(self, x: T, op: str = "sum", compression: Any = None) -> CollectiveResult[T]:
        """See :meth:`Mesh.allreduce`; ``compression``: ``"int8"`` or an ``Int8Compression``
        (``DataPlane.allreduce``)."""
        return self._jobs.run(self.call, self.mesh.allreduce, x, op, compression)

    def reduce_scatter(self, x: T, op: str = "sum") -> CollectiveResult[T]:
        return self._jobs.run(self.call, self.mesh.reduce_scatter, x, op)

    def allgather(self, x: T) -> CollectiveResult[T]:
        return self._jobs.run(self.call, self.mesh.allgather, x)

    def broadcast(self, x: T, root: str) -> CollectiveResult[T]:
        return self._jobs.run(self.call, self.mesh.broadcast, x, root)

    def barrier(self) -> CollectiveResult[None]:
        return self._jobs.run(self.call, self.mesh.barrier)

    def allreduce_on(
        self, view: RingView, x: T, op: str = "sum", compression: Any = None
    ) -> CollectiveResult[T]:
        """Allreduce on exactly ``view``; see :meth:`Mesh.on_view`. Runs in this thread, after
        the collectives submitted before it."""
        return self._jobs.run(self._on_view, view, "allreduce", x, op, "", None, compression)

    def broadcast_on(self, view: RingView, x: T, root: str) -> CollectiveResult[T]:
        """Broadcast from ``root`` on exactly ``view``; see :meth:`allreduce_on`."""
        return self._jobs.run(self._on_view, view, "broadcast", x, "sum", root, None)

    def allgather_on(self, view: RingView, x: T) -> CollectiveResult[T]:
        """``allgather`` on exactly ``view``; see :meth:`allreduce_on`."""
        return self._jobs.run(self._on_view, view, "allgather", x, "sum", "", None)

    def barrier_on(self, view: RingView, io_timeout: float | None = None) -> None:
        """``barrier`` on exactly ``view``; see :meth:`allreduce_on`."""
        self._jobs.run(self._on_view, view, "barrier", None, "sum", "", io_timeout)

    def serve_state(self, source: Lookup) -> tuple[str, int]:
        """See :meth:`Mesh.serve_state`; ``source`` is called from the mesh's thread."""
        return self.call(self.mesh.serve_state, source)

    def fetch_state(
        self,
        holders: Sequence[str],
        step: int,
        digest: str,
        stats: TransferStats | None = None,
        buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None,
    ) -> Snapshot:
        """See :meth:`Mesh.fetch_state`."""
        return self.call(self.mesh.fetch_state, holders, step, digest, stats, buffer)

    def advertise_state(self, nbytes: int) -> None:
        """See :meth:`Mesh.advertise_state`."""
        self.call_sync(self.mesh.advertise_state, nbytes)

    def advertised_state_bytes(self) -> int:
        """See :meth:`Mesh.advertised_state_bytes`."""
        return self.call_sync(self.mesh.advertised_state_bytes)

    def drop_view(self, view: RingView) -> None:
        """Reconnect ``view``'s ring before its next collective; see ``DataPlane.drop_view``."""
        self.call_sync(self.mesh.data_plane.drop_view, view.epoch)

    def wait_view_change(self, epoch: str, timeout: float) -> RingView | None:
        """Block until the view's epoch differs from ``epoch`` (or ``timeout`` seconds);
        returns the view then."""

        async def wait() -> RingView | None:
            with trio.move_on_after(timeout):
                while (v := self.mesh.view()) is None or v.epoch == epoch:
                    await self.mesh.view_changed()
            return self.mesh.view()

        return self.call(wait)

    def close(self, join_timeout: float = 10.0) -> None:
        self._jobs.close(0)  # refuse new collectives; closing the mesh ends running ones
        if self._stop is not None and self._token is not None and not self._stop.is_set():
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        if self._thread is not None:
            self._thread.join(join_timeout)
        self._jobs.close(join_timeout)

    def __enter__(self) -> SyncMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ENV_PREFIX = "FTMESH_"


def connect(
    *,
    mesh: str | None = None,
    discovery: str | None = None,
    join: tuple[str, ...] | None = None,
    preset: str | None = None,
    role: str = "train",
    start_timeout: float = 30.0,
) -> SyncMesh:
    """Join a training mesh from a plain (non-trio) program; the usual entry point of a
    training script started by ``ftmesh launch`` or ``ftmesh worker``.

    Every argument left as ``None`` falls back to the environment those commands set
    (``FTMESH_MESH``, ``FTMESH_DISCOVERY``, ``FTMESH_JOIN`` (comma-separated),
    ``FTMESH_PRESET``, ``FTMESH_INTERFACE``, ``FTMESH_BIND``, ``FTMESH_PORT``,
    ``FTMESH_REGISTRY_DIR``,
    ``FTMESH_SECRET_FILE``), then to the defaults: mesh ``default``, ``local`` discovery, the
    ``lan`` preset. Explicit arguments always win over the environment.
    """
    import os

    from .membership.config import MembershipConfig
    from .net.node import NodeConfig
    from .security import load_secrets

    env = os.environ
    joins = (
        join if join is not None else tuple(j for j in env.get("FTMESH_JOIN", "").split(",") if j)
    )
    disc = discovery or env.get("FTMESH_DISCOVERY") or ("seeds" if joins else "local")
    interface = env.get("FTMESH_INTERFACE", "")
    bind = env.get("FTMESH_BIND", "") or (interface if disc == "mdns" and interface else "")
    node = NodeConfig(
        mesh=mesh or env.get("FTMESH_MESH", "default"),
        discovery=disc,
        join=joins,
        bind=bind or "127.0.0.1",
        port=int(env.get("FTMESH_PORT") or 0),
        interface=interface,
        registry_dir=env.get("FTMESH_REGISTRY_DIR", ""),
        membership=MembershipConfig.preset(preset or env.get("FTMESH_PRESET", "lan")),
        auth=load_secrets(env.get("FTMESH_SECRET_FILE") or None),
    )
    return SyncMesh.start(MeshConfig(node=node, role=role), start_timeout=start_timeout)
