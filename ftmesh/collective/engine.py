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
* a send or receive that makes no progress for ``io_timeout`` aborts with ``PeerStalledError``
  naming that neighbour.

A member sends ``DONE`` only when all its receives completed, so a mismatch, detected at the
header, is always seen by every member.

*Fatal* aborts (a neighbour lost or stalled, or ``DataPlane.abort_view`` saying a member of the
view is dead) end the ring instead of keeping it in sync: the forward ``ABORT`` frame cannot get
past a dead member, so the member that learns of it also writes the abort as a *notice* on the
reverse direction of its connection from the left (nothing else ever flows that way), and the
socket towards the dead member is shut down. Engine threads wake every ``poll_interval`` while
blocked (the sockets' SO_RCVTIMEO/SO_SNDTIMEO) to read such notices, see a local abort and count
towards ``io_timeout``; so an abort travels both ways round the ring until it reaches the dead
member from both sides, every survivor raises it within about one ``poll_interval`` per hop, and
the ring is dropped.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
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
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_FATAL = ("lost", "stalled")
_KEEPALIVE_FRAME = wire.FRAME.pack(wire.KEEPALIVE, 0)


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


class _Killed(Exception):
    """A fatal abort is set: stop using the sockets (the ring will be dropped)."""


def _send_frame_raw(sock: socket.socket, kind: int, payload: bytes) -> None:
    """Best-effort, non-blocking write of one small frame (abort notices)."""
    with contextlib.suppress(OSError):
        sock.send(wire.FRAME.pack(kind, len(payload)) + payload, _DONTWAIT)


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
        poll_interval: float = 0.2,
    ) -> None:
        self.node_id = node_id
        self.ring = ring
        self.header = header
        self.sched = sched
        self.bufs = bufs
        self.io_timeout = io_timeout
        self.poll_interval = min(poll_interval, io_timeout)
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
        self.fatal = False
        self.done_sent = False
        self.broken = False
        self.stalled: str | None = None
        self.inline = False
        self.owner = 0
        self.next_send = 0
        self.send_dead = False
        self._back_lock = threading.Lock()

    # -- shared state ---------------------------------------------------------------------
    def _set_abort(
        self,
        reason: dict[str, Any],
        *,
        broken: bool = False,
        override: bool = False,
        from_left: bool = False,
    ) -> None:
        fatal = reason.get("kind") in _FATAL
        with self.cv:
            if broken or fatal:
                self.broken = True
            first = self.abort is None
            if first or override:
                self.abort = reason
            if fatal:
                self.fatal = True
            self.cv.notify_all()
        if fatal:
            self._notify_left(reason, from_left=from_left)
            self.ring.shutdown_towards(str(reason.get("peer")))
        if first and self.inline and threading.get_ident() == self.owner:
            self._send_abort_inline()

    def abort_from_outside(self, reason: dict[str, Any]) -> None:
        """``Ring.kill``: a member of the view is dead; end this round with ``reason``."""
        self._set_abort(reason, override=True)

    def _notify_left(self, reason: dict[str, Any], *, from_left: bool) -> None:
        """Write the abort once on the reverse direction of the connection from the left (the
        left neighbour reads it while blocked; see the module doc). Skipped when the abort came
        from the left, or names it."""
        ring = self.ring
        with ring.lock:
            if ring.notice_sent or from_left or reason.get("peer") == ring.left.node_id:
                return
            ring.notice_sent = True
            sock = ring.recv_sock
        if sock is not None:
            _send_frame_raw(sock, wire.ABORT, wire.pack_control(reason)[4:])

    def _poll_back(self) -> None:
        """Read an abort notice from the right neighbour, if one arrived (never blocks)."""
        sock = self.ring.send_sock
        if sock is None or not self._back_lock.acquire(blocking=False):
            return
        try:
            try:
                data = sock.recv(4096, _DONTWAIT)
            except OSError:  # nothing there (EAGAIN), or the socket already failed
                return
            right = self.ring.right.node_id
            if not data:
                msg = f"{right} closed the connection"
                self._set_abort(self._reason("lost", right, msg))
                return
            back = self.ring.back
            back += data
            if len(back) < wire.FRAME.size:
                return
            kind, length = wire.FRAME.unpack_from(back)
            if kind != wire.ABORT or length > wire.MAX_CONTROL_BYTES:
                back.clear()  # not a notice: ignore it, the data stream decides
                return
            if len(back) < wire.FRAME.size + length:
                return
            try:
                body = bytes(back[wire.FRAME.size : wire.FRAME.size + length])
                reason = wire.unpack_control(body)
            except RemoteProtocolError:
                return
            finally:
                back.clear()
            if isinstance(reason.get("kind"), str) and isinstance(reason.get("msg"), str):
                self._set_abort(reason)
        finally:
            self._back_lock.release()

    def _idle(self, since: float, *, receiving: bool = False) -> float:
        """A socket call returned with nothing moved after ``poll_interval``: look for aborts,
        enforce ``io_timeout``. Returns when the wait goes on since ``since`` (0: just began)."""
        now = time.monotonic()
        if not since:
            since = now - self.poll_interval
        self._poll_back()
        if self.fatal:
            raise _Killed
        if now - since >= self.io_timeout:
            raise _Stalled
        if receiving and self.inline and threading.get_ident() == self.owner:
            self._inline_keepalive()
        return since

    def _recv_exactly(self, sock: socket.socket, mv: memoryview) -> None:
        since = 0.0
        while mv:
            try:
                n = sock.recv_into(mv, len(mv), _WAITALL)
            except BlockingIOError:  # SO_RCVTIMEO: nothing arrived for poll_interval
                since = self._idle(since, receiving=True)
                continue
            if n == 0:
                raise EOFError
            since = 0.0
            mv = mv[n:]

    def _send_all(self, sock: socket.socket, mv: memoryview | bytes) -> None:
        mv = memoryview(mv)
        since = 0.0
        while mv:
            try:
                n = sock.send(mv)
            except BlockingIOError:  # SO_SNDTIMEO: nothing went out for poll_interval
                since = self._idle(since)
                continue
            since = 0.0
            mv = mv[n:]

    def _send_frame(self, sock: socket.socket, kind: int, payload: memoryview | bytes) -> None:
        head = wire.FRAME.pack(kind, len(payload))
        if not len(payload):
            self._send_all(sock, head)
            return
        try:
            n = sock.sendmsg([head, payload])
        except BlockingIOError:
            n = 0
        if n < len(head):
            self._send_all(sock, head[n:])
            n = len(head)
        self._send_all(sock, memoryview(payload)[n - len(head) :])

    def _reason(self, kind: str, peer: str, msg: str) -> dict[str, Any]:
        return {"kind": kind, "peer": peer, "origin": self.node_id, "msg": msg}

    def _wait_recvs(self, need: int, sock: socket.socket) -> bool:
        """Block until ``need`` receives are done (True) or the round aborted (False), sending
        a ``KEEPALIVE`` to the right every ``poll_interval`` meanwhile."""
        for _ in range(1 << 40):  # each wait is bounded, and so is the receiver's
            with self.cv:
                if self.abort is not None:
                    return False
                if self.recv_done >= need:
                    return True
                if self.cv.wait(self.poll_interval):
                    continue
            self._send_all(sock, _KEEPALIVE_FRAME)
        return False

    # -- sender ---------------------------------------------------------------------------
    def _sender(self) -> None:
        sock = self.ring.send_sock
        right = self.ring.right.node_id
        try:
            if sock is None:
                raise EOFError
            self._send_frame(sock, wire.HEADER, wire.pack_control(self.header)[4:])
            sends, after, isz = self.sched.sends, self.sched.send_after, self.isz
            inp_b, acc_b = self.inp_b, self.acc_b
            for j, s in enumerate(sends):
                need = after[j]
                if need and self.recv_done < need and not self._wait_recvs(need, sock):
                    break
                if self.abort is not None:
                    break
                src = inp_b if s.from_input else acc_b
                self._send_frame(sock, wire.DATA, src[s.start * isz : s.stop * isz])
            else:
                if self._wait_recvs(len(self.sched.recvs), sock):
                    self._send_frame(sock, wire.DONE, b"")
                    self.done_sent = True
                    return
            reason = self.abort
            if reason is not None and not (self.fatal and reason.get("peer") == right):
                self._send_frame(sock, wire.ABORT, wire.pack_control(reason)[4:])
        except _Killed:
            pass
        except _Stalled:
            self.stalled = self.stalled or right
            self._set_abort(self._reason("stalled", right, f"{right} stopped reading"), broken=True)
        except (OSError, EOFError) as exc:
            self._poll_back()  # a notice sent before the connection broke names the culprit
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
        except _Killed:
            if self.inline:
                self._send_abort_inline()
        except _Stalled:
            self.stalled = self.stalled or left
            msg = f"no data from {left} for {self.io_timeout}s"
            self._set_abort(self._reason("stalled", left, msg), broken=True)
        except (EOFError, OSError) as exc:
            self._poll_back()
            what = "closed the connection" if isinstance(exc, EOFError) else f"failed: {exc!r}"
            msg = f"connection from {left} {what}"
            self._set_abort(self._reason("lost", left, msg), broken=True)
        except RemoteProtocolError as exc:
            msg = f"bad frame from {left}: {exc}"
            self._set_abort(self._reason("protocol", left, msg), broken=True)

    def _read_head(self, sock: socket.socket) -> tuple[int, int]:
        """The next frame head, skipping keepalives (each one restarts the stall clock)."""
        for _ in range(1 << 40):
            self._recv_exactly(sock, memoryview(self.fhead))
            kind, length = wire.FRAME.unpack(self.fhead)
            if kind != wire.KEEPALIVE:
                return int(kind), int(length)
            if length:
                raise RemoteProtocolError("malformed", f"keepalive with {length} bytes")
            if self.inline:  # our left waits on its left: so do we; tell our right (the sender
                self._inline_keepalive()  # thread does that on its own in two-thread mode)
        raise RemoteProtocolError("malformed", "endless keepalives")

    def _read_control(self, sock: socket.socket, length: int) -> dict[str, Any]:
        if length > wire.MAX_CONTROL_BYTES:
            raise RemoteProtocolError("oversized", f"control frame of {length} bytes")
        body = bytearray(length)
        self._recv_exactly(sock, memoryview(body))
        return wire.unpack_control(bytes(body))

    def _receive(self, sock: socket.socket, left: str) -> None:
        kind, length = self._read_head(sock)
        if kind == wire.ABORT:  # the left neighbour's ring was killed before it started
            self._take_abort(sock, length)
            return
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
            if self.fatal:
                raise _Killed
            if self.abort is not None:  # we aborted: read and discard the rest
                self._drain(sock, len(recvs) - i, first=(kind, length))
                return
            n = r.stop - r.start
            if kind != wire.DATA or length != n * isz:
                raise RemoteProtocolError(
                    "malformed", f"frame kind {kind} length {length}, expected {n * isz} data"
                )
            if r.reduce:
                self._recv_exactly(sock, scratch_b[: n * isz])
                if reduce is not None:
                    reduce(inp[r.start : r.stop], scratch[:n], acc[r.start : r.stop])
            else:
                self._recv_exactly(sock, acc_b[r.start * isz : r.stop * isz])
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
        self._set_abort(reason, from_left=True)

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
                self._recv_exactly(sock, junk[:k])
                length -= k
            kind, length = self._read_head(sock)
        raise RemoteProtocolError("malformed", "left neighbour sent more frames than announced")

    # -- inline mode: small rounds, one thread ------------------------------------------------
    def _inline_send(self, kind: int, payload: memoryview | bytes) -> bool:
        sock, right = self.ring.send_sock, self.ring.right.node_id
        try:
            if sock is None:
                raise EOFError
            self._send_frame(sock, kind, payload)
            return True
        except _Killed:
            self.send_dead = True
        except _Stalled:
            self.send_dead = True
            self.stalled = self.stalled or right
            self._set_abort(self._reason("stalled", right, f"{right} stopped reading"), broken=True)
        except (OSError, EOFError) as exc:
            self.send_dead = True
            self._poll_back()
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

    def _inline_keepalive(self) -> None:
        if self.abort is None and not self.send_dead and not self.done_sent:
            self._inline_send(wire.KEEPALIVE, b"")

    def _send_abort_inline(self) -> None:
        reason = self.abort
        if self.fatal and reason is not None and reason.get("peer") == self.ring.right.node_id:
            return  # no one to tell there
        if not self.done_sent and not self.send_dead and reason is not None:
            self.send_dead = True  # nothing may follow an ABORT
            self._inline_send(wire.ABORT, wire.pack_control(reason)[4:])

    def _run_inline(self) -> None:
        self.inline = True
        self.owner = threading.get_ident()
        if self._inline_send(wire.HEADER, wire.pack_control(self.header)[4:]):
            self._pump()
        self._receiver()
        self._send_abort_inline()  # if an abort came from another thread; no-op otherwise

    # -- entry point ----------------------------------------------------------------------
    def run_blocking(self, sender_pool: ThreadPoolExecutor, *, inline_max_bytes: int = 0) -> None:
        """Run the collective and raise the round's error, if any. Rounds whose sends total at
        most ``inline_max_bytes`` run in this thread alone (they fit in the socket buffers, so
        sends never block, and a thread hand-off would cost more than it saves); larger ones
        receive here and send from ``sender_pool``. Marks the ring broken when its streams are
        out of sync."""
        ring = self.ring
        with ring.lock:
            started = ring.killed is None
            if started:
                ring.active = self
            else:
                self.abort, self.fatal, self.broken = ring.killed, True, True
        if started:
            try:
                total = sum(s.stop - s.start for s in self.sched.sends) * self.isz
                if total <= inline_max_bytes:
                    self._run_inline()
                else:
                    fut = sender_pool.submit(self._sender)
                    try:
                        self._receiver()
                    finally:
                        fut.result()  # bounded: every sender wait and socket call has a timeout
            finally:
                with ring.lock:
                    ring.active = None
        if self.broken:
            ring.broken = True
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
