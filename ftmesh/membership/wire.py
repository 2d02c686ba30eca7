"""Wire format of membership packets and stream frames: msgpack, versioned, capped, sealed.

Layout of one datagram or stream frame::

    b"FM" | version:u8 | flags:u8 | body | tag[16] (only when flags & AUTH)
    b"FM" | version:u8 | flags:u8 | salt[16] | AEAD(body) (flags & ENCRYPT, with AUTH)
    body = msgpack [mesh:str, sent_ms:int, nonce:bin(8), [message, ...]]
    message = msgpack [type:int, field, ...]   (see ``messages``)

Theory of operation: ``PacketCodec.open`` is the only door from the network into the node. It
checks, in order, the magic and version, the size caps, the tag (with the mesh secret: any
member's key, see ``ftmesh.security``) or, in an encrypting mesh, the AEAD (which decrypts and
authenticates at once), the mesh name, then for authenticated packets freshness (replay), and
finally every field of every message.

Freshness does not rest on synchronized clocks. A stream frame (TCP push-pull) must carry, as
its nonce, the challenge the receiver sent when the connection opened (``challenge``): fresh
by construction, whatever the clocks say. A datagram must carry a timestamp within
``replay_window`` of the *sender's* clock as the receiver knows it: the receiver's wall clock
plus the ``clock_offset`` it learned for that sender from the timestamps of challenged stream
frames (``ftmesh.net.clocks``), and a nonce not seen in the window (cache). A datagram outside
the window raises ``StaleError`` carrying the skew, so the driver can learn the sender's clock
again (a member whose clock was stepped) and say so.

Encryption: AES-256-GCM under a key derived per datagram from the mesh key and the packet's
random 128-bit salt (so no key ever meets a nonce twice however many datagrams the mesh sends;
the GCM nonce is then constant), with the 20-byte header and salt as associated data. A packet
whose encryption flag differs from ours is refused as ``encryption_mismatch``; one that does
not decrypt under any of our keys (wrong secret, or tampered) as ``bad_mac``.
Anything wrong raises ``RemoteProtocolError`` with a short ``reason`` that the I/O layer
counts; nothing else escapes. Unknown message types from a newer peer are skipped, so message
types can be appended without breaking old members.

Every cap below states what it protects against; they bound the memory and CPU that one
hostile packet can cost.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import LocalUsageError, RemoteProtocolError
from ..security import AEAD_NONCE_BYTES, AEAD_TAG_BYTES, TAG_BYTES, MeshAuth, new_aead
from .messages import (
    Ack,
    Address,
    Alive,
    Dead,
    IndirectPing,
    MemberSnapshot,
    MemberState,
    Message,
    Meta,
    MsgType,
    Nack,
    PacketPair,
    Ping,
    PushPull,
    Suspect,
)

PROTOCOL_VERSION = 1
MAGIC = b"FM"
FLAG_AUTH = 0x01
FLAG_ENCRYPT = 0x02
HEADER_BYTES = 4
NONCE_BYTES = 8
SALT_BYTES = 16
"""Random per encrypted packet; the packet's key is derived from it (see the module doc)."""
_ZERO_NONCE = bytes(AEAD_NONCE_BYTES)

MAX_DATAGRAM = 65_000
"""Largest datagram accepted: the UDP maximum, so one packet can never exceed a recv buffer."""
MAX_FRAME = 16 * 1024 * 1024
"""Largest stream frame (a push-pull of ~100k members): bounds memory per TCP connection."""
MAX_MESH_NAME = 64
"""Mesh names are short labels; longer is an attack or a bug."""
MAX_NAME = 128
"""Human member names (hostname-pid by default)."""
MAX_NODE_ID = 32
"""Node ids are 128-bit values in hex."""
MAX_HOST = 64
"""Dotted IPv4 or a short hostname."""
MAX_MSGS_PER_PACKET = 256
"""Messages one datagram may carry: bounds per-packet CPU."""
MAX_META_ENTRIES = 32
"""Metadata keys per member: metadata is for small facts (data address, devices, role)."""
MAX_META_KEY = 64
MAX_META_STR = 512
MAX_META_BYTES = 2048
"""Encoded metadata per member: it rides in every alive rumour and push-pull."""
MAX_MEMBERS = 100_000
"""Members in one push-pull: bounds a frame's decode cost and memory."""
MAX_NONCES = 65_536
"""Replay cache entries (~4 MiB): a full cache evicts the oldest, which is already outside the
timestamp window in any mesh sending fewer than MAX_NONCES/(2 * replay_window) packets a
second."""
MAX_PAIR_FILLER = 1500
"""Padding bytes of a packet-pair datagram: one MTU's worth is all a measurement needs."""
MAX_COUNTER = 2**62
"""Incarnations and sequence numbers fit in a signed 64-bit integer everywhere."""


def _fail(reason: str, detail: str = "") -> RemoteProtocolError:
    return RemoteProtocolError(reason, detail)


class StaleError(RemoteProtocolError):
    """An authenticated datagram whose timestamp is outside the replay window of the sender's
    clock as we know it: a replay, or a sender whose clock moved. ``skew`` (seconds) is its
    timestamp minus what we expected (positive: the sender's clock is ahead)."""

    def __init__(self, skew: float, window: float) -> None:
        super().__init__(
            "stale", f"timestamp {skew:+.1f}s off the sender's clock (replay_window {window:g}s)"
        )
        self.skew = skew


@dataclass(frozen=True, slots=True)
class Opened:
    """What ``PacketCodec.open_envelope`` found: the sender's timestamp (its wall clock, in
    seconds) and the messages."""

    sent: float
    msgs: list[Message]


def _str(x: Any, cap: int, what: str) -> str:
    if not isinstance(x, str) or len(x) > cap:
        raise _fail("malformed", f"{what}: expected str of at most {cap} chars")
    return x


def _node_id(x: Any) -> str:
    s = _str(x, MAX_NODE_ID, "node id")
    if not s:
        raise _fail("malformed", "empty node id")
    return s


def _int(x: Any, what: str, lo: int = 0, hi: int = MAX_COUNTER) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise _fail("malformed", f"{what}: expected int in [{lo}, {hi}]")
    return x


def _padding(x: Any, cap: int, what: str) -> int:
    """The length of a padding array (its contents are not read)."""
    if not isinstance(x, tuple) or len(x) > cap:
        raise _fail("malformed", f"{what}: expected a list of at most {cap}")
    return len(x)


def _bool(x: Any, what: str) -> bool:
    if type(x) is not bool:
        raise _fail("malformed", f"{what}: expected bool")
    return x


def _addr(x: Any) -> Address:
    if not isinstance(x, tuple) or len(x) != 2:
        raise _fail("malformed", "address: expected [host, port]")
    return (_str(x[0], MAX_HOST, "host"), _int(x[1], "port", 1, 65535))


def check_meta(meta: Any) -> Meta:
    """Validate member metadata (also used for local metadata updates)."""
    if not isinstance(meta, dict) or len(meta) > MAX_META_ENTRIES:
        raise _fail("malformed", f"meta: expected a map of at most {MAX_META_ENTRIES} entries")
    for k, v in meta.items():
        _str(k, MAX_META_KEY, "meta key")
        if isinstance(v, str):
            _str(v, MAX_META_STR, "meta value")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise _fail("malformed", "meta value: non-finite float")
        elif v is not None and not isinstance(v, bool | int):
            raise _fail("malformed", "meta value: expected str, int, float, bool or nil")
        elif type(v) is int and not -MAX_COUNTER <= v <= MAX_COUNTER:
            raise _fail("malformed", "meta value: int out of range")
    if len(msgpack.packb(meta)) > MAX_META_BYTES:
        raise _fail("oversized", f"meta larger than {MAX_META_BYTES} bytes")
    return dict(meta)


def _snapshot(x: Any) -> MemberSnapshot:
    if not isinstance(x, tuple) or len(x) != 6:
        raise _fail("malformed", "member snapshot: expected 6 fields")
    state = _int(x[4], "state", 0, max(MemberState))
    return MemberSnapshot(
        node=_node_id(x[0]),
        name=_str(x[1], MAX_NAME, "name"),
        addr=_addr(x[2]),
        incarnation=_int(x[3], "incarnation"),
        state=MemberState(state),
        meta=check_meta(x[5]),
    )


def _members(x: Any) -> tuple[MemberSnapshot, ...]:
    if not isinstance(x, tuple) or len(x) > MAX_MEMBERS:
        raise _fail("malformed", "members: expected a list")
    return tuple(_snapshot(m) for m in x)


_DECODERS: dict[int, tuple[int, Callable[[tuple[Any, ...]], Message]]] = {
    MsgType.PING: (
        4,
        lambda f: Ping(
            seq=_int(f[0], "seq"),
            target=_node_id(f[1]),
            source=_node_id(f[2]),
            source_addr=_addr(f[3]),
        ),
    ),
    MsgType.INDIRECT_PING: (
        6,
        lambda f: IndirectPing(
            seq=_int(f[0], "seq"),
            target=_node_id(f[1]),
            target_addr=_addr(f[2]),
            source=_node_id(f[3]),
            source_addr=_addr(f[4]),
            want_nack=_bool(f[5], "want_nack"),
        ),
    ),
    MsgType.ACK: (2, lambda f: Ack(seq=_int(f[0], "seq"), source=_node_id(f[1]))),
    MsgType.NACK: (2, lambda f: Nack(seq=_int(f[0], "seq"), source=_node_id(f[1]))),
    MsgType.ALIVE: (
        5,
        lambda f: Alive(
            node=_node_id(f[0]),
            name=_str(f[1], MAX_NAME, "name"),
            addr=_addr(f[2]),
            incarnation=_int(f[3], "incarnation"),
            meta=check_meta(f[4]),
        ),
    ),
    MsgType.SUSPECT: (
        3,
        lambda f: Suspect(
            node=_node_id(f[0]), incarnation=_int(f[1], "incarnation"), accuser=_node_id(f[2])
        ),
    ),
    MsgType.DEAD: (
        3,
        lambda f: Dead(
            node=_node_id(f[0]), incarnation=_int(f[1], "incarnation"), accuser=_node_id(f[2])
        ),
    ),
    MsgType.PACKET_PAIR: (
        4,
        lambda f: PacketPair(
            seq=_int(f[0], "seq"),
            part=_int(f[1], "part", 0, 1),
            source=_node_id(f[2]),
            filler=_padding(f[3], MAX_PAIR_FILLER, "filler"),
        ),
    ),
    MsgType.PUSH_PULL: (
        4,
        lambda f: PushPull(
            source=_node_id(f[0]),
            members=_members(f[1]),
            join=_bool(f[2], "join"),
            observer=_bool(f[3], "observer"),
        ),
    ),
}


def message_fields(msg: Message) -> list[Any]:
    """The msgpack array for one message: ``[type, fields...]``."""
    if isinstance(msg, Ping):
        return [MsgType.PING, msg.seq, msg.target, msg.source, list(msg.source_addr)]
    if isinstance(msg, IndirectPing):
        return [
            MsgType.INDIRECT_PING,
            msg.seq,
            msg.target,
            list(msg.target_addr),
            msg.source,
            list(msg.source_addr),
            msg.want_nack,
        ]
    if isinstance(msg, Ack):
        return [MsgType.ACK, msg.seq, msg.source]
    if isinstance(msg, Nack):
        return [MsgType.NACK, msg.seq, msg.source]
    if isinstance(msg, Alive):
        return [MsgType.ALIVE, msg.node, msg.name, list(msg.addr), msg.incarnation, msg.meta]
    if isinstance(msg, Suspect):
        return [MsgType.SUSPECT, msg.node, msg.incarnation, msg.accuser]
    if isinstance(msg, Dead):
        return [MsgType.DEAD, msg.node, msg.incarnation, msg.accuser]
    if isinstance(msg, PacketPair):
        return [MsgType.PACKET_PAIR, msg.seq, msg.part, msg.source, [0] * msg.filler]
    return [
        MsgType.PUSH_PULL,
        msg.source,
        [snapshot_fields(m) for m in msg.members],
        msg.join,
        msg.observer,
    ]


def snapshot_fields(m: MemberSnapshot) -> list[Any]:
    """The msgpack array for one member of a push-pull."""
    return [m.node, m.name, list(m.addr), m.incarnation, int(m.state), m.meta]


def encoded_size(msg: Message) -> int:
    """Bytes ``msg`` takes inside a packet (used to fill datagrams up to the budget)."""
    return len(msgpack.packb(message_fields(msg)))


PACKET_OVERHEAD = HEADER_BYTES + SALT_BYTES + TAG_BYTES + NONCE_BYTES + MAX_MESH_NAME + 16
"""Upper bound on the envelope's bytes around the messages."""


def decode_message(item: Any) -> Message | None:
    """One message from its decoded msgpack array; None for an unknown (newer) type."""
    if not isinstance(item, tuple) or not item:
        raise _fail("malformed", "message: expected a non-empty list")
    kind = _int(item[0], "type", 0, 2**16)
    entry = _DECODERS.get(kind)
    if entry is None:
        return None
    arity, build = entry
    if len(item) != arity + 1:
        raise _fail("malformed", f"message type {kind}: expected {arity} fields")
    return build(item[1:])


class PacketCodec:
    """Seals outgoing and opens incoming packets for one mesh (sans-IO: the caller passes the
    wall clock in seconds and the random nonce)."""

    def __init__(self, mesh: str, auth: MeshAuth, replay_window: float = 30.0) -> None:
        if not mesh or len(mesh) > MAX_MESH_NAME:
            raise RemoteProtocolError("malformed", "mesh name")  # pragma: no cover
        self.mesh = mesh
        self.auth = auth
        self.replay_window = replay_window
        self._nonces: OrderedDict[bytes, float] = OrderedDict()

    def seal(
        self, msgs: Sequence[Message], now_wall: float, nonce: bytes, salt: bytes | None = None
    ) -> bytes:
        """One packet. ``salt`` (16 random bytes) is only used when encrypting; None draws one
        from ``os.urandom``."""
        body: bytes = msgpack.packb(
            [self.mesh, int(now_wall * 1000), nonce, [message_fields(m) for m in msgs]]
        )
        if self.auth.encrypt:
            head = MAGIC + bytes((PROTOCOL_VERSION, FLAG_AUTH | FLAG_ENCRYPT))
            salt = os.urandom(SALT_BYTES) if salt is None else salt
            if len(salt) != SALT_BYTES:
                raise LocalUsageError(f"salt must be {SALT_BYTES} bytes")
            aead = new_aead(self.auth.derive(0, b"gossip", salt))
            return head + salt + aead.encrypt(_ZERO_NONCE, body, head + salt)
        flags = FLAG_AUTH if self.auth.enabled else 0
        head = MAGIC + bytes((PROTOCOL_VERSION, flags))
        if self.auth.enabled:
            return head + body + self.auth.tag(head + body)
        return head + body

    def _decrypt(self, data: bytes) -> bytes:
        """The body of an encrypted packet, trying every key (rotation); ``bad_mac`` if none
        opens it."""
        if len(data) < HEADER_BYTES + SALT_BYTES + AEAD_TAG_BYTES:
            raise _fail("malformed", "encrypted packet too short")
        aad = data[: HEADER_BYTES + SALT_BYTES]
        salt = aad[HEADER_BYTES:]
        sealed = data[HEADER_BYTES + SALT_BYTES :]
        from cryptography.exceptions import InvalidTag

        for i in range(len(self.auth.keys)):
            aead = new_aead(self.auth.derive(i, b"gossip", salt))
            try:
                body: bytes = aead.decrypt(_ZERO_NONCE, sealed, aad)
            except InvalidTag:
                continue
            return body
        raise _fail("bad_mac", "packet does not decrypt with the mesh key")

    def open(
        self, data: bytes, now_wall: float, cap: int = MAX_DATAGRAM, *, clock_offset: float = 0.0
    ) -> list[Message]:
        """The messages of a datagram (see ``open_envelope``)."""
        return self.open_envelope(data, now_wall, cap, clock_offset=clock_offset).msgs

    def open_envelope(
        self,
        data: bytes,
        now_wall: float,
        cap: int = MAX_DATAGRAM,
        *,
        clock_offset: float = 0.0,
        challenge: bytes | None = None,
    ) -> Opened:
        """Open a packet (see the module doc). ``now_wall``: our wall clock; ``clock_offset``:
        the sender's clock minus ours, as learned; ``challenge``: for a stream frame, the nonce
        we challenged the sender with (then no clock is consulted)."""
        if len(data) > cap:
            raise _fail("oversized", f"{len(data)} bytes")
        if len(data) < HEADER_BYTES or data[:2] != MAGIC:
            raise _fail("malformed", "bad magic")
        if data[2] != PROTOCOL_VERSION:
            raise _fail("bad_version", f"version {data[2]}")
        authed = bool(data[3] & FLAG_AUTH)
        encrypted = bool(data[3] & FLAG_ENCRYPT)
        if self.auth.encrypt:
            if not authed:
                raise _fail("unauthenticated")
            if not encrypted:
                raise _fail("encryption_mismatch", "peer sends plaintext; this mesh encrypts")
            body = self._decrypt(data)
        elif encrypted and self.auth.enabled:
            raise _fail("encryption_mismatch", "peer encrypts; this member does not")
        elif self.auth.enabled:
            if not authed or len(data) < HEADER_BYTES + TAG_BYTES:
                raise _fail("unauthenticated")
            signed, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
            if not self.auth.verify(signed, tag):
                raise _fail("bad_mac")
            body = signed[HEADER_BYTES:]
        else:
            if authed:
                # A member holding a secret talks to one without: never merge the two.
                raise _fail("unauthenticated", "peer uses a secret we do not have")
            body = data[HEADER_BYTES:]
        try:
            env = msgpack.unpackb(
                body,
                raw=False,
                use_list=False,
                strict_map_key=True,
                max_array_len=MAX_MEMBERS,
                max_map_len=MAX_META_ENTRIES,
                max_str_len=MAX_META_STR,
                max_bin_len=NONCE_BYTES,
                max_ext_len=0,
            )
        except Exception as exc:  # msgpack raises many types on hostile input
            raise _fail("malformed", type(exc).__name__) from None
        if not isinstance(env, tuple) or len(env) != 4:
            raise _fail("malformed", "envelope")
        mesh, sent_ms, nonce, items = env
        if mesh != self.mesh:
            raise _fail("wrong_mesh", str(mesh)[:MAX_MESH_NAME])
        _int(sent_ms, "timestamp", 0, MAX_COUNTER)
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise _fail("malformed", "nonce")
        if not isinstance(items, tuple) or len(items) > MAX_MSGS_PER_PACKET:
            raise _fail("malformed", "message list")
        if self.auth.enabled:
            if challenge is not None:
                if nonce != challenge:
                    raise _fail("replayed", "stream frame does not answer our challenge")
            else:
                self._check_replay(sent_ms / 1000.0, nonce, now_wall, clock_offset)
        out = []
        for item in items:
            msg = decode_message(item)
            if msg is not None:
                out.append(msg)
        return Opened(sent_ms / 1000.0, out)

    def _check_replay(self, sent: float, nonce: bytes, now_wall: float, offset: float) -> None:
        skew = sent - (now_wall + offset)
        if abs(skew) > self.replay_window:
            raise StaleError(skew, self.replay_window)
        while self._nonces:
            oldest_nonce, expiry = next(iter(self._nonces.items()))
            if expiry >= now_wall and len(self._nonces) < MAX_NONCES:
                break
            del self._nonces[oldest_nonce]
        if nonce in self._nonces:
            raise _fail("replayed")
        # (our clock: this packet passes the window check until at most 2 windows from now)
        self._nonces[nonce] = now_wall + 2 * self.replay_window
