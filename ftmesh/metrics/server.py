"""A minimal HTTP server for ``GET /metrics``, on trio, in the node's nursery.

Theory of operation: Prometheus scrapes each member every few seconds with one short
``GET /metrics``. The server answers that and nothing else (``/`` gets a pointer to it, any
other path 404, any other method 405) and closes each connection after one response. It
runs in the node's trio thread, so the collector reads membership with no locks and the
listener lives under the node's structured concurrency like the gossip sockets. Bounds
below keep a scanner or a flood from holding the member's descriptors or memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ..errors import ConfigError

log = logging.getLogger("ftmesh.metrics")

MAX_CONNECTIONS = 8
"""Connections served at once; more are closed at accept. A Prometheus server needs one;
the cap bounds the descriptors and tasks a flood of idle connections can hold."""
REQUEST_TIMEOUT = 5.0
"""Seconds a client has to send its request head; then the connection is closed (an idle
connection cannot hold a slot longer)."""
MAX_REQUEST_BYTES = 8192
"""Largest request head read; bounds the memory one client can make us hold."""
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def _response(status: bytes, body: bytes, ctype: bytes = b"text/plain; charset=utf-8") -> bytes:
    head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    return head % (status, ctype, len(body)) + body


async def serve_metrics(
    render: Callable[[], bytes],
    host: str,
    port: int,
    *,
    counters: dict[str, int],
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``render()`` at ``http://host:port/metrics`` until cancelled; reports the bound
    address through ``task_status``. Refusals are counted in ``counters``
    (``metrics_refused_busy``, ``metrics_bad_request``)."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    sock = listeners[0].socket
    bound = sock.getsockname()
    task_status.started((str(bound[0]), int(bound[1])))
    slots = trio.Semaphore(MAX_CONNECTIONS)

    def count(key: str) -> None:
        counters[key] = counters.get(key, 0) + 1

    async def handle(stream: trio.SocketStream) -> None:
        try:
            async with stream:
                with trio.fail_after(REQUEST_TIMEOUT):
                    head = await _read_head(stream)
                    if head is None:
                        count("metrics_bad_request")
                        return
                    await stream.send_all(_answer(head, render))
        except (trio.TooSlowError, trio.BrokenResourceError, OSError):
            count("metrics_bad_request")
        finally:
            slots.release()  # taken by the accept loop

    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept_loop, listener, slots, handle, count, nursery)


async def _accept_loop(
    listener: trio.SocketListener,
    slots: trio.Semaphore,
    handle: Callable[[trio.SocketStream], object],
    count: Callable[[str], None],
    nursery: trio.Nursery,
) -> None:
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE and friends: shed load, never crash the member
                count("metrics_accept_errors")
                log.debug("metrics accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            try:
                slots.acquire_nowait()  # released by handle()
            except trio.WouldBlock:
                count("metrics_refused_busy")
                await stream.aclose()
                continue
            nursery.start_soon(handle, stream)  # type: ignore[arg-type]


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        if len(data) > MAX_REQUEST_BYTES:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:
            return data or None
        data += chunk
    return data


def _answer(head: bytes, render: Callable[[], bytes]) -> bytes:
    parts = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return _response(b"400 Bad Request", b"bad request\n")
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if method not in (b"GET", b"HEAD"):
        return _response(b"405 Method Not Allowed", b"only GET\n")
    if target == b"/metrics":
        body = render()
        out = _response(b"200 OK", body, CONTENT_TYPE)
        return out[: len(out) - len(body)] if method == b"HEAD" else out
    if target == b"/":
        return _response(b"200 OK", b"ftmesh member: metrics at /metrics\n")
    return _response(b"404 Not Found", b"not found; metrics at /metrics\n")
