"""What a member knows about its peers' wall clocks, so that replay protection does not need
synchronized clocks (sans-IO: callers pass the times in).

Theory of operation: gossip datagrams are only accepted within ``replay_window`` of their
sender's clock (``ftmesh.membership.wire``). Every push-pull exchange (joins, anti-entropy)
measures the peer's clock offset from its challenged, hence fresh, frame
(``ftmesh.net.frames``), and :class:`PeerClocks` keeps the latest per gossip address. A
datagram that is stale even so comes from a sender we have not measured yet, one whose clock
moved (an NTP step, a VM restored, a manual change), or a replay: ``should_sync`` then says
when to run a push-pull with that address (at most once per ``SYNC_INTERVAL``), which measures
the true offset again. A replayed datagram stays refused; a member with a skewed or stepped
clock is accepted again within a round trip, instead of being cut off.

Members' clocks may therefore differ by any amount. A large offset is still worth knowing (the
members' logs are hard to read side by side): it is logged as a warning with the peer's name
whenever it is learned or changes by more than ``LOG_CHANGE``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from ..membership.messages import Address

log = logging.getLogger("ftmesh.node")

MAX_PEERS = 4096
"""Addresses whose offset (and sync time) is remembered, least recently used evicted: bounds
what spoofed stale datagrams can make us store."""
SYNC_INTERVAL = 2.0
"""Seconds between two clock syncs (push-pulls) triggered by stale datagrams from one address:
bounds the TCP connections that replayed or spoofed datagrams can make us open."""
LOG_CHANGE = 5.0
"""Seconds: an offset this far from the last one logged for a peer (or from 0) is logged.
Smaller ones are ordinary drift or measurement noise (a measurement on a busy host can be off
by up to ``ftmesh.net.frames.MAX_OFFSET_UNCERTAINTY``)."""


class PeerClocks:
    """Clock offsets (peer's wall clock minus ours, seconds) by gossip address."""

    def __init__(self) -> None:
        self._offsets: OrderedDict[Address, float] = OrderedDict()
        self._logged: dict[Address, float] = {}
        self._synced: OrderedDict[Address, float] = OrderedDict()
        self.learned = 0

    def offset(self, addr: Address) -> float:
        """What to add to our clock to get ``addr``'s (0 if never measured)."""
        return self._offsets.get(addr, 0.0)

    def offsets(self) -> dict[Address, float]:
        return dict(self._offsets)

    def learn(self, addr: Address, offset: float, who: str) -> None:
        """``addr`` (member ``who``) was measured ``offset`` seconds ahead of us."""
        self._offsets[addr] = offset
        self._offsets.move_to_end(addr)
        if len(self._offsets) > MAX_PEERS:
            old, _ = self._offsets.popitem(last=False)
            self._logged.pop(old, None)
        self.learned += 1
        if abs(offset - self._logged.get(addr, 0.0)) > LOG_CHANGE:
            self._logged[addr] = offset
            side = "ahead of" if offset > 0 else "behind"
            log.warning(
                "the clock of %s (%s:%d) is %.1f s %s ours; replay protection follows it "
                "(members need not sync clocks, but their logs are easier to compare if they do)",
                who,
                addr[0],
                addr[1],
                abs(offset),
                side,
            )

    def should_sync(self, addr: Address, now: float) -> bool:
        """A stale datagram came from ``addr`` at ``now`` (monotonic seconds): whether to
        measure its clock now."""
        last = self._synced.get(addr)
        if last is not None and now - last < SYNC_INTERVAL:
            return False
        self._synced[addr] = now
        self._synced.move_to_end(addr)
        if len(self._synced) > MAX_PEERS:
            self._synced.popitem(last=False)
        return True
