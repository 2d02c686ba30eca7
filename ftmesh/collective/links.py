"""What the kernel knows of each ring connection: its round trip and throughput.

Theory of operation. A ring member sends a collective's bytes to its right neighbour over one
long-lived TCP connection, and the kernel measures that connection all along, for free: the
smallest round trip it has seen (``tcpi_min_rtt``: the path's own delay, without the
queueing and without the processes' scheduling that a membership probe's round trip
includes), its latest delivery rate (``tcpi_delivery_rate``: bytes the receiver acknowledged
per second over the last round trip; *application limited* when the sender had nothing more
to send, as a ring does between its chunks, which makes it a lower bound of what the path
can carry) and the segments it had to send again. After each collective that completed, the
data plane reads ``TCP_INFO`` once for the connection to the right (one ``getsockopt``) and
keeps the newest ``LinkStatistics`` per neighbour, with the payload bytes sent to it
(``DataPlane.links``): metrics (``ftmesh_link_*``) and the mesh's measured links (the kernel's
round trip is one more sample of ``topology.LinkEstimator``) read them. Linux only: elsewhere
the readings carry the bytes alone.
"""

from __future__ import annotations

import socket
import struct
import sys
from dataclasses import dataclass, replace

from ..stats import LinkStatistics

TCP_INFO_BYTES = 168
"""Bytes of ``struct tcp_info`` read: up to ``tcpi_delivery_rate`` (Linux 4.9 and later)."""
_RTT = struct.Struct("=II")  # tcpi_rtt, tcpi_rttvar (microseconds) at offset 68
_RETRANS = struct.Struct("=I")  # tcpi_total_retrans at offset 100
_MIN_RTT = struct.Struct("=I")  # tcpi_min_rtt (microseconds) at offset 148
_RATE = struct.Struct("=Q")  # tcpi_delivery_rate (bytes per second) at offset 160
_APP_LIMITED_BYTE = 7  # bit 0: tcpi_delivery_rate_app_limited


@dataclass(frozen=True, slots=True)
class TcpInfo:
    """One reading of a connection's ``TCP_INFO`` (see the module docstring)."""

    min_rtt_s: float
    """Smallest round trip over the connection's life, in seconds."""
    rtt_s: float
    """Smoothed round trip, in seconds."""
    delivery_rate: float
    """Bytes per second delivered over the last round trip."""
    app_limited: bool
    """The sender ran out of data during that measurement: ``delivery_rate`` is a lower bound."""
    retransmits: int
    """Segments sent again over the connection's life."""


def parse_tcp_info(raw: bytes) -> TcpInfo | None:
    """A ``TcpInfo`` from the bytes of ``getsockopt(IPPROTO_TCP, TCP_INFO)``; None when
    they are too short (an old kernel)."""
    if len(raw) < TCP_INFO_BYTES:
        return None
    rtt, _var = _RTT.unpack_from(raw, 68)
    return TcpInfo(
        min_rtt_s=_MIN_RTT.unpack_from(raw, 148)[0] / 1e6,
        rtt_s=rtt / 1e6,
        delivery_rate=float(_RATE.unpack_from(raw, 160)[0]),
        app_limited=bool(raw[_APP_LIMITED_BYTE] & 1),
        retransmits=_RETRANS.unpack_from(raw, 100)[0],
    )


def read_tcp_info(sock: socket.socket) -> TcpInfo | None:
    """The kernel's reading of ``sock`` (a connected TCP socket), or None (not Linux, closed)."""
    if sys.platform != "linux":
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
    except OSError:
        return None
    return parse_tcp_info(raw)


def updated(link: LinkStatistics, nbytes: int, tcp: TcpInfo | None) -> LinkStatistics:
    """``link`` after one more completed collective that sent ``nbytes`` over a connection
    the kernel read as ``tcp``."""
    if tcp is None:
        return replace(link, sent_bytes=link.sent_bytes + nbytes)
    rate = link.delivery_rate
    if not tcp.app_limited and tcp.delivery_rate > 0:
        rate = tcp.delivery_rate
    return LinkStatistics(link.sent_bytes + nbytes, tcp.min_rtt_s, rate, tcp.retransmits)
