"""Transmit-limited rumour queue for piggybacked dissemination (SWIM section 4.1).

Each rumour about a member is piggybacked on outgoing packets up to ``limit`` times, where the
limit is ``retransmit_mult * ceil(log10(n + 1))`` (see ``MembershipConfig.retransmit_limit``):
enough for an epidemic to reach every member with high probability, and no more. A newer rumour
about the same member replaces the older one, which then stops spreading. Rumours that have been
sent the fewest times go first, newest first among equals, so fresh news is never starved by a
backlog.

Rumours live in buckets (stacks) keyed by how often they were sent; taking one moves it to the
next bucket. Every operation costs O(rumours taken) amortised, which matters at thousands of
members: a replaced rumour is left in place and skipped later rather than searched for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .messages import Gossip


@dataclass(slots=True)
class _Rumour:
    msg: Gossip
    size: int
    sent: int = 0


_MAX_MISSES = 8
"""Rumours that did not fit the remaining budget before ``take`` gives up on a bucket: rumours
differ little in size, so scanning a backlog of thousands for one that fits would cost far more
than the few bytes it could fill."""


class BroadcastQueue:
    def __init__(self, size_of: Callable[[Gossip], int]) -> None:
        self._size_of = size_of
        self._by_key: dict[str, _Rumour] = {}
        self.by_key: Mapping[str, object] = self._by_key
        """The rumours being spread, by member (read-only; empty when there is nothing)."""
        # sent count -> rumours, oldest first. A rumour replaced by a newer one about the same
        # member stays behind as a stale entry (its key maps to another object) and is skipped
        # when reached; ``_compact`` bounds how many pile up.
        self._buckets: dict[int, list[_Rumour]] = {}
        self._entries = 0  # list entries, stale ones included
        self._min_size = 1 << 30  # smallest rumour ever queued: less budget fits nothing

    def __len__(self) -> int:
        return len(self._by_key)

    def has(self, node: str) -> bool:
        """True while a rumour about ``node`` is still being spread."""
        return node in self._by_key

    def push(self, msg: Gossip) -> None:
        """Queue ``msg``, invalidating any older rumour about the same member."""
        rumour = _Rumour(msg, self._size_of(msg))
        self._min_size = min(self._min_size, rumour.size)
        self._by_key[msg.node] = rumour
        self._buckets.setdefault(0, []).append(rumour)
        self._entries += 1
        if self._entries > 2 * len(self._by_key) + 64:
            self._compact()

    def take(self, budget: int, limit: int) -> list[Gossip]:
        """Rumours whose encoded sizes fit in ``budget`` bytes; each counts one transmission,
        and is dropped once it reaches ``limit`` transmissions."""
        out: list[Gossip] = []
        min_size = self._min_size
        if budget < min_size or not self._by_key:
            return out
        by_key = self._by_key
        buckets = self._buckets
        if self._entries == 1:
            # One rumour and nothing stale: most calls, between bursts of news. The same
            # steps as below, without the loops.
            ((sent, bucket),) = buckets.items()
            rumour = bucket[0]
            if rumour.size > budget:
                return out
            rumour.sent += 1
            del buckets[sent]
            if rumour.sent >= limit:
                del by_key[rumour.msg.node]
                self._entries = 0
            else:
                buckets[sent + 1] = bucket
            out.append(rumour.msg)
            return out
        promoted: list[tuple[int, list[_Rumour]]] = []
        # (One bucket, the usual case between bursts of news, needs no sort.)
        for sent in sorted(buckets) if len(buckets) > 1 else list(buckets):
            moved: list[_Rumour] = []
            bucket = buckets[sent]
            skipped: list[_Rumour] | None = None
            while bucket:
                rumour = bucket.pop()  # newest first
                self._entries -= 1
                if by_key.get(rumour.msg.node) is not rumour:
                    continue  # stale: a newer rumour about the member replaced it
                if rumour.size > budget:
                    if skipped is None:
                        skipped = []
                    skipped.append(rumour)
                    if len(skipped) >= _MAX_MISSES:
                        break
                    continue
                budget -= rumour.size
                out.append(rumour.msg)
                rumour.sent += 1
                if rumour.sent >= limit:
                    del by_key[rumour.msg.node]
                else:
                    moved.append(rumour)
                if budget < min_size:
                    break
            if skipped:
                skipped.reverse()
                bucket.extend(skipped)
                self._entries += len(skipped)
            if not bucket:
                del buckets[sent]
            if moved:
                promoted.append((sent + 1, moved))
            if budget < min_size:
                break
        # Only now, so that no rumour is taken twice in one call.
        for sent, moved in promoted:
            into = buckets.get(sent)
            if into is None:
                buckets[sent] = moved
            else:
                into.extend(moved)
            self._entries += len(moved)
        return out

    def prune(self, limit: int) -> None:
        """Drop rumours already sent ``limit`` times (after the mesh shrank)."""
        for sent in [s for s in self._buckets if s >= limit]:
            bucket = self._buckets.pop(sent)
            self._entries -= len(bucket)
            for rumour in bucket:
                if self._by_key.get(rumour.msg.node) is rumour:
                    del self._by_key[rumour.msg.node]

    def _compact(self) -> None:
        by_key = self._by_key
        for sent in list(self._buckets):
            live = [r for r in self._buckets[sent] if by_key.get(r.msg.node) is r]
            if live:
                self._buckets[sent] = live
            else:
                del self._buckets[sent]
        self._entries = sum(len(b) for b in self._buckets.values())
