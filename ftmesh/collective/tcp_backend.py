"""The TCP ring behind the GPU epoch interfaces: the control channel, and a communicator.

``TcpControl`` is the ``epochs.ControlChannel`` of a member: the NCCL set-up record travels
as a broadcast on the view's TCP ring (authenticated, and ordered with the ring's other
collectives), the agreement as an allreduce(min). ``TcpFactory`` makes ``epochs``
communicators that run on the same ring (host buffers), so the epoch manager's lifecycle --
id exchange, epochs, deadlines, aborts -- is tested end to end without a GPU. (Their init is
immediate: anything it sent on the ring would interleave with the control channel's
collectives, which an NCCL init, on its own sockets, never does.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import FtmeshError
from .aborts import NCCL_REMOTE_ERROR, CommFailure
from .epochs import GpuCall
from .errors import RingPeerLostError
from .ops import Kind
from .view import RingView


class RingOps(Protocol):
    """The TCP ring collectives ``TcpControl`` uses (``SyncDataPlane`` has them)."""

    def allreduce(self, view: RingView, x: Any, op: str = "sum") -> Any: ...
    def broadcast(self, view: RingView, x: Any, root: str) -> Any: ...


class TcpControl:
    def __init__(self, ring: RingOps) -> None:
        self._ring = ring

    def broadcast_bytes(self, view: RingView, payload: bytes, root: str) -> bytes:
        buf = np.frombuffer(payload, np.uint8).copy()
        self._ring.broadcast(view, buf, root)
        return buf.tobytes()

    def agree(self, view: RingView, ok: bool, token: bytes) -> bool:
        # one allreduce(min) of [ok, token, -token]: min(-t) = -max(t), so the token part
        # shows whether every member passed the same token
        t = np.frombuffer(token, np.uint8).astype(np.int32)
        vote = np.concatenate([[1 if ok else 0], t, -t]).astype(np.int32)
        self._ring.allreduce(view, vote, "min")
        lo, neg_hi = vote[1 : 1 + t.size], vote[1 + t.size :]
        return bool(vote[0] == 1 and np.array_equal(lo, -neg_hi))


class TcpCommunicator:
    """A communicator on the TCP ring: each step runs in a worker thread, polled."""

    def __init__(self, ring: RingOps, view: RingView, uid: bytes, abort: Callable[[], None]):
        self._ring = ring
        self._view = view
        self._abort = abort
        self._aborted = False
        self._lock = threading.Lock()
        """Makes ``start`` and ``abort`` atomic: a collective started after an abort (the
        manager aborted between choosing the epoch and starting) would run on unseen."""
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.uid = uid

    def _spawn(self, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by ready()/done()
                self._error = exc

        self._error = None
        self._thread = threading.Thread(target=run, name="ftmesh-tcp-comm", daemon=True)
        self._thread.start()

    def _poll(self) -> bool:
        if self._aborted:
            raise CommFailure(-2, "communicator aborted")
        if self._thread is not None and self._thread.is_alive():
            return False
        err = self._error
        if isinstance(err, CommFailure):
            raise err
        if isinstance(err, RingPeerLostError):
            raise CommFailure(NCCL_REMOTE_ERROR, str(err))
        if isinstance(err, FtmeshError):
            raise CommFailure(3, str(err))
        if err is not None:
            raise err
        return True

    def ready(self) -> bool:
        return self._poll()

    def start(self, op: GpuCall) -> None:
        ring, view = self._ring, self._view
        with self._lock:
            if self._aborted:  # as NCCL refuses a collective on an aborted communicator
                raise CommFailure(-2, "communicator aborted")
            if op.kind is Kind.ALLREDUCE:
                self._spawn(lambda: ring.allreduce(view, op.buffer, op.op))
            else:
                root = view.members[op.root].node_id
                self._spawn(lambda: ring.broadcast(view, op.buffer, root))

    def done(self) -> bool:
        return self._poll()

    def abort(self) -> None:
        """Fail the TCP collective in flight, if any: that aborts the ring's epoch on this
        member (shared with the control channel and staging), so only then."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            running = self._thread is not None and self._thread.is_alive()
        if running:
            self._abort()


class TcpFactory:
    """``epochs.CommFactory`` over a member's TCP ring. ``abort_view(epoch)`` fails the TCP
    collectives running on that epoch (``SyncDataPlane.abort_view``)."""

    name = "tcp"

    def __init__(self, ring: RingOps, abort_view: Callable[[str], None]) -> None:
        self._ring = ring
        self._abort_view = abort_view
        self.aborted: list[list[str]] = []
        """Epochs of each ``abort_group`` call, in order (what the tests read)."""

    def unique_id(self) -> bytes:
        return os.urandom(16)

    def create(self, view: RingView, node_id: str, uid: bytes) -> TcpCommunicator:
        return TcpCommunicator(self._ring, view, uid, lambda: self._abort_view(view.epoch))

    def abort_group(self, comms: Sequence[Any]) -> None:
        self.aborted.append([c._view.epoch for c in comms])
        for c in comms:
            c.abort()
