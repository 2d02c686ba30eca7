"""A TCP server under a 64-descriptor limit, run by ``tests/test_admission.py``: it admits
connections with ``ftmesh.net.admission`` (caps far above the limit, so that accept hits
EMFILE), answers ``hi`` with ``ok``, and prints its port, then its drop counters on stdin EOF."""

from __future__ import annotations

import json
import resource
import sys

import trio

from ftmesh.net.admission import Admission, accept_loop

drops: dict[str, int] = {}


def drop(reason: str, detail: str) -> None:
    drops[reason] = drops.get(reason, 0) + 1


async def main() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    admission = Admission(drop, handshake_timeout=60.0, max_pending=10_000, max_per_source=10_000)

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            with admission.admit("peer"):
                if await stream.receive_some(2) == b"hi":
                    await stream.send_all(b"ok")

    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listener.socket.getsockname()[1], flush=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            accept_loop, listener.accept, lambda s: nursery.start_soon(handle, s), admission
        )
        await trio.to_thread.run_sync(sys.stdin.read)
        print(json.dumps(drops), flush=True)
        nursery.cancel_scope.cancel()


trio.run(main)
