"""Membership messages: frozen dataclasses with their wire type numbers.

The numeric values of :class:`MsgType` are part of the protocol: append only, never reuse or
renumber. Each message encodes as a msgpack array ``[type, field1, field2, ...]`` in field
order; decoding checks every field's type and every length against the caps in ``wire``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeAlias

Address: TypeAlias = tuple[str, int]
"""(IPv4 host, port) of a member's gossip endpoint (UDP and TCP share the port)."""

MetaValue: TypeAlias = str | int | float | bool | None
Meta: TypeAlias = dict[str, MetaValue]


class MsgType(enum.IntEnum):
    PING = 1
    INDIRECT_PING = 2
    ACK = 3
    NACK = 4
    ALIVE = 5
    SUSPECT = 6
    DEAD = 7
    PUSH_PULL = 8
    PACKET_PAIR = 9
    # append new types below; the numbers are part of the protocol


class MemberState(enum.IntEnum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    """Are you alive? ``target`` guards against a new process reusing a dead one's port."""

    seq: int
    target: str
    source: str
    source_addr: Address


@dataclass(frozen=True, slots=True, kw_only=True)
class IndirectPing:
    """Please probe ``target`` for me and relay its ack (and a nack if it stays silent)."""

    seq: int
    target: str
    target_addr: Address
    source: str
    source_addr: Address
    want_nack: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    seq: int
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Nack:
    """The relay reached us but not the target: tells the asker its own link is fine."""

    seq: int
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Alive:
    node: str
    name: str
    addr: Address
    incarnation: int
    meta: Meta = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Suspect:
    node: str
    incarnation: int
    accuser: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Dead:
    """``accuser == node`` means the member left gracefully."""

    node: str
    incarnation: int
    accuser: str


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberSnapshot:
    """One member as carried in a push-pull exchange, and as ``Swim`` keeps it: immutable and
    shared (events, ``Swim.members()`` and push-pulls hand out the same object, and a change
    makes a new one), so its ``meta`` must be treated as read-only."""

    node: str
    name: str
    addr: Address
    incarnation: int
    state: MemberState
    meta: Meta = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class PushPull:
    """Full-state exchange over TCP. ``join`` marks a joiner's first contact; ``observer``
    marks a reader (``ftmesh status``) that must not be added to the mesh."""

    source: str
    members: tuple[MemberSnapshot, ...]
    join: bool = False
    observer: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PacketPair:
    """One of two datagrams sent back to back to time the path's capacity (packet-pair
    dispersion, ``ftmesh.net.pairs``): ``part`` 0 then 1 of pair ``seq``, padded by ``filler``
    zeros (a msgpack array: members of older releases skip the unknown type, where a long
    ``bin`` would fail their envelope's caps) to a full-sized datagram. Not a SWIM message:
    the node times it and never hands it to the membership machine."""

    seq: int
    part: int
    source: str
    filler: int = 0


Gossip: TypeAlias = Alive | Suspect | Dead
Message: TypeAlias = (
    Ping | IndirectPing | Ack | Nack | Alive | Suspect | Dead | PushPull | PacketPair
)

TYPE_OF: dict[type[Any], MsgType] = {
    Ping: MsgType.PING,
    IndirectPing: MsgType.INDIRECT_PING,
    Ack: MsgType.ACK,
    Nack: MsgType.NACK,
    Alive: MsgType.ALIVE,
    Suspect: MsgType.SUSPECT,
    Dead: MsgType.DEAD,
    PushPull: MsgType.PUSH_PULL,
    PacketPair: MsgType.PACKET_PAIR,
}
