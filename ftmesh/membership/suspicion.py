"""Lifeguard suspicion timeouts and local-health awareness.

Suspicion (Lifeguard, Dadgar et al. 2018, section 4.2 "Lifeguard Suspicion"): a suspicion
starts with a long timeout and shrinks it logarithmically as independent members confirm it,
down to a floor reached after ``k`` confirmations:

    timeout(c) = max(min, max - (max - min) * log(c + 1) / log(k + 1))

so a truly dead member is declared quickly (many confirm it), while one member's flaky link
alone cannot kill a healthy peer quickly.

Awareness (section 4.1 "Local Health Aware Probe"): a score that rises when this member misses
acks or nacks it should have had (it is probably the slow one) and falls on every successful
probe. Probe intervals and timeouts are multiplied by ``score + 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class Suspicion:
    incarnation: int
    start: float
    min_timeout: float
    max_timeout: float
    k: int
    accusers: set[str] = field(default_factory=set)
    last_chance: int = 0
    """Sequence number of the final direct probe sent when the timeout expired (0: none)."""

    @property
    def deadline(self) -> float:
        c = max(len(self.accusers) - 1, 0)  # the first accuser is not a confirmation
        if self.k < 1 or c >= self.k:
            timeout = self.min_timeout
        else:
            frac = math.log(c + 1) / math.log(self.k + 1)
            timeout = max(
                self.min_timeout, self.max_timeout - (self.max_timeout - self.min_timeout) * frac
            )
        return self.start + timeout

    def confirm(self, accuser: str) -> bool:
        """Record an accusation; True when it is a new, independent one that still counts.

        Once ``k`` confirmations are in, the timeout sits at its floor and further ones are
        ignored (as memberlist does): otherwise every member that probes the dead member
        would restart the spread of a Suspect rumour, n rumours per death, and the accuser
        set would grow with the mesh."""
        if len(self.accusers) > self.k or accuser in self.accusers:
            return False
        self.accusers.add(accuser)
        return True


class Awareness:
    def __init__(self, max_multiplier: int) -> None:
        self._max = max_multiplier
        self.score = 0

    def apply(self, delta: int) -> None:
        self.score = min(max(self.score + delta, 0), self._max - 1)

    def scale(self, seconds: float) -> float:
        return seconds * (self.score + 1)
