"""Length-prefixed frames on trio streams, and the push-pull exchange built on them.

A frame is a 4-byte big-endian length followed by that many bytes (a sealed packet, see
``ftmesh.membership.wire``). The length is checked against a cap before anything is buffered,
so a peer announcing a huge frame costs us nothing.
"""

from __future__ import annotations

import os
import struct
import time

import trio

from ..errors import RemoteProtocolError
from ..membership.messages import Address, PushPull
from ..membership.wire import MAX_FRAME, PacketCodec

_LEN = struct.Struct(">I")


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


async def read_push_pull(stream: trio.abc.ReceiveStream, codec: PacketCodec) -> PushPull:
    msgs = codec.open(await read_frame(stream), time.time(), cap=MAX_FRAME)
    if len(msgs) != 1 or not isinstance(msgs[0], PushPull):
        raise RemoteProtocolError("malformed", "expected one push-pull message")
    return msgs[0]


async def write_push_pull(stream: trio.abc.SendStream, codec: PacketCodec, pp: PushPull) -> None:
    await write_frame(stream, codec.seal([pp], time.time(), os.urandom(8)))


async def exchange_push_pull(
    dest: Address, codec: PacketCodec, ours: PushPull, timeout: float
) -> PushPull:
    """Connect to ``dest``, send our state, return theirs. Raises ``OSError``,
    ``RemoteProtocolError`` or ``trio.TooSlowError``."""
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(*dest)
        async with stream:
            await write_push_pull(stream, codec, ours)
            return await read_push_pull(stream, codec)
