"""Per-source token buckets for incoming datagrams.

A hostile or broken host can send datagrams far faster than any member would; checking each
one's MAC costs CPU. Every source gets a bucket of ``burst`` tokens refilled at ``rate`` per
second, checked before anything else is done with the datagram. The table of sources is
capped (least recently seen evicted), so spoofed source addresses cannot grow memory, and a
global bucket bounds the total work whatever the number of sources.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

MAX_SOURCES = 4096
"""Sources tracked at once: bounds the table a flood with spoofed addresses can build."""


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


class RateLimiter:
    def __init__(self, rate: float, burst: float, global_rate: float) -> None:
        self.rate = rate
        self.burst = burst
        self._global = _Bucket(2 * global_rate, 0.0)
        self._global_rate = global_rate
        self._buckets: OrderedDict[Hashable, _Bucket] = OrderedDict()

    def _take(self, b: _Bucket, rate: float, cap: float, now: float) -> bool:
        b.tokens = min(cap, b.tokens + (now - b.stamp) * rate)
        b.stamp = now
        if b.tokens < 1.0:
            return False
        b.tokens -= 1.0
        return True

    def allow(self, source: Hashable, now: float) -> bool:
        """Whether one more datagram from ``source`` at ``now`` (seconds) may be processed."""
        b = self._buckets.get(source)
        if b is None:
            if len(self._buckets) >= MAX_SOURCES:
                self._buckets.popitem(last=False)
            b = self._buckets[source] = _Bucket(self.burst, now)
        else:
            self._buckets.move_to_end(source)
        if not self._take(b, self.rate, self.burst, now):
            return False
        return self._take(self._global, self._global_rate, 2 * self._global_rate, now)
