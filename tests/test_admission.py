"""Admission of unauthenticated TCP connections (``ftmesh.net.admission``) on real sockets:
the oldest pending connection is shed past a cap (per source, then per port), idle ones time
out, and running out of descriptors (a real ``EMFILE``, under a 64-descriptor limit) sheds
instead of ending the accept loop."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import trio

from ftmesh.net.admission import Admission, accept_loop

ROOT = Path(__file__).resolve().parent.parent


async def _closed_by_server(stream: trio.SocketStream, within: float) -> bool:
    with trio.move_on_after(within):
        try:
            return await stream.receive_some(10) == b""
        except trio.BrokenResourceError:
            return True
    return False


async def test_the_oldest_pending_connection_is_shed_and_idle_ones_time_out() -> None:
    drops: dict[str, int] = {}
    admission = Admission(
        lambda reason, _: drops.__setitem__(reason, drops.get(reason, 0) + 1),
        handshake_timeout=1.0,
        max_pending=4,
        max_per_source=2,
    )

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            host = stream.socket.getpeername()[0]
            with admission.admit(host):
                if await stream.receive_some(2) == b"hi":
                    await stream.send_all(b"ok")

    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]

    async def connect(src: str) -> trio.SocketStream:
        stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=src)
        await trio.sleep(0.05)  # let the server admit it: arrival order is age order
        return stream

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            accept_loop, listener.accept, lambda s: nursery.start_soon(handle, s), admission
        )
        a1, a2 = await connect("127.0.0.2"), await connect("127.0.0.2")
        a3 = await connect("127.0.0.2")  # over the per-source cap: a1 goes
        assert await _closed_by_server(a1, 1.0) and drops == {"shed": 1}
        assert admission.pending == 2
        b1, b2 = await connect("127.0.0.3"), await connect("127.0.0.3")
        legit = await connect("127.0.0.1")  # over the port's cap: the oldest (a2) goes
        assert await _closed_by_server(a2, 1.0) and drops == {"shed": 2}
        await legit.send_all(b"hi")
        assert await legit.receive_some(2) == b"ok"
        for idle in (a3, b1, b2):  # never spoke: closed at the deadline
            assert await _closed_by_server(idle, 2.0)
        assert drops == {"shed": 2, "handshake_timeout": 3} and admission.pending == 0
        nursery.cancel_scope.cancel()


def test_out_of_descriptors_sheds_instead_of_crashing() -> None:
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "scripts" / "emfile_server.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    idle: list[socket.socket] = []
    try:
        assert server.stdout is not None and server.stdin is not None
        port = int(server.stdout.readline())
        for _ in range(100):  # more than the server has descriptors for
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.settimeout(10)
            s.sendall(b"hi")
            assert s.recv(2) == b"ok"
        assert server.poll() is None, "the accept loop ended"
        server.stdin.close()
        drops = json.loads(server.stdout.readline())
        assert drops["accept_error"] >= 1 and drops["shed"] >= 1, drops
    finally:
        for s in idle:
            s.close()
        server.kill()
        server.wait()
