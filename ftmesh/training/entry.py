"""Into the ring and out of it: the start gate, cold spares' slots, the quorum.

Theory of operation. :class:`Ring` is the part of the step machine (``ftmesh.training.step``)
that deals with a member's place in the ring, as generators of the machine's actions (it
performs nothing either). A member outside the ring *enters* it (:meth:`Ring.enter`): it
looks whether the mesh is already training (:func:`training_mesh`: an alive member with the
role ``train`` advertises a committed state); if it is not (a *cold start*), it lets
membership settle (``join_settle``: quiet for that long, or until a training mesh shows up),
so that members started together find each other before step 1; then it passes the start
gate (``ftmesh.training.start``; back from a fail-slow pause only into a mesh that still
trains), waits as a cold spare for a free slot when ``max_peers`` is set
(:meth:`Ring.wait_for_slot`), and takes the role ``train``. A member that enters a training
mesh waits for nothing more: the machine takes the first view that holds it, and the
members already training reach that view at their next step boundary (the ring's opening
waits for them to confirm it), where they sync with it (issue #30). Members that started
together may all see a free slot before their roles have spread: one that has not trained
and is past the first ``max_peers`` of a view steps back out (:meth:`Ring.over_max_peers`).
A view is trained on only with a quorum of the last view the member settled on
(:meth:`Ring.quorate`: members that left, that the ring leaves out, that stepped out as
spares, or that are dead for ``quorum_grace`` do not count). A member steps out of the ring
(role ``joining``) to re-enter it as a fresh view (:meth:`Ring.step_out`).

After a failed attempt, the member waits for the next view as long as the failure calls for
(:meth:`Ring.await_change`), never by a sleep that the view change does not end:

* a lost peer: until a view *without a member of the failed one* arrives (the retry starts
  at that moment), at most ``LOSS_WAIT_S``; a view that only adds members (a joiner) does
  not end the wait, since the dead member is still in it. Only when no such view comes
  (a peer that closed its connection but lives on, a stall that membership does not judge
  a death) is the same view retried. Retrying the failed view at once, or after a pause the
  view change does not end, failed again whenever membership had not yet dropped the dead
  peer (with the random pause this replaced, 28 of 70 kills took 3 or more attempts; 3 of
  70 after: ``ftmesh bench recovery --procs 4``, docs/DESIGN-NOTES.md);
* settings that others will change: ``QUORUM_POLL_S``;
* a malformed header: ``HEADER_RETRY_S``, a bounded rate while the accusation path leaves
  the offender out (a few strikes).

None of these pauses is drawn at random: the members that failed together retry the same
ring, and they want to open it together (a draw only delays the ring to the slowest one).

A member asked to leave (``leave_requested``, read through the machine) departs at once at
the start gate and while it waits as a spare: the ``leave`` callback raises the machine's
departure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..errors import DeadlineExceeded, TrainingFinishedError
from ..membership.messages import MemberState
from .actions import (
    Failed,
    Failure,
    MemberInfo,
    PrepareJoin,
    ReadMembers,
    SetRole,
    Settle,
    WaitToStart,
    WaitViewChange,
)
from .config import TrainerConfig
from .protocol import FRESH, has_quorum
from .runs import Abort, Steps, members_of, seen_of
from .start import StartConfig

if TYPE_CHECKING:
    from ..collective.view import RingView

log = logging.getLogger("ftmesh.training")

SLOT_POLL_S = 1.0
"""The longest a spare waits for a membership change before looking again."""
QUORUM_POLL_S = 1.0
"""The longest a member without quorum waits for another view before looking again."""
LOSS_WAIT_S = 0.5
"""After a loss, the longest a member waits for a view without a member of the failed view
before it retries the same view (the peer then lives on: see the module docstring). Long
enough for membership to drop a dead peer after the data plane reported it (~0.1 s on the
``local`` preset, ``ftmesh bench recovery``), short enough that we are back before
neighbours that wait for us give up (``view_timeout``, 5 s)."""
HEADER_RETRY_S = 0.3
"""After a malformed header, the pause before the next attempt unless the view changes."""
GATHER_SETTLES = 2.0
"""On a cold start, the longest the first view waits for members still seen at the start gate
(role ``starting``), in multiples of ``join_settle`` (see :meth:`Ring.gather`)."""


def training_mesh(members: Sequence[MemberInfo]) -> bool:
    """Whether ``members`` hold a training mesh to join: an alive member with the role
    ``train`` that advertises a committed state (it has committed a step)."""
    return any(m.state == MemberState.ALIVE and m.role == "train" and m.started for m in members)


class Ring:
    """One member's place in the ring; see the module docstring. ``leave()`` departs (it
    raises) when this member was asked to leave, else returns."""

    def __init__(
        self, config: TrainerConfig, me: str, start: StartConfig, leave: Callable[[], None]
    ) -> None:
        self.config = config
        self.me = me
        self.start = start
        self.leave = leave
        self.in_ring = False
        self.last_view: tuple[str, ...] = ()
        """The members of the last view we settled on (the quorum is of it)."""
        self._dead_since: dict[str, float] = {}

    def enter(
        self, now: float, deadline: float, back: bool = False
    ) -> Steps[tuple[float, float, bool]]:
        """Into the ring; ``back`` from a fail-slow pause: only into a mesh that still trains
        (the gate stops us with ``TrainingFinishedError`` if the others finished meanwhile,
        instead of our training the rest alone). Returns the time, the deadline and whether
        the mesh was training (then the first view that holds us will do: no settle)."""
        cfg = self.config
        training = False
        if cfg.join_settle > 0:
            now, out = yield ReadMembers()
            training = training_mesh(members_of(out))
        if not training:
            # A cold start: let discovery and gossip settle, so that members started
            # together find each other before step 1 instead of each training a lonely
            # mesh of its own (whose steps are thrown away when the meshes merge). The
            # driver ends the wait early when a training mesh shows up.
            now, _ = yield Settle(cfg.join_settle, max(deadline - now, 0.1))
            if cfg.join_settle > 0:
                now, out = yield ReadMembers()
                training = training_mesh(members_of(out))
        if self.start.waits or back:
            now, _ = yield WaitToStart(max(deadline - now, 0.1), rejoin=back)
            self.leave()
        if cfg.max_peers and cfg.spares == "cold":
            now = yield from self.wait_for_slot(now)
            deadline = now + cfg.step_timeout
        now, _ = yield PrepareJoin()
        now, _ = yield SetRole("train")
        self.in_ring = True
        return now, deadline, training

    def gather(self, now: float, view: RingView, deadline: float) -> Steps[tuple[float, RingView]]:
        """A cold start's first view: wait until it holds the members we still see at the
        start gate (alive, role ``starting``), at most ``GATHER_SETTLES * join_settle`` and
        never past ``deadline``. Members that passed the gate together take the role
        ``train`` at about the same moment, but under CPU starvation the news of one of them
        can take longer than the view's settle to spread: without this wait step 1 ran on
        the others (a first sync the next view supersedes, and a first step without it).
        A view that leaves us out or is too small is not taken: the caller waits again."""
        end = min(now + GATHER_SETTLES * self.config.join_settle, deadline)
        while now < end:
            now, out = yield ReadMembers()
            members = members_of(out)
            if training_mesh(members):
                break  # (a training mesh: we join it as it is)
            waiting = [
                m.node
                for m in members
                if m.state == MemberState.ALIVE and m.role == "starting" and m.node not in view
            ]
            if not waiting:
                break
            log.debug("first view %s: waiting for %s at the start gate", view.epoch, waiting)
            now, seen = yield WaitViewChange(view.epoch, end - now)
            new = seen_of(seen)
            if new is not None and self.me in new and new.size >= self.config.min_peers:
                view = new
        return now, view

    def wait_for_slot(self, now: float) -> Steps[float]:
        """Cold spares: wait as a ``spare`` until the ring has room for us. Free slots
        (``max_peers`` less the members training) go to the candidates (spares and members
        still joining) in node-id order, so every member that sees the same membership picks
        the same ones; the choice is re-made on every membership change, so a member that
        looked at a stale membership catches up (too many that step in at once are sorted out
        by :meth:`over_max_peers`). Once a training member has finished (role ``done``) no
        slot is taken: that is how training ends, and the run raises
        ``TrainingFinishedError`` when none is training any more (also when the last ones
        left: nobody holds the state). A member that left while others train (a planned
        departure) frees its slot."""
        now, _ = yield SetRole("spare")
        announced = False
        while True:
            self.leave()
            now, out = yield ReadMembers()
            members = members_of(out)
            alive = [m for m in members if m.state == MemberState.ALIVE]
            training = [m.node for m in alive if m.role == "train"]
            finished = any(m.role == "done" for m in members)
            left = any(
                m.state == MemberState.LEFT and m.role in ("train", "leaving") for m in members
            )
            if not training and (finished or left):
                raise Abort(
                    TrainingFinishedError("the training finished while we waited as a spare")
                )
            if not finished:
                candidates = sorted(m.node for m in alive if m.role in ("spare", "joining"))
                free = self.config.max_peers - len(training)
                if free > 0 and self.me in candidates[:free]:
                    return now
            if not announced:
                log.info(
                    "%d members train (max_peers %d): waiting as a spare",
                    len(training),
                    self.config.max_peers,
                )
                announced = True
            now, _ = yield WaitViewChange(None, SLOT_POLL_S)

    def step_out(self) -> Steps[None]:
        """Leave the ring (role ``joining``) until the next attempt enters it again."""
        yield SetRole("joining")
        self.in_ring = False

    def await_change(self, now: float, view: RingView, failure: Failed) -> Steps[float]:
        """After an attempt on ``view`` failed with ``failure``: wait for the view to change,
        as long as the failure calls for (see the module docstring)."""
        if failure.kind is Failure.PEER_LOST:
            # Whoever the failure names (the dead peer, or a neighbour that gave up the ring
            # for it), the ring that works is on a view without a member of this one.
            end, epoch, wait = now + LOSS_WAIT_S, view.epoch, LOSS_WAIT_S
            while wait > 0:
                now, seen = yield WaitViewChange(epoch, wait)
                new = seen_of(seen)
                if new is None or new.epoch == epoch:
                    break  # none came: retry (the peer lives on)
                if not set(view.node_ids) <= set(new.node_ids):
                    break  # a member is gone: retry on this view at once
                # Only members added (a joiner): the lost one is still in; wait on.
                epoch, wait = new.epoch, end - now
        elif failure.kind is Failure.SETTINGS:  # until the odd ones have left
            now, _ = yield WaitViewChange(view.epoch, QUORUM_POLL_S)
        elif failure.kind is Failure.HEADER:
            # Until the accusation path leaves the offender out (a few strikes): retry at
            # a bounded rate, or when the view changes.
            now, _ = yield WaitViewChange(view.epoch, HEADER_RETRY_S)
        return now

    def over_max_peers(self, view: RingView, committed: int) -> bool:
        """Cold spares: whether we, not having trained yet (``committed``), are one too many:
        members that started together can all see a free slot before their roles have
        spread. The first ``max_peers`` of the view (node-id order) stay, as every member
        computes alike."""
        m = self.config.max_peers
        return bool(
            m
            and self.config.spares == "cold"
            and committed == FRESH
            and view.size > m
            and self.me not in view.node_ids[:m]
        )

    def await_quorum(
        self, now: float, view: RingView, deadline: float
    ) -> Steps[tuple[float, bool]]:
        """Whether ``view`` holds a quorum of the last view; if not, wait for another view
        (``deadline`` bounds the waiting)."""
        now, quorate = yield from self.quorate(now, view)
        if quorate:
            return now, True
        log.info(
            "view of %d lacks a quorum of the last view of %d; waiting",
            view.size,
            len(self.last_view),
        )
        now, _ = yield WaitViewChange(view.epoch, QUORUM_POLL_S)
        if now > deadline:
            raise Abort(DeadlineExceeded(f"no quorum within {self.config.step_timeout}s"))
        return now, False

    def quorate(self, now: float, view: RingView) -> Steps[tuple[float, bool]]:
        """Whether ``view`` holds a quorum of the last view (``TrainerConfig.quorum``)."""
        if self.config.quorum == "any" or not self.last_view:
            return now, True
        if set(self.last_view) <= set(view.node_ids):  # all that last trained are here
            self._dead_since.clear()
            return now, True
        now, out = yield ReadMembers()
        states = {m.node: m.state for m in members_of(out)}
        gone = (MemberState.DEAD, MemberState.LEFT)
        for node in self.last_view:
            # Forgotten members (dead for long) count as dead.
            if states.get(node, MemberState.DEAD) in gone:
                self._dead_since.setdefault(node, now)
            else:
                self._dead_since.pop(node, None)
        # Members that left, and members the ring leaves out (unreachable, or failing
        # verification: every member, they included, computes them out of its view from the
        # same gossip, as it sees a departure), do not count, at once.
        excluded = {m.node for m in members_of(out) if m.excluded}
        # Nor do members that stepped out as spares (fail-slow: they chose to stay out).
        spares = {m.node for m in members_of(out) if m.role == "spare"}
        left = [
            n
            for n in self.last_view
            if states.get(n) == MemberState.LEFT or n in excluded or n in spares
        ]
        grace = self.config.quorum_grace
        dead = [n for n, t in self._dead_since.items() if now - t >= grace]
        return now, has_quorum(self.config.quorum, view.node_ids, self.last_view, [*left, *dead])
