"""Packet pairs: the capacity of the path from a peer, timed on the gossip socket. Sans-IO.

Theory of operation (packet-pair dispersion, Keshav 1991; as pathrate and CapProbe use it).
A member sends a peer two full-sized datagrams back to back (``PacketPair`` parts 0 and 1,
padded to ``PAIR_BYTES``). Wherever the path is narrowest, the second waits for the first to
be sent, so they leave the narrow link ``size / capacity`` apart and keep that spacing to the
receiver. The receiver's kernel stamps each datagram as it arrives (``SO_TIMESTAMPNS``: the
time the packet reached this host, not when the process got around to reading it), and
``size of the second / spacing`` is one sample of the path's capacity, in bytes per second.

What this measures, and what not: the bottleneck's capacity, not the bandwidth left over by
other traffic (cross traffic queued between the two datagrams spreads them, a sample too
low; a queue after the narrow link that holds the first one bunches them, too high: the
mesh's estimate is the median of a window, ``topology.LinkEstimator.for_rates``). The sender
is a Python process: its two ``sendto`` calls are a few microseconds apart, so a link faster
than a few hundred Mbit/s reads as that (``topology.MAX_CROSS_RATE_BUCKET`` is well below). A
sender descheduled between its two sends spreads the pair: rare, and the median drops it.

Cost: one pair of ~1.2 KB datagrams per ``NodeConfig.pair_interval`` per member, to one peer
at a time in turn (peers at our own address are never timed: nothing lies between us). Where
the kernel gives no timestamps (not Linux), nothing is measured.
"""

from __future__ import annotations

import socket
import struct
import sys
from collections import OrderedDict

PAIR_BYTES = 1200
"""Target size of each datagram of a pair: under a 1280-byte IPv6 minimum MTU and any
tunnel's, so neither is fragmented (a fragment would time the fragments)."""
SO_TIMESTAMPNS = 35
"""Linux's ``SO_TIMESTAMPNS`` (also its ``SCM_TIMESTAMPNS``): receive time of each datagram
in ancillary data, a ``struct timespec``. Python's ``socket`` does not name it."""
_TIMESPEC = struct.Struct("=qq" if struct.calcsize("l") == 8 else "=ll")
ANCILLARY_BYTES = 64
"""Room for the timestamp's control message (``CMSG_SPACE(16)`` is 32)."""
HEADERS = 28
"""IPv4 and UDP header bytes around each datagram: on the wire a pair's second half is its
payload and these."""
MAX_PENDING = 64
"""First halves remembered while waiting for their second (bounds memory against a peer
that sends only first halves)."""


def enable_timestamps(sock: socket.socket) -> bool:
    """Ask the kernel to stamp every datagram ``sock`` receives; whether it will."""
    if sys.platform != "linux":
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def kernel_time_ns(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The receive time in a ``recvmsg`` result's ancillary data, in nanoseconds (the kernel's
    wall clock: only differences mean anything), or None."""
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(raw)
            return int(sec) * 1_000_000_000 + int(nsec)
    return None


class PairTimer:
    """The receiving side: the two halves of each pair -> one capacity sample."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._first: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.unmatched = 0
        """Second halves whose first did not arrive (lost, reordered) or arrived later."""

    def arrived(self, source: str, seq: int, part: int, at_ns: int, nbytes: int) -> float | None:
        """Half ``part`` of pair ``seq`` from ``source``, stamped ``at_ns``, ``nbytes`` long
        (its payload). The second half returns the sample: its bytes on the wire over the
        spacing, bytes per second (None: no sample)."""
        key = (source, seq)
        if part == 0:
            self._first[key] = at_ns
            self._first.move_to_end(key)
            while len(self._first) > self.max_pending:
                self._first.popitem(last=False)
            return None
        first = self._first.pop(key, None)
        if first is None or at_ns <= first:
            self.unmatched += 1
            return None
        return (nbytes + HEADERS) * 1e9 / (at_ns - first)
