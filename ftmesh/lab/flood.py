"""A hostile peer that opens TCP connections and never speaks (lab and test use only).

``IdleFlood(host, port, n)`` holds ``n`` connections to a member's TCP port (gossip, data
plane or state server) without sending a byte, the way a port scanner, a stuck client or an
attacker without the mesh secret would, and *sustains* them: a background thread replaces
every connection the member closes, so the member faces ``n`` idle connections for as long as
the flood lasts, not only until its first timeout. A member must keep admitting its peers
meanwhile (``ftmesh.net.admission``).

Bounded: at most ``MAX_CONNECTIONS`` connections, each connect bounded by ``CONNECT_TIMEOUT``,
replacements checked every ``TICK`` seconds and made at ``reopen_rate`` at most; traffic goes
only to the address given, from the loopback or lab addresses the caller chooses (``sources``,
used in turn, so a flood can come from several hosts).
"""

from __future__ import annotations

import contextlib
import resource
import select
import socket
import threading
from collections.abc import Sequence
from types import TracebackType

from ..errors import LocalUsageError

MAX_CONNECTIONS = 10_000
"""Most connections one flood holds."""
CONNECT_TIMEOUT = 2.0
"""Seconds one connect may take (a full accept backlog makes connects wait)."""
TICK = 0.2
"""Seconds between two checks for connections the member closed."""
REOPEN_RATE = 200.0
"""Default replacements per second: enough to keep a member's pending connections full of
idle ones (it sheds the oldest, the flood puts new ones in), without turning the flood into a
connection-rate attack that measures how fast the host can accept."""
_GONE = select.POLLHUP | select.POLLERR | select.POLLIN | getattr(select, "POLLRDHUP", 0x2000)


class IdleFlood:
    """``with IdleFlood("127.0.0.1", port, 1100) as flood: ...``. ``opened`` counts every
    connection made (replacements included), ``closed_by_peer`` those the member closed.
    Raises this process's descriptor limit towards its hard limit if needed."""

    def __init__(
        self,
        host: str,
        port: int,
        n: int,
        *,
        sources: Sequence[str] = ("127.0.0.1",),
        reopen_rate: float = REOPEN_RATE,
    ) -> None:
        if not 0 < n <= MAX_CONNECTIONS:
            raise LocalUsageError(f"n must be in 1..{MAX_CONNECTIONS}")
        self.target = (host, port)
        self.n = n
        self.sources = tuple(sources)
        self.reopen_per_tick = max(1, int(reopen_rate * TICK))
        self.opened = 0
        self.failed = 0
        self.closed_by_peer = 0
        self._socks: dict[int, socket.socket] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sustain, name="idle-flood", daemon=True)
        self._next_source = 0

    def __enter__(self) -> IdleFlood:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = self.n + 256
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
        try:
            for _ in range(self.n):
                self._open_one()
        except BaseException:
            self.close()
            raise
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _open_one(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(CONNECT_TIMEOUT)
        try:
            s.bind((self.sources[self._next_source % len(self.sources)], 0))
            self._next_source += 1
            s.connect(self.target)
        except OSError:
            self.failed += 1
            s.close()
            return
        self.opened += 1
        self._socks[s.fileno()] = s

    def _sustain(self) -> None:
        while not self._stop.wait(TICK):
            poller = select.poll()
            for fd in self._socks:
                poller.register(fd, _GONE)
            for fd, _ev in poller.poll(0):
                self._socks.pop(fd).close()
                self.closed_by_peer += 1
            for _ in range(min(self.n - len(self._socks), self.reopen_per_tick)):
                if self._stop.is_set():
                    break
                self._open_one()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10 * CONNECT_TIMEOUT)
        for s in self._socks.values():
            with contextlib.suppress(OSError):
                s.close()
        self._socks.clear()
