"""The pipelined ring engine: drives one member's half of a ``Schedule`` over its two sockets.

Theory of operation: one thread per collective runs a small event loop over the member's two
blocking sockets, using non-blocking calls (``MSG_DONTWAIT``) and ``poll()`` when neither can
move. The *transmit* side writes ``HEADER``, then each send of the schedule as a ``DATA`` frame
(``sendmsg`` gathers the 8-byte frame head and the payload, straight from the array) once the
receives it depends on are done, then ``DONE`` once all receives are done. The *receive* side
reads the left neighbour's ``HEADER`` and compares it with ours, then ``recv_into``s each
``DATA`` payload straight into place (allgather, broadcast) or into one chunk-sized scratch
buffer that is reduced into place when the chunk is complete (reduce-scatter). No other copies
are made, no allocation happens per chunk.

Why one thread and not a sender and a receiver thread (nor trio tasks): on a CPU-bound host
(several members per core) the time goes into the kernel's copies and the reduction; a second
thread per member only adds wake-ups, GIL hand-offs and context switches per chunk, and an
event-loop round trip through trio would add more. The kernel's socket buffers give the
overlap: while this thread reduces a chunk the kernel keeps moving what is queued both ways.
Trio still owns connection setup, agreement and cancellation (``DataPlane`` runs
``run_blocking`` via ``trio.to_thread`` and shuts the sockets down if cancelled).

Every collective starts by sending ``READY`` (its sequence number) to the left neighbour on the
reverse direction of that connection, and the transmit side holds its ``HEADER`` until the
right neighbour's ``READY`` for the same collective has arrived. So a member never writes a
collective into a connection before its receiver has started that collective; without this, a
member whose ring formed early could stream a collective, give the ring up, and leave frames
that the receiver, once its own ring formed, would read as its first collective (same sequence
number and shape, data of a round long gone). While the ``HEADER`` is held the loop reads the
reverse direction on every pass, not only when both sockets are idle: a steady stream from the
left would otherwise keep the ``READY`` unread, and a member would send nothing until it had
received everything.

Failure handling keeps every member informed without any coordinator:

* a mismatching header, a closed connection or a malformed frame sets the *abort reason*;
* a member that has not yet sent ``DONE`` replaces the rest of its stream by one ``ABORT`` frame
  carrying the reason, so the abort travels round the ring and every member raises it;
* a member that originated an abort keeps reading (and discarding) from its left until that
  neighbour's ``ABORT`` or ``DONE``, so nobody blocks writing into a socket no one reads and the
  connections stay in sync for the next collective;
* a direction that makes no progress for ``io_timeout`` aborts with ``PeerStalledError`` naming
  that neighbour. A member waiting on its own left neighbour sends its right one a
  ``KEEPALIVE`` every ``poll_interval``, so only the member that actually stopped is blamed;
* a neighbour that has not *started* the collective yet (no byte from the left, no ``READY``
  from the right) and that declares itself busy between steps (``busy``: its published
  progress, read by the mesh from membership) is waited for up to ``start_wait`` instead: its
  training thread evaluates or saves while its process is alive. Whether it is alive is
  membership's to judge meanwhile: a suspicion, a death or a view change aborts the wait at
  once (``DataPlane.abort_view``, ``supersede_view``), and a crash closes the connection. A
  neighbour that does not declare itself busy (one whose packets a broken link drops, a
  frozen one) keeps ``io_timeout``. A wait past ``io_timeout`` is logged (naming the
  neighbour) and shown by ``Pipeline.waiting_for``; once the neighbour started, ``io_timeout``
  applies again.

A member sends ``DONE`` only when all its receives completed, so a mismatch, detected at the
header, is always seen by every member.

With encryption (``secure``), the ring carries a ``RingCrypto``: frames are sealed where they
are built and the receive side reads through ``FrameOpener``, which presents the same
plaintext frame stream and decrypts each payload straight into the place this loop reads it
into. A frame that fails authentication is a protocol error: the round aborts and the ring is
dropped, as for any stream out of sync. Without encryption none of this runs.

*Fatal* aborts (a neighbour lost or stalled, ``DataPlane.abort_view`` saying a member of the
view is dead, or ``DataPlane.supersede_view`` saying a member moved on to a newer view) end the
ring instead of keeping it in sync: the forward ``ABORT`` frame cannot get past a dead member,
so the member that learns of it also writes the abort as a *notice* on the reverse direction of
its connection from the left (besides ``READY`` frames, nothing else flows that way; the loop
polls that direction too), and the socket towards the dead member is shut down. The loop wakes
at least every ``poll_interval`` to see an abort set from another thread. So an abort travels
both ways round the ring until it reaches the dead member from both sides, every survivor
raises it promptly, and the ring is dropped. A notice reaching a member whose last send is
already written does not end its round: the right neighbour has all it needs from it, and
whether its own receives complete is for its left to decide (the data, ``DONE``, a forward
``ABORT``, EOF or ``io_timeout``). So a neighbour that finished a collective and moved on (a
graceful leave, a newer view) cannot fail a member still reading that collective's last frames.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import RemoteProtocolError
from . import wire
from .aborts import Abort, AbortKind, error_for
from .ops import Array, Reducer
from .schedule import Schedule
from .secure import FrameOpener
from .transport import Ring

log = logging.getLogger(__name__)

WAIT_LOG_EVERY = 60.0
"""Seconds between two log lines about the same wait for a neighbour to start a collective."""
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_KEEPALIVE_FRAME = wire.FRAME.pack(wire.KEEPALIVE, 0)
_DONE_FRAME = wire.FRAME.pack(wire.DONE, 0)
_JUNK = 1 << 16

# receive states
_HEAD, _CONTROL, _DATA, _JUNK_DATA, _FINISHED = range(5)


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
    on_send: Callable[[int], None] | None = None
    """Called with a send's index just before its bytes are read (to produce them late, e.g.
    encode a shard while earlier ones are on the wire), or None."""
    on_recv: Callable[[int], None] | None = None
    """Called with a receive's index once its bytes are in place, before the sends waiting
    for it may go (to decode or reduce what arrived), or None."""


class _Stop(Exception):
    """Leave the loop: the abort reason is set."""


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
        start_wait: float = 0.0,
        busy: Callable[[str], str | None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.ring = ring
        self.header = header
        self.seq = int(header["seq"])
        self.sched = sched
        self.bufs = bufs
        self.io_timeout = io_timeout
        self.poll_interval = min(poll_interval, io_timeout)
        self.start_wait = max(start_wait, io_timeout)
        """Seconds to wait for a neighbour busy between steps to start the collective."""
        self.busy = busy
        """If a member declares itself busy between steps, how to name it in a log line, else
        None (``DataPlane.busy``)."""
        self.waiting_for: tuple[str, float] | None = None
        """``(neighbour, since)`` (``time.monotonic()``) while a wait for a neighbour to start
        the collective has lasted longer than ``io_timeout``; read from any thread."""
        self._waiting_name = ""
        """The neighbour waited for, as ``busy`` names it (for the log line)."""
        self._busy_named: dict[str, str] = {}
        """The neighbours found busy between steps in this collective, as ``busy`` names them."""
        self._wait_logged = 0.0
        self.isz = bufs.acc.itemsize
        self.acc_b = bufs.acc.view(np.uint8).data
        self.inp_b = bufs.inp.view(np.uint8).data
        need = any(r.reduce for r in sched.recvs)
        self.scratch = np.empty(chunk_bytes // self.isz + 1 if need else 1, bufs.acc.dtype)
        self.scratch_b = self.scratch.view(np.uint8).data
        self.lock = threading.Lock()
        self.hangup: str | None = None
        """The neighbour whose connection closed or reset under this collective before any
        abort reason was known (no notice came first): what a killed process's sockets do.
        The data plane tells membership (``Transport.report_closed``)."""
        self.abort: Abort | None = None
        self.fatal = False
        self.broken = False
        # transmit side
        self.tx_pending: list[memoryview] = []
        self.tx_off = 0
        """Bytes of the pending frame already written (0: a frame boundary)."""
        self.tx_closed = False
        self.right_closed = False
        self.header_sent = False
        self.next_send = 0
        self.done_sent = False
        # receive side
        self.recv_done = 0
        self.fhead = bytearray(wire.FRAME.size)
        self.rx_state = _HEAD
        self.rx_mv = memoryview(self.fhead)
        self.control = bytearray(0)
        self.control_kind = 0
        self.got_header = False
        self.junk_left = 0
        self.drain_frames = 0
        self.junk = memoryview(bytearray(0))

    # -- abort state ----------------------------------------------------------------------
    def _set_abort(self, reason: Abort, *, override: bool = False, from_left: bool = False) -> None:
        fatal = reason.fatal
        with self.lock:
            held = self.abort
            # A loss says who to report; a later supersession must not hide it.
            hides_loss = held is not None and held.loss and reason.kind is AbortKind.SUPERSEDED
            if held is None or (override and not hides_loss):
                self.abort = reason
            if fatal:
                self.fatal = self.broken = True
            elif reason.kind is AbortKind.DESYNC:
                # The member that saw a bad frame drops its ring (its stream is out of sync),
                # so the ring is over for everyone: drop ours too rather than fail next time.
                self.broken = True
        if fatal:
            self._notify_left(reason, from_left=from_left)
            self.ring.shutdown_towards(reason.peer)

    def _hung_up(self, peer: str) -> None:
        """``peer``'s connection closed or failed: note it as ``hangup`` unless we knew of an
        abort already (it gave the ring up after a notice, or we shut the socket ourselves:
        ``Ring.kill``, or ``Ring.shutdown`` on a cancellation, which marks the ring broken)."""
        with self.lock:
            if self.abort is None and self.hangup is None and not self.ring.broken:
                self.hangup = peer

    def abort_from_outside(self, reason: Abort) -> None:
        """``Ring.kill``: a member of the view is dead; end this round with ``reason``. Any
        thread; the loop sees it within ``poll_interval``."""
        self._set_abort(reason, override=True)

    def _reason(self, kind: AbortKind, peer: str, msg: str) -> Abort:
        return Abort(kind, peer, self.node_id, msg)

    def _notify_left(self, reason: Abort, *, from_left: bool) -> None:
        """Write the abort once on the reverse direction of the connection from the left (the
        left neighbour reads it while blocked; see the module doc). Skipped when the abort came
        from the left, or names it."""
        ring = self.ring
        body = wire.pack_control(reason.to_wire())[4:]
        with ring.lock:
            if ring.notice_sent or from_left or reason.peer == ring.left.node_id:
                return
            ring.notice_sent = True
            sock = ring.recv_sock
            if sock is not None:
                with contextlib.suppress(OSError):  # best effort: the left also has io_timeout
                    if ring.crypto is not None:
                        ring.crypto.rev_tx.send_nowait(sock, wire.ABORT, body)
                    else:
                        sock.send(wire.FRAME.pack(wire.ABORT, len(body)) + body, _DONTWAIT)

    def _poll_back(self) -> None:
        """Read what the right neighbour sent on the reverse direction: ``READY`` frames, an
        abort notice, or EOF."""
        sock = self.ring.send_sock
        if sock is None:
            return
        right = self.ring.right.node_id
        reader: socket.socket | FrameOpener = sock
        if self.ring.crypto is not None:
            reader = self.ring.crypto.rev_rx
        try:
            data = reader.recv(4096, _DONTWAIT)
        except OSError:  # nothing there (EAGAIN), or the socket already failed
            return
        except RemoteProtocolError as exc:  # a reverse frame failed authentication
            self.right_closed = self.broken = True  # stop polling that direction
            self._set_abort(
                self._reason(AbortKind.DESYNC, right, f"bad notice from {right}: {exc}")
            )
            return
        if not data:
            self.right_closed = self.broken = True
            if not (self.tx_closed and not self.tx_pending):  # else it has all it needs from us
                self._hung_up(right)
                self._set_abort(
                    self._reason(AbortKind.PEER_LOST, right, f"{right} closed the connection")
                )
            return
        back = self.ring.back
        back += data
        for _ in range(len(back)):  # bounded: every pass consumes a frame or stops
            if len(back) < wire.FRAME.size:
                return
            kind, length = wire.FRAME.unpack_from(back)
            if kind == wire.READY:
                self.ring.peer_ready = max(self.ring.peer_ready, length)
                del back[: wire.FRAME.size]
                continue
            if kind != wire.ABORT or length > wire.MAX_CONTROL_BYTES:
                back.clear()  # not a notice: ignore it, the data stream decides
                return
            if len(back) < wire.FRAME.size + length:
                return
            body = bytes(back[wire.FRAME.size : wire.FRAME.size + length])
            del back[: wire.FRAME.size + length]
            try:
                notice = Abort.from_wire(wire.unpack_control(body))
            except RemoteProtocolError:
                continue
            if notice is not None and self.next_send < len(self.sched.sends):
                self._set_abort(notice)
            elif notice is not None:  # the right has all it needs from us: our left decides
                log.debug("#%d: notice from %s after our last send: %s", self.seq, right, notice)

    def _send_ready(self) -> None:
        """Tell the left neighbour we have started this collective (it holds its ``HEADER``
        until then). Best effort: a broken connection shows up in the data stream."""
        ring, sock = self.ring, self.ring.recv_sock
        if sock is None:
            return
        with ring.lock, contextlib.suppress(OSError):
            if ring.crypto is not None:
                ring.crypto.rev_tx.send_nowait(sock, wire.READY, field=self.seq)
            else:
                sock.send(wire.FRAME.pack(wire.READY, self.seq), _DONTWAIT)

    def _waiting_ready(self) -> bool:
        """Whether our ``HEADER`` is held back because the right neighbour has not started
        this collective yet."""
        return not self.header_sent and self.abort is None and self.ring.peer_ready < self.seq

    # -- transmit side --------------------------------------------------------------------
    def _frame(self, kind: int, body: bytes) -> list[memoryview]:
        """A control frame (or an empty one) for the right neighbour."""
        crypto = self.ring.crypto
        if crypto is not None:
            return crypto.fwd_tx.seal(kind, body)
        return [memoryview(wire.FRAME.pack(kind, len(body)) + body)]

    def _keepalive(self) -> list[memoryview]:
        if self.ring.crypto is not None:
            return self._frame(wire.KEEPALIVE, b"")
        return [memoryview(_KEEPALIVE_FRAME)]

    def _next_frame(self) -> list[memoryview] | None:
        """The next frame to write, or None when there is nothing to write now."""
        if self.tx_closed:
            return None
        reason = self.abort
        if reason is not None:
            self.tx_closed = True
            if self.fatal and reason.peer == self.ring.right.node_id:
                return None  # no one to tell there
            return self._frame(wire.ABORT, wire.pack_control(reason.to_wire())[4:])
        if not self.header_sent:
            if self.ring.peer_ready < self.seq:
                return None  # the right neighbour has not started this collective yet
            self.header_sent = True
            return self._frame(wire.HEADER, wire.pack_control(self.header)[4:])
        sends = self.sched.sends
        j = self.next_send
        if j < len(sends):
            if self.sched.send_after[j] > self.recv_done:
                return None
            s = sends[j]
            self.next_send = j + 1
            if self.bufs.on_send is not None:
                self.bufs.on_send(j)
            src = self.inp_b if s.from_input else self.acc_b
            payload = src[s.start * self.isz : s.stop * self.isz]
            if self.ring.crypto is not None:
                return self.ring.crypto.fwd_tx.seal_data(payload)
            return [memoryview(wire.FRAME.pack(wire.DATA, len(payload))), payload]
        if self.recv_done == len(self.sched.recvs):
            self.tx_closed = self.done_sent = True
            if self.ring.crypto is not None:
                return self._frame(wire.DONE, b"")
            return [memoryview(_DONE_FRAME)]
        return None

    def _tx(self, sock: socket.socket) -> bool:
        """Write what can be written without blocking; True if any byte went out."""
        moved = False
        pending = self.tx_pending
        for _ in range(len(self.sched.sends) + 4):
            if not pending:
                frame = self._next_frame()
                if frame is None:
                    break
                pending.extend(frame)
            try:
                n = sock.sendmsg(pending, (), _DONTWAIT)
            except BlockingIOError:
                break
            moved = True
            self.tx_off += n
            while n:
                k = len(pending[0])
                if n >= k:
                    n -= k
                    pending.pop(0)
                else:
                    pending[0] = pending[0][n:]
                    n = 0
            while pending and not len(pending[0]):
                pending.pop(0)
            if pending:
                break  # the socket is full
            self.tx_off = 0
        return moved

    # -- receive side ---------------------------------------------------------------------
    def _rx(self, sock: socket.socket | FrameOpener, flags: int) -> bool:
        """Read what has arrived (``_DONTWAIT``), or wait for the current target to fill
        (``_WAITALL``: one wake-up per chunk instead of one per segment; bounded by the socket's
        ``poll_interval`` timeout); True if any byte came in."""
        moved = False
        for _ in range(1 << 20):  # bounded; ends when the socket is empty
            if self.rx_state == _FINISHED:
                break
            mv = self.rx_mv
            if len(mv):
                try:
                    n = sock.recv_into(mv, len(mv), flags)
                except BlockingIOError:
                    break
                if n == 0:
                    raise EOFError
                moved = True
                if n < len(mv):
                    self.rx_mv = mv[n:]
                    break  # the socket is empty
            if self.rx_state == _DATA:
                self._rx_complete()
                break  # a chunk is done: let the sends it unlocks go first
            self._rx_complete()
        return moved

    def _expect(self, state: int, mv: memoryview) -> None:
        self.rx_state, self.rx_mv = state, mv

    def _rx_complete(self) -> None:
        """The current receive target is full: act on it and set the next one."""
        state = self.rx_state
        if state == _DATA:
            r = self.sched.recvs[self.recv_done]
            bufs = self.bufs
            if r.reduce and bufs.reduce is not None:
                n = r.stop - r.start
                bufs.reduce(
                    bufs.inp[r.start : r.stop], self.scratch[:n], bufs.acc[r.start : r.stop]
                )
            if r.final and bufs.scale is not None:
                bufs.scale(bufs.acc[r.start : r.stop])
            if bufs.on_recv is not None:
                bufs.on_recv(self.recv_done)
            self.recv_done += 1
            self._expect(_HEAD, memoryview(self.fhead))
        elif state == _HEAD:
            self._on_head()
        elif state == _JUNK_DATA:
            self._next_junk()
        elif state == _CONTROL:
            self._on_control()

    def _on_head(self) -> None:
        kind, length = wire.FRAME.unpack(self.fhead)
        head = memoryview(self.fhead)
        if kind == wire.KEEPALIVE:
            if length:
                raise RemoteProtocolError("malformed", f"keepalive with {length} bytes")
            self._expect(_HEAD, head)
            return
        if kind in (wire.HEADER, wire.ABORT):
            if kind == wire.HEADER and self.got_header:
                raise RemoteProtocolError("malformed", "second HEADER")
            if length > wire.MAX_CONTROL_BYTES:
                raise RemoteProtocolError("oversized", f"control frame of {length} bytes")
            self.control_kind = kind
            self.control = bytearray(length)
            self._expect(_CONTROL, memoryview(self.control))
            return
        if not self.got_header:
            raise RemoteProtocolError("malformed", f"expected HEADER, got frame kind {kind}")
        if self.abort is not None:  # we aborted: read and discard up to DONE or ABORT
            self.drain_frames -= 1
            if self.drain_frames < 0:
                raise RemoteProtocolError("malformed", "left sent more frames than announced")
            if kind == wire.DONE:
                self._expect(_FINISHED, head)
            elif kind == wire.DATA:
                self.junk_left = length
                self._next_junk()
            else:
                raise RemoteProtocolError("malformed", f"frame kind {kind} while draining")
            return
        recvs = self.sched.recvs
        i = self.recv_done
        if kind == wire.DONE and not length and i == len(recvs):
            self._expect(_FINISHED, head)
            return
        if kind != wire.DATA or i >= len(recvs):
            raise RemoteProtocolError("malformed", f"unexpected frame kind {kind}")
        r = recvs[i]
        nb = (r.stop - r.start) * self.isz
        if length != nb:
            raise RemoteProtocolError("malformed", f"data frame of {length} bytes, expected {nb}")
        if r.reduce:
            self._expect(_DATA, self.scratch_b[:nb])
        else:
            self._expect(_DATA, self.acc_b[r.start * self.isz : r.stop * self.isz])

    def _next_junk(self) -> None:
        if not self.junk_left:
            self._expect(_HEAD, memoryview(self.fhead))
            return
        if not len(self.junk):
            self.junk = memoryview(bytearray(_JUNK))
        k = min(self.junk_left, _JUNK)
        self.junk_left -= k
        self._expect(_JUNK_DATA, self.junk[:k])

    def _on_control(self) -> None:
        msg = wire.unpack_control(bytes(self.control))
        left = self.ring.left.node_id
        if self.control_kind == wire.ABORT:
            notice = Abort.from_wire(msg)
            if notice is None:
                raise RemoteProtocolError("malformed", "abort frame without kind/msg")
            self._set_abort(notice, from_left=True)
            self._expect(_FINISHED, memoryview(self.fhead))
            return
        self.got_header = True
        mine = {k: v for k, v in self.header.items() if k != "frames"}
        theirs = {k: v for k, v in msg.items() if k != "frames"}
        if theirs != mine:
            text = (
                f"{self.node_id} called {_describe(mine)} but its left neighbour {left} "
                f"called {_describe(theirs)}"
            )
            self._set_abort(self._reason(AbortKind.MISMATCH, left, text))
            frames = msg.get("frames")
            self.drain_frames = (frames if isinstance(frames, int) else 1 << 30) + 1
        self._expect(_HEAD, memoryview(self.fhead))

    # -- the loop -------------------------------------------------------------------------
    def _finished(self) -> bool:
        return self.rx_state == _FINISHED and self.tx_closed and not self.tx_pending

    def _loop(self) -> None:
        ring = self.ring
        tx, rx = ring.send_sock, ring.recv_sock
        left, right = ring.left.node_id, ring.right.node_id
        if tx is None or rx is None:
            who = right if tx is None else left
            raise _Stop(self._reason(AbortKind.PEER_LOST, who, f"connection with {who} is closed"))
        self._send_ready()
        poller = select.poll()
        txfd, rxfd = tx.fileno(), rx.fileno()
        poller.register(txfd, select.POLLIN)
        poller.register(rxfd, select.POLLIN)
        tx_mask = rx_mask = select.POLLIN
        tx_reg = True
        reader: socket.socket | FrameOpener = rx
        if ring.crypto is not None:
            reader = ring.crypto.fwd_rx
        poll_s = self.poll_interval
        poll_ms = max(1, int(poll_s * 1000))
        now = time.monotonic()
        last_rx = last_tx = last_sent = started = now
        left_started = False  # a byte came from the left (its HEADER is its first)
        for _ in range(1 << 40):  # bounded in time by io_timeout per idle direction
            if self.fatal:
                return
            try:
                sent = self._tx(tx)
            except OSError as exc:
                self._poll_back()  # a notice sent before the connection broke names the culprit
                self._hung_up(right)
                msg = f"connection to {right} broke: {exc!r}"
                raise _Stop(self._reason(AbortKind.PEER_LOST, right, msg)) from None
            # Nothing to write until more arrives: block on the left (no poll, no busy loop),
            # unless we wait for the right neighbour's READY, which comes on the other socket.
            waiting = self._waiting_ready()
            block = not waiting and not self.tx_pending and self.rx_state != _FINISHED
            try:
                got = self._rx(reader, _WAITALL if block else _DONTWAIT)
            except (EOFError, OSError) as exc:
                self._poll_back()
                self._hung_up(left)
                what = "closed the connection" if isinstance(exc, EOFError) else f"failed: {exc!r}"
                msg = f"connection from {left} {what}"
                raise _Stop(self._reason(AbortKind.PEER_LOST, left, msg)) from None
            except RemoteProtocolError as exc:
                # The left stream is out of sync: stop reading it, still tell the right.
                self.broken = True
                self._set_abort(
                    self._reason(AbortKind.DESYNC, left, f"bad frame from {left}: {exc}")
                )
                self.rx_state = _FINISHED
                got = True
            if self._finished():
                return
            if sent or got:
                now = time.monotonic()
                if got:
                    last_rx = now
                    left_started = True
                if self.waiting_for is not None and left_started and not waiting:
                    self._wait_over(now)
                if sent:
                    last_tx = last_sent = now
                elif not self.tx_pending and not self.tx_closed and now - last_sent >= poll_s:
                    self.tx_pending.extend(self._keepalive())
                if waiting:  # the right's READY: a steady stream from the left skips the poll
                    self._poll_back()
                continue
            if block:  # the blocking receive already waited poll_interval
                events = poller.poll(0) if tx_reg else []
            else:  # wait for either socket (or a notice on the reverse direction)
                want_tx = (0 if self.right_closed else select.POLLIN) | (
                    select.POLLOUT if self.tx_pending else 0
                )
                want_rx = select.POLLIN if self.rx_state != _FINISHED else 0
                if want_tx != tx_mask and tx_reg:
                    poller.modify(txfd, want_tx)
                    tx_mask = want_tx
                if want_rx != rx_mask:
                    poller.modify(rxfd, want_rx)
                    rx_mask = want_rx
                events = poller.poll(poll_ms)
            for fd, ev in events:
                if fd != txfd:
                    continue
                self._poll_back()
                if (
                    ev & (select.POLLERR | select.POLLHUP)
                    and self.tx_closed
                    and not self.tx_pending
                ):
                    self.right_closed = self.broken = True  # done with it: stop polling it
                    if tx_reg:
                        poller.unregister(txfd)
                        tx_reg = False
            now = time.monotonic()
            if self.rx_state != _FINISHED and not left_started:
                self._wait_start(left, started, now)
            elif self.rx_state != _FINISHED and now - last_rx >= self.io_timeout:
                msg = f"no data from {left} for {self.io_timeout}s"
                raise _Stop(self._reason(AbortKind.STALLED, left, msg))
            if self.tx_pending and now - last_tx >= self.io_timeout:
                raise _Stop(self._reason(AbortKind.STALLED, right, f"{right} stopped reading"))
            if waiting:
                self._wait_start(right, started, now)
            if not self.tx_pending and not waiting:
                last_tx = now  # not waiting on the right neighbour
                if not self.tx_closed and now - last_sent >= self.poll_interval:
                    self.tx_pending.extend(self._keepalive())

    def _wait_start(self, peer: str, started: float, now: float) -> None:
        """We wait for ``peer`` to start this collective: past ``io_timeout`` say so, past
        ``start_wait`` give up on it (``PeerStalledError``)."""
        waited = now - started
        if waited < self.io_timeout:
            return
        named = self._busy_named.get(peer)
        if named is None:
            # Asked once per neighbour, when io_timeout is up: the answer holds for this
            # collective (the busy member publishes that its pause ended as it starts its
            # next step, which may reach us before its first frame does; and we may be
            # waiting for both neighbours, each asked once).
            named = self.busy(peer) if self.busy is not None else None
            if named is None:
                # Running but silent (a link that drops its packets), or frozen: io_timeout's.
                msg = f"{peer} did not start the collective within {self.io_timeout:g}s"
                raise _Stop(self._reason(AbortKind.STALLED, peer, msg))
            self._busy_named[peer] = named
        if self.waiting_for is None or self.waiting_for[0] != peer:
            self.waiting_for = (peer, started)
            self._waiting_name = named
        if waited >= self.start_wait:
            msg = f"{peer} did not start the collective within {self.start_wait:g}s"
            raise _Stop(self._reason(AbortKind.STALLED, peer, msg))
        if now - self._wait_logged >= WAIT_LOG_EVERY:
            self._wait_logged = now
            log.info(
                "waiting for %s to start collective #%d (%.0fs so far): it is busy between "
                "steps; giving up after %gs (CollectiveConfig.start_wait)",
                self._waiting_name,
                self.seq,
                waited,
                self.start_wait,
            )

    def _wait_over(self, now: float) -> None:
        held = self.waiting_for
        self.waiting_for = None
        if held is not None:
            log.info("%s started collective #%d after %.1fs", held[0], self.seq, now - held[1])

    # -- entry point ----------------------------------------------------------------------
    def run_blocking(self) -> None:
        """Run the collective in this thread and raise the round's error, if any. Marks the
        ring broken when its streams are out of sync."""
        ring = self.ring
        with ring.lock:
            started = ring.killed is None
            if started:
                ring.active = self
            else:
                self.abort, self.fatal, self.broken = ring.killed, True, True
        if started:
            try:
                self._loop()
            except _Stop as stop:
                self._set_abort(stop.args[0])
                self.broken = True
            except BaseException:
                # Interrupted mid-round (e.g. KeyboardInterrupt in a caller's thread): the
                # streams are out of sync, so the ring must never be used again.
                self.broken = ring.broken = True
                ring.shutdown()
                raise
            finally:
                if self.fatal:
                    self._forward_abort()
                with ring.lock:
                    ring.active = None
        if self.broken:
            ring.broken = True
        reason = self.abort
        if reason is None:
            return
        raise error_for(reason, ring.view.epoch, self.node_id)

    def _forward_abort(self) -> None:
        """After a fatal abort: pass it to the right neighbour if we are at a frame boundary
        (best effort, never blocks; the right neighbour also gets the notice chain or EOF)."""
        reason, sock = self.abort, self.ring.send_sock
        if self.tx_closed or self.tx_off or reason is None or sock is None:
            return
        self.tx_closed = True
        if reason.peer == self.ring.right.node_id:
            return
        body = wire.pack_control(reason.to_wire())[4:]
        crypto = self.ring.crypto
        with contextlib.suppress(OSError):
            if crypto is not None and self.tx_pending:
                # A sealed frame is queued, not one byte of it written (tx_off == 0): the
                # abort takes its place and its number (a skipped number fails every tag).
                self.tx_pending.clear()
                crypto.fwd_tx.send_instead_nowait(sock, wire.ABORT, body)
            elif crypto is not None:
                crypto.fwd_tx.send_nowait(sock, wire.ABORT, body)
            else:
                sock.send(wire.FRAME.pack(wire.ABORT, len(body)) + body, _DONTWAIT)


def _describe(h: dict[str, Any]) -> str:
    what = f"{h.get('kind')}(dtype={h.get('dtype')}, shape={h.get('shape')}"
    if h.get("op") is not None:
        what += f", op={h.get('op')}"
    if h.get("root") is not None:
        what += f", root={h.get('root')}"
    if h.get("codec") is not None:
        what += f", compression={h.get('codec')}"
    return what + f") #{h.get('seq')}"
