"""Admission of inbound TCP connections that have not authenticated yet, and accept loops that
survive floods.

Theory of operation: every TCP port a member listens on (gossip push-pull, the data plane,
the state server) accepts connections from anyone who can reach it. Until a connection has
proved the mesh secret (or, in a mesh without one, finished its handshake) it costs a file
descriptor, a task and a little memory, and gives nothing back. :class:`Admission` holds the
*pending* connections of one port in arrival order and keeps them within two caps by
shedding the **oldest** pending connection when a new one would exceed a cap: a real member's
handshake takes milliseconds, so the connections that have waited longest are the idle ones
of a flood, and a join arriving during a flood displaces one of them instead of waiting
behind all of them. Every pending connection also has a deadline (``handshake_timeout``,
counted from accept), so even a flood that stays under the caps ages out.

:func:`accept_loop` runs a listener. Accept errors a flood can cause (``EMFILE``/``ENFILE``:
out of descriptors; ``ENOBUFS``/``ENOMEM``) never end it: it sheds the oldest pending
connection (freeing a descriptor), backs off briefly (``ACCEPT_BACKOFF``) and accepts again;
connections the kernel keeps queued meanwhile are accepted then. Other transient accept errors
are counted and retried the same way. Each shed, timeout and accept error is reported through
the owner's drop counter (``drop(reason, detail)``), which logs once in a while.
"""

from __future__ import annotations

import errno
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TypeVar

import trio

T = TypeVar("T")

MAX_PENDING = 64
"""Connections of one port that have not authenticated yet. Bounds the descriptors, tasks and
buffered bytes (at most ``MAX_PENDING`` times the port's largest first message) that anyone who
can reach the port can make us hold; a real mesh opens a handful at a time (a join, a ring
edge, a state fetch per peer)."""
MAX_PENDING_PER_SOURCE = 16
"""Of those, from one source address. Keeps one flooding host from shedding everybody else's
handshakes; members on one host share ``127.0.0.1`` and open far fewer at once."""
SHED_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""Accept errors that mean "out of resources": answered by shedding a pending connection."""
ACCEPT_BACKOFF = (0.01, 1.0)
"""First and longest pause after a failed accept, in seconds (doubling in between): a flood
that exhausts descriptors costs a few wake-ups a second, not a busy loop."""

Drop = Callable[[str, str], None]
"""``drop(reason, detail)``: the owner's counter (and rate-limited log) of refused input."""


def peer_host(sock: trio.socket.SocketType) -> str:
    """The source address an accepted connection is admitted under."""
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"


class Ticket:
    """One pending connection: a cancel scope with the handshake deadline, cancelled early
    when the connection is shed. ``with ticket:`` around the unauthenticated part of the
    connection's handling; the connection leaves the pending set when the block ends."""

    def __init__(self, admission: Admission, source: str, deadline: float) -> None:
        self._admission = admission
        self.source = source
        self.scope = trio.CancelScope(deadline=deadline)
        self.shed = False

    def __enter__(self) -> Ticket:
        self.scope.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._admission._release(self)
        handled = self.scope.__exit__(exc_type, exc, tb)
        if self.scope.cancelled_caught and not self.shed:
            self._admission.drop("handshake_timeout", f"from {self.source}: no handshake in time")
        return handled

    @property
    def admitted(self) -> bool:
        """False when the block ended because the connection was shed or ran out of time."""
        return not self.scope.cancelled_caught


class Admission:
    """Pending (unauthenticated) connections of one listening port; see the module doc."""

    def __init__(
        self,
        drop: Drop,
        *,
        handshake_timeout: float,
        max_pending: int = MAX_PENDING,
        max_per_source: int = MAX_PENDING_PER_SOURCE,
    ) -> None:
        self.drop = drop
        self.handshake_timeout = handshake_timeout
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self._pending: OrderedDict[Ticket, None] = OrderedDict()
        self._per_source: dict[str, int] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    def admit(self, source: str) -> Ticket:
        """A ticket for a connection just accepted from ``source``, shedding the oldest
        pending one of the same source, or of all, that it would push over a cap."""
        if self._per_source.get(source, 0) >= self.max_per_source:
            oldest = next(t for t in self._pending if t.source == source)
            self._shed(oldest, f"more than {self.max_per_source} pending from {source}")
        elif len(self._pending) >= self.max_pending:
            self._shed(next(iter(self._pending)), f"more than {self.max_pending} pending")
        ticket = Ticket(self, source, trio.current_time() + self.handshake_timeout)
        self._pending[ticket] = None
        self._per_source[source] = self._per_source.get(source, 0) + 1
        return ticket

    def shed_oldest(self) -> bool:
        """Shed the oldest pending connection (to free a descriptor); False if none."""
        if not self._pending:
            return False
        self._shed(next(iter(self._pending)), "out of descriptors")
        return True

    def _shed(self, ticket: Ticket, why: str) -> None:
        ticket.shed = True
        ticket.scope.cancel()
        self._release(ticket)  # (its task runs later; it must not count against the caps)
        self.drop("shed", f"connection from {ticket.source} closed unauthenticated: {why}")

    def _release(self, ticket: Ticket) -> None:
        if ticket in self._pending:
            del self._pending[ticket]
            n = self._per_source[ticket.source] - 1
            if n:
                self._per_source[ticket.source] = n
            else:
                del self._per_source[ticket.source]


async def accept_loop(
    accept: Callable[[], Awaitable[T]], handle: Callable[[T], None], admission: Admission
) -> None:
    """``handle(accept())`` forever (``handle`` starts a task and returns); see the module doc
    for how accept errors are survived. Ends when the listener is closed."""
    pause = ACCEPT_BACKOFF[0]
    while True:
        try:
            conn = await accept()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        except OSError as exc:
            if exc.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                return  # the listener was closed under us
            shed = exc.errno in SHED_ERRNOS and admission.shed_oldest()
            admission.drop(
                "accept_error", f"{exc!r}{'; shed a pending connection' if shed else ''}"
            )
            await trio.sleep(pause)
            pause = min(2 * pause, ACCEPT_BACKOFF[1])
            continue
        pause = ACCEPT_BACKOFF[0]
        handle(conn)
