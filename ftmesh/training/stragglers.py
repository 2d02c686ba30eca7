"""Stragglers: who sits out the compute set, decided alike on every member (#15 item 4).

Theory of operation. After every committed step each member holds the same vector of the
computing members' smoothed compute speeds (samples/s of their own forward and backward; the
speed slots of the step's gradient allreduce, ``ftmesh.training.protocol``). From it,
:class:`Stragglers` predicts the next step's time with the slowest member computing and
without it: the time of a step is its slowest member's share at its speed, under the split
the trainer would use (``proportional``: ``shares="speed"``'s weights with their floor, else
equal shares). When *with* exceeds ``factor`` times *without* for ``steps`` consecutive
steps, the slowest member leaves the compute set: it stays in the ring as a hot spare (it
applies every step, its state stays current, it contributes nothing), and the next steps
split the global batch among the others. With equal shares a member at half the speed of the
others already costs more than ``factor`` (1.5 by default); with speed shares only a member
too slow for its floor share does (at a twentieth of the speed, say), or one whose fixed
per-step cost dominates.

A member out of the compute set cannot be measured, so after ``readmit`` steps it comes back
on trial, in two steps. The *probe*: one step at the share its last known speed gives it
(with equal shares too; a small share, so a member still slow costs that step little),
judged as it was split; then one step at the normal split (equal shares: its whole share).
Too slow in either, it goes back out at once, for twice as long each time (at most
``2**MAX_BACKOFF_DOUBLINGS`` times ``readmit``); otherwise it stays, and its share follows
its measured speed. (Its first measurement back replaces its smoothed speed of the slow days:
``Pace._remeasure``.) At most one member leaves per step, never the last one
computing.

Every member computes the same decisions because every input is agreed: the speeds of the
reduced header and the committed step count. A view change keeps who sits out: after a
planned departure the members that stay saw the same steps and keep everything (the
leavers' entries dropped); a sync (a join, a lost member, a false suspicion) carries each
member's exclusions, failed trials, last speeds, slow streak and trial in the sync vector
(:meth:`sync_slots`, ``SYNC_FIELDS`` slots per member of the new view, reduced with max like
the rest of it), and every member adopts the same reduced claims (:meth:`adopt`): a
straggler still sits out and is retried when it would have been, a streak goes on where it
was, a member on trial is judged at its next step as a *confirm* (the first step after a sync
is at the normal split, not the probe's), and a joiner learns it all. A stale claim (of a
member that was away while the others went on) costs little: a streak or a trial of a member
that is not slow ends at the next step. The split tag of every step catches members that
disagree anyway (the round is a desync, retried from a sync). FTLib calls this setting
``straggler-detection``.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .protocol import FRESH, MAX_SPEED, filled_speeds, proportional_weights, split_share

log = logging.getLogger("ftmesh.training")

PROBE = "probe"
CONFIRM = "confirm"
MAX_BACKOFF_DOUBLINGS = 3
"""A member whose trials keep failing sits out at most ``2**3 = 8`` times ``readmit``."""
SYNC_FIELDS = 5
"""Sync vector slots per member of the view: the committed step count when it sat out,
its failed trials in a row, its last agreed speed (in milli-samples/s), its slow steps in a
row, whether it is on trial (1); ``FRESH`` when not known. Every member writes its claims
about every member: max() gives each the latest."""


MAX_MILLI_SPEED = round(MAX_SPEED * 1000)
"""The largest speed slot of the sync vector (milli-samples/s) that is believed."""


def milli_speed(speed: float) -> int:
    """``speed`` (samples/s) as a sync slot: milli-samples/s, bounded to ``[0,
    MAX_MILLI_SPEED]`` (a non-finite or huge agreed speed must not overflow the int64 slot:
    issue #26 item 1); ``FRESH`` for a speed that is not a number."""
    if not math.isfinite(speed):
        return FRESH if math.isnan(speed) else MAX_MILLI_SPEED
    return min(max(round(speed * 1000), 0), MAX_MILLI_SPEED)


@dataclass(frozen=True, slots=True)
class StragglerRule:
    """When a member leaves the compute set and when it is retried (``TrainerConfig``'s
    ``straggler_factor``, ``straggler_steps``, ``readmit_steps``)."""

    factor: float = 1.5
    """Leave when steps with the member are predicted to take more than this many times as
    long as without it (0: never)."""
    steps: int = 20
    """... for this many consecutive steps."""
    readmit: int = 50
    """Steps a member sits out before it is retried."""

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    @property
    def key(self) -> int:
        """The rule as a number for the sync's settings slots (0: off)."""
        if not self.enabled:
            return 0
        text = f"{self.factor:.6g}/{self.steps}/{self.readmit}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


class Stragglers:
    """The compute set's exclusions on one member; see the module docstring."""

    def __init__(self, rule: StragglerRule, proportional: bool, floor: float) -> None:
        self.rule = rule
        self.proportional = proportional
        self.floor = floor
        self.out: dict[str, int] = {}
        """Members out of the compute set, with the index of the first step they sat out."""
        self.known: dict[str, float] = {}
        """Each member's last agreed speed (samples/s)."""
        self._streak: dict[str, int] = {}
        self._trial: dict[str, str] = {}
        """Members on trial: ``PROBE`` (their first step back, at the share their last speed
        gives them) or ``CONFIRM`` (their first step at the normal split)."""
        self._failed: dict[str, int] = {}
        """Failed trials in a row, by member (each doubles the next time out)."""

    def probing(self, member: str) -> bool:
        """Whether ``member``'s next step is its probe (its first back, at a small share)."""
        return self._trial.get(member) == PROBE

    def reset(self) -> None:
        """A new view: everyone computes, and what we knew is forgotten (a member that joined
        has not seen it: every decision comes from speeds agreed since the view began)."""
        self.known.clear()
        self.out.clear()
        self._streak.clear()
        self._trial.clear()
        self._failed.clear()

    def keep_only(self, node_ids: Sequence[str]) -> None:
        """A planned departure: forget the members that left (the others saw the same steps
        and keep everything else)."""
        for d in (self.known, self.out, self._streak, self._trial, self._failed):
            for m in [m for m in d if m not in node_ids]:
                del d[m]

    def sync_slots(self, node_ids: Sequence[str]) -> np.ndarray:
        """Our claims about the members ``node_ids`` of a new view, for the sync vector (see
        ``SYNC_FIELDS``; a joiner, which knows nothing, writes ``FRESH`` everywhere)."""
        size = len(node_ids)
        v = np.full(SYNC_FIELDS * size, FRESH, dtype=np.int64)
        for j, n in enumerate(node_ids):
            if n in self.out:
                v[j] = self.out[n]
            if n in self._failed:
                v[size + j] = self._failed[n]
            if n in self.known:
                v[2 * size + j] = milli_speed(self.known[n])
            if n in self._streak:
                v[3 * size + j] = self._streak[n]
            if n in self._trial:
                v[4 * size + j] = 1
        return v

    def adopt(self, reduced: np.ndarray, node_ids: Sequence[str], committed: int) -> None:
        """A sync to step ``committed`` on the view ``node_ids``: start from the reduced
        claims of its members (:meth:`sync_slots`), the same on every member; a claim from
        the future (a step not yet committed) counts as now, so no claim keeps a member out
        for longer than one time out. What we know of stragglers outside the view stays (a
        slow member suspected for a while is still one when it is back: we claim it in the
        next sync)."""
        away = {m for m in (*self.out, *self._failed) if m not in node_ids}
        self._streak.clear()
        self._trial.clear()
        for d in (self.out, self._failed, self.known):
            for m in [m for m in d if m not in away]:
                del d[m]
        size = len(node_ids)
        for j, n in enumerate(node_ids):
            since, failed, speed, streak, trial = (
                int(reduced[k * size + j]) for k in range(SYNC_FIELDS)
            )
            if since >= 0:
                self.out[n] = min(since, max(committed, 0))
            if failed > 0:
                self._failed[n] = min(failed, MAX_BACKOFF_DOUBLINGS)
            if 0 < speed <= MAX_MILLI_SPEED:  # (a bigger claim is nobody's honest one)
                self.known[n] = speed / 1000
            if n in self.out:
                continue
            if streak > 0:
                self._streak[n] = min(streak, self.rule.steps)
            if trial > 0:  # (the step after a sync is at the normal split)
                self._trial[n] = CONFIRM
        if self.out:
            log.info("members sitting out the compute set, carried by the sync: %s", self.out)

    def step_time(self, batch: int, speeds: Sequence[float], proportional: bool) -> float:
        """Predicted compute time of a step of ``batch`` samples among members of these
        ``speeds`` (all > 0), split in proportion to them (with the floor) or equally."""
        weights = proportional_weights(speeds, self.floor) if proportional else None
        counts = split_share(batch, weights, len(speeds))
        return max(c / s for c, s in zip(counts, speeds, strict=True))

    def observe(
        self, index: int, workers: Sequence[str], speeds: Sequence[float], batch: int
    ) -> str:
        """After committing step ``index`` (0-based), computed by ``workers`` (sorted) at the
        agreed ``speeds``: update the exclusions for the next step. Returns the member that
        leaves the compute set now ("" if none)."""
        for w, s in zip(workers, speeds, strict=True):
            if s > 0:
                self.known[w] = s
        # (this step's split: the probe's, if a member was probed in it)
        probed = any(self._trial.get(w) == PROBE for w in workers)
        for m, since in list(self.out.items()):
            if index + 1 - since >= self.sits_out(m):
                del self.out[m]
                self._trial[m] = PROBE
                log.info(
                    "member %s computes again on trial after %d steps out", m, index + 1 - since
                )
        filled = filled_speeds(speeds)
        if not self.rule.enabled or len(workers) < 2 or filled is None:
            return ""
        slowest = min(range(len(workers)), key=lambda i: (filled[i], workers[i]))
        member = workers[slowest]
        rest = filled[:slowest] + filled[slowest + 1 :]
        proportional = self.proportional or probed
        ratio = self.step_time(batch, filled, proportional) / self.step_time(
            batch, rest, proportional
        )
        for w in list(self._streak):
            if w != member:
                del self._streak[w]
        slow = ratio > self.rule.factor
        for w in workers:  # a trial step passed: probe -> confirm -> done
            if w in self._trial and not (slow and w == member):
                if self._trial[w] == PROBE:
                    self._trial[w] = CONFIRM
                else:
                    del self._trial[w]
                    self._failed.pop(w, None)
        if not slow:
            self._streak.pop(member, None)
            return ""
        self._streak[member] = self._streak.get(member, 0) + 1
        on_trial = member in self._trial
        if self._streak[member] < (1 if on_trial else self.rule.steps):
            return ""
        del self._streak[member]
        if on_trial:
            del self._trial[member]
            self._failed[member] = self._failed.get(member, 0) + 1
        self.out[member] = index + 1
        log.warning(
            "member %s is a straggler: steps with it are predicted to take %.1fx as long as "
            "without it (straggler_factor %.1f); it sits out the compute set as a hot spare "
            "for %d steps",
            member,
            ratio,
            self.rule.factor,
            self.sits_out(member),
        )
        return member

    def sits_out(self, member: str) -> int:
        """Steps ``member`` sits out this time: ``readmit``, doubled after each failed trial
        in a row (at most ``2**MAX_BACKOFF_DOUBLINGS`` times as long)."""
        doublings = min(self._failed.get(member, 0), MAX_BACKOFF_DOUBLINGS)
        return int(self.rule.readmit << doublings)
