"""State transfer against the raw TCP ceiling, on loopback, in one run (``measure_transfer``).

Moved here from ``ftmesh.state.transfer``, which it measures. One child process (spawned)
builds a state and serves it from ``peers`` state servers plus a raw blocking-socket sender;
this process fetches it with ``fetch_state`` (hash-verified) and receives the raw blob with
``recv_into``; the result is the best of ``repeats`` for each and their ratio.
"""

from __future__ import annotations

import functools
import socket as _stdsocket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from ..errors import LocalUsageError
from ..security import MeshAuth
from ..state.state import State
from ..state.transfer import TransferConfig, fetch_state, serve_state


@dataclass(frozen=True)
class TransferBenchmark:
    size_mb: float
    peers: int
    transfer_mb_per_s: float
    """Best of the runs: ``fetch_state`` from ``peers`` servers, hash-verified, MB = 1e6 B."""
    raw_tcp_mb_per_s: float
    """Best of the runs: one plain blocking socket ``sendall`` of the same bytes, received
    with ``recv_into`` into a preallocated buffer: the ceiling on this host."""

    @property
    def ratio(self) -> float:
        return self.transfer_mb_per_s / self.raw_tcp_mb_per_s


def measure_transfer(
    size_mb: float, peers: int = 3, *, repeats: int = 3, config: TransferConfig | None = None
) -> TransferBenchmark:
    """Measure joiner state transfer against the raw TCP ceiling, on loopback, in one run.

    As in a mesh, the serving side is another process: one child process builds the state
    (``size_mb`` MB of random bytes), runs ``peers`` state servers (one trio loop) and a raw
    sender that does a plain blocking ``sendall`` of the same blob to whoever connects. This
    process fetches with ``fetch_state`` (verified) and, for the ceiling, receives the raw
    blob with ``recv_into`` into a preallocated buffer. Best of ``repeats`` for each.
    Synchronous: do not call it from inside trio.
    """
    import multiprocessing

    if size_mb <= 0 or peers < 1 or repeats < 1:
        raise LocalUsageError("size_mb must be > 0, peers and repeats >= 1")
    config = config or TransferConfig()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_bench_server_main, args=(child, size_mb, peers, config))
    proc.start()
    child.close()  # the child's end lives in the child
    try:
        if not parent.poll(120):
            raise RuntimeError("benchmark server process did not start")
        ports, raw_port, digest, size = parent.recv()
        auth = MeshAuth.none()
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = trio.run(
                functools.partial(
                    fetch_state,
                    [("127.0.0.1", p) for p in ports],
                    1,
                    digest,
                    auth=auth,
                    mesh="bench",
                    config=config,
                )
            )
            best = max(best, size / 1e6 / (time.perf_counter() - t0))
            if got.digest != digest:
                raise RuntimeError("benchmark transfer returned the wrong state")
            del got
        raw = max(_raw_tcp_once(raw_port, size) for _ in range(repeats))
    finally:
        parent.send("stop")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()
        proc.close()
    return TransferBenchmark(size_mb, peers, best, raw)


def _bench_server_main(conn: Any, size_mb: float, peers: int, config: TransferConfig) -> None:
    """Child process of ``measure_transfer``: state servers plus a raw TCP sender."""

    payload = np.random.default_rng(0).integers(0, 256, int(size_mb * 1e6), dtype=np.uint8)
    snap = State(arrays={"payload": payload}, rng=False).commit(step=1)
    parts = snap.to_bytes_parts()
    raw_listener = _stdsocket.create_server(("127.0.0.1", 0))

    def raw_sender() -> None:
        while True:
            try:
                sock, _ = raw_listener.accept()
            except OSError:
                return
            with sock:
                for part in parts:
                    sock.sendall(part)

    threading.Thread(target=raw_sender, daemon=True).start()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ports = []
            for _ in range(peers):
                server = await nursery.start(
                    functools.partial(
                        serve_state,
                        lambda step, digest: snap,
                        auth=MeshAuth.none(),
                        mesh="bench",
                        config=config,
                    )
                )
                ports.append(server.port)
            info = (ports, raw_listener.getsockname()[1], snap.digest, snap.nbytes)
            conn.send(info)
            await trio.to_thread.run_sync(conn.recv)  # until told to stop
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        raw_listener.close()


def _raw_tcp_once(port: int, size: int) -> float:
    buf = np.empty(size, dtype=np.uint8)
    t0 = time.perf_counter()
    with _stdsocket.create_connection(("127.0.0.1", port)) as s:
        mv = buf.data
        while mv:
            n = s.recv_into(mv)
            if n == 0:
                raise RuntimeError("raw TCP benchmark: early EOF")
            mv = mv[n:]
    return size / 1e6 / (time.perf_counter() - t0)
