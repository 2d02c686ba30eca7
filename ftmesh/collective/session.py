"""One collective session per view: the one way into a collective from outside trio.

Theory of operation. A ``ViewSession`` holds the collectives of exactly one agreed view
(``RingView``) of one member. Every blocking caller -- the trainer's gradient buckets, its
state sync, ZeRO's shard exchange, the GPU epochs' control channel, a user's
``mesh.session(view).allreduce(x)``, the benchmarks -- goes through it:

1. *One description.* A collective is an ``ops.CollectiveOp`` (kind, op, root, compression,
   I/O timeout) plus this member's buffer.
2. *One backend choice.* A device buffer (a torch CUDA tensor, a CuPy array) runs on the
   member's GPU path when it has one and the view was set up on NCCL (``GpuPath``: one
   communicator per view epoch, ``epochs.EpochManager``); everything else -- host buffers,
   views that fell back, kinds or dtypes NCCL lacks -- runs on the TCP ring, device buffers
   staged through host memory (``ops.stage``).
3. *One place that opens rings.* If the view's ring is open (``Host.ring_in_use``), the
   collective drives its sockets straight from the calling thread (the engine is blocking
   socket code); if not, the host opens it in its trio thread first (``Host.open_ring``:
   connect, agree on the epoch with both neighbours) and the collective then runs here.
4. *One order.* Collectives of one member run one at a time in call order, across all its
   sessions: ``run`` waits for the ones ``submit``ted before it (``jobs.JobThread``), and
   ``submit`` returns a future, e.g. for a gradient bucket launched during backward.

Failures are the data plane's typed errors (``errors``, ``aborts``): a loss names the peer,
and the host hears of it (``Host.peer_lost``: membership's fast path) before it is raised.
The session never retries: a view that failed is over, and choosing the next one is the
caller's (the training step machine's) business.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .backend import Backend, call_backend
from .dataplane import CollectiveResult, DataPlane
from .errors import RingPeerLostError
from .jobs import JobThread
from .ops import CollectiveOp, Kind
from .transport import Ring
from .view import RingView

if TYPE_CHECKING:
    from .epochs import EpochManager
    from .ring_store import ViewCollectives

T = TypeVar("T")


def is_device_buffer(x: Any) -> bool:
    """A torch CUDA tensor or a CuPy array (looked up without importing either)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return bool(x.is_cuda)
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


@dataclass(frozen=True)
class Host:
    """What a session needs from the member that owns it (a ``SyncMesh``, or a bare
    ``SyncDataPlane`` for benchmarks and tests). All four are safe from any thread."""

    plane: DataPlane
    jobs: JobThread
    ring_in_use: Callable[[RingView], Ring | None]
    """The view's open ring if collectives may run on it now, else None (never blocks)."""
    open_ring: Callable[[RingView], Ring]
    """Open the view's ring (blocking: the host's trio thread connects and agrees)."""
    peer_lost: Callable[[str], None] = lambda peer: None
    """Told of a peer a collective lost, before the error is raised."""


class GpuPath:
    """A member's GPU backend: NCCL communicators per view epoch (``EpochManager``) for the
    device buffers of views set up on NCCL. ``is_device`` tells device buffers apart (tests
    inject one that takes host arrays to a fake NCCL)."""

    def __init__(
        self,
        manager: EpochManager,
        is_device: Callable[[Any], bool] = is_device_buffer,
        current_view: Callable[[], RingView | None] = lambda: None,
    ) -> None:
        self.manager = manager
        self.is_device = is_device
        self._current_view = current_view

    def backend_for(self, view: RingView, op: CollectiveOp, x: Any) -> Backend:
        """NCCL if ``x`` is a device buffer whose dtype NCCL reduces, ``op`` is one a
        communicator runs, and the view is set up on NCCL or not set up yet; else staging
        (device buffers) or TCP (host buffers)."""
        from .epochs import GPU_KINDS

        device = self.is_device(x)
        if op.kind not in GPU_KINDS or op.compression is not None:
            return Backend.STAGING if device else Backend.TCP
        chosen = self.manager.backend_of(view) or Backend.NCCL
        return call_backend(chosen, device, str(getattr(x, "dtype", "")).removeprefix("torch."))

    def run(self, view: RingView, op: CollectiveOp, x: T) -> CollectiveResult[T]:
        from .epochs import GpuCall

        if self.manager.aborted(view.epoch) is not None:
            current = self._current_view()
            if current is not None and current.epoch == view.epoch:
                # the view is current again (a suspect refuted): as ``Mesh._in_use`` does for
                # the data plane, it loses its abort
                self.manager.clear_abort(view.epoch)
        return self.manager.run(view, GpuCall.of(view, op, x))


class ViewSession:
    """The collectives of one view on one member; see the module doc. Get one from
    ``SyncMesh.session(view)`` (or ``SyncDataPlane.session(view)``)."""

    def __init__(self, view: RingView, host: Host, gpu: GpuPath | None = None) -> None:
        view.rank_of(host.plane.node_id)  # LocalUsageError if we are not a member
        self.view = view
        self._host = host
        self._gpu = gpu

    @property
    def node_id(self) -> str:
        return self._host.plane.node_id

    @property
    def rank(self) -> int:
        return self.view.rank_of(self.node_id)

    @property
    def size(self) -> int:
        return self.view.size

    # -- the two ways to run one collective -------------------------------------------------------
    def run(self, op: CollectiveOp, x: T) -> CollectiveResult[T]:
        """Run ``op`` on ``x`` in this thread, after every collective submitted before it."""
        return self._host.jobs.run(self._run, op, x)

    def submit(self, op: CollectiveOp, x: T) -> Future[CollectiveResult[T]]:
        """Queue ``op`` on ``x`` (in order with ``run`` and other ``submit``s) and return at
        once; the future holds the result or the typed error."""
        return self._host.jobs.submit(self._run, op, x)

    # -- conveniences -------------------------------------------------------------------------
    def allreduce(self, x: T, op: str = "sum", compression: Any = None) -> CollectiveResult[T]:
        """``x`` reduced in place; ``compression``: None, ``"int8"`` or an
        ``Int8Compression`` (see ``DataPlane.plan``)."""
        return self.run(CollectiveOp.allreduce(op, compression), x)

    def reduce_scatter(self, x: T, op: str = "sum") -> CollectiveResult[T]:
        return self.run(CollectiveOp(kind=Kind.REDUCE_SCATTER, op=op), x)

    def allgather(self, x: T) -> CollectiveResult[T]:
        return self.run(CollectiveOp(kind=Kind.ALLGATHER), x)

    def broadcast(self, x: T, root: str) -> CollectiveResult[T]:
        return self.run(CollectiveOp(kind=Kind.BROADCAST, root=root), x)

    def barrier(self, io_timeout: float | None = None) -> CollectiveResult[None]:
        """``io_timeout`` raises the wait for a neighbour to enter (see ``DataPlane.plan``)."""
        return self.run(CollectiveOp(kind=Kind.BARRIER, io_timeout=io_timeout), None)

    def backend_for(self, op: CollectiveOp, x: Any) -> Backend:
        """The backend ``op`` on ``x`` would run on now."""
        if self._gpu is None:
            return Backend.STAGING if is_device_buffer(x) else Backend.TCP
        return self._gpu.backend_for(self.view, op, x)

    # -- execution ----------------------------------------------------------------------------
    def _run(self, op: CollectiveOp, x: T) -> CollectiveResult[T]:
        if self._gpu is not None and self._gpu.backend_for(self.view, op, x) is Backend.NCCL:
            return self._gpu.run(self.view, op, x)
        return self.run_on_ring(op, x)

    def run_on_ring(self, op: CollectiveOp, x: T) -> CollectiveResult[T]:
        """The TCP ring's path, whatever the buffer (device buffers are staged), outside the
        order of ``run``: for the GPU path's set-up and staging, which run inside a collective
        of this member already (``NestedSession``)."""
        host, view = self._host, self.view
        ring = host.ring_in_use(view) or host.open_ring(view)
        try:
            if host.plane.hierarchical(view, op):  # (three phases on sub-views: dataplane)
                phases = host.plane.plan_phases(view, op, x)
                return host.plane.run_phases_blocking(
                    phases, lambda sub: host.ring_in_use(sub) or host.open_ring(sub)
                )
            return host.plane.run_plan_blocking(ring, host.plane.plan(view, op, x))
        except RingPeerLostError as exc:
            if exc.peer:
                host.peer_lost(exc.peer)
            raise


class NestedSession:
    """One view's collectives on its TCP ring *outside* the order of ``ViewSession.run``
    (``ViewSession.run_on_ring``), for code that runs inside a collective of this member
    already: the GPU path's set-up -- the epoch manager's control channel and the store
    rounds of torch's process group (``torch_pg``) -- and its host staging. Through ``run``
    they would queue behind the very collective they run in: ``JobThread.run`` waits for the
    last job submitted, and one submitted meanwhile (a gradient bucket) waits for the running
    one, which waits for this call. Satisfies ``ring_store.ViewCollectives``."""

    def __init__(self, session: ViewSession) -> None:
        self._session = session

    @property
    def view(self) -> RingView:
        return self._session.view

    @property
    def node_id(self) -> str:
        return self._session.node_id

    def allreduce(self, x: T, op: str = "sum") -> CollectiveResult[T]:
        return self._session.run_on_ring(CollectiveOp(kind=Kind.ALLREDUCE, op=op), x)

    def allgather(self, x: T) -> CollectiveResult[T]:
        return self._session.run_on_ring(CollectiveOp(kind=Kind.ALLGATHER), x)

    def broadcast(self, x: T, root: str) -> CollectiveResult[T]:
        return self._session.run_on_ring(CollectiveOp(kind=Kind.BROADCAST, root=root), x)

    def barrier(self) -> CollectiveResult[None]:
        return self._session.run_on_ring(CollectiveOp(kind=Kind.BARRIER), None)


def nested_sessions(
    sessions: Callable[[RingView], ViewSession],
) -> Callable[[RingView], NestedSession]:
    """``sessions`` (``mesh.session``) as ``NestedSession``s."""
    return lambda view: NestedSession(sessions(view))


class SessionRing:
    """``tcp_backend.RingOps`` (collectives that name their view) on a member's sessions:
    ``sessions(view)`` runs them. The one adapter between the GPU epochs' interfaces and the
    sessions, for every caller: the mesh's GPU path gives it ``nested_sessions(mesh.session)``
    (it runs inside collectives); a caller outside any collective (a test, a benchmark, the
    device check driving an ``EpochManager`` itself) may give it ``mesh.session`` as it is."""

    def __init__(self, sessions: Callable[[RingView], ViewCollectives]) -> None:
        self._sessions = sessions

    def allreduce(self, view: RingView, x: T, op: str = "sum") -> CollectiveResult[T]:
        return self._sessions(view).allreduce(x, op)

    def broadcast(self, view: RingView, x: T, root: str) -> CollectiveResult[T]:
        return self._sessions(view).broadcast(x, root)
