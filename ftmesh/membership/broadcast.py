"""Transmit-limited rumour queue for piggybacked dissemination (SWIM section 4.1).

Each rumour about a member is piggybacked on outgoing packets up to ``limit`` times, where the
limit is ``retransmit_mult * ceil(log10(n + 1))`` (see ``MembershipConfig.retransmit_limit``):
enough for an epidemic to reach every member with high probability, and no more. A newer rumour
about the same member replaces the older one, which then stops spreading. Rumours that have been
sent the fewest times go first, newest first among equals, so fresh news is never starved by a
backlog.

Rumours live in buckets keyed by how often they were sent; taking one moves it to the next
bucket. Every operation costs O(rumours taken), which matters at thousands of members.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .messages import Gossip


@dataclass(slots=True)
class _Rumour:
    msg: Gossip
    size: int
    sent: int = 0


_MIN_USEFUL = 32
"""Below this many bytes of budget no rumour fits: stop looking."""


class BroadcastQueue:
    def __init__(self, size_of: Callable[[Gossip], int]) -> None:
        self._size_of = size_of
        self._by_key: dict[str, _Rumour] = {}
        self._buckets: dict[int, dict[str, _Rumour]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def push(self, msg: Gossip) -> None:
        """Queue ``msg``, invalidating any older rumour about the same member."""
        key = msg.node
        old = self._by_key.pop(key, None)
        if old is not None:
            del self._buckets[old.sent][key]
        rumour = _Rumour(msg, self._size_of(msg))
        self._by_key[key] = rumour
        self._buckets.setdefault(0, {})[key] = rumour

    def take(self, budget: int, limit: int) -> list[Gossip]:
        """Rumours whose encoded sizes fit in ``budget`` bytes; each counts one transmission,
        and is dropped once it reaches ``limit`` transmissions."""
        out: list[Gossip] = []
        moved: list[_Rumour] = []
        for sent in sorted(self._buckets):
            bucket = self._buckets[sent]
            chosen: list[str] = []
            for key in reversed(bucket):
                size = bucket[key].size
                if size <= budget:
                    budget -= size
                    chosen.append(key)
                    if budget < _MIN_USEFUL:
                        break
            for key in chosen:
                rumour = bucket.pop(key)
                out.append(rumour.msg)
                rumour.sent += 1
                if rumour.sent >= limit:
                    del self._by_key[key]
                else:
                    moved.append(rumour)
            if not bucket:
                del self._buckets[sent]
            if budget < _MIN_USEFUL:
                break
        for rumour in moved:
            self._buckets.setdefault(rumour.sent, {})[rumour.msg.node] = rumour
        return out

    def prune(self, limit: int) -> None:
        """Drop rumours already sent ``limit`` times (after the mesh shrank)."""
        for sent in [s for s in self._buckets if s >= limit]:
            for key in self._buckets.pop(sent):
                del self._by_key[key]
