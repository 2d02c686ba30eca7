"""Blocking facade for training loops that are not written in trio.

Theory of operation: ``SyncDataPlane.start`` runs ``open_data_plane`` inside ``trio.run`` on a
private daemon thread and waits until the listener is bound. Collectives run on a
``ViewSession`` (``session(view)``) like a mesh member's: on a view whose ring is open straight
in the caller's thread, a new view's ring opened first by the trio thread. Calls are
serialised; the arrays are shared, not copied. Don't use the underlying async ``dp``
concurrently with this facade. ``close()`` (or leaving the ``with``
block) cancels the trio run and joins the thread, bounded by ``join_timeout``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TypeVar

import trio

from ..errors import FtmeshError, MeshClosedError
from ..security import MeshAuth
from .config import CollectiveConfig
from .dataplane import DataPlane, open_data_plane
from .jobs import JobThread
from .session import Host, ViewSession
from .transport import Ring
from .view import RingView

T = TypeVar("T")


class SyncDataPlane:
    """A data plane outside a mesh (benchmarks, tests), in a trio thread of its own; its
    collectives run on ``session(view)``. Use ``SyncDataPlane.start``."""

    def __init__(self) -> None:
        self._dp: DataPlane | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._jobs = JobThread("ftmesh-dp-collectives")
        self._host: Host | None = None

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

    def _open_ring(self, view: RingView) -> Ring:
        return trio.from_thread.run(self.dp.open_ring, view, trio_token=self._token)

    def open_ring(self, view: RingView) -> None:
        """Connect to the view's neighbours and agree on its epoch now (the first collective on
        a view does it otherwise)."""
        if self.dp.cached_ring(view) is None:
            self._open_ring(view)

    def session(self, view: RingView) -> ViewSession:
        """The collectives of ``view`` (``ViewSession``): the only way to run one here."""
        if self._host is None:
            dp = self.dp
            self._host = Host(dp, self._jobs, dp.cached_ring, self._open_ring)
        return ViewSession(view, self._host)

    def abort_view(self, epoch: str, peer: str, reason: str) -> None:
        """``DataPlane.abort_view`` from any thread (it hops to the trio thread); a collective
        blocked in another thread on that epoch then raises ``RingPeerLostError``."""
        dp, token = self.dp, self._token
        trio.from_thread.run_sync(dp.abort_view, epoch, peer, reason, trio_token=token)

    def close(self, join_timeout: float = 10.0) -> None:
        self._jobs.close(0)
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
