"""The metrics server under a flood of idle connections (issue #26, item 7): a per-source cap,
and the oldest connection closed to make room, so scrapes are answered while 8 idle
connections are reopened at 1.6/s. Real sockets on loopback, the server in one trio run."""

from __future__ import annotations

import trio

from ftmesh.metrics import server as metrics_server
from ftmesh.metrics.server import serve_metrics

BODY = b"ftmesh_up 1\n"


async def _scrape(port: int) -> bytes:
    """One GET /metrics; the whole answer (empty if the server closed the connection)."""
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            try:
                await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                out = b""
                while chunk := await stream.receive_some(65536):
                    out += chunk
            except (trio.BrokenResourceError, OSError):
                return b""
            return out


async def _closed(stream: trio.SocketStream) -> bool:
    """Whether the server closed ``stream`` (within a short bound)."""
    with trio.move_on_after(0.5):
        try:
            return await stream.receive_some(1) == b""
        except (trio.BrokenResourceError, OSError):
            return True
    return False


def test_idle_connections_reopened_never_block_a_scrape() -> None:
    counters: dict[str, int] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            _, port = await nursery.start(
                lambda task_status: serve_metrics(
                    lambda: BODY, "127.0.0.1", 0, counters=counters, task_status=task_status
                )
            )
            idle: list[trio.SocketStream] = []

            async def flood(stop: trio.Event) -> None:
                """8 idle connections from this host, one reopened every 1/1.6 s."""
                for _ in range(metrics_server.MAX_CONNECTIONS):
                    idle.append(await trio.open_tcp_stream("127.0.0.1", port))
                while not stop.is_set():
                    with trio.move_on_after(1 / 1.6):
                        await stop.wait()
                    old = idle.pop(0)
                    await old.aclose()
                    idle.append(await trio.open_tcp_stream("127.0.0.1", port))

            stop = trio.Event()
            nursery.start_soon(flood, stop)
            while len(idle) < metrics_server.MAX_CONNECTIONS:
                await trio.sleep(0.01)
            await trio.sleep(0.2)  # (the server has accepted them)
            answers = [await _scrape(port) for _ in range(5)]
            stop.set()
            for s in idle:
                await s.aclose()
            nursery.cancel_scope.cancel()
        for a in answers:
            assert a.startswith(b"HTTP/1.1 200 OK") and a.endswith(BODY), a

    trio.run(main)
    assert counters.get("metrics_refused_busy", 0) >= 5, counters  # an idle one made room


def test_one_source_holds_at_most_its_share() -> None:
    """Idle connections from 127.0.0.2 hold at most ``MAX_PER_SOURCE`` slots: the oldest are
    closed; a scrape from 127.0.0.1 is answered with no one shed."""
    counters: dict[str, int] = {}
    n = metrics_server.MAX_PER_SOURCE + 3

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            _, port = await nursery.start(
                lambda task_status: serve_metrics(
                    lambda: BODY, "0.0.0.0", 0, counters=counters, task_status=task_status
                )
            )
            other = [
                await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.2")
                for _ in range(n)
            ]
            closed = [await _closed(s) for s in other]
            assert closed == [True] * 3 + [False] * metrics_server.MAX_PER_SOURCE, closed
            shed = counters.get("metrics_refused_busy", 0)
            answer = await _scrape(port)
            assert answer.startswith(b"HTTP/1.1 200 OK"), answer
            assert counters.get("metrics_refused_busy", 0) == shed, counters
            for s in other:
                await s.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
