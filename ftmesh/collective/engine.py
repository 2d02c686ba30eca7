"""The pipelined ring engine: drives one member's half of a ``Schedule`` over its two sockets.

Theory of operation: two threads per collective, on blocking sockets whose every send and
receive times out after ``io_timeout`` (SO_SNDTIMEO/SO_RCVTIMEO). The *sender* writes
``HEADER``, then each send of the schedule as a ``DATA`` frame once the receives it depends on
are done, then ``DONE`` once all receives are done. The *receiver* reads the left neighbour's
``HEADER`` and compares it with ours, then ``recv_into``s each ``DATA`` frame (``MSG_WAITALL``:
one syscall per chunk) straight into place (allgather, broadcast) or into one chunk-sized
scratch buffer that is reduced into place on arrival (reduce-scatter). No other copies are made.

Why threads and not trio tasks: on a CPU-bound host (several members per core) the time goes
into the kernel's copies and the reduction, all of which release the GIL; two threads let the
send copy, the receive copy and the reduction of one member proceed in parallel, and blocking
calls avoid an event-loop round trip per partial read. Trio still owns connection setup,
agreement and cancellation (``DataPlane`` runs ``run_blocking`` via ``trio.to_thread`` and shuts
the sockets down if cancelled).

Failure handling keeps every member informed without any coordinator:

* a mismatching header, a closed connection or a malformed frame sets the *abort reason*;
* a sender that has not yet sent ``DONE`` replaces the rest of its stream by one ``ABORT`` frame
  carrying the reason, so the abort travels round the ring and every member raises it;
* a receiver that originated an abort keeps reading (and discarding) from its left until that
  neighbour's ``ABORT`` or ``DONE``, so nobody blocks writing into a socket no one reads and the
  connections stay in sync for the next collective;
* a send or receive that times out aborts with ``PeerStalledError`` naming that neighbour.

A member sends ``DONE`` only when all its receives completed, so a mismatch, detected at the
header, is always seen by every member.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CollectiveError, RemoteProtocolError
from . import wire
from .errors import InputMismatchError, PeerStalledError, RingPeerLostError
from .ops import Array, Reducer
from .schedule import Schedule
from .transport import Ring

_ABORT_MSG_CAP = 2000
_WAITALL = getattr(socket, "MSG_WAITALL", 0)


@dataclass
class Buffers:
    """Typed flat arrays the schedule's element offsets refer to."""

    acc: Array
    """Accumulator and output: receives land here, later sends read from here."""
    inp: Array
    """Input of the first reduce-scatter step (``acc`` itself for in-place collectives)."""
    reduce: Reducer | None = None
    scale: Callable[[Array], None] | None = None
    """Applied to chunks this member finalises (``avg``), or None."""


class _Stalled(Exception):
    pass


def _recv_exactly(sock: socket.socket, mv: memoryview) -> None:
    while mv:
        try:
            n = sock.recv_into(mv, len(mv), _WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO expired
            raise _Stalled from None
        if n == 0:
            raise EOFError
        mv = mv[n:]


def _send_all(sock: socket.socket, mv: memoryview | bytes) -> None:
    mv = memoryview(mv)
    while mv:
        try:
            n = sock.send(mv)
        except BlockingIOError:  # SO_SNDTIMEO expired
            raise _Stalled from None
        mv = mv[n:]


def _send_frame(sock: socket.socket, kind: int, payload: memoryview | bytes) -> None:
    head = wire.FRAME.pack(kind, len(payload))
    if not len(payload):
        _send_all(sock, head)
        return
    try:
        n = sock.sendmsg([head, payload])
    except BlockingIOError:
        raise _Stalled from None
    if n < len(head):
        _send_all(sock, head[n:])
        n = len(head)
    _send_all(sock, memoryview(payload)[n - len(head) :])


class Pipeline:
    """One collective's state on one member; ``run_blocking`` does the work and raises."""

    def __init__(
        self,
        node_id: str,
        ring: Ring,
        header: dict[str, Any],
        sched: Schedule,
        bufs: Buffers,
        *,
        io_timeout: float,
        chunk_bytes: int,
    ) -> None:
        self.node_id = node_id
        self.ring = ring
        self.header = header
        self.sched = sched
        self.bufs = bufs
        self.io_timeout = io_timeout
        self.isz = bufs.acc.itemsize
        self.acc_b = bufs.acc.view(np.uint8).data
        self.inp_b = bufs.inp.view(np.uint8).data
        need = any(r.reduce for r in sched.recvs)
        self.scratch = np.empty(chunk_bytes // self.isz + 1 if need else 1, bufs.acc.dtype)
        self.scratch_b = self.scratch.view(np.uint8).data
        self.fhead = bytearray(wire.FRAME.size)
        self.cv = threading.Condition()
        self.recv_done = 0
        self.abort: dict[str, Any] | None = None
        self.done_sent = False
        self.broken = False
        self.stalled: str | None = None
        self.inline = False
        self.next_send = 0
        self.send_dead = False

    # -- shared state ---------------------------------------------------------------------
    def _set_abort(self, reason: dict[str, Any], *, broken: bool = False) -> None:
        with self.cv:
            if broken:
                self.broken = True
            first = self.abort is None
            if first:
                self.abort = reason
            self.cv.notify_all()
        if first and self.inline:
            self._send_abort_inline()

    def _reason(self, kind: str, peer: str, msg: str) -> dict[str, Any]:
        return {"kind": kind, "peer": peer, "origin": self.node_id, "msg": msg}

    def _wait_recvs(self, need: int) -> bool:
        """Block until ``need`` receives are done (True) or the round aborted (False)."""
        with self.cv:
            for _ in range(1 << 20):  # each wait is bounded; the receiver's are too
                if self.abort is not None:
                    return False
                if self.recv_done >= need:
                    return True
                self.cv.wait(self.io_timeout)
        return False

    # -- sender ---------------------------------------------------------------------------
    def _sender(self) -> None:
        sock = self.ring.send_sock
        right = self.ring.right.node_id
        try:
            if sock is None:
                raise EOFError
            _send_frame(sock, wire.HEADER, wire.pack_control(self.header)[4:])
            sends, after, isz = self.sched.sends, self.sched.send_after, self.isz
            inp_b, acc_b = self.inp_b, self.acc_b
            for j, s in enumerate(sends):
                need = after[j]
                if need and self.recv_done < need and not self._wait_recvs(need):
                    break
                if self.abort is not None:
                    break
                src = inp_b if s.from_input else acc_b
                _send_frame(sock, wire.DATA, src[s.start * isz : s.stop * isz])
            else:
                if self._wait_recvs(len(self.sched.recvs)):
                    _send_frame(sock, wire.DONE, b"")
                    self.done_sent = True
                    return
            assert self.abort is not None
            _send_frame(sock, wire.ABORT, wire.pack_control(self.abort)[4:])
        except _Stalled:
            self.stalled = self.stalled or right
            self._set_abort(self._reason("stalled", right, f"{right} stopped reading"), broken=True)
        except (OSError, EOFError) as exc:
            msg = f"connection to {right} broke: {exc!r}"
            self._set_abort(self._reason("lost", right, msg), broken=True)

    # -- receiver -------------------------------------------------------------------------
    def _receiver(self) -> None:
        sock = self.ring.recv_sock
        left = self.ring.left.node_id
        try:
            if sock is None:
                raise EOFError
            self._receive(sock, left)
        except _Stalled:
            self.stalled = self.stalled or left
            msg = f"no data from {left} for {self.io_timeout}s"
            self._set_abort(self._reason("stalled", left, msg), broken=True)
        except (EOFError, OSError) as exc:
            what = "closed the connection" if isinstance(exc, EOFError) else f"failed: {exc!r}"
            msg = f"connection from {left} {what}"
            self._set_abort(self._reason("lost", left, msg), broken=True)
        except RemoteProtocolError as exc:
            msg = f"bad frame from {left}: {exc}"
            self._set_abort(self._reason("protocol", left, msg), broken=True)

    def _read_head(self, sock: socket.socket) -> tuple[int, int]:
        _recv_exactly(sock, memoryview(self.fhead))
        kind, length = wire.FRAME.unpack(self.fhead)
        return int(kind), int(length)

    def _read_control(self, sock: socket.socket, length: int) -> dict[str, Any]:
        if length > wire.MAX_CONTROL_BYTES:
            raise RemoteProtocolError("oversized", f"control frame of {length} bytes")
        body = bytearray(length)
        _recv_exactly(sock, memoryview(body))
        return wire.unpack_control(bytes(body))

    def _receive(self, sock: socket.socket, left: str) -> None:
        kind, length = self._read_head(sock)
        if kind != wire.HEADER:
            raise RemoteProtocolError("malformed", f"expected HEADER, got frame kind {kind}")
        theirs = self._read_control(sock, length)
        mine = {k: v for k, v in self.header.items() if k != "frames"}
        their_cmp = {k: v for k, v in theirs.items() if k != "frames"}
        if their_cmp != mine:
            msg = (
                f"{self.node_id} called {_describe(mine)} but its left neighbour {left} "
                f"called {_describe(their_cmp)}"
            )
            self._set_abort(self._reason("mismatch", left, msg))
            frames = theirs.get("frames")
            self._drain(sock, frames if isinstance(frames, int) else 1 << 30)
            return
        recvs, bufs, isz = self.sched.recvs, self.bufs, self.isz
        acc, inp, acc_b, scratch, scratch_b = (
            bufs.acc,
            bufs.inp,
            self.acc_b,
            self.scratch,
            self.scratch_b,
        )
        reduce, scale, cv = bufs.reduce, bufs.scale, self.cv
        for i, r in enumerate(recvs):
            kind, length = self._read_head(sock)
            if kind == wire.ABORT:
                self._take_abort(sock, length)
                return
            if self.abort is not None:  # we aborted: read and discard the rest
                self._drain(sock, len(recvs) - i, first=(kind, length))
                return
            n = r.stop - r.start
            if kind != wire.DATA or length != n * isz:
                raise RemoteProtocolError(
                    "malformed", f"frame kind {kind} length {length}, expected {n * isz} data"
                )
            if r.reduce:
                _recv_exactly(sock, scratch_b[: n * isz])
                if reduce is not None:
                    reduce(inp[r.start : r.stop], scratch[:n], acc[r.start : r.stop])
            else:
                _recv_exactly(sock, acc_b[r.start * isz : r.stop * isz])
            if r.final and scale is not None:
                scale(acc[r.start : r.stop])
            if self.inline:
                self.recv_done = i + 1
                self._pump()
            else:
                with cv:
                    self.recv_done = i + 1
                    cv.notify()
        kind, length = self._read_head(sock)
        if kind == wire.ABORT:
            self._take_abort(sock, length)
        elif kind != wire.DONE or length:
            raise RemoteProtocolError("malformed", f"expected DONE, got frame kind {kind}")

    def _take_abort(self, sock: socket.socket, length: int) -> None:
        reason = self._read_control(sock, length)
        if not isinstance(reason.get("kind"), str) or not isinstance(reason.get("msg"), str):
            raise RemoteProtocolError("malformed", "abort frame without kind/msg")
        self._set_abort(reason)

    def _drain(
        self, sock: socket.socket, frames: int, first: tuple[int, int] | None = None
    ) -> None:
        """Discard the left neighbour's stream up to its DONE or ABORT (at most frames+1)."""
        kind, length = first if first is not None else self._read_head(sock)
        junk = memoryview(bytearray(1 << 16))
        for _ in range(frames + 1):
            if kind == wire.ABORT:
                self._read_control(sock, length)
                return
            if kind == wire.DONE:
                return
            if kind != wire.DATA:
                raise RemoteProtocolError("malformed", f"frame kind {kind} while draining")
            while length:
                k = min(length, len(junk))
                _recv_exactly(sock, junk[:k])
                length -= k
            kind, length = self._read_head(sock)
        raise RemoteProtocolError("malformed", "left neighbour sent more frames than announced")

    # -- inline mode: small rounds, one thread ------------------------------------------------
    def _inline_send(self, kind: int, payload: memoryview | bytes) -> bool:
        sock, right = self.ring.send_sock, self.ring.right.node_id
        try:
            if sock is None:
                raise EOFError
            _send_frame(sock, kind, payload)
            return True
        except _Stalled:
            self.send_dead = True
            self.stalled = self.stalled or right
            self._set_abort(self._reason("stalled", right, f"{right} stopped reading"), broken=True)
        except (OSError, EOFError) as exc:
            self.send_dead = True
            msg = f"connection to {right} broke: {exc!r}"
            self._set_abort(self._reason("lost", right, msg), broken=True)
        return False

    def _pump(self) -> None:
        """Send everything the receives done so far allow, then DONE after the last one."""
        sends, after, isz = self.sched.sends, self.sched.send_after, self.isz
        while (
            self.next_send < len(sends)
            and after[self.next_send] <= self.recv_done
            and self.abort is None
            and not self.send_dead
        ):
            s = sends[self.next_send]
            src = self.inp_b if s.from_input else self.acc_b
            if not self._inline_send(wire.DATA, src[s.start * isz : s.stop * isz]):
                return
            self.next_send += 1
        if (
            self.next_send == len(sends)
            and self.recv_done == len(self.sched.recvs)
            and self.abort is None
            and not self.send_dead
            and not self.done_sent
            and self._inline_send(wire.DONE, b"")
        ):
            self.done_sent = True

    def _send_abort_inline(self) -> None:
        if not self.done_sent and not self.send_dead and self.abort is not None:
            self.send_dead = True  # nothing may follow an ABORT
            self._inline_send(wire.ABORT, wire.pack_control(self.abort)[4:])

    def _run_inline(self) -> None:
        self.inline = True
        if self._inline_send(wire.HEADER, wire.pack_control(self.header)[4:]):
            self._pump()
        self._receiver()

    # -- entry point ----------------------------------------------------------------------
    def run_blocking(self, sender_pool: ThreadPoolExecutor, *, inline_max_bytes: int = 0) -> None:
        """Run the collective and raise the round's error, if any. Rounds whose sends total at
        most ``inline_max_bytes`` run in this thread alone (they fit in the socket buffers, so
        sends never block, and a thread hand-off would cost more than it saves); larger ones
        receive here and send from ``sender_pool``. Marks the ring broken when its streams are
        out of sync."""
        total = sum(s.stop - s.start for s in self.sched.sends) * self.isz
        if total <= inline_max_bytes:
            self._run_inline()
        else:
            fut = sender_pool.submit(self._sender)
            try:
                self._receiver()
            finally:
                fut.result()  # bounded: every sender wait and socket call has a timeout
        if self.broken:
            self.ring.broken = True
        if self.abort is None:
            return
        reason = self.abort
        epoch = self.ring.view.epoch
        kind, msg = str(reason.get("kind")), str(reason.get("msg"))[:_ABORT_MSG_CAP]
        origin, peer = str(reason.get("origin")), str(reason.get("peer"))
        if origin != self.node_id:
            msg = f"{msg} (reported by {origin})"
        if kind == "stalled":
            raise PeerStalledError(msg, peer=peer, epoch=epoch)
        if kind == "lost":
            raise RingPeerLostError(msg, peer=peer, epoch=epoch)
        if kind == "mismatch":
            raise InputMismatchError(msg)
        raise CollectiveError(f"collective aborted: {msg}")


def _describe(h: dict[str, Any]) -> str:
    what = f"{h.get('kind')}(dtype={h.get('dtype')}, shape={h.get('shape')}"
    if h.get("op") is not None:
        what += f", op={h.get('op')}"
    if h.get("root") is not None:
        what += f", root={h.get('root')}"
    return what + f") #{h.get('seq')}"
