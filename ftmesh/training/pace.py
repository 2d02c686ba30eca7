"""The pace of one member's steps: who computes, at what share, and when to step out.

Theory of operation. :class:`Pace` holds everything the step machine
(``ftmesh.training.step``) knows about speed, and nothing else: this member's smoothed
compute speed, the weights of the next split (``shares="speed"``), who sits out as a
straggler and who is on trial (``ftmesh.training.stragglers``, the rule), and this member's
recent freezes with its fail-slow pauses (``ftmesh.torch.freezes``, the clock). It decides
nothing alone and performs nothing: the machine feeds it the agreed inputs and reads its
answers, so every member that saw the same committed steps and syncs holds the same pace.

Inputs (each called by the machine at one point of a run):

- :meth:`Pace.settled`: the machine settled on a view (a sync, whose reduced vector carries
  every member's straggler claims, or a planned departure or a needless sync, which keep
  them); after a sync the split starts from the carried speeds (a joiner at the median).
- :meth:`Pace.committed`: a step committed, with its agreed speeds (the header's speed slots,
  one per view rank) and the seconds this member stood still since the last one. The
  stragglers rule observes the speeds; the next split's weights follow them
  (``protocol.speed_weights``: proportional, a floor, a hysteresis), or, for a member back on
  trial, its last known speed.
- :meth:`Pace.read_rows`: the step's gathered rows say who froze in it (``FLAG_FROZE``) and
  who asks to step out after it (``FLAG_STEPS_OUT``); read before the step commits.

Fail-slow, agreed through the rows. A freeze of ours counts only when fewer than half of the
view's other members froze in the same step: a stall of the whole host (every member starved
of CPU at once, a loaded machine running several) is nobody's fault, and stepping out would
only empty the ring one member after another. Enough counted freezes in the last
``straggler_steps`` steps make this member ask to step out (:attr:`Pace.wants_out`, its next
row's ``FLAG_STEPS_OUT``); when that step commits, the rows say who asked, and
``protocol.may_step_out`` lets as many of them go as leave two members computing (the first
by node id): the same answer on every member. One that may *sits out* (:attr:`Pace.sit_out`):
the machine then steps out of the ring for :meth:`Pace.pause`'s seconds (``failslow_pause``,
doubled for each pause that came within ``readmit_steps`` of the member's return, at most
``2**MAX_BACKOFF_DOUBLINGS`` times); one that may not stays, its count started over.

Outputs: the compute set of a view (:meth:`Pace.compute_set`: the first ``max_peers`` of the
members not sitting out), the weights of a split (:meth:`Pace.split_weights`), its tag
(``protocol.split_tag``), this member's speed slots of a step's header
(:meth:`Pace.speed_slots`, which also counts the step's compute time in the smoothed speed)
and its straggler claims for a sync vector (:meth:`Pace.sync_slots`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .actions import Compute
from .config import TrainerConfig
from .protocol import (
    SHARE_FLOOR,
    SHARE_SMOOTHING,
    SPEED_RANKS,
    SPEED_SLOTS,
    filled_speeds,
    may_step_out,
    proportional_weights,
    speed_weights,
    split_share,
    split_tag,
)
from .stragglers import MAX_BACKOFF_DOUBLINGS, Stragglers

if TYPE_CHECKING:
    from ..collective.view import RingView

log = logging.getLogger("ftmesh.training")


class Pace:
    """One member's pace; see the module docstring. ``batch_size(index)`` gives the size of
    step ``index``'s global batch."""

    def __init__(self, config: TrainerConfig, me: str, batch_size: Callable[[int], int]) -> None:
        self.config = config
        self.me = me
        self.batch_size = batch_size
        self.speed = 0.0
        """``shares="speed"``: this member's smoothed compute speed (samples/s; 0: none yet)."""
        self._weights: dict[str, float] = {}
        """``shares="speed"``: the split's weights by member, agreed from the last committed
        step's speeds, or after a sync from the speeds it carried ({}: equal shares)."""
        self._remeasure = False
        """We sat out (a straggler or a hot spare), or were just probed: our next measurement
        replaces the smoothed speed, so a member that recovered meanwhile is judged on its
        speed now."""
        self._froze: deque[bool] = deque(maxlen=config.straggler_steps)
        """Whether we froze in each of the last committed steps (``ftmesh.torch.freezes``)."""
        self.wants_out = False
        """Fail-slow: ask to step out after the next step (our row's ``FLAG_STEPS_OUT``)."""
        self.sit_out = False
        """Fail-slow: step out of the ring before the next attempt (:meth:`pause`)."""
        self._rows: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        """The pending step's rows: who froze in it, who asks to step out after it."""
        self._pause_doublings = 0
        """Fail-slow pauses that came soon after the one before (each doubles the next)."""
        self._back_since: int | None = None
        """Committed steps when we first committed again after a fail-slow pause."""
        self.stragglers = Stragglers(config.straggler_rule, config.shares == "speed", SHARE_FLOOR)
        """Who sits out the compute set (``ftmesh.training.stragglers``; carried across
        views)."""
        self.straggler_steps = 0
        """Committed steps this member sat out as a straggler."""
        self.pauses = 0
        """Fail-slow pauses this member took."""

    # -- outputs ---------------------------------------------------------------------------

    def compute_set(self, view: RingView) -> tuple[str, ...]:
        """The members that compute on ``view``: the first ``max_peers`` (all without a
        limit) of those not sitting out as stragglers (``ftmesh.training.stragglers``); the
        others are hot spares."""
        m = self.config.max_peers
        out = self.stragglers.out
        ids = tuple(n for n in view.node_ids if n not in out) or view.node_ids
        return ids[:m] if m else ids

    def split_weights(self, workers: Sequence[str]) -> tuple[float, ...] | None:
        """The weights of the next split among ``workers`` (in sorted order, as the sampler
        takes them): the agreed ones, renormalized over those still computing (members that
        left in a planned departure); ``None`` (equal) when some worker has none."""
        if not self._weights or any(w not in self._weights for w in workers):
            return None
        ws = [self._weights[w] for w in sorted(workers)]
        return tuple(w / sum(ws) for w in ws)

    def split_tag(self, action: Compute) -> int:
        """The tag of ``action``'s split (``protocol.split_tag``)."""
        workers = sorted(action.workers)
        counts = split_share(self.batch_size(action.index), action.weights, len(workers))
        return split_tag(workers, counts)

    def speed_slots(self, action: Compute, share: int, seconds: float) -> np.ndarray:
        """The speed part of our header for ``action`` (empty unless ``shares="speed"``),
        after counting ``share`` samples computed in ``seconds`` (forward and backward, not
        the waits for the allreduce) in our smoothed speed: that speed in our rank's slot,
        the split tag in the last."""
        if not self.config.measures_speed:
            return np.empty(0, dtype=np.float32)
        if self.me not in action.workers:
            self._remeasure = True  # our speed may have changed meanwhile
        elif share > 0 and seconds > 0:
            if self.speed == 0 or self._remeasure:
                self.speed = share / seconds
            else:  # (the EWMA is of seconds per sample: see SHARE_SMOOTHING)
                pace = 1 / self.speed
                self.speed = 1 / (pace + SHARE_SMOOTHING * (seconds / share - pace))
            # A probe's small share mostly times the step's fixed cost: the trial's second
            # step, at the normal split, replaces what it measured.
            self._remeasure = self.stragglers.probing(self.me)
        slots = np.zeros(SPEED_SLOTS, dtype=np.float32)
        rank = action.view.rank_of(self.me)
        if self.me in action.workers and rank < SPEED_RANKS:
            slots[rank] = self.speed
        slots[-1] = self.split_tag(action)
        return slots

    def speeds(self, header: Sequence[float]) -> tuple[float, ...]:
        """The agreed speeds (one per view rank) in a checked reduced header (``()`` unless
        ``TrainerConfig.measures_speed``)."""
        if not self.config.measures_speed:
            return ()
        return tuple(float(v) for v in header[-SPEED_SLOTS:-1])

    def sync_slots(self, node_ids: Sequence[str]) -> np.ndarray:
        """Our straggler claims for a sync vector on a view of ``node_ids``."""
        return self.stragglers.sync_slots(node_ids)

    # -- inputs ----------------------------------------------------------------------------

    def settled(
        self, view: RingView, carried: np.ndarray | None, committed: int
    ) -> tuple[str, ...]:
        """The machine settled on ``view`` at ``committed`` steps: who sits out comes from a
        sync's ``carried`` claims, or, after a planned departure or a loss (no sync), stays
        as it was. Returns the compute set of ``view``."""
        if carried is None:
            self.stragglers.keep_only(view.node_ids)
        else:
            self.stragglers.adopt(carried, view.node_ids, committed)
        computing = self.compute_set(view)
        if carried is not None:
            # Every member of the view ran this sync and holds the same carried speeds (the
            # weights each had before may differ, and joiners have none): shares="speed"
            # starts its steps from them, a joiner at the median speed.
            speed = self.config.shares == "speed"
            self._weights = self._known_weights(sorted(computing)) if speed else {}
        return computing

    def read_rows(self, froze: Sequence[str], asking: Sequence[str]) -> None:
        """The pending step's gathered rows: the members that froze in it (``FLAG_FROZE``)
        and those that ask to step out after it (``FLAG_STEPS_OUT``)."""
        self._rows = (tuple(froze), tuple(asking))

    def committed(
        self, action: Compute, speeds: Sequence[float], frozen: float, committed: int
    ) -> None:
        """``action`` committed (``committed`` steps now), with its agreed ``speeds``; we
        stood still ``frozen`` seconds since the last committed step (our row said so)."""
        self._reweigh(action, speeds)
        (froze, asking), self._rows = self._rows, ((), ())
        self._count_freeze(frozen, action, committed, froze, asking)

    def pause(self) -> float:
        """Start the fail-slow pause :attr:`sit_out` asked for; returns its seconds."""
        self.sit_out = False
        self.pauses += 1
        self._back_since = None
        return self._pause_seconds()

    # -- the rules -------------------------------------------------------------------------

    def _reweigh(self, action: Compute, speeds: Sequence[float]) -> None:
        """After committing ``action``: the stragglers and the next split's weights from its
        agreed speeds (every member that committed it computes the same)."""
        if not speeds:
            return
        workers = sorted(action.workers)
        view = action.view
        ranks = [view.rank_of(w) for w in workers]
        measured = [speeds[r] if r < SPEED_RANKS else 0.0 for r in ranks]
        batch = self.batch_size(action.index)
        if self.me in self.stragglers.out:  # we sat this step out
            self.straggler_steps += 1
        self.stragglers.observe(action.index, workers, measured, batch)
        self._weights = {}
        if self.config.shares == "speed":
            counts = split_share(batch, action.weights, len(workers))
            weights = speed_weights(measured, counts, action.weights)
            self._weights = dict(zip(workers, weights, strict=True)) if weights else {}
        after = sorted(self.compute_set(view))
        retried = [w for w in after if w not in workers]
        if retried and all(w in self.stragglers.known for w in after):
            # Back on trial, with equal shares too: for one step, the share of its last known
            # speed (a member still slow costs that step little, and is sent back).
            self._weights = self._known_weights(after)

    def _known_weights(self, workers: Sequence[str]) -> dict[str, float]:
        """Weights proportional to the last agreed speeds of ``workers`` (one not measured
        counts at the median of the others), with the floor ({}: none measured)."""
        filled = filled_speeds([self.stragglers.known.get(w, 0.0) for w in workers])
        if filled is None:
            return {}
        return dict(zip(workers, proportional_weights(filled, SHARE_FLOOR), strict=True))

    def _count_freeze(
        self,
        frozen: float,
        action: Compute,
        committed: int,
        froze: Sequence[str],
        asking: Sequence[str],
    ) -> None:
        """After committing ``action``'s step, in which we stood still ``frozen`` seconds and
        the rows said ``froze`` froze and ``asking`` ask to step out: see the module doc."""
        cfg = self.config
        if self._back_since is None and self.pauses:
            self._back_since = committed  # our first step back after a pause
        if self.wants_out and self.me in asking:  # our request rode in this step's row
            self.wants_out = False
            self._froze.clear()
            if self.me in may_step_out(asking, action.workers):
                self._step_out(committed)
            else:
                log.warning(
                    "this member is fail-slow but stays in the ring: %d asked to step out "
                    "after step %d and %d compute, and two must go on computing",
                    len(asking),
                    committed,
                    len(action.workers),
                )
            return
        others = action.view.size - 1
        host_wide = others > 0 and 2 * sum(m != self.me for m in froze) >= others
        self._froze.append(frozen > 0 and not host_wide)
        # Only from a view of three or more: stepping out of a pair leaves one member
        # training alone.
        if (
            cfg.failslow_freezes
            and sum(self._froze) >= cfg.failslow_freezes
            and action.view.size > 2
        ):
            self.wants_out = True

    def _step_out(self, committed: int) -> None:
        cfg = self.config
        # fail-slow again within readmit_steps of coming back: twice as long (at most 8x)
        soon = self._back_since is not None and committed - self._back_since < cfg.readmit_steps
        self._pause_doublings = min(self._pause_doublings + 1, MAX_BACKOFF_DOUBLINGS) if soon else 0
        log.warning(
            "this member froze (stood still for more than %.1fs, alone or with fewer than half "
            "of the others) in %d of its last %d steps: it is fail-slow and steps out of the "
            "ring for %.0fs (every freeze in a collective stops the whole ring)",
            cfg.failslow_freeze,
            cfg.failslow_freezes,
            cfg.straggler_steps,
            self._pause_seconds(),
        )
        self.sit_out = True

    def _pause_seconds(self) -> float:
        """This fail-slow pause: ``failslow_pause``, doubled for each pause in a row that
        came within ``readmit_steps`` of the member's return (``MAX_BACKOFF_DOUBLINGS``)."""
        return self.config.failslow_pause * (1 << self._pause_doublings)
