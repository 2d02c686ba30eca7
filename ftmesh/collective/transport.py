"""Data-plane connections: listener, authenticated handshake, pairwise view agreement.

Theory of operation: each member keeps one TCP connection per ring edge, opened by the sender
(member ``i`` connects to its right neighbour ``i+1``; bytes of collectives only flow that way).
Opening a ring for a view runs two halves concurrently:

* *right*: connect to the right neighbour, say hello (mesh, our id, its id, the epoch, a nonce),
  check its challenge response, answer its challenge, then wait for its ``view_ok``;
* *left*: wait for the left neighbour's authenticated connection carrying the same epoch (the
  listener parks connections by ``(from, epoch)``), then send it ``view_ok``.

A neighbour only sends ``view_ok`` once it is itself opening a ring on that epoch, so when both
halves succeed, both neighbours hold our view; if every adjacent pair agrees the whole ring
agrees, and nobody runs a collective on a view its neighbours don't share. A mismatch waits
(gossip may be about to converge) for ``view_timeout`` and then raises ``ViewMismatchError``.
A neighbour opens its halves when it starts its next collective: one that declares itself
busy between steps (``busy``, as the engine's ``start_wait``) is waited for past
``view_timeout``, up to ``start_wait``; membership's verdict ends the wait at once
(``DataPlane.abort_view`` cancels the opening).

With a mesh secret, both sides prove knowledge of it by MACing the transcript, which includes a
fresh nonce from each side, so a node without the secret cannot join and recorded handshakes
cannot be replayed. Inbound connections are admitted by ``ftmesh.net.admission`` until their
handshake completes (caps per port and per source, oldest shed first, ``connect_timeout``
from accept), so idle or hostile connections cannot hold up a ring neighbour's.

When the mesh encrypts, the hello says so (``enc``) and the transcript binds it, so neither
side can be talked into the other mode; a server whose mode differs answers with an error
naming it (the client raises a clear ``CollectiveError``) and drops the connection. Both sides
then derive the connection's two keys from the transcript and the mesh key that made the
server's tag (``secure.session_keys``), and everything after ``view_ok`` is sealed
(``secure.RingCrypto``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import socket as _stdsocket
import struct
import termios
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from ..errors import CollectiveError, FtmeshError, RemoteProtocolError
from ..net.admission import Admission, accept_loop
from ..security import MeshAuth
from . import wire
from .aborts import Abort
from .config import CollectiveConfig
from .errors import RingPeerLostError, ViewMismatchError
from .reach import Connected, ConnectEnded, ConnectFailed, Connecting, ReachEvent
from .secure import RingCrypto, SessionKeys, session_keys
from .view import Peer, RingView

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PARKED = 64
"""Inbound connections waiting for their view to be adopted locally. Bounds what unknown or
stale peers can pin; the oldest is closed first."""

Socket = trio.socket.SocketType
Link = tuple[Socket, SessionKeys | None]
"""A handshaken connection and, when the mesh encrypts, its keys."""
Observer = Callable[[ReachEvent], None]
"""Where connection outcomes go (``reach``); must not block (called from the trio thread and
from engine threads)."""


def _ignore(_ev: ReachEvent) -> None:
    pass


def tune_socket(sock: Socket, config: CollectiveConfig) -> None:
    sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
    if config.socket_buffer_bytes:
        sock.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_SNDBUF, config.socket_buffer_bytes)
        sock.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_RCVBUF, config.socket_buffer_bytes)


async def send_all(sock: Socket, data: bytes | memoryview) -> None:
    mv = memoryview(data)
    while mv:
        n = await sock.send(mv)
        mv = mv[n:]


async def recv_exactly_into(sock: Socket, mv: memoryview) -> bool:
    """Fill ``mv``; False on a clean EOF before it is full."""
    while mv:
        n = await sock.recv_into(mv)
        if n == 0:
            return False
        mv = mv[n:]
    return True


async def send_control(sock: Socket, msg: dict[str, Any]) -> None:
    await send_all(sock, wire.pack_control(msg))


async def recv_control(sock: Socket) -> dict[str, Any]:
    head = bytearray(wire.CONTROL_LEN.size)
    if not await recv_exactly_into(sock, memoryview(head)):
        raise EOFError("connection closed")
    (length,) = wire.CONTROL_LEN.unpack(head)
    if length > wire.MAX_CONTROL_BYTES:
        raise RemoteProtocolError("oversized", f"control message of {length} bytes")
    body = bytearray(length)
    if not await recv_exactly_into(sock, memoryview(body)):
        raise EOFError("connection closed")
    return wire.unpack_control(bytes(body))


def _field(msg: dict[str, Any], key: str, typ: type) -> Any:
    v = msg.get(key)
    if not isinstance(v, typ):
        raise RemoteProtocolError("malformed", f"handshake field {key!r} missing or mistyped")
    return v


@dataclass(eq=False)
class Ring:
    """The two connections of one member for one view: to the right and from the left.

    Bytes of collectives only flow rightwards. The reverse direction of each connection carries
    nothing but abort notices (see ``engine``), so a member whose left neighbour has stopped
    sending still hears of an abort from its right."""

    view: RingView
    rank: int
    right: Peer
    left: Peer
    send_sock: _stdsocket.socket | None
    """Blocking stdlib socket to the right neighbour (used from the engine's threads)."""
    recv_sock: _stdsocket.socket | None
    """Blocking stdlib socket from the left neighbour."""
    seq: int = 0
    broken: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Guards ``active``, ``killed`` and ``notice_sent`` (engine threads, the trio thread and a
    sync caller's thread all touch them)."""
    active: Any = None
    """The engine ``Pipeline`` running on this ring, if any."""
    killed: Abort | None = None
    """Abort reason set by ``kill``: no collective may start on this ring any more."""
    notice_sent: bool = False
    """An abort notice went out on this ring already (each ring sends at most one each way)."""
    back: bytearray = field(default_factory=bytearray, repr=False)
    """Partial frame read from the reverse direction of ``send_sock``."""
    peer_ready: int = 0
    """Highest collective sequence number the right neighbour said it started (``READY``)."""
    crypto: RingCrypto | None = None
    """Sealers and openers of both connections when the mesh encrypts (see ``secure``)."""
    worked: bool = False
    """A collective completed on this ring (both connections carry data)."""
    running: bool = False
    """A collective (all its rounds) runs on this ring (``DataPlane._run_pipeline``)."""
    retiring: Abort | None = None
    """Set by ``kill(..., let_finish=True)`` while a collective runs: it ends on its own
    (completes, or fails as its neighbours decide), then the ring is killed with this reason."""
    on_close: Callable[[], None] | None = field(default=None, repr=False)
    """Called once as ``close`` begins, before the sockets close (``HangupWatch.remove``)."""

    def kill(self, reason: Abort, *, let_finish: bool = False) -> bool:
        """Abort whatever runs on this ring and refuse anything later (``DataPlane.abort_view``);
        True once killed. With ``let_finish`` (we moved on from the view: nobody was lost), a
        collective that runs is left to end on its own and the ring is killed after it
        (``end_collective``; False here): its neighbours may have sent all it needs, and
        whoever will not run it tells it so with their own notices. Sync and non-blocking;
        callable from any thread."""
        with self.lock:
            if let_finish and self.running and self.killed is None:
                self.retiring = self.retiring or reason
                return False
            self.broken = True
            if self.killed is None:
                self.killed = reason
            pipe = self.active
            if pipe is None and not self.notice_sent:
                # Nothing runs here: tell both neighbours ourselves. No engine thread can be
                # writing (none is active and none may start once ``killed`` is set).
                self.notice_sent = True
                body = wire.pack_control(reason.to_wire())[4:]
                frame = wire.FRAME.pack(wire.ABORT, len(body)) + body
                crypto = self.crypto
                for s, sealer in (
                    (self.send_sock, crypto and crypto.fwd_tx),
                    (self.recv_sock, crypto and crypto.rev_tx),
                ):
                    if s is not None:
                        with contextlib.suppress(OSError):
                            if sealer:
                                sealer.send_nowait(s, wire.ABORT, body)
                            else:
                                s.send(frame, _stdsocket.MSG_DONTWAIT)
        if pipe is not None:
            pipe.abort_from_outside(reason)
        self.shutdown_towards(reason.peer)
        return True

    def begin_collective(self) -> None:
        with self.lock:
            self.running = True

    def end_collective(self) -> None:
        """The collective that ran has ended: carry out a kill left for its end."""
        with self.lock:
            self.running = False
            retiring, self.retiring = self.retiring, None
        if retiring is not None and not self.broken:
            self.kill(retiring)

    def shutdown_towards(self, peer: str) -> None:
        """Fail the socket(s) to ``peer`` if it is a neighbour: a thread blocked writing to or
        reading from a dead member returns at once."""
        if self.view.size < 2:
            return
        for s, who in ((self.send_sock, self.right), (self.recv_sock, self.left)):
            if s is not None and who.node_id == peer:
                with contextlib.suppress(OSError):
                    s.shutdown(_stdsocket.SHUT_RDWR)

    def shutdown(self) -> None:
        """Unblock any thread using the sockets (they then fail fast); used on cancellation."""
        for s in (self.send_sock, self.recv_sock):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(_stdsocket.SHUT_RDWR)

    def close(self) -> None:
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()
        for s in (self.send_sock, self.recv_sock):
            if s is not None:
                s.close()
        self.send_sock = self.recv_sock = None


def sock_name(sock: _stdsocket.socket) -> str:
    try:
        return f"{sock.getsockname()[1]}->{sock.getpeername()[1]}"
    except OSError as exc:
        return repr(exc)


def to_blocking(sock: Socket, poll_interval: float) -> _stdsocket.socket:
    """Take the fd away from trio: a blocking stdlib socket for the engine. The engine itself
    uses non-blocking calls (``MSG_DONTWAIT``) and ``poll()``; SO_SNDTIMEO/SO_RCVTIMEO of
    ``poll_interval`` are a safety net so that no call on it can block for longer."""
    std = _stdsocket.socket(_stdsocket.AF_INET, _stdsocket.SOCK_STREAM, fileno=sock.detach())
    std.setblocking(True)
    sec = int(poll_interval)
    tv = struct.pack("ll", sec, max(1000, int((poll_interval - sec) * 1e6)))
    std.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_RCVTIMEO, tv)
    std.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_SNDTIMEO, tv)
    return std


_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)


def _shut_by_peer(sock: Socket) -> bool:
    """Whether the peer has shut down or reset a connection, even with data still unread;
    never blocks."""
    poller = select.poll()
    poller.register(sock.fileno(), _POLLRDHUP)
    return any(ev & (_POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))


def _unread(sock: _stdsocket.socket) -> int:
    """Bytes received on ``sock`` and not read yet (0 if that cannot be told)."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", raw)[0])


class HangupWatch:
    """The connections of open rings, watched for a neighbour that hangs up on them while no
    collective runs (item 2 of issue #30): a ring's connections stay open between collectives,
    so a neighbour killed between two steps is noticed when its kernel closes them, not when
    the next step's collective finds them closed.

    One ``epoll`` set holds every ring connection with ``EPOLLRDHUP`` alone (the peer's FIN
    or reset, and errors: never mere data, so the bytes of the next collective wake nobody),
    and trio waits on that set's own descriptor: no thread and no task per connection. Each
    connection is reported at most once and then leaves the set. Reported to ``report``
    (``Transport.report_closed``) only when it means something: the ring is idle (during a
    collective the engine sees the same close and reports it, ``Pipeline.hangup``), neither
    killed nor broken by us (then we shut it ourselves), and nothing the neighbour sent is
    unread (a live neighbour that gives a ring up writes an abort notice before it closes
    it; a killed process writes nothing). Without ``select.epoll`` (not Linux) nothing is
    watched."""

    def __init__(self) -> None:
        self._ep = select.epoll() if hasattr(select, "epoll") else None
        self._watched: dict[int, tuple[Ring, str, _stdsocket.socket]] = {}
        self.reported = 0
        """Hang-ups reported (for tests and statistics)."""

    def add(self, ring: Ring) -> None:
        """Watch ``ring``'s two connections until it closes (``Ring.on_close``)."""
        ep = self._ep
        if ep is None:
            return
        for sock, peer in ((ring.send_sock, ring.right), (ring.recv_sock, ring.left)):
            if sock is None:
                continue
            fd = sock.fileno()
            self._watched[fd] = (ring, peer.node_id, sock)
            try:
                ep.register(fd, select.EPOLLRDHUP)
            except OSError:
                self._watched.pop(fd, None)
        ring.on_close = lambda: self.remove(ring)

    def remove(self, ring: Ring) -> None:
        """Stop watching ``ring``'s connections (before they close). Any thread."""
        ep = self._ep
        if ep is None:
            return
        for sock in (ring.send_sock, ring.recv_sock):
            fd = sock.fileno() if sock is not None else -1
            entry = self._watched.get(fd)
            if entry is not None and entry[0] is ring:
                self._watched.pop(fd, None)
                with contextlib.suppress(OSError, ValueError):
                    ep.unregister(fd)

    async def run(self, report: Callable[[str], None]) -> None:
        ep = self._ep
        if ep is None:
            return
        while True:
            await trio.lowlevel.wait_readable(ep.fileno())
            for fd, _events in ep.poll(0):
                entry = self._watched.pop(fd, None)
                with contextlib.suppress(OSError, ValueError):
                    ep.unregister(fd)  # reported once: the condition stays
                if entry is None:
                    continue
                ring, peer, sock = entry
                idle = ring.active is None and not ring.running
                live = ring.killed is None and not ring.broken and sock.fileno() != -1
                if idle and live and _unread(sock) == 0:
                    self.reported += 1
                    log.debug("ring %s: %s hung up between collectives", ring.view.epoch, peer)
                    report(peer)

    def close(self) -> None:
        if self._ep is not None:
            self._ep.close()
        self._watched.clear()


class Transport:
    """Owns the listening socket, parked inbound connections and open rings of one member."""

    def __init__(
        self,
        node_id: str,
        listener: Socket,
        *,
        auth: MeshAuth,
        mesh: str,
        config: CollectiveConfig,
        observe: Observer | None = None,
    ) -> None:
        self.node_id = node_id
        self.observe = observe or _ignore
        """Receives connection outcomes (``reach`` events)."""
        self.listener = listener
        self.auth = auth
        self.mesh = mesh
        self.config = config
        self._parked: OrderedDict[tuple[str, str], Link] = OrderedDict()
        self._parked_changed = trio.Event()
        self._rings: OrderedDict[str, Ring] = OrderedDict()
        self._killed: list[Ring] = []
        """Rings killed while idle, closed at the next ``open_ring`` (see ``kill_ring``)."""
        self.dropped: dict[str, int] = {}
        self._admission = Admission(self._drop, handshake_timeout=config.connect_timeout)
        """Inbound connections still in their handshake (see ``ftmesh.net.admission``)."""
        self._poll = min(config.poll_interval, config.io_timeout)
        self.busy: Callable[[str], str | None] | None = None
        """``DataPlane.busy``: how a neighbour busy between steps is named, else None."""
        self.on_closed: Callable[[str, bool], None] | None = None
        """``DataPlane.on_closed``: told of a neighbour that closed, reset or (``True``)
        refused a connection (``report_closed``)."""
        self.hangups = HangupWatch()
        """The open rings' connections, watched between collectives."""

    def kill_ring(self, epoch: str, reason: Abort, *, let_finish: bool = False) -> None:
        """``Ring.kill`` the open ring of ``epoch`` (if any) and forget it; with ``let_finish``
        a collective running on it ends first (the ring stays cached, killed at its end, and
        a later ``kill_ring`` without ``let_finish`` still aborts it). A killed ring's sockets
        are closed only at the next ``open_ring``: ``kill`` has just written the abort
        notices, and closing a socket with the left neighbour's unread data queued resets the
        connection, which can overtake the notice (the neighbour would see a loss)."""
        ring = self._rings.get(epoch)
        if ring is None or not ring.kill(reason, let_finish=let_finish):
            return
        if self._rings.get(epoch) is ring:  # (an engine thread may have dropped it already)
            self._rings.pop(epoch, None)
        if ring.active is None:
            self._killed.append(ring)

    def report_closed(self, peer: str, *, refused: bool = False) -> None:
        """Tell ``on_closed`` that ``peer`` closed or reset a ring connection with nothing
        left unsaid (``refused``: refused to connect). Any thread; never raises."""
        fn = self.on_closed
        if fn is None or not peer or peer == self.node_id:
            return
        try:
            fn(peer, refused)
        except Exception:  # (a report must never break the collective that made it)
            log.exception("reporting %s's closed connection failed", peer)

    # -- inbound ------------------------------------------------------------------------
    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.hangups.run, self.report_closed)
            await accept_loop(
                self.listener.accept,
                lambda conn: nursery.start_soon(self._inbound, *conn),
                self._admission,
            )

    def _drop(self, reason: str, detail: str) -> None:
        n = self.dropped.get(reason, 0) + 1
        self.dropped[reason] = n
        if n & (n - 1) == 0:  # log the 1st, 2nd, 4th, 8th... occurrence
            log.warning("data plane dropped inbound connection (%s, #%d): %s", reason, n, detail)

    async def _inbound(self, sock: Socket, addr: tuple[str, int]) -> None:
        """Handshake an inbound connection within the admission's deadline, then park it."""
        found: tuple[tuple[str, str], Link] | None = None
        try:
            with self._admission.admit(str(addr[0])):
                found = await self._inbound_handshake(sock)
        except (RemoteProtocolError, EOFError, OSError) as exc:
            reason = exc.reason if isinstance(exc, RemoteProtocolError) else "handshake_failed"
            self._drop(reason, str(exc))
        finally:
            if found is None:
                sock.close()
        if found is not None:
            self._park(*found)

    async def _inbound_handshake(self, sock: Socket) -> tuple[tuple[str, str], Link] | None:
        """The server side of the handshake (see the module doc): where to park it, and it;
        None for a reachability probe (``probe``: it has its answer, nothing to park)."""
        tune_socket(sock, self.config)
        hello = await recv_control(sock)
        if hello.get("v") != wire.PROTOCOL_VERSION:
            raise RemoteProtocolError("bad_version", repr(hello.get("v")))
        if _field(hello, "mesh", str) != self.mesh:
            raise RemoteProtocolError("wrong_mesh", repr(hello.get("mesh")))
        if _field(hello, "to", str) != self.node_id:
            raise RemoteProtocolError("malformed", "hello addressed to another node")
        src = _field(hello, "from", str)
        epoch = _field(hello, "epoch", str)
        nc = _field(hello, "nonce", bytes)
        if len(nc) != wire.NONCE_BYTES or len(src) > 256 or len(epoch) > 64:
            raise RemoteProtocolError("malformed", "bad hello field sizes")
        enc = self.auth.encrypt
        if (hello.get("enc") is True) != enc:
            mine = "encrypts" if enc else "does not encrypt"
            await send_control(sock, {"v": wire.PROTOCOL_VERSION, "error": f"this member {mine}"})
            raise RemoteProtocolError(
                "encryption_mismatch", f"{src!r}: this member {mine}, it does not"
            )
        na = os.urandom(wire.NONCE_BYTES)
        t = wire.transcript(self.mesh, src, self.node_id, epoch, nc, na, encrypt=enc)
        tag = self.auth.tag(b"A" + t) if self.auth.enabled else b""
        await send_control(sock, {"v": wire.PROTOCOL_VERSION, "nonce": na, "tag": tag})
        resp = await recv_control(sock)
        if self.auth.enabled and not self.auth.verify(b"C" + t, _field(resp, "tag", bytes)):
            raise RemoteProtocolError("bad_mac", f"from {src!r}")
        keys = session_keys(self.auth, 0, t) if enc else None
        if hello.get("probe") is True:
            return None
        return (src, epoch), (sock, keys)

    def _park(self, key: tuple[str, str], link: Link) -> None:
        old = self._parked.pop(key, None)
        if old is not None:
            old[0].close()
        self._parked[key] = link
        while len(self._parked) > MAX_PARKED:
            _, victim = self._parked.popitem(last=False)
            victim[0].close()
        ev, self._parked_changed = self._parked_changed, trio.Event()
        ev.set()

    async def _take_parked(self, key: tuple[str, str]) -> Link:
        """The connection parked under ``key``, waiting for one. A connection its client has
        closed meanwhile (it gave up waiting for us) is dropped, not handed out."""
        while True:
            while key not in self._parked:
                await self._parked_changed.wait()
            link = self._parked.pop(key)
            if not _shut_by_peer(link[0]):
                return link
            link[0].close()

    # -- rings --------------------------------------------------------------------------
    def cached_ring(self, view: RingView) -> Ring | None:
        ring = self._rings.get(view.epoch)
        if ring is not None and ring.broken:
            self.drop_ring(ring)
            return None
        return ring

    def cached_ring_of(self, epoch: str) -> Ring | None:
        return self._rings.get(epoch)

    def drop_ring(self, ring: Ring) -> None:
        if ring.send_sock is not None or ring.recv_sock is not None:
            log.debug("dropped ring %s at seq %d", ring.view.epoch, ring.seq)
        ring.close()
        if self._rings.get(ring.view.epoch) is ring:  # (may be called from an engine thread)
            self._rings.pop(ring.view.epoch, None)

    def close(self) -> None:
        for ring in [*self._rings.values(), *self._killed]:
            ring.close()
        self._rings.clear()
        self._killed.clear()
        for s, _keys in self._parked.values():
            s.close()
        self._parked.clear()
        self.hangups.close()
        self.listener.close()

    async def open_ring(self, view: RingView) -> Ring:
        """Return the ring for ``view``, connecting and agreeing with the neighbours if needed."""
        for dead in self._killed:
            dead.close()
        self._killed.clear()
        for done in list(self._rings.values()):  # killed at the end of a collective
            if done.killed is not None and not done.running:
                self.drop_ring(done)
        ring = self.cached_ring(view)
        if ring is not None:
            return ring
        rank = view.rank_of(self.node_id)
        ring = Ring(view, rank, view.right_of(self.node_id), view.left_of(self.node_id), None, None)
        log.debug("opening ring of %s: rank %d of %d", view.epoch, rank, view.size)
        if view.size > 1:
            (send, send_keys), (recv, recv_keys) = await self._formed_halves(ring)
            ring.send_sock = to_blocking(send, self._poll)
            ring.recv_sock = to_blocking(recv, self._poll)
            if send_keys is not None and recv_keys is not None:
                ring.crypto = RingCrypto.create(
                    ring.send_sock,
                    send_keys,
                    ring.recv_sock,
                    recv_keys,
                    max(self.config.chunk_bytes + 1024, wire.MAX_CONTROL_BYTES),
                )
            log.debug(
                "ring %x of %s: from %s via %s, to %s via %s",
                id(ring),
                view.epoch,
                ring.left.node_id,
                sock_name(ring.recv_sock),
                ring.right.node_id,
                sock_name(ring.send_sock),
            )
        self._rings[view.epoch] = ring
        self.hangups.add(ring)
        log.debug("opened ring %x of %s: rank %d of %d", id(ring), view.epoch, rank, view.size)
        # The cache holds the rings of the last ``max_cached_views`` views; a sub-view's ring
        # (a phase of a hierarchical allreduce, ``RingView.sub``) counts as its view's.
        recent = dict.fromkeys(r.view.parent or e for e, r in reversed(self._rings.items()))
        keep = set(list(recent)[: self.config.max_cached_views])
        for epoch, old in list(self._rings.items()):
            if (old.view.parent or epoch) not in keep:
                del self._rings[epoch]
                log.debug("closed ring %s (cache full, at seq %d)", old.view.epoch, old.seq)
                old.close()
        return ring

    async def _formed_halves(self, ring: Ring) -> tuple[Link, Link]:
        """``_connect_halves``, then re-done for any half whose neighbour has meanwhile given
        its connection up. A half can be confirmed long before the other one (the neighbour
        on that side formed its ring first), and that neighbour may then have failed and
        closed it: a ring formed on such a connection fails at once, its failure aborts the
        neighbours' new rings, whose failures abort the next ones, and so on round the ring
        for as long as members keep retrying. Checking both connections once the ring is
        complete, and replacing a dead one, ends that."""
        deadline = trio.current_time() + self.config.view_timeout
        send, recv = await self._connect_halves(ring)
        try:
            for _ in range(64):  # bounded by count and by view_timeout
                dead_send, dead_recv = _shut_by_peer(send[0]), _shut_by_peer(recv[0])
                if not (dead_send or dead_recv):
                    return send, recv
                if trio.current_time() > deadline:
                    break
                log.debug(
                    "ring of %s: %s gave its connection up while the ring formed; reconnecting",
                    ring.view.epoch,
                    "right" if dead_send else "left",
                )
                if dead_send:
                    send[0].close()
                    send = await self._open_right(ring)
                if dead_recv:
                    recv[0].close()
                    recv = await self._open_left(ring)
        except BaseException:
            send[0].close()
            recv[0].close()
            raise
        send[0].close()
        recv[0].close()
        raise ViewMismatchError(
            f"{self.node_id}: the neighbours of view {ring.view.epoch} kept giving up their "
            f"connections within {self.config.view_timeout}s",
            epoch=ring.view.epoch,
            peer=ring.right.node_id,
        )

    async def _connect_halves(self, ring: Ring) -> tuple[Link, Link]:
        """Both connections of ``ring``, each confirmed by its neighbour (``view_ok``)."""
        errors: list[FtmeshError] = []
        socks: dict[str, Link] = {}

        async def half(
            name: str, fn: Callable[[Ring], Awaitable[Link]], cancel: trio.CancelScope
        ) -> None:
            try:
                socks[name] = await fn(ring)
            except FtmeshError as exc:  # surfaced below, unwrapped from the group
                errors.append(exc)
                cancel.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(half, "send", self._open_right, nursery.cancel_scope)
                nursery.start_soon(half, "recv", self._open_left, nursery.cancel_scope)
        except BaseException:
            for sock, _keys in socks.values():
                sock.close()
            raise
        if errors:
            for sock, _keys in socks.values():
                sock.close()
            raise errors[0]
        return socks["send"], socks["recv"]

    async def _neighbour_within(
        self, peer: str, epoch: str, wait: Callable[[], Awaitable[T]]
    ) -> T | None:
        """``wait()`` (cancel-safe) for ``peer``'s half of the ring of ``epoch``: within
        ``view_timeout``, or, if ``peer`` then declares itself busy between steps, within
        ``start_wait`` in all. None when it did not come."""
        start = trio.current_time()
        with trio.move_on_at(start + self.config.view_timeout):
            return await wait()
        named = self.busy(peer) if self.busy is not None else None
        if named is None:
            return None
        log.info(
            "waiting for %s to open the ring of view %s: it is busy between steps; giving up "
            "after %gs (CollectiveConfig.start_wait)",
            named,
            epoch,
            self.config.start_wait,
        )
        with trio.move_on_at(start + max(self.config.start_wait, self.config.view_timeout)):
            return await wait()
        return None

    async def _open_left(self, ring: Ring) -> Link:
        epoch, left = ring.view.epoch, ring.left.node_id
        parked = await self._neighbour_within(left, epoch, lambda: self._take_parked((left, epoch)))
        if parked is not None:
            sock, keys = parked
            try:
                await send_control(sock, {"view_ok": epoch})
            except OSError:
                sock.close()
                raise RingPeerLostError(
                    f"left neighbour {left} closed the connection during view agreement",
                    peer=left,
                    epoch=epoch,
                ) from None
            except BaseException:
                sock.close()
                raise
            return sock, keys
        others = [e for (src, e) in self._parked if src == left]
        seen = f"; it connected with epoch(s) {others}" if others else ""
        raise ViewMismatchError(
            f"{self.node_id}: left neighbour {left} did not confirm view epoch {epoch} "
            f"(members {list(ring.view.node_ids)}) within {self.config.view_timeout}s{seen}",
            epoch=epoch,
            peer=left,
        )

    async def _open_right(self, ring: Ring) -> Link:
        view, right = ring.view, ring.right
        sock, keys = await self._connect(view, right)

        async def readable() -> bool:
            await trio.lowlevel.wait_readable(sock)
            return True

        try:
            if await self._neighbour_within(right.node_id, view.epoch, readable):
                with trio.move_on_after(self.config.view_timeout):
                    msg = await recv_control(sock)
                    if msg.get("view_ok") != view.epoch:
                        raise RemoteProtocolError("malformed", f"unexpected view reply {msg!r}")
                    return sock, keys
        except (EOFError, OSError):
            sock.close()
            raise RingPeerLostError(
                f"right neighbour {right.node_id} closed the connection during view agreement",
                peer=right.node_id,
                epoch=view.epoch,
            ) from None
        except BaseException:
            sock.close()
            raise
        sock.close()
        raise ViewMismatchError(
            f"{self.node_id}: right neighbour {right.node_id} did not confirm view epoch "
            f"{view.epoch} (members {list(view.node_ids)}) within {self.config.view_timeout}s",
            epoch=view.epoch,
            peer=right.node_id,
        )

    async def _connect(self, view: RingView, peer: Peer) -> Link:
        """Connect and authenticate, retrying refused connections until connect_timeout.
        Every attempt is reported to ``observe`` (``reach`` decides whether the neighbour is
        unreachable)."""
        last: BaseException | None = None
        delay = 0.01
        addr = f"{peer.host}:{peer.port}"
        self.observe(Connecting(time.monotonic(), peer.node_id, addr))
        connected = refused = False
        try:
            with trio.move_on_after(self.config.connect_timeout):
                for _attempt in range(1000):  # bounded by count and by the deadline above
                    sock = trio.socket.socket(_stdsocket.AF_INET, _stdsocket.SOCK_STREAM)
                    try:
                        tune_socket(sock, self.config)
                        await sock.connect((peer.host, peer.port))
                        keys = await self._client_handshake(sock, view.epoch, peer)
                        connected = True
                        self.observe(Connected(time.monotonic(), peer.node_id))
                        return sock, keys
                    except (OSError, EOFError) as exc:
                        sock.close()
                        last = exc
                        self.observe(ConnectFailed(time.monotonic(), peer.node_id, addr, repr(exc)))
                        if isinstance(exc, ConnectionRefusedError) and not refused:
                            refused = True  # (its listener is gone: membership probes it)
                            self.report_closed(peer.node_id, refused=True)
                    except RemoteProtocolError as exc:
                        sock.close()
                        self.observe(ConnectFailed(time.monotonic(), peer.node_id, addr, str(exc)))
                        raise self._refused(peer, exc) from None
                    except BaseException:
                        sock.close()
                        raise
                    await trio.sleep(delay)
                    delay = min(delay * 2, 0.5)
        finally:
            if not connected:
                self.observe(ConnectEnded(time.monotonic(), peer.node_id))
        raise RingPeerLostError(
            f"{self.node_id}: cannot reach ring neighbour {peer.node_id} at "
            f"{addr} within {self.config.connect_timeout}s ({last!r})",
            peer=peer.node_id,
            epoch=view.epoch,
        )

    def _refused(self, peer: Peer, exc: RemoteProtocolError) -> CollectiveError:
        if exc.reason == "encryption_mismatch":
            mine = "on" if self.auth.encrypt else "off"
            return CollectiveError(
                f"{self.node_id}: ring neighbour {peer.node_id} refused the data-plane "
                f"handshake ({exc}); encryption is {mine} here: every member of a mesh must "
                "use the same --encrypt setting"
            )
        return CollectiveError(
            f"{self.node_id}: ring neighbour {peer.node_id} refused or failed the data-plane "
            f"handshake ({exc}); is it in the same mesh, with the same secret?"
        )

    async def probe(self, peer: Peer, timeout: float) -> bool:
        """Whether ``peer`` answers at its data address: one connect and the authenticated
        handshake (so another process at that address, or one without the mesh secret, does
        not count), within ``timeout`` seconds. Opens no ring; the peer parks nothing."""
        sock = trio.socket.socket(_stdsocket.AF_INET, _stdsocket.SOCK_STREAM)
        try:
            with trio.move_on_after(timeout):
                await sock.connect((peer.host, peer.port))
                await self._client_handshake(sock, "", peer, probe=True)
                return True
            return False
        except (OSError, EOFError, RemoteProtocolError):
            return False
        finally:
            sock.close()

    async def _client_handshake(
        self, sock: Socket, epoch: str, peer: Peer, *, probe: bool = False
    ) -> SessionKeys | None:
        nc = os.urandom(wire.NONCE_BYTES)
        enc = self.auth.encrypt
        hello: dict[str, Any] = {
            "v": wire.PROTOCOL_VERSION,
            "mesh": self.mesh,
            "from": self.node_id,
            "to": peer.node_id,
            "epoch": epoch,
            "nonce": nc,
        }
        if enc:
            hello["enc"] = True
        if probe:
            hello["probe"] = True
        await send_control(sock, hello)
        reply = await recv_control(sock)
        if "error" in reply:
            err = str(reply["error"])[:200]
            reason = "encryption_mismatch" if "encrypt" in err else "refused"
            raise RemoteProtocolError(reason, err)
        na = _field(reply, "nonce", bytes)
        t = wire.transcript(self.mesh, self.node_id, peer.node_id, epoch, nc, na, encrypt=enc)
        keys = None
        if self.auth.enabled:
            index = self.auth.verify_index(b"A" + t, _field(reply, "tag", bytes))
            if index is None:
                raise RemoteProtocolError(
                    "bad_mac", f"{peer.node_id} did not prove the mesh secret"
                )
            tag = self.auth.tag(b"C" + t)
            if enc:
                keys = session_keys(self.auth, index, t)
        else:
            tag = b""
        await send_control(sock, {"tag": tag})
        return keys
