"""Length-prefixed frames on trio streams, and the push-pull exchange built on them.

A frame is a 4-byte big-endian length followed by that many bytes (a sealed packet, see
``ftmesh.membership.wire``). The length is checked against a cap before anything is buffered,
so a peer announcing a huge frame costs us nothing.

A push-pull exchange opens with a *challenge* from each side (``CHALLENGE_MAGIC`` and 8 random
bytes, sent as soon as the connection is up, without waiting for the other's), then each side
sends one frame whose envelope nonce is the other's challenge::

    C -> S  challenge c            S -> C  challenge s      (concurrently)
    C -> S  frame(PushPull, nonce=s)
    S -> C  frame(PushPull, nonce=c)

So a recorded exchange cannot be replayed, and no clock is consulted to tell (see the wire
module doc). The frames' timestamps are still read: sent between our challenge and the frame's
arrival, each bounds the sender's clock offset (``Exchanged.clock_offset``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ..errors import RemoteProtocolError
from ..membership.messages import Address, PushPull
from ..membership.wire import MAX_FRAME, NONCE_BYTES, PacketCodec

_LEN = struct.Struct(">I")
CHALLENGE_MAGIC = b"FMch"
"""Opens a push-pull stream. An old peer reads it as a 1.2 GB frame length and drops it as
oversized: mixed versions fail fast, not silently."""
MAX_OFFSET_UNCERTAINTY = 2.0
"""Seconds: a clock offset measured over an exchange slower than twice this is not learned
(the peer's timestamp could be anywhere in that interval)."""

Wall = Callable[[], float]
"""The wall clock, in seconds (``time.time``; tests shift it)."""


async def read_exactly(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise RemoteProtocolError("truncated", f"stream closed after {len(buf)}/{n} bytes")
        buf += chunk
    return bytes(buf)


async def read_frame(stream: trio.abc.ReceiveStream, cap: int = MAX_FRAME) -> bytes:
    (size,) = _LEN.unpack(await read_exactly(stream, _LEN.size))
    if size > cap:
        raise RemoteProtocolError("oversized", f"frame of {size} bytes")
    return await read_exactly(stream, size)


async def write_frame(stream: trio.abc.SendStream, data: bytes) -> None:
    await stream.send_all(_LEN.pack(len(data)) + data)


async def send_challenge(stream: trio.abc.SendStream) -> bytes:
    """Send our challenge; returns it (the nonce the peer's frame must carry)."""
    nonce = os.urandom(NONCE_BYTES)
    await stream.send_all(CHALLENGE_MAGIC + nonce)
    return nonce


async def read_challenge(stream: trio.abc.ReceiveStream) -> bytes:
    data = await read_exactly(stream, len(CHALLENGE_MAGIC) + NONCE_BYTES)
    if data[: len(CHALLENGE_MAGIC)] != CHALLENGE_MAGIC:
        raise RemoteProtocolError("malformed", "push-pull stream without a challenge")
    return data[len(CHALLENGE_MAGIC) :]


@dataclass(frozen=True, slots=True)
class Exchanged:
    """The peer's push-pull, and what its timestamp says about its clock."""

    push_pull: PushPull
    clock_offset: float | None
    """The peer's wall clock minus ours, in seconds; None when the exchange was too slow to
    tell (``MAX_OFFSET_UNCERTAINTY``)."""


def _offset(sent: float, challenged: float, arrived: float) -> float | None:
    """The peer stamped its frame after our challenge (at ``challenged``, our clock) and
    before it arrived: its offset lies in ``[sent - arrived, sent - challenged]``."""
    if arrived - challenged > 2 * MAX_OFFSET_UNCERTAINTY:
        return None
    return sent - (challenged + arrived) / 2


async def read_push_pull(
    stream: trio.abc.ReceiveStream,
    codec: PacketCodec,
    challenge: bytes,
    challenged: float,
    wall: Wall,
) -> Exchanged:
    """Read the peer's push-pull frame, which must answer ``challenge`` (sent at our wall time
    ``challenged``)."""
    opened = codec.open_envelope(await read_frame(stream), wall(), MAX_FRAME, challenge=challenge)
    if len(opened.msgs) != 1 or not isinstance(opened.msgs[0], PushPull):
        raise RemoteProtocolError("malformed", "expected one push-pull message")
    return Exchanged(opened.msgs[0], _offset(opened.sent, challenged, wall()))


async def write_push_pull(
    stream: trio.abc.SendStream,
    codec: PacketCodec,
    pp: PushPull,
    their_challenge: bytes,
    wall: Wall,
) -> None:
    await write_frame(stream, codec.seal([pp], wall(), their_challenge))


async def exchange_push_pull(
    dest: Address, codec: PacketCodec, ours: PushPull, timeout: float, wall: Wall
) -> Exchanged:
    """Connect to ``dest``, send our state, return theirs. Raises ``OSError``,
    ``RemoteProtocolError`` or ``trio.TooSlowError``."""
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(*dest)
        async with stream:
            mine = await send_challenge(stream)
            challenged = wall()
            theirs = await read_challenge(stream)
            await write_push_pull(stream, codec, ours, theirs, wall)
            return await read_push_pull(stream, codec, mine, challenged, wall)
