"""Data-plane wire format.

Two layers, both little-endian:

* Handshake messages: ``u32 length`` + a msgpack map, at most ``MAX_CONTROL_BYTES``. Used only
  while a connection is being set up (hello, challenge, response, view confirmation).
* Collective frames: ``u32 kind, u32 length`` + payload. A collective is ``HEADER`` (msgpack:
  what the sender is about to run), then the data frames of the schedule, then ``DONE``;
  ``ABORT`` (msgpack: why) may replace whatever is left. Data payloads are raw array bytes whose
  length both sides derive from the schedule, so the receiver ``recv_into``s them in place.
  ``KEEPALIVE`` (empty) may come between any two frames: a sender waiting on its own left
  neighbour sends one every ``poll_interval``, so that its right neighbour blames a stall on the
  member that actually stopped, not on everyone waiting behind it.
* The *reverse* direction of a ring connection (from the receiving member to the sending one)
  carries ``READY`` frames (no payload; the length field is the sequence number of the
  collective the receiver has just started) and at most one ``ABORT`` notice. A sender writes a
  collective's ``HEADER`` only once the receiver's ``READY`` for it has arrived, so every frame
  is read by the collective it was written for: never by a later one on a ring the sender
  has meanwhile given up (which could otherwise match in sequence number and shape).

Version 2 added ``KEEPALIVE`` and the reverse-direction notices; version 3 ``READY``.

The numeric values below are part of the protocol: append only.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from ..errors import RemoteProtocolError

PROTOCOL_VERSION = 3

FRAME = struct.Struct("<II")
CONTROL_LEN = struct.Struct("<I")

HEADER = 1
DATA = 2
DONE = 3
ABORT = 4
KEEPALIVE = 5
READY = 6

MAX_CONTROL_BYTES = 16 * 1024
"""Cap on a handshake message, header or abort payload: bounds what an unauthenticated or
confused peer can make us buffer before we drop it."""

NONCE_BYTES = 16


def pack_control(msg: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_CONTROL_BYTES:
        raise RemoteProtocolError("oversized", f"control message of {len(body)} bytes")
    return CONTROL_LEN.pack(len(body)) + body


def unpack_control(body: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise RemoteProtocolError("malformed", str(exc)) from None
    if not isinstance(msg, dict):
        raise RemoteProtocolError("malformed", "control message is not a map")
    return msg


def transcript(
    mesh: str, src: str, dst: str, epoch: str, nc: bytes, na: bytes, *, encrypt: bool = False
) -> bytes:
    """Bytes both sides MAC during the challenge/response; binds every handshake field,
    including whether the connection is to be encrypted (then also the key derivation input,
    see ``secure``)."""
    fields: list[Any] = [b"ftmesh-dp-v1", PROTOCOL_VERSION, mesh, src, dst, epoch, nc, na]
    if encrypt:
        fields.append(b"aes-256-gcm")
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed
