"""Striped, hash-verified state transfer over TCP (trio); its benchmark: ``bench/transfer.py``.

Theory of operation: every member that holds a committed snapshot can run a ``StateServer``.
A member that needs that state (a joiner, or a survivor that is behind) knows the ``(step,
digest)`` it wants from the commit protocol, and calls ``fetch_state`` with several peers.

Per connection, the protocol (version 1; length-prefixed msgpack control messages, capped at
``MAX_CONTROL_BYTES``, then raw bytes)::

    C -> S  hello      {v, t, mesh, nonce_c, step, digest}
    S -> C  challenge  {v, t, nonce_s, tag_s}       | error {reason} (wrong mesh / version)
    C -> S  auth       {t, tag_c}
    S -> C  manifest   {t, step, digest, size, chunk} + leaf hashes (32 B per chunk)
            | unavailable {t, step, digest}         (the server holds another state)
    C -> S  get        {t, first, count}             (repeated)
    S -> C  raw bytes of chunks [first, first+count)
    C -> S  bye

With a mesh secret, ``tag_s = MAC("S" | transcript)`` and ``tag_c = MAC("C" | transcript)``
where the transcript binds the mesh name, both fresh nonces, the step and the digest: each
side proves it holds the secret, and a recorded handshake cannot be replayed. Integrity does
not rest on the secret: the client checks the manifest's leaves against the digest it asked
for, and every chunk against its leaf as it arrives, so a lying or broken peer is detected
(its chunks are re-fetched from another peer and it is dropped), and a corrupt state is
never returned.

Until a client has passed the challenge its connection is admitted by
``ftmesh.net.admission`` (caps per port and per source, oldest shed first, ``connect_timeout``
from accept); authenticated sessions are then capped by ``max_sessions``.

Striping: the blob is split into ranges of ``chunks_per_request`` chunks in a shared queue;
each peer's worker takes the next range, so peers pull disjoint stripes in parallel and fast
peers naturally take more. A range whose peer dies, lies or misses its ``request_timeout`` goes
back to the front of the queue for another peer. Chunks are received straight into one
preallocated buffer (``recv_into``), and hashing runs in worker threads (BLAKE3 releases the
GIL), overlapping with the next receive.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket as _stdsocket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import trio

from ..errors import ConfigError, LocalUsageError, RemoteProtocolError
from ..net.admission import Admission, accept_loop, peer_host
from ..net.ports import bind_error
from ..security import MeshAuth
from .errors import StaleSnapshotError, StateTransferError
from .memory import prepared_zeros
from .snapshot import (
    DIGEST_CHUNK_BYTES,
    LEAF_BYTES,
    Snapshot,
    chunk_count,
    chunk_len,
    hash_chunks,
    root_digest,
)

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 2
"""2: snapshot format 2 (BLAKE3 leaves); a peer of another version is refused as
``bad_version``."""
NONCE_BYTES = 16
MAX_CONTROL_BYTES = 4096
"""Cap on one control message. The largest legitimate one (hello) is ~200 bytes."""
MAX_CHUNKS_PER_GET = 256
"""Cap on one request: bounds how long one client request keeps a server sending (256 MiB)."""
MAX_MESH_NAME = 256
MAX_DIGEST_CHARS = 128
_LEN = struct.Struct(">I")
_TRANSCRIPT_PERSON = b"ftmesh-state-transfer-v1"

Socket = trio.socket.SocketType
Lookup = Callable[[int, str], Snapshot | None]
"""``lookup(step, digest)``: the snapshot a state server serves for that request."""
SnapshotSource = Callable[[], "Snapshot | None"]


MIN_CHUNKS_PER_REQUEST = 4
"""Fewest chunks a request asks for (unless ``chunks_per_request`` is lower)."""


@dataclass(frozen=True)
class TransferConfig:
    """Timeouts and sizes of state transfer. Every wait is bounded by one of these."""

    connect_timeout: float = 5.0
    """Seconds for TCP connect + handshake + manifest. Loopback/LAN need milliseconds; the
    slack covers a server that is computing the digest of a fresh multi-GB snapshot."""
    request_timeout: float = 10.0
    """Seconds for one request of ``chunks_per_request`` chunks. A peer slower than
    ``chunks_per_request`` MiB per ``request_timeout`` is given up on and its stripe
    re-assigned; lower it to react faster to stalled peers, at the risk of dropping slow ones."""
    chunks_per_request: int = 32
    """Most chunks (1 MiB each) per request: larger amortises round trips and thread hand-offs
    (measured on loopback: 32 gives ~1.5x the throughput of 8), smaller re-assigns less work
    when a peer fails. Small states use smaller requests so that every peer gets about four,
    but not under ``MIN_CHUNKS_PER_REQUEST`` (16 MiB from 3 peers on loopback: 1-chunk
    requests ran at 0.37x the raw TCP ceiling, 4-chunk ones at 0.57x)."""
    max_state_bytes: int = 1 << 40
    """Largest state a client accepts from a manifest (bounds the buffer it allocates)."""
    idle_timeout: float = 60.0
    """Server: seconds a client may stay silent between requests before it is dropped."""
    max_sessions: int = 32
    """Server: concurrent client sessions; more are refused (bounds memory and threads)."""
    socket_buffer_bytes: int = 4 << 20
    """SO_SNDBUF/SO_RCVBUF; 0 keeps the OS default."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "request_timeout", "idle_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if not 1 <= self.chunks_per_request <= MAX_CHUNKS_PER_GET:
            raise ConfigError(f"chunks_per_request must be in [1, {MAX_CHUNKS_PER_GET}]")
        if self.max_sessions < 1 or self.max_state_bytes < 1 or self.socket_buffer_bytes < 0:
            raise ConfigError("max_sessions, max_state_bytes must be >= 1")


# -- low-level I/O -------------------------------------------------------------------------


def _tune(sock: Socket, config: TransferConfig) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
        if config.socket_buffer_bytes:
            sock.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_SNDBUF, config.socket_buffer_bytes)
            sock.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_RCVBUF, config.socket_buffer_bytes)


async def _send_all(sock: Socket, data: bytes | bytearray | memoryview) -> None:
    mv = memoryview(data)
    while mv:
        n = await sock.send(mv)
        mv = mv[n:]


async def _recv_into(sock: Socket, mv: memoryview) -> None:
    while mv:
        n = await sock.recv_into(mv)
        if n == 0:
            raise EOFError("connection closed")
        mv = mv[n:]


async def _send_msg(sock: Socket, msg: dict[str, Any]) -> None:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    await _send_all(sock, _LEN.pack(len(body)) + body)


async def _recv_msg(sock: Socket) -> dict[str, Any]:
    head = bytearray(_LEN.size)
    await _recv_into(sock, memoryview(head))
    (length,) = _LEN.unpack(head)
    if length > MAX_CONTROL_BYTES:
        raise RemoteProtocolError("oversized", f"control message of {length} bytes")
    body = bytearray(length)
    await _recv_into(sock, memoryview(body))
    try:
        msg = msgpack.unpackb(bytes(body), raw=False)
    except Exception as exc:  # msgpack's own error types vary by version
        raise RemoteProtocolError("malformed", f"control message: {exc!r}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise RemoteProtocolError("malformed", "control message is not a typed map")
    return msg


def _field(msg: dict[str, Any], key: str, typ: type) -> Any:
    v = msg.get(key)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise RemoteProtocolError("malformed", f"field {key!r} missing or mistyped")
    return v


def _transcript(mesh: str, nc: bytes, ns: bytes, step: int, digest: str) -> bytes:
    m = mesh.encode()
    return b"".join(
        [
            _TRANSCRIPT_PERSON,
            len(m).to_bytes(4, "big"),
            m,
            nc,
            ns,
            step.to_bytes(8, "big"),
            digest.encode(),
        ]
    )


def _addr(peer: Any) -> tuple[str, int]:
    if hasattr(peer, "host") and hasattr(peer, "port"):
        return str(peer.host), int(peer.port)
    host, port = peer
    return str(host), int(port)


# -- server --------------------------------------------------------------------------------


class StateServer:
    """Serves snapshots: ``source`` is a ``State`` (its latest committed snapshot is served)
    or a lookup ``source(step, digest)`` returning the snapshot a client asks for (or any other
    snapshot, or None: the client is told it is unavailable). Start it with
    ``nursery.start(server.serve, ...)`` or ``serve_state``; ``close()`` stops it and drops
    every session."""

    def __init__(
        self,
        source: Any,
        *,
        auth: MeshAuth,
        mesh: str,
        config: TransferConfig | None = None,
    ) -> None:
        if callable(source):
            self._source: Lookup = source
        elif hasattr(source, "committed"):
            self._source = lambda step, digest: source.committed
        else:
            raise LocalUsageError("source must be a State or a lookup(step, digest)")
        self.auth = auth
        self.mesh = mesh
        self.config = config or TransferConfig()
        self.host = ""
        self.port = 0
        self._listeners: list[trio.SocketListener] = []
        self.dropped: dict[str, int] = {}
        """Refused or failed sessions by reason (``bad_mac``, ``wrong_mesh``, ``timeout``...)."""
        self.sessions_served = 0
        self.bytes_sent = 0
        self._cancel = trio.CancelScope()
        self._limiter = trio.CapacityLimiter(self.config.max_sessions)
        self._admission = Admission(self._drop, handshake_timeout=self.config.connect_timeout)
        """Sessions still in their handshake (see ``ftmesh.net.admission``)."""

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def close(self) -> None:
        """Stop serving. The listening socket is closed now, not when the server's task next
        runs, so a replacement can bind the same fixed port (``--state-port``) at once."""
        self._cancel.cancel()
        for lst in self._listeners:
            with contextlib.suppress(OSError):
                lst.socket.close()

    async def serve(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        task_status: trio.TaskStatus[StateServer] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind ``host:port`` (0: any free port) and serve until ``close()``. A port that
        cannot be bound is a ``ConfigError`` naming ``--state-port``."""
        with self._cancel:
            try:
                listeners = await trio.open_tcp_listeners(port, host=host)
            except OSError as exc:
                raise bind_error(
                    "state", host, port, "--state-port ($FTMESH_STATE_PORT)", exc
                ) from None
            self._listeners = listeners
            try:
                sockname = listeners[0].socket.getsockname()
                self.host, self.port = str(sockname[0]), int(sockname[1])
                async with trio.open_nursery() as nursery:
                    task_status.started(self)
                    await accept_loop(
                        listeners[0].accept,
                        lambda stream: nursery.start_soon(self._session, stream),
                        self._admission,
                    )
            finally:
                for lst in listeners:
                    with contextlib.suppress(OSError):
                        lst.socket.close()

    def _drop(self, reason: str, detail: str) -> None:
        n = self.dropped.get(reason, 0) + 1
        self.dropped[reason] = n
        if n & (n - 1) == 0:  # log the 1st, 2nd, 4th, 8th... occurrence
            log.warning("state server dropped a session (%s, #%d): %s", reason, n, detail)

    async def _session(self, stream: trio.SocketStream) -> None:
        sock = stream.socket
        try:
            request = None
            with self._admission.admit(peer_host(sock)):
                _tune(sock, self.config)
                request = await self._handshake(sock)
            if request is None:
                return  # shed or timed out (counted by the admission)
            try:
                self._limiter.acquire_nowait()
            except trio.WouldBlock:
                self._drop("busy", "too many sessions")
                return
            try:
                await self._run_session(sock, *request)
            finally:
                self._limiter.release()
        except RemoteProtocolError as exc:
            self._drop(exc.reason, str(exc))
        except trio.TooSlowError:
            self._drop("timeout", "client too slow")
        except StaleSnapshotError as exc:
            self._drop("stale", str(exc))
        except (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._drop("eof", repr(exc))
        finally:
            sock.close()

    async def _handshake(self, sock: Socket) -> tuple[int, str]:
        """The server's side of the handshake: the ``(step, digest)`` the client asks for,
        once it has proved the secret."""
        hello = await _recv_msg(sock)
        if hello.get("v") != PROTOCOL_VERSION or hello.get("t") != "hello":
            await _send_msg(sock, {"t": "error", "reason": "bad_version"})
            raise RemoteProtocolError("bad_version", repr(hello.get("v")))
        mesh = _field(hello, "mesh", str)
        if mesh != self.mesh:
            await _send_msg(sock, {"t": "error", "reason": "wrong_mesh"})
            raise RemoteProtocolError("wrong_mesh", repr(mesh[:MAX_MESH_NAME]))
        nc = _field(hello, "nonce", bytes)
        step = _field(hello, "step", int)
        digest = _field(hello, "digest", str)
        if len(nc) != NONCE_BYTES or len(digest) > MAX_DIGEST_CHARS or not 0 <= step < 2**63:
            raise RemoteProtocolError("malformed", "hello field sizes")
        ns = os.urandom(NONCE_BYTES)
        tr = _transcript(self.mesh, nc, ns, step, digest)
        tag = self.auth.tag(b"S" + tr) if self.auth.enabled else b""
        await _send_msg(sock, {"v": PROTOCOL_VERSION, "t": "challenge", "nonce": ns, "tag": tag})
        resp = await _recv_msg(sock)
        ctag = _field(resp, "tag", bytes) if resp.get("t") == "auth" else None
        if ctag is None:
            raise RemoteProtocolError("malformed", "expected auth")
        if self.auth.enabled and not self.auth.verify(b"C" + tr, ctag):
            raise RemoteProtocolError("bad_mac", "client failed the challenge")
        return step, digest

    async def _run_session(self, sock: Socket, step: int, digest: str) -> None:
        with trio.fail_after(self.config.connect_timeout):
            snap = self._source(step, digest)
            if snap is None or snap.step != step:
                await self._unavailable(sock, snap)
                return
            with snap.lease():
                # (hashing a fresh snapshot takes a while: not in the event loop's thread)
                known = snap._digest or await trio.to_thread.run_sync(lambda: snap.digest)
                if known != digest:
                    await self._unavailable(sock, snap)
                    return
                await _send_msg(
                    sock,
                    {
                        "t": "manifest",
                        "step": snap.step,
                        "digest": snap.digest,
                        "size": snap.nbytes,
                        "chunk": DIGEST_CHUNK_BYTES,
                    },
                )
                await _send_all(sock, snap.leaves)
                self.sessions_served += 1
        with snap.lease():
            await self._serve_chunks(sock, snap)

    async def _unavailable(self, sock: Socket, snap: Snapshot | None) -> None:
        have = {"step": -1, "digest": ""} if snap is None else {"step": snap.step, "digest": ""}
        await _send_msg(sock, {"t": "unavailable", **have})

    async def _serve_chunks(self, sock: Socket, snap: Snapshot) -> None:
        n = snap.chunk_count
        while True:
            with trio.fail_after(self.config.idle_timeout):
                try:
                    msg = await _recv_msg(sock)
                except EOFError:
                    return  # client done (or gone): a normal end
            if msg["t"] == "bye":
                return
            if msg["t"] != "get":
                raise RemoteProtocolError("malformed", f"unexpected {msg['t']!r}")
            first, count = _field(msg, "first", int), _field(msg, "count", int)
            if not (first >= 0 and 1 <= count <= MAX_CHUNKS_PER_GET and first + count <= n):
                raise RemoteProtocolError("malformed", f"bad range {first}+{count} of {n}")
            with trio.fail_after(self.config.request_timeout):
                for i in range(first, first + count):
                    await self._send_chunk(sock, snap, i)

    async def _send_chunk(self, sock: Socket, snap: Snapshot, index: int) -> None:
        """Send one chunk. Fault-injection tests override this."""
        for mv in snap.chunk_views(index):
            await _send_all(sock, mv)
            self.bytes_sent += len(mv)


async def serve_state(
    source: Any,
    *,
    auth: MeshAuth,
    mesh: str,
    host: str = "127.0.0.1",
    port: int = 0,
    config: TransferConfig | None = None,
    task_status: trio.TaskStatus[StateServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a ``StateServer``; use as ``server = await nursery.start(functools.partial(
    serve_state, state, auth=auth, mesh=name))``. ``server.port`` is the bound port."""
    server = StateServer(source, auth=auth, mesh=mesh, config=config)
    await server.serve(host=host, port=port, task_status=task_status)


# -- client --------------------------------------------------------------------------------


@dataclass
class TransferStats:
    """What a ``fetch_state`` did: bytes per peer, peers given up on and why."""

    bytes_from: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    bad_chunks: int = 0
    reassigned: int = 0
    """Ranges put back in the queue after their peer failed."""
    seconds: float = 0.0


class _Job:
    def __init__(
        self,
        step: int,
        digest: str,
        config: TransferConfig,
        n_peers: int,
        buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None,
    ) -> None:
        self.n_peers = n_peers
        self.step = step
        self.digest = digest
        self.config = config
        self.size = -1
        self.leaves = b""
        self.buf = buffer
        self.mv = memoryview(b"")
        self.n = 0
        self.pending: deque[tuple[int, int]] = deque()
        self.done = 0
        self.changed = trio.Event()
        self.finished = trio.Event()

    def adopt(self, size: int, leaves: bytes) -> None:
        if root_digest(size, leaves) != self.digest:
            raise RemoteProtocolError("bad_manifest", "manifest does not hash to the digest")
        if self.size >= 0:
            return
        self.size, self.leaves = size, leaves
        self.n = chunk_count(size)
        buf = self.buf
        if buf is None or buf.nbytes < size:
            # A thread maps the pages while the first receives run: page faults inside
            # recv_into cost several times more (see ``memory``).
            buf = prepared_zeros(size)
        self.buf = buf[:size]
        self.mv = self.buf.data
        # Up to four requests per peer, the same number for each, none under
        # MIN_CHUNKS_PER_REQUEST (a request costs a round trip and a thread hand-off, which
        # would dominate 1 MiB requests) or over chunks_per_request; of equal size within one
        # chunk, so no short tail costs a round trip of its own.
        rounds = min(4, max(1, self.n // (MIN_CHUNKS_PER_REQUEST * self.n_peers)))
        fewest = -(-self.n // self.config.chunks_per_request)
        count = min(self.n, max(rounds * self.n_peers, fewest))
        base, extra = divmod(self.n, count)
        first = 0
        for i in range(count):
            length = base + (i < extra)
            self.pending.append((first, length))
            first += length
        self._poke()

    def _poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def take(self) -> tuple[int, int] | None:
        """The next range to fetch; None when everything is verified. Waits while the rest is
        in flight elsewhere: bounded, since every in-flight range completes or comes back
        within ``request_timeout`` (plus its hashing)."""
        with trio.fail_after(2 * self.config.request_timeout + self.config.connect_timeout):
            while True:
                if self.done == self.n:
                    return None
                if self.pending:
                    return self.pending.popleft()
                await self.changed.wait()

    def give_back(self, rng: tuple[int, int]) -> None:
        self.pending.appendleft(rng)
        self._poke()

    def complete(self, rng: tuple[int, int]) -> None:
        self.done += rng[1]
        if self.done == self.n:
            self.finished.set()
        self._poke()

    def view(self, rng: tuple[int, int]) -> memoryview:
        first, count = rng
        start = first * DIGEST_CHUNK_BYTES
        stop = start + sum(chunk_len(self.size, i) for i in range(first, first + count))
        return self.mv[start:stop]

    def expected(self, rng: tuple[int, int]) -> bytes:
        first, count = rng
        return self.leaves[first * LEAF_BYTES : (first + count) * LEAF_BYTES]


SIZE_HINT_FACTOR = 4
"""A joiner prepares a receive buffer of at most this many times its own state's size (plus
``SIZE_HINT_SLACK``) from the size the members advertise: the state it will fetch is the
same model and optimizer as its own (4x covers extra optimizer state, a sharded piece and
buffers), so a larger hint is a member's lie or a different program, and allocating it
would be the joiner's loss (a member could advertise 1 TiB)."""
SIZE_HINT_SLACK = 64 << 20
"""Bytes allowed over ``SIZE_HINT_FACTOR`` times the joiner's own state (small states)."""


def bounded_state_hint(holders: Sequence[tuple[int, int]], *, cap: int) -> int:
    """The state size the members agree on, 0 for none: ``holders`` are ``(committed step,
    advertised bytes)`` of the training members; of those holding the newest step, the
    largest size more than half of them advertise at least (one member's claim cannot raise
    it above what the others hold), and 0 if that exceeds ``cap``."""
    if not holders:
        return 0
    newest = max(step for step, _ in holders)
    sizes = sorted((n for step, n in holders if step == newest), reverse=True)
    hint = sizes[len(sizes) // 2]
    return 0 if hint > cap else hint


def own_size_limit(own: int) -> int:
    """The largest hint a joiner whose own state takes ``own`` bytes prepares a buffer for:
    ``SIZE_HINT_FACTOR`` times it plus ``SIZE_HINT_SLACK``."""
    return max(own, 0) * SIZE_HINT_FACTOR + SIZE_HINT_SLACK


async def _client_handshake(
    sock: Socket, job: _Job, *, auth: MeshAuth, mesh: str, config: TransferConfig
) -> tuple[int, bytes]:
    nc = os.urandom(NONCE_BYTES)
    await _send_msg(
        sock,
        {
            "v": PROTOCOL_VERSION,
            "t": "hello",
            "mesh": mesh,
            "nonce": nc,
            "step": job.step,
            "digest": job.digest,
        },
    )
    ch = await _recv_msg(sock)
    if ch["t"] == "error":
        reason = ch.get("reason")
        raise RemoteProtocolError(reason if isinstance(reason, str) else "refused", "by server")
    if ch["t"] != "challenge" or ch.get("v") != PROTOCOL_VERSION:
        raise RemoteProtocolError("bad_version", "expected a challenge")
    ns = _field(ch, "nonce", bytes)
    stag = _field(ch, "tag", bytes)
    if len(ns) != NONCE_BYTES:
        raise RemoteProtocolError("malformed", "nonce size")
    tr = _transcript(mesh, nc, ns, job.step, job.digest)
    if auth.enabled and not auth.verify(b"S" + tr, stag):
        raise RemoteProtocolError("bad_mac", "server failed the challenge")
    await _send_msg(sock, {"t": "auth", "tag": auth.tag(b"C" + tr) if auth.enabled else b""})
    m = await _recv_msg(sock)
    if m["t"] == "unavailable":
        raise RemoteProtocolError("unavailable", f"peer holds step {m.get('step')!r}")
    if m["t"] != "manifest":
        # an authenticated server that refuses our tag just closes: EOF above
        raise RemoteProtocolError("malformed", f"expected a manifest, got {m['t']!r}")
    size = _field(m, "size", int)
    if _field(m, "chunk", int) != DIGEST_CHUNK_BYTES:
        raise RemoteProtocolError("bad_version", "different chunk size")
    if not 0 < size <= config.max_state_bytes:
        raise RemoteProtocolError("oversized", f"state of {size} bytes")
    if _field(m, "step", int) != job.step or _field(m, "digest", str) != job.digest:
        raise RemoteProtocolError("unavailable", "manifest for another state")
    leaves = bytearray(chunk_count(size) * LEAF_BYTES)
    await _recv_into(sock, memoryview(leaves))
    return size, bytes(leaves)


async def _worker(
    peer: tuple[str, int],
    job: _Job,
    stats: TransferStats,
    *,
    auth: MeshAuth,
    mesh: str,
    config: TransferConfig,
) -> None:
    key = f"{peer[0]}:{peer[1]}"
    stream: trio.SocketStream | None = None
    stats.bytes_from.setdefault(key, 0)
    failure: list[BaseException] = []
    bad: list[str] = []
    try:
        with trio.fail_after(config.connect_timeout):
            stream = await trio.open_tcp_stream(*peer)
            sock = stream.socket
            _tune(sock, config)
            size, leaves = await _client_handshake(sock, job, auth=auth, mesh=mesh, config=config)
        job.adopt(size, leaves)
        async with trio.open_nursery() as verifiers:
            # A received range is hashed in a thread while the next one is requested; at most
            # two ranges per peer are unverified at once.
            slots = trio.Semaphore(2)
            while True:
                await slots.acquire()
                rng = await job.take()
                if rng is None:
                    slots.release()
                    break
                try:
                    with trio.fail_after(config.request_timeout):
                        await _send_msg(sock, {"t": "get", "first": rng[0], "count": rng[1]})
                        dst = job.view(rng)
                        await _recv_into(sock, dst)
                except BaseException as exc:
                    slots.release()
                    job.give_back(rng)
                    stats.reassigned += 1
                    if not isinstance(exc, _PEER_FAILURES):
                        raise
                    # recorded here: raising inside the nursery would wrap it in a group
                    failure.append(exc)
                    verifiers.cancel_scope.cancel()
                    break
                stats.bytes_from[key] += len(dst)
                verifiers.start_soon(_verify, rng, job, stats, slots, bad, verifiers.cancel_scope)
        if bad:
            raise RemoteProtocolError("bad_chunk", bad[0])
        if failure:
            raise failure[0]
        if job.done == job.n:
            with contextlib.suppress(*_PEER_FAILURES), trio.move_on_after(1):
                await _send_msg(sock, {"t": "bye"})
    except _PEER_FAILURES as exc:
        stats.failures[key] = _reason(exc)
        log.info("state transfer: giving up on %s: %r", key, exc)
    finally:
        if stream is not None:
            stream.socket.close()


_PEER_FAILURES = (
    trio.TooSlowError,
    RemoteProtocolError,
    EOFError,
    OSError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timeout"
    if isinstance(exc, RemoteProtocolError):
        return exc.reason
    if isinstance(exc, EOFError):
        return "eof"
    return f"io: {exc.__class__.__name__}"


async def _verify(
    rng: tuple[int, int],
    job: _Job,
    stats: TransferStats,
    slots: trio.Semaphore,
    bad: list[str],
    scope: trio.CancelScope,
) -> None:
    # Shielded: a range that was received must end up either completed or given back,
    # even when this peer's worker is being cancelled (hashing takes milliseconds).
    got: bytes | None = None
    try:
        with trio.CancelScope(shield=True):
            got = await trio.to_thread.run_sync(hash_chunks, job.mv, rng[0], rng[1], job.size)
    finally:
        slots.release()
        if got is not None and got == job.expected(rng):
            job.complete(rng)
        else:
            job.give_back(rng)
            stats.reassigned += 1
            if got is not None:  # a lying or broken peer: re-fetch elsewhere, drop it
                stats.bad_chunks += 1
                bad.append(f"chunks {rng[0]}+{rng[1]} fail their hash")
                scope.cancel()


async def fetch_state(
    peers: Sequence[Any],
    step: int,
    digest: str,
    *,
    auth: MeshAuth,
    mesh: str,
    config: TransferConfig | None = None,
    stats: TransferStats | None = None,
    buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None,
) -> Snapshot:
    """Fetch the committed state ``(step, digest)`` from ``peers`` (``(host, port)`` pairs or
    objects with ``.host``/``.port``), striped over all of them, every chunk verified.

    Returns a ``Snapshot`` whose digest is ``digest`` (feed it to ``State.load_snapshot``).
    Raises ``StateTransferError`` (a ``PeerLostError``) with each peer's failure reason when
    the peers together cannot supply it. Fill ``stats`` to see who sent what.

    ``buffer`` (1-D writable ``uint8``, e.g. from ``memory.prepared_zeros`` made while waiting
    to join): receive into it when the state fits, instead of into new memory. The snapshot
    returned then lives in it; after a failed fetch its contents are undefined.
    """
    if not peers:
        raise LocalUsageError("fetch_state needs at least one peer")
    if buffer is not None and not (
        buffer.dtype == np.uint8
        and buffer.ndim == 1
        and buffer.flags.c_contiguous
        and buffer.flags.writeable
    ):
        raise LocalUsageError("fetch_state's buffer must be a writable 1-D uint8 array")
    config = config or TransferConfig()
    stats = stats if stats is not None else TransferStats()
    addrs = list(dict.fromkeys(_addr(p) for p in peers))
    job = _Job(step, digest, config, len(addrs), buffer)
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:

        async def stop_when_done() -> None:
            await job.finished.wait()
            nursery.cancel_scope.cancel()  # stop peers still connecting or saying bye

        nursery.start_soon(stop_when_done)
        async with trio.open_nursery() as workers:
            for p in addrs:
                workers.start_soon(
                    functools.partial(_worker, p, job, stats, auth=auth, mesh=mesh, config=config)
                )
        nursery.cancel_scope.cancel()
    stats.seconds = time.perf_counter() - t0
    if job.size < 0 or job.buf is None or job.done != job.n:
        raise StateTransferError(
            f"could not fetch state step={step} digest={digest[:16]}", stats.failures
        )
    try:
        snap = Snapshot.from_buffer(job.buf)
    except RemoteProtocolError as exc:
        raise StateTransferError(f"state {digest[:16]} does not parse: {exc}", {}) from exc
    snap._leaves, snap._digest = job.leaves, digest
    return snap
