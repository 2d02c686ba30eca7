"""Blocking facade for training loops that are not written in trio.

Theory of operation: ``SyncDataPlane.start`` runs ``open_data_plane`` inside ``trio.run`` on a
private daemon thread and waits until the listener is bound. A collective on a view whose ring is
already open runs straight in the caller's thread (the engine is blocking-socket code, see
``engine``); opening a ring for a new view is handed to the trio thread with
``trio.from_thread.run``. Calls are serialised; the arrays are shared, not copied. Don't use the
underlying async ``dp`` concurrently with this facade. ``close()`` (or leaving the ``with``
block) cancels the trio run and joins the thread, bounded by ``join_timeout``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, TypeVar

import trio

from ..errors import FtmeshError, MeshClosedError
from ..security import MeshAuth
from .config import CollectiveConfig
from .dataplane import CollectiveResult, DataPlane, Plan, open_data_plane
from .view import RingView

T = TypeVar("T")


class SyncDataPlane:
    """Same collectives as ``DataPlane``, as blocking calls. Use ``SyncDataPlane.start``."""

    def __init__(self) -> None:
        self._dp: DataPlane | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._call_lock = threading.Lock()

    @classmethod
    def start(
        cls,
        node_id: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        auth: MeshAuth | None = None,
        mesh: str = "default",
        config: CollectiveConfig | None = None,
        start_timeout: float = 30.0,
    ) -> SyncDataPlane:
        self = cls()

        async def main() -> None:
            try:
                async with open_data_plane(
                    node_id, host=host, port=port, auth=auth, mesh=mesh, config=config
                ) as dp:
                    self._dp = dp
                    self._token = trio.lowlevel.current_trio_token()
                    self._stop = trio.Event()
                    self._ready.set()
                    await self._stop.wait()
            finally:
                self._ready.set()

        def thread_main() -> None:
            try:
                trio.run(main)
            except BaseException as exc:  # reported to start() / close()
                self._error = exc

        self._thread = threading.Thread(
            target=thread_main, name=f"ftmesh-dp-{node_id}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(start_timeout) or self._dp is None:
            self.close()
            raise FtmeshError(f"data plane did not start: {self._error!r}") from self._error
        return self

    @property
    def dp(self) -> DataPlane:
        if self._dp is None or self._token is None:
            raise MeshClosedError("data plane is closed")
        return self._dp

    @property
    def address(self) -> tuple[str, int]:
        return self.dp.address

    @property
    def node_id(self) -> str:
        return self.dp.node_id

    def _run(self, plan: Plan[T]) -> CollectiveResult[T]:
        dp, token = self.dp, self._token
        with self._call_lock:
            ring = dp.cached_ring(plan.view)
            if ring is None:
                ring = trio.from_thread.run(dp.open_ring, plan.view, trio_token=token)
            return dp.run_plan_blocking(ring, plan)

    def open_ring(self, view: RingView) -> None:
        """Connect to the view's neighbours and agree on its epoch now (the first collective on
        a view does it otherwise)."""
        dp, token = self.dp, self._token
        with self._call_lock:
            if dp.cached_ring(view) is None:
                trio.from_thread.run(dp.open_ring, view, trio_token=token)

    def allreduce(
        self, view: RingView, x: T, op: str = "sum", compression: Any = None
    ) -> CollectiveResult[T]:
        """See ``DataPlane.allreduce`` (``compression``: ``"int8"``, an ``Int8Compression``)."""
        return self._run(self.dp.plan_allreduce(view, x, op, compression))

    def reduce_scatter(self, view: RingView, x: T, op: str = "sum") -> CollectiveResult[T]:
        return self._run(self.dp.plan_reduce_scatter(view, x, op))

    def allgather(self, view: RingView, x: T) -> CollectiveResult[T]:
        return self._run(self.dp.plan_allgather(view, x))

    def broadcast(self, view: RingView, x: T, root: str) -> CollectiveResult[T]:
        return self._run(self.dp.plan_broadcast(view, x, root))

    def barrier(self, view: RingView) -> CollectiveResult[None]:
        return self._run(self.dp.plan_barrier(view))

    def abort_view(self, epoch: str, peer: str, reason: str) -> None:
        """``DataPlane.abort_view`` from any thread (it hops to the trio thread); a collective
        blocked in another thread on that epoch then raises ``RingPeerLostError``."""
        dp, token = self.dp, self._token
        trio.from_thread.run_sync(dp.abort_view, epoch, peer, reason, trio_token=token)

    def close(self, join_timeout: float = 10.0) -> None:
        token, stop = self._token, self._stop
        self._dp = None
        self._token = None
        if token is not None and stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(stop.set, trio_token=token)
        if self._thread is not None:
            self._thread.join(join_timeout)

    def __enter__(self) -> SyncDataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
