"""A minimal HTTP server for ``GET /metrics``, ``/healthz`` and ``/readyz``, on trio, in the
node's nursery.

Theory of operation: Prometheus scrapes each member every few seconds with one short
``GET /metrics``; the kubelet probes ``/healthz`` (liveness) and ``/readyz`` (readiness,
``ftmesh.metrics.probes``: 200 in the ring, 503 otherwise, with a one-line reason). The
server answers those and nothing else (``/`` gets a pointer to them, any other path 404, any
other method 405) and closes each connection after one response. It
runs in the node's trio thread, so the collector reads membership with no locks and the
listener lives under the node's structured concurrency like the gossip sockets. Bounds
below keep a scanner or a flood from holding the member's descriptors or memory: at most
``MAX_CONNECTIONS`` at once, ``MAX_PER_SOURCE`` from one address, the oldest closed to make
room for a new one (``ftmesh.net.admission``, as on the member's other ports).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from ..errors import ConfigError
from ..net.admission import Admission, Ticket, accept_loop, peer_host

if TYPE_CHECKING:
    from .probes import Readiness

log = logging.getLogger("ftmesh.metrics")

MAX_CONNECTIONS = 8
"""Connections served at once. A Prometheus server needs one; the cap bounds the descriptors
and tasks a flood of idle connections can hold."""
MAX_PER_SOURCE = 4
"""Of those, from one source address. Past either cap the *oldest* connection (of that
source, or of all) is closed to make room (``ftmesh.net.admission``): a scrape is answered
in milliseconds, so the oldest are the idle ones, and a scrape arriving while idle
connections hold every slot displaces one instead of being refused. Without it 8 idle
connections reopened every ``REQUEST_TIMEOUT`` (1.6/s) refused every scrape."""
REQUEST_TIMEOUT = 5.0
"""Seconds a client has to send its request head and take the answer; then the connection
is closed (an idle connection cannot hold a slot longer)."""
MAX_REQUEST_BYTES = 8192
"""Largest request head read; bounds the memory one client can make us hold."""
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
PLAIN = b"text/plain; charset=utf-8"
PATHS = b"metrics at /metrics, liveness at /healthz, readiness at /readyz"


def _response(status: bytes, body: bytes, ctype: bytes = PLAIN) -> bytes:
    head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    return head % (status, ctype, len(body)) + body


async def serve_metrics(
    render: Callable[[], bytes],
    host: str,
    port: int,
    *,
    counters: dict[str, int],
    ready: Callable[[], Readiness] | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``render()`` at ``http://host:port/metrics`` until cancelled, ``/healthz`` and
    ``/readyz`` (``ready()``; without it, always 503); reports the bound address through
    ``task_status``. Refusals are counted in ``counters``
    (``metrics_refused_busy``: closed to make room; ``metrics_bad_request``: malformed or
    too slow; ``metrics_accept_errors``)."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    sock = listeners[0].socket
    bound = sock.getsockname()
    task_status.started((str(bound[0]), int(bound[1])))

    def count(key: str) -> None:
        counters[key] = counters.get(key, 0) + 1

    reasons = {"shed": "metrics_refused_busy", "handshake_timeout": "metrics_bad_request"}

    def drop(reason: str, detail: str) -> None:
        count(reasons.get(reason, "metrics_accept_errors"))
        log.debug("metrics connection dropped (%s): %s", reason, detail)

    admission = Admission(
        drop,
        handshake_timeout=REQUEST_TIMEOUT,
        max_pending=MAX_CONNECTIONS,
        max_per_source=MAX_PER_SOURCE,
    )

    async def handle(stream: trio.SocketStream, ticket: Ticket) -> None:
        try:
            async with stream:
                with ticket:  # (the deadline, and closed early to make room)
                    head = await _read_head(stream)
                    if head is None:
                        count("metrics_bad_request")
                        return
                    await stream.send_all(_answer(head, render, ready))
        except (trio.BrokenResourceError, OSError):
            count("metrics_bad_request")

    async with trio.open_nursery() as nursery:

        def admit(stream: trio.SocketStream) -> None:
            ticket = admission.admit(peer_host(stream.socket))  # (sheds the oldest now)
            nursery.start_soon(handle, stream, ticket)

        for listener in listeners:
            nursery.start_soon(accept_loop, listener.accept, admit, admission)


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


def _answer(
    head: bytes, render: Callable[[], bytes], ready: Callable[[], Readiness] | None
) -> bytes:
    parts = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return _response(b"400 Bad Request", b"bad request\n")
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if method not in (b"GET", b"HEAD"):
        return _response(b"405 Method Not Allowed", b"only GET\n")
    if target == b"/metrics":
        status, body, ctype = b"200 OK", render(), CONTENT_TYPE
    elif target == b"/healthz":
        status, body, ctype = b"200 OK", b"ok: the member's mesh thread answers\n", PLAIN
    elif target == b"/readyz":
        answer = ready() if ready is not None else None
        if answer is None:
            status, body = b"503 Service Unavailable", b"not ready: no mesh on this node\n"
        else:
            status = b"200 OK" if answer.ready else b"503 Service Unavailable"
            word = "ready" if answer.ready else "not ready"
            body = f"{word}: {' '.join(answer.reason.split())}\n".encode()
        ctype = PLAIN
    elif target == b"/":
        status, body, ctype = b"200 OK", b"ftmesh member: " + PATHS + b"\n", PLAIN
    else:
        status, body, ctype = b"404 Not Found", b"not found; " + PATHS + b"\n", PLAIN
    out = _response(status, body, ctype)
    return out[: len(out) - len(body)] if method == b"HEAD" else out
