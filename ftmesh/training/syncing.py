"""The sync: how the members of a view come to hold the same state before they step on it.

Theory of operation. :class:`Syncer` is the part of the step machine
(``ftmesh.training.step``) that agrees on state, as generators of the machine's actions (it
performs nothing either). On a view other than the one it last settled on, a member *syncs*
(:meth:`Syncer.sync`, the machine's phase 3):

1. **Agree**: the ``Sync`` action allreduces (max) every member's sync vector
   (:meth:`Syncer.sync_vector`: its committed step, state size and digest in its own slots,
   ``ftmesh.training.protocol``; the pace's straggler claims, ``Pace.sync_slots``; its
   shared settings, ``ftmesh.training.shards``). Every other member writes ``FRESH`` into our
   slots, so the reduction must give ours back: if not, the vector mixed rounds (``DESYNC``).
   The reduced vector makes the plan (``plan_sync``: the target step, who holds it, who is
   behind).
2. **Check**: a mesh that had committed steps (``seen_step``, the driver's input) but whose
   view holds no trained state stops this member (``StateLostError``: never restart the run
   from step 1 silently); settings we cannot share stop it too (``ConfigError``), each after
   stepping out of the ring so the others go on without us; settings that others will
   change fail the attempt (``SETTINGS``).
3. **Transfer**: a member behind fetches the target state from a holder (``Fetch``), then
   everyone passes a barrier while others still fetch, then, in sharded mode, the optimizer
   state is re-sharded over the view (``Reshard``).
4. **Settle** (:meth:`Syncer.settle_on`): every member of the view holds our state: steps run
   on it without a sync until it changes. The pace learns who computes (the stragglers'
   carried claims), ``ftmesh.training.held.Held`` what the others hold, and a change in the
   number of computing members is told to the driver (``WorldChanged``).

A view is also settled on *without* a sync, when ``Held.needless`` says every member of it
already holds our state (after a loss before our row went out), and after a planned
departure (:meth:`Syncer.without_leavers`: at the start of their next run, so that the
loop's work between steps overlaps the leave, the members that stay wait briefly for the
view without the leavers and take it when it is exactly the rest; sharded optimizer state
always syncs, to re-spread the leavers' shards). Before a member leaves the mesh at the end it
syncs a last time (:meth:`Syncer.final`), so that one whose last step failed after the
others committed it catches up instead of redoing it alone.

The syncer reads and sets the machine's committed step count through :class:`Member` (a
fetch makes our state the target step's), and reads there what the driver told the machine
(``seen_step``, ``layout``). It forgets what the others hold (``Held.forget``) whenever the
sync may change our state, and settles it again only when the sync ends well.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..errors import ConfigError, DeadlineExceeded, StateLostError
from .actions import (
    Barrier,
    DropRing,
    Failed,
    Failure,
    Fetch,
    ReadView,
    Reshard,
    SetRole,
    Sync,
    WaitView,
    WaitViewChange,
    WorldChanged,
)
from .config import RECOVERIES, TrainerConfig
from .entry import QUORUM_POLL_S, Ring
from .held import LOSSES, Held
from .pace import Pace
from .protocol import FRESH, SHARES, SyncPlan, own_slots_intact, plan_sync, sync_vector
from .reports import Counters
from .runs import Abort, Steps, nbytes_of, seen_of, vector_of, view_of
from .shards import (
    COMPRESSION_CODES,
    SETTINGS_SLOTS,
    SharedSettings,
    read_settings,
    settings_problem,
    settings_slots,
)
from .stragglers import SYNC_FIELDS

if TYPE_CHECKING:
    from ..collective.view import RingView

log = logging.getLogger("ftmesh.training")

DEPARTURE_WAIT_S = 2.0
"""How long the members that stay wait for membership to show the view without the members
that announced their departure (their graceful leave reaches everyone in milliseconds; after
this the next step runs on whatever view there is, with a sync)."""


class Member(Protocol):
    """What the syncer reads and sets of its step machine."""

    committed: int
    """Steps committed (``FRESH``: never trained in this mesh); set by a fetch."""
    seen_step: int
    """The newest committed step a member of the mesh published while we had none."""
    layout: tuple[int, int, int]
    """(state, bucket, data) layout hashes of the registered state (``SharedSettings``)."""


@dataclass(frozen=True, slots=True)
class _SyncRead:
    """A reduced sync vector, read (``Syncer._read``)."""

    plan: SyncPlan
    steps: np.ndarray
    """Each rank's committed step."""
    theirs: list[SharedSettings]
    """Each rank's settings."""
    carried: np.ndarray
    """The stragglers' claims (``Stragglers.adopt``)."""


class Syncer:
    """One member's sync; see the module docstring."""

    def __init__(
        self,
        config: TrainerConfig,
        me: str,
        member: Member,
        parts: tuple[Ring, Pace, Held, Counters],
    ) -> None:
        self.config = config
        self.me = me
        self.member = member
        self.ring, self.pace, self.held, self.stats = parts
        self.synced_epoch = ""
        """The view we last synced on ("" after a failure: sync again, unless needless)."""
        self.world = 0
        """Members computing on the last view we synced on."""
        self.last_bytes = 0
        """State bytes the last sync received."""
        self.last_seconds = 0.0
        """Seconds the last sync took (agreement plus state transfer)."""
        self._own: np.ndarray | None = None
        self.departed: tuple[RingView, tuple[str, ...]] | None = None
        """The last committed step's view and the members that left after it, until the next
        run takes the view without them (:meth:`saw_off`)."""

    @property
    def settings(self) -> SharedSettings:
        """What every member must share (compared in every sync)."""
        c = self.config
        every = c.checkpoint_every if c.checkpoint_dir is not None else 0
        return SharedSettings.of(
            c.shard_optimizer,
            c.replicas,
            every,
            max_peers=c.max_peers,
            check_every=c.check_every,
            compression=COMPRESSION_CODES.index(c.compression or "none"),
            state_layout=self.member.layout[0],
            bucket_layout=self.member.layout[1],
            data_layout=self.member.layout[2],
            shares=SHARES.index(c.shares),
            stragglers=c.straggler_rule.key,
            recovery=RECOVERIES.index(c.recovery),
        )

    def sync_vector(self, view: RingView, nbytes: int, digest: str) -> np.ndarray:
        """Our contribution to the pending ``Sync``: the sync vector of our committed step,
        state size and digest, and our settings."""
        rank = view.rank_of(self.me)
        vec = np.concatenate(
            [
                sync_vector(rank, view.size, self.member.committed, nbytes, digest),
                self.pace.sync_slots(view.node_ids),
                settings_slots(self.settings, rank, view.size),
            ]
        )
        self._own = vec.copy()
        return vec

    def step_out(self) -> Steps[None]:
        """Leave the ring (``Ring.step_out``); the next view change syncs."""
        yield from self.ring.step_out()
        self.held.forget()

    # -- the sync --------------------------------------------------------------------------

    def sync(
        self, now: float, view: RingView, *, shards: bool
    ) -> Steps[tuple[float, Failed | None]]:
        """The sync on ``view`` (the module docstring): agree, fetch what we lack, re-shard
        (``shards``: the optimizer state too), and settle on the view."""
        started = now
        self.last_bytes = 0
        rank = view.rank_of(self.me)
        now, out = yield Sync(view)
        if isinstance(out, Failed):
            if out.kind not in LOSSES:
                self.held.forget()
            return now, out
        # From here our state is the sync's to set (a fetch, a re-shard): held again only if
        # the sync ends well (``settle_on``).
        self.held.forget()
        read = self._read(view, rank, vector_of(out))
        if isinstance(read, Failed):
            return now, read
        failure = yield from self._check(view, rank, read)
        if failure is None:
            now, failure = yield from self._transfer(now, view, rank, read, shards)
        if failure is not None:
            return now, failure
        self.stats.state_transfer_bytes += self.last_bytes
        self.last_seconds = now - started
        now = yield from self.settle_on(now, view, read.carried)
        return now, None

    def _read(self, view: RingView, rank: int, vec: np.ndarray) -> _SyncRead | Failed:
        """The reduced sync vector's parts, or a ``DESYNC`` failure when it lost ours."""
        own = self._own
        assert own is not None
        cut = len(vec) - SETTINGS_SLOTS * view.size
        theirs = read_settings(vec[cut:], view.size)
        carried = vec[cut - SYNC_FIELDS * view.size : cut]  # the stragglers' claims
        cut -= SYNC_FIELDS * view.size
        if not own_slots_intact(vec[:cut], own[:cut], rank, view.size) or (
            theirs[rank] != self.settings
        ):
            # Every other member writes FRESH into our slots, so max() must give ours back.
            what = f"sync vector {vec.tolist()} lost our slots {own.tolist()}"
            return Failed(Failure.DESYNC, what)
        return _SyncRead(plan_sync(vec[:cut]), vec[: view.size], theirs, carried)

    def _check(self, view: RingView, rank: int, read: _SyncRead) -> Steps[Failed | None]:
        """Whether the sync may go on: a run's state that nobody holds any more, or settings
        we cannot share, stop this member (out of the ring first); settings that others will
        change fail the attempt."""
        trained = int(read.steps.max()) != FRESH  # (else rank 0's state is adopted)
        seen = self.member.seen_step
        if not trained and self.member.committed == FRESH and seen > 0:
            yield from self.step_out()
            raise Abort(
                StateLostError(
                    (),
                    f"this mesh had committed {seen} steps, but no member of the "
                    f"view {view.epoch} holds that state (its holders died or left) and there "
                    "is no checkpoint to resume from: not restarting the run from step 1. "
                    "Resume from a checkpoint (checkpoint_dir), or start a new mesh",
                )
            )
        holders = read.plan.holders if trained else ()
        problem = settings_problem(read.theirs, view.node_ids, rank, holders)
        if problem is not None and problem.fatal:
            # Step out of the ring first: the members that go on see a view without us at
            # once, even if the script catches the error and stays alive.
            yield from self.step_out()
            raise Abort(ConfigError(problem.message))
        if problem is not None:
            return Failed(Failure.SETTINGS, problem.message)
        return None

    def _transfer(
        self, now: float, view: RingView, rank: int, read: _SyncRead, shards: bool
    ) -> Steps[tuple[float, Failed | None]]:
        """The sync's state transfer: fetch the newest state if we are behind, a barrier
        while others fetch, and the re-shard of the optimizer state in sharded mode."""
        plan = read.plan
        log.info(
            "sync on view %s rank %d/%d at step %d: steps %s -> target %d root %d behind %s",
            view.epoch,
            rank,
            view.size,
            self.member.committed,
            read.steps.tolist(),
            plan.target_step,
            plan.root,
            plan.behind,
        )
        if rank in plan.behind:
            now, out = yield Fetch(view, plan)
            if isinstance(out, Failed):
                return now, out
            self.last_bytes = nbytes_of(out)
            self.member.committed = plan.target_step
        if plan.behind:
            # Nobody moves on (and, at the end, leaves) while others still fetch from it.
            now, out = yield Barrier(view)
            if isinstance(out, Failed):
                return now, out
        self.member.committed = plan.target_step
        if self.config.shard_optimizer and shards:
            everyone = tuple(range(view.size))
            candidates = plan.holders if plan.behind else everyone
            now, out = yield Reshard(view, plan.target_step, candidates)
            if isinstance(out, Failed):
                return now, out
            self.last_bytes += nbytes_of(out)
        return now, None

    def settle_on(
        self, now: float, view: RingView, carried: np.ndarray | None = None
    ) -> Steps[float]:
        """Every member of ``view`` holds our state: steps run on it without a sync. Who
        sits out the compute set comes from the sync's ``carried`` claims, or, after a
        planned departure or a loss (no sync), stays as it was
        (``ftmesh.training.stragglers``)."""
        self.synced_epoch = view.epoch
        self.held.settle(view.node_ids, synced=carried is not None)  # (a sync: all were in it)
        computing = self.pace.settled(view, carried, self.member.committed)
        self.ring.last_view = view.node_ids
        world = len(computing)
        if self.world != world:
            if self.world:
                now, _ = yield WorldChanged(self.world, world)
            self.world = world
        return now

    # -- departures ------------------------------------------------------------------------

    def saw_off(self, view: RingView, gone: tuple[str, ...]) -> None:
        """A step on ``view`` committed, and its members ``gone`` leave after it (they have
        passed its barrier): the next run begins by taking the view without them
        (:meth:`without_leavers`), not this one's end, so that whatever the training loop
        does between the two steps overlaps their leave spreading through membership."""
        self.departed = (view, gone)

    def without_leavers(self, now: float) -> Steps[float]:
        """At the start of a run after a step whose members left (:meth:`saw_off`): wait
        for membership to show the view without them and take it without a sync (we hold
        the same state), or else sync as after any change (the run's own view and sync)."""
        if self.departed is None:
            return now
        view, gone = self.departed
        self.departed = None
        end = now + DEPARTURE_WAIT_S
        now, seen = yield ReadView()
        current = seen_of(seen)
        while current is not None and any(n in current.node_ids for n in gone):
            if now >= end:
                return now
            now, seen = yield WaitViewChange(current.epoch, end - now)
            current = seen_of(seen)
        rest = tuple(n for n in view.node_ids if n not in gone)
        if current is not None and current.node_ids == rest and not self.config.shard_optimizer:
            # (Sharded: the leavers' shards must be re-spread, which the sync does.)
            now = yield from self.settle_on(now, current)
        return now

    def final(self, now: float, timeout: float) -> Steps[None]:
        """A last sync on the current view before leaving, so that a member whose final step
        failed after others committed it catches up instead of redoing it alone."""
        deadline = now + timeout
        now = yield from self.without_leavers(now)
        while now < deadline:
            now, seen = yield WaitView(1, 0.0, max(deadline - now, 0.1))
            view = view_of(seen)
            now, failure = yield from self.sync(now, view, shards=True)
            if failure is not None and failure.kind is Failure.STATE_LOST:
                # Members that finished first took their shards with them; the optimizer
                # state is of no further use: agree on the model only.
                now, failure = yield from self.sync(now, view, shards=False)
            if failure is None:
                yield SetRole("done")  # spares waiting for a slot stop waiting
                return None
            log.info("final sync failed (%s); retrying", failure.detail)
            if failure.kind is Failure.DESYNC:
                now, _ = yield DropRing(view)
            now, _ = yield WaitViewChange(view.epoch, QUORUM_POLL_S)
        raise Abort(DeadlineExceeded(f"final sync did not complete within {timeout}s"))
