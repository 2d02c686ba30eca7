"""The fault-tolerant training step, as a sans-IO state machine.

Theory of operation. :class:`StepMachine` decides everything a member does to commit one step
of ``ftmesh.training.protocol``: when it enters the ring, which view it trains on, whether it
has a quorum, when it syncs state and with whom, what it computes, what a failure costs, when
it gives up. It performs nothing itself: it returns *actions* (frozen dataclasses: wait for a
view, run the sync allreduce, fetch state, compute this share, write a checkpoint...) and the
driver (``ftmesh.torch.ElasticTrainer``) carries each one out and feeds back its *outcome*
(a typed value: a view, a reduced vector, bytes fetched, a :class:`Failed` with a
:class:`Failure` kind). Time comes in with every outcome and randomness from a seeded
``random.Random``, so a test drives the machine through any sequence of views, failures and
timeouts instantly and reproducibly (``tests/test_training_step.py``), with no process,
thread or socket.

One call of :meth:`StepMachine.begin` starts a *run*: a step (``"step"``), a join without
computing (``"join"``: enter the ring and sync; ``ElasticTrainer.epochs`` positions a joiner
before its loop starts), or the final sync before leaving (``"finish"``). A run is a sequence
of *attempts*:

1. **Enter** (outside the ring only): let membership settle (``join_settle``); pass the start
   gate (``ftmesh.training.start``: in a mesh that has not started, wait for ``start_peers``
   members, a majority at the timeout, else ``MeshNotFormedError``; a member started to join
   a running mesh waits for one); as a cold spare, wait for a free slot; then take the role
   ``train``.
2. **View**: wait for a view of ``min_peers``; a cold spare that is one too many steps back
   out; without a quorum of the last view, wait for another view.
3. **Sync** (when the view differs from the one we last synced on): the sync allreduce, then
   fetch the newest state if we are behind, a barrier while others fetch, and the re-shard of
   the optimizer state in sharded mode. If the sync shows that the others committed the step
   we were computing, the run ends there: the step is *adopted*, never computed twice. A view
   made only of members of the last one we settled on, after nothing but losses that struck
   before our row of a step went out, is taken without a sync, as after a planned departure
   (``ftmesh.training.held`` gives the argument: after a kill the survivors go straight
   to the retried step).
4. **Compute**: our share of the step (equal, or by the weights the pace made from the
   last committed step's agreed speeds: ``shares="speed"``, ``protocol`` 5), as
   micro-batches; the driver runs backward, the gradient allreduce, the allgather of every
   member's own header contribution and the optimizer (skipped alike by every member when
   some member's gradients were not finite), and judges the header with
   :meth:`StepMachine.check_step` (``ftmesh.training.verdicts``: typed verdicts, offenders
   named); the step is committed.

5. **Departures** (``ftmesh.training.protocol``, 4): the step's reduced leave slots say who
   leaves after it. Everyone passes one barrier on the step's view; a leaver then departs
   (the ``Depart`` action: it leaves the mesh, the call raises ``ftmesh.Departed``), the others
   wait briefly for the view without the leavers and take it without a sync (they all hold
   the same state). A member asked to leave (:meth:`StepMachine.request_leave`, fed by the
   driver) announces in the next step it computes; outside the ring, at the start gate, as a
   cold spare, while waiting for a view, or after a failed attempt it departs at once.

A failure in 3 or 4 (a peer lost, a ring that disagreed, data of another round) costs one
attempt: the machine forgets the synced view (the next attempt syncs again, unless the sync
is needless, as in 3), pauses as the failure calls for (a lost peer that membership still
holds alive: until the view changes, at most a random ``RETRY_JITTER_S``), and starts over
at 1 or 2. The step's global batch never changes between
attempts, only its split; the deadline ``step_timeout`` bounds the whole run.

The machine owns the run, written as one generator per phase (enter and view, quorum, sync
or settle, compute, commit, failure, retry pause). Parts of its own hold the rest of a
member's step state, fed and read by the machine through small typed methods: its place in
the ring (``ftmesh.training.entry.Ring``: the start gate, spares' slots, the quorum), the
*pace* (``ftmesh.training.pace.Pace``: speeds, split weights, who sits out, fail-slow
pauses), the *judge* of step headers (``ftmesh.training.verdicts.HeaderJudge``), what the
others hold (``ftmesh.training.held.Held``: when a view is taken without a sync) and the
counters and reports (``ftmesh.training.reports``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeAlias

import numpy as np

from ..collective.view import RingView
from ..errors import (
    ConfigError,
    DeadlineExceeded,
    FtmeshError,
    LocalUsageError,
    StateLostError,
)
from ..membership.messages import MemberState
from ..mesh.meta import Progress
from ..stats import TrainerStatistics
from .actions import (
    EXPECTS,
    Action,
    Advertise,
    Barrier,
    Checkpoint,
    Compute,
    Computed,
    Depart,
    DropRing,
    Failed,
    Failure,
    FallBack,
    Fetch,
    Fetched,
    Finished,
    Loaded,
    MemberInfo,
    Members,
    Outcome,
    Raise,
    ReadMembers,
    ReadView,
    Reduced,
    Reshard,
    Saved,
    SetRole,
    Sleep,
    Sync,
    ViewSeen,
    WaitView,
    WaitViewChange,
    WorldChanged,
)
from .config import TrainerConfig
from .entry import QUORUM_POLL_S, SLOT_POLL_S, Ring
from .held import Held
from .pace import Pace
from .protocol import (
    FRESH,
    SHARES,
    SyncPlan,
    own_slots_intact,
    plan_sync,
    sync_vector,
)
from .reports import Counters, Ending, StepReport
from .runs import Abort, Leave, Steps
from .shards import (
    COMPRESSION_CODES,
    SETTINGS_SLOTS,
    SharedSettings,
    read_settings,
    settings_problem,
    settings_slots,
)
from .start import StartConfig
from .stragglers import SYNC_FIELDS, Stragglers
from .verdicts import NONFINITE_LIMIT, HeaderJudge, StepVerdict, leaving

__all__ = ["NONFINITE_LIMIT", "StepMachine", "StepReport", "StepVerdict"]

log = logging.getLogger("ftmesh.training")

REANNOUNCE_EVERY = 20
"""Failed attempts after which a member that never trained re-enters the ring."""
RETRY_JITTER_S = 0.2
"""After a loss of a peer that membership still holds alive, wait for the view to change at
most this many seconds (drawn at random, so that members that failed together do not retry
in lockstep on an unchanged view): a peer that really died is dropped by membership within
the wait, and the retry starts the moment the view without it arrives, not after a sleep
(issue #30)."""
LOSS_WAIT_S = 0.5
"""After a loss of a peer that membership no longer holds alive, how long to wait for the
view to drop it; short, so that we are back before neighbours that wait for us give up."""
LOSSES = (Failure.PEER_LOST, Failure.VIEW)
"""The failures of a collective that a lost member or a changed view explain: struck before
our row of a step went out, they leave the state where it was
(``Held.needless``)."""
DEPARTURE_WAIT_S = 2.0
"""How long the members that stay wait for membership to show the view without the members
that announced their departure (their graceful leave reaches everyone in milliseconds; after
this the next step runs on whatever view there is, with a sync)."""


_Run: TypeAlias = Steps[StepReport | None]


@dataclass(slots=True)
class _Tries:
    """One run's bookkeeping across its attempts (``StepMachine._attempts``)."""

    started: float
    deadline: float
    """When the run gives up (``step_timeout`` after its start, or after a pause ended)."""
    entered_at: int
    """The committed steps when the run began: more after a sync means the step was adopted."""
    attempts: int = 0
    synced: bool = False
    """The run synced (its report says so)."""
    failed_at: float | None = None
    """When its first attempt failed (the recovery time runs from there)."""


@dataclass(frozen=True, slots=True)
class _SyncRead:
    """A reduced sync vector, read (``StepMachine._read_sync``)."""

    plan: SyncPlan
    steps: np.ndarray
    """Each rank's committed step."""
    theirs: list[SharedSettings]
    """Each rank's settings."""
    carried: np.ndarray
    """The stragglers' claims (``Stragglers.adopt``)."""


class StepMachine:
    """One member's step machine; see the module docstring. ``batch_size(index)`` gives the
    size of step ``index``'s global batch (the sampler's)."""

    def __init__(
        self,
        config: TrainerConfig,
        me: str,
        rng: random.Random,
        batch_size: Callable[[int], int],
        *,
        start: StartConfig | None = None,
    ) -> None:
        self.config = config
        self.me = me
        self.rng = rng
        self.batch_size = batch_size
        self.start = start or StartConfig()
        """How this member starts (``ftmesh.training.start``; the driver's ``WaitToStart``)."""
        self.leave_requested = False
        """A planned departure was asked for (:meth:`request_leave`)."""
        self._committed = FRESH
        self._synced_epoch = ""
        self._advertised_on = ""
        """The view epoch of our last ``Advertise``: the first step we commit on a view,
        synced or taken without a sync, publishes our state's size (a joiner waits for a
        training member that advertises one, ``training/start.py``)."""
        self.held = Held()
        """When a view is taken without a sync (``ftmesh.training.held``)."""
        self.world = 0
        """Members computing on the last view we synced on."""
        self.recoveries = 0
        self.fallbacks = 0
        self.last_sync_bytes = 0
        self.last_sync_seconds = 0.0
        self.layout = (0, 0, 0)
        """(state, bucket, data) layout hashes, set by the driver (``SharedSettings``)."""
        self.ring = Ring(config, me, self.start, self._leave_if_asked)
        """Our place in the ring: entering it, spares' slots, the quorum (``training.entry``)."""
        self.pace = Pace(config, me, batch_size)
        """Speeds, shares, stragglers and fail-slow pauses (``ftmesh.training.pace``)."""
        self.judge = HeaderJudge(config, me, batch_size, self.pace)
        """Judges each step's reduced header and gathered rows (``ftmesh.training.verdicts``)."""
        self._own_sync: np.ndarray | None = None
        self.parts = 0
        """Check slots of the header (the registered parts; set by the driver)."""
        self.seen_step = FRESH
        """The newest committed step a member of the mesh published (``Progress.step``) while
        we had none; set by the driver before each run. A sync that then finds nobody in the
        view with a committed state fails loudly instead of restarting the run from step 1
        (issue #26 item 5)."""
        self._run: _Run | None = None
        self._pending: Action | None = None
        self._stats = Counters()

    @property
    def committed(self) -> int:
        """Steps committed (``FRESH``: never trained in this mesh)."""
        return self._committed

    @committed.setter
    def committed(self, step: int) -> None:
        # Set from outside (a checkpoint or snapshot loaded): that state is ours alone.
        self._committed = step
        self.held.forget()

    @property
    def in_ring(self) -> bool:
        """Whether we are in the ring (``Ring.in_ring``)."""
        return self.ring.in_ring

    @property
    def last_view(self) -> tuple[str, ...]:
        """The members of the last view we settled on (``Ring.last_view``)."""
        return self.ring.last_view

    @last_view.setter
    def last_view(self, members: tuple[str, ...]) -> None:
        self.ring.last_view = members

    @property
    def synced_epoch(self) -> str:
        """The view we last synced on ("" after a failure: sync again, unless the sync is
        needless: ``Held.needless``)."""
        return self._synced_epoch

    @synced_epoch.setter
    def synced_epoch(self, epoch: str) -> None:
        # Set from outside ("": a step's body raised, its collectives are out of order with
        # the others'): the next attempt syncs, whatever the view.
        self._synced_epoch = epoch
        self.held.forget()

    # -- driving ---------------------------------------------------------------------------

    def begin(self, now: float, kind: str = "step", timeout: float | None = None) -> Action:
        """Start a run (``step``, ``join`` or ``finish``; ``timeout`` bounds a ``finish``) and
        return its first action."""
        if kind == "step":
            run = self._attempts(now, compute=True)
        elif kind == "join":
            run = self._attempts(now, compute=False)
        elif kind == "finish":
            run = self._finish(now, 60.0 if timeout is None else timeout)
        else:
            raise LocalUsageError(f"unknown run {kind!r}")
        self._run = run
        return self._advance(lambda: next(run))

    def request_leave(self) -> None:
        """Input: this member was asked to leave (``SyncMesh.leave_requested``; the driver
        calls this before it feeds an outcome). It announces in the next step it computes, or
        departs at once where there is nothing to announce (see the module docstring)."""
        self.leave_requested = True

    @property
    def pending(self) -> Action | None:
        """The action the driver is carrying out (``None`` between runs)."""
        return self._pending

    def feed(self, now: float, outcome: Outcome) -> Action:
        """The outcome of the pending action; returns the next action."""
        action, run = self._pending, self._run
        if action is None or run is None:
            raise LocalUsageError("no run in progress: call begin() first")
        expected = EXPECTS.get(type(action), ())
        if not isinstance(outcome, expected):
            names = " or ".join(t.__name__ for t in expected) or "nothing"
            raise LocalUsageError(
                f"{type(action).__name__} expects {names}, got {type(outcome).__name__}"
            )
        return self._advance(lambda: run.send((now, outcome)))

    def _advance(self, step: Callable[[], Action]) -> Action:
        try:
            action = step()
        except StopIteration as stop:
            action = Finished(stop.value)
        except Abort as abort:
            action = Raise(abort.error, abort.cause)
        except Leave as leave:
            action = leave.action
        self._pending = None if isinstance(action, Finished | Depart | Raise) else action
        if self._pending is None:
            self._run = None
        return action

    # -- pure helpers the driver calls -------------------------------------------------------

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
            state_layout=self.layout[0],
            bucket_layout=self.layout[1],
            data_layout=self.layout[2],
            shares=SHARES.index(c.shares),
            stragglers=c.straggler_rule.key,
        )

    def sync_vector(self, view: RingView, nbytes: int, digest: str) -> np.ndarray:
        """Our contribution to the pending ``Sync``: the sync vector of our committed step,
        state size and digest, and our settings."""
        rank = view.rank_of(self.me)
        vec = np.concatenate(
            [
                sync_vector(rank, view.size, self.committed, nbytes, digest),
                self.pace.sync_slots(view.node_ids),
                settings_slots(self.settings, rank, view.size),
            ]
        )
        self._own_sync = vec.copy()
        return vec

    def check_reduction(
        self,
        action: Compute,
        header: Sequence[float],
        own_checks: Sequence[int] | None,
        announced: bool = False,
    ) -> Failed | tuple[int, ...] | None:
        """Check the reduced header of ``action`` (:meth:`HeaderJudge.check_reduction`)."""
        return self.judge.check_reduction(action, header, own_checks, announced)

    def row(self, header: np.ndarray, nonfinite: bool) -> np.ndarray:
        """Our row for the step's gathered claims: our own header contribution as we added
        it, then our non-finite flag (``protocol.row_faults``); float64, which holds the
        float32 header exactly. The driver calls it for the pending ``Compute`` before the
        row goes out (after the gradient allreduce): it tells the machine that from then on
        the others can commit the step without us, so that a failure after it syncs on the
        next view (``Held.needless``)."""
        self.held.row_out = True
        return np.append(np.asarray(header, dtype=np.float64), float(nonfinite))

    def check_step(
        self,
        action: Compute,
        header: Sequence[float],
        rows: np.ndarray,
        own_checks: Sequence[int] | None,
        announced: bool = False,
        reduced_finite: bool = True,
    ) -> StepVerdict:
        """Judge a step from its reduced ``header`` and every member's gathered ``rows`` (its
        own contribution and non-finite flag, :meth:`row`): ``ftmesh.training.verdicts``."""
        return self.judge.check_step(
            action, header, rows, own_checks, self.parts, announced, reduced_finite
        )

    # -- speed-proportional shares (``shares="speed"``) -------------------------------------

    def speed_slots(self, action: Compute, share: int, seconds: float) -> np.ndarray:
        """The speed part of our header for ``action`` (:meth:`Pace.speed_slots`)."""
        return self.pace.speed_slots(action, share, seconds)

    def speeds(self, header: Sequence[float]) -> tuple[float, ...]:
        """The agreed speeds (one per view rank) in a reduced header checked with
        :meth:`check_reduction` (``()`` unless ``TrainerConfig.measures_speed``)."""
        return self.pace.speeds(header)

    @property
    def stragglers(self) -> Stragglers:
        """Who sits out the compute set (``Pace.stragglers``)."""
        return self.pace.stragglers

    @property
    def speed(self) -> float:
        """This member's smoothed compute speed (``Pace.speed``)."""
        return self.pace.speed

    def leaving(self, action: Compute, header: Sequence[float]) -> tuple[str, ...]:
        """The members that announced in ``action``'s reduced header (checked with
        :meth:`check_reduction`) that they leave after the step."""
        return leaving(action, header)

    def progress(self, backend: str = "tcp") -> Progress:
        """What the member publishes after a committed step (``SyncMesh.report_progress``)."""
        s = self._stats
        return Progress(
            step=max(self.committed, 0),
            step_s=s.last_step_s,
            share=s.share,
            sps=s.sps,
            world=s.world_size,
            backend=backend,
            fault=s.last_fault,
        )

    def statistics(self) -> TrainerStatistics:
        """A frozen snapshot of this member's counters (for metrics)."""
        p = self.pace
        nonfinite = self.judge.nonfinite_steps
        return self._stats.statistics(self.committed, p.straggler_steps, p.pauses, nonfinite)

    # -- a run -----------------------------------------------------------------------------

    def _attempts(self, now: float, *, compute: bool) -> _Run:
        """A run of attempts (the module docstring's 1 to 4), until one commits a step (or,
        without ``compute``, settles on a view)."""
        run = _Tries(now, now + self.config.step_timeout, max(self.committed, 0))
        while True:
            run.attempts += 1
            self._stats.attempts_total += 1
            now, view = yield from self._enter_view(now, run)
            if view is None:
                continue
            now, quorate = yield from self.ring.await_quorum(now, view, run.deadline)
            if not quorate:
                continue
            now, settled = yield from self._sync_or_settle(now, view, run)
            if isinstance(settled, StepReport):
                return settled  # adopted
            failure = settled
            if failure is None and not compute:
                return None
            if failure is None:
                now, done = yield from self._compute(now, view, run)
                if isinstance(done, StepReport):
                    return done
                failure = done
            now = yield from self._failed(now, view, failure, run)

    def _enter_view(
        self, now: float, run: _Tries
    ) -> Generator[Action, tuple[float, Outcome], tuple[float, RingView | None]]:
        """Enter the ring if we are out of it (after a fail-slow pause if one is due), and
        wait for a view; ``None``: we are one member too many (back to spare)."""
        cfg = self.config
        if self.leave_requested and (run.attempts > 1 or not self.in_ring):
            self._depart()  # nothing to announce, or the announcing attempt failed
        back = False
        if self.pace.sit_out and self.in_ring:
            now = yield from self._pause(now)
            run.deadline = now + cfg.step_timeout
            back = True
        if not self.in_ring:
            now, run.deadline = yield from self.ring.enter(now, run.deadline, back)
            settle = cfg.join_settle / 4
        else:
            settle = 0.0
        now, seen = yield WaitView(cfg.min_peers, settle, max(run.deadline - now, 0.1))
        if self.leave_requested and _seen(seen) is None:
            self._depart()
        view = _view(seen)
        if self.ring.over_max_peers(view, self.committed):
            log.info("%d members train (max_peers %d): back to spare", view.size, cfg.max_peers)
            self.ring.in_ring = False
            self.held.forget()
            return now, None
        return now, view

    def _sync_or_settle(
        self, now: float, view: RingView, run: _Tries
    ) -> Generator[Action, tuple[float, Outcome], tuple[float, Failed | StepReport | None]]:
        """On a view other than the one we synced on: sync, or settle on it without a sync
        when that is needless. A report: others committed the step we were computing, and
        the sync adopted it (the run ends)."""
        if view.epoch == self.synced_epoch:
            return now, None
        if self.held.needless(view, self.committed, self.config.shard_optimizer):
            log.info(
                "view %s: %d members of the view we last settled on, none of which can "
                "have committed a step without us: no sync (step %d)",
                view.epoch,
                view.size,
                self.committed,
            )
            now = yield from self._settle_on(now, view)
            return now, None
        now, failure = yield from self._sync(now, view, shards=True)
        if failure is not None:
            return now, failure
        run.synced = True
        if self.committed > run.entered_at:
            # Others committed the step we were computing (we failed at its end, or
            # joined): adopting it was this step.
            return now, self._done(now, run, view, None)
        return now, None

    def _compute(
        self, now: float, view: RingView, run: _Tries
    ) -> Generator[Action, tuple[float, Outcome], tuple[float, StepReport | Failed]]:
        """Our share of the next step on ``view``: its report once committed, or the
        failure."""
        index = self.committed
        computing = self.pace.compute_set(view)
        action = Compute(
            view=view,
            index=index,
            workers=computing,
            weights=self.pace.split_weights(computing),
            check=self.config.check_due(index),
            attempt=run.attempts,
        )
        self.held.row_out = False
        now, out = yield action
        if isinstance(out, Computed):
            return (yield from self._commit(now, action, out, run))
        failure = _failed(out)
        if self.held.row_out or failure.kind not in LOSSES:
            self.held.forget()  # others may have committed it, or we differ
        return now, failure

    def _commit(
        self, now: float, action: Compute, out: Computed, run: _Tries
    ) -> Generator[Action, tuple[float, Outcome], tuple[float, StepReport]]:
        """``action`` committed: count it, advertise our state on a new view, checkpoint
        when due, and see off the members that announced their departure."""
        view = action.view
        self._committed = action.index + 1
        self.held.tried.clear()
        self.judge.committed(out.nonfinite, out.skipped)
        self.pace.committed(action, out.speeds, out.frozen, self.committed)
        if view.epoch != self._advertised_on:
            self._advertised_on = view.epoch
            yield Advertise()
        if self.config.checkpoint_due(self.committed):
            now, saved = yield Checkpoint(self.committed)
            if isinstance(saved, Saved) and saved.written:
                self._stats.checkpoint_step = self.committed
        report = self._done(now, run, view, (out, action))
        if out.leaving:
            yield from self._see_off(now, view, report)
        return now, report

    def _failed(
        self, now: float, view: RingView, failure: Failed, run: _Tries
    ) -> Generator[Action, tuple[float, Outcome], float]:
        """An attempt on ``view`` failed: forget the synced view, fall back to a checkpoint
        when the state is lost, give up past the deadline, else pause before the retry."""
        self.held.tried.add(view.epoch)
        run.failed_at = now if run.failed_at is None else run.failed_at
        self._stats.last_fault = f"step {self.committed + 1}: {failure.detail}"
        if failure.kind is Failure.DESYNC:
            log.warning(
                "collective data from another round on view %s: %s", view.epoch, failure.detail
            )
            now, _ = yield DropRing(view)
        elif failure.kind is Failure.HEADER:
            log.warning("malformed step header on view %s: %s", view.epoch, failure.detail)
        self._synced_epoch = ""  # agree on state again first (unless needless)
        if failure.kind is Failure.STATE_LOST:
            now, loaded = yield FallBack(failure)
            assert isinstance(loaded, Loaded)
            self.committed = loaded.step
            self.fallbacks += 1
        else:
            self.recoveries += 1
        if now > run.deadline:
            error = DeadlineExceeded(
                f"step {self.committed + 1} did not commit within {self.config.step_timeout}s "
                f"({run.attempts} attempts; last: {failure.detail})"
            )
            raise Abort(error, failure.error)
        if failure.kind is Failure.STATE_LOST:
            return now
        return (yield from self._before_retry(now, view, failure, run.attempts))

    def _before_retry(
        self, now: float, view: RingView, failure: Failed, attempts: int
    ) -> Generator[Action, tuple[float, Outcome], float]:
        """The pause the failure calls for before the next attempt (the module docstring)."""
        log.info(
            "step %d attempt %d failed (%s); retrying on the next view",
            self.committed + 1,
            attempts,
            failure.detail,
        )
        if self.committed == FRESH and attempts % REANNOUNCE_EVERY == 0:
            # A joiner that cannot get in: step out of the ring and back in, which every
            # member sees as a view change (and a fresh sync).
            yield from self._step_out()
            return now
        if failure.kind is Failure.PEER_LOST:
            now, members = yield ReadMembers()
            states = {m.node: m.state for m in _members(members)}
            if states.get(failure.peer) == MemberState.ALIVE:
                # A neighbour that gave up a ring and forms the next one, or a peer that
                # died and is not suspected yet: the view change ends the wait.
                jitter = self.rng.uniform(0.0, RETRY_JITTER_S)
                now, _ = yield WaitViewChange(view.epoch, jitter)
            else:
                now, _ = yield WaitViewChange(view.epoch, LOSS_WAIT_S)
        elif failure.kind is Failure.SETTINGS:  # until the odd ones have left
            now, _ = yield WaitViewChange(view.epoch, QUORUM_POLL_S)
        elif failure.kind is Failure.HEADER:
            # Until the accusation path leaves the offender out (a few strikes): retry at
            # a bounded rate, or when the view changes.
            now, _ = yield WaitViewChange(
                view.epoch, RETRY_JITTER_S + self.rng.uniform(0.0, RETRY_JITTER_S)
            )
        return now

    def _done(
        self,
        now: float,
        run: _Tries,
        view: RingView,
        computed: tuple[Computed, Compute] | None,
    ) -> StepReport:
        """The report of the run that ends at ``now`` on ``view`` (``computed``: our
        compute's outcome and action; ``None``: the step was adopted)."""
        self._stats.ended(run.started, now, run.failed_at)
        samples = self.batch_size(self.committed - 1)
        sync = self.last_sync_bytes, self.last_sync_seconds
        ending = Ending(self.committed, samples, view, run.attempts, *sync)
        if computed is None:  # adopted
            return self._stats.adopted(ending, len(self.pace.compute_set(view)))
        out, action = computed
        return self._stats.computed(ending, out, action.workers, run.synced)

    def _finish(self, now: float, timeout: float) -> _Run:
        """A last sync on the current view before leaving, so that a member whose final step
        failed after others committed it catches up instead of redoing it alone."""
        deadline = now + timeout
        while now < deadline:
            now, seen = yield WaitView(1, 0.0, max(deadline - now, 0.1))
            view = _view(seen)
            now, failure = yield from self._sync(now, view, shards=True)
            if failure is not None and failure.kind is Failure.STATE_LOST:
                # Members that finished first took their shards with them; the optimizer
                # state is of no further use: agree on the model only.
                now, failure = yield from self._sync(now, view, shards=False)
            if failure is None:
                yield SetRole("done")  # spares waiting for a slot stop waiting
                return None
            log.info("final sync failed (%s); retrying", failure.detail)
            if failure.kind is Failure.DESYNC:
                now, _ = yield DropRing(view)
            now, _ = yield WaitViewChange(view.epoch, QUORUM_POLL_S)
        raise Abort(DeadlineExceeded(f"final sync did not complete within {timeout}s"))

    # -- the ring ---------------------------------------------------------------------------

    def _step_out(self) -> Steps[None]:
        """Leave the ring (``Ring.step_out``); the next view change syncs."""
        yield from self.ring.step_out()
        self.held.forget()

    # -- the sync --------------------------------------------------------------------------

    def _sync(
        self, now: float, view: RingView, *, shards: bool
    ) -> Generator[Action, tuple[float, Outcome], tuple[float, Failed | None]]:
        """The sync on ``view`` (the module docstring's 3): agree, fetch what we lack,
        re-shard (``shards``: the optimizer state too), and settle on the view."""
        started = now
        self.last_sync_bytes = 0
        rank = view.rank_of(self.me)
        now, out = yield Sync(view)
        if isinstance(out, Failed):
            if out.kind not in LOSSES:
                self.held.forget()
            return now, out
        # From here our state is the sync's to set (a fetch, a re-shard): held again only if
        # the sync ends well (``_settle_on``).
        self.held.forget()
        read = self._read_sync(view, rank, _reduced(out))
        if isinstance(read, Failed):
            return now, read
        failure = yield from self._check_sync(view, rank, read)
        if failure is None:
            now, failure = yield from self._transfer(now, view, rank, read, shards)
        if failure is not None:
            return now, failure
        self._stats.state_transfer_bytes += self.last_sync_bytes
        self.last_sync_seconds = now - started
        now = yield from self._settle_on(now, view, read.carried)
        return now, None

    def _read_sync(self, view: RingView, rank: int, vec: np.ndarray) -> _SyncRead | Failed:
        """The reduced sync vector's parts, or a ``DESYNC`` failure when it lost ours."""
        own = self._own_sync
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

    def _check_sync(
        self, view: RingView, rank: int, read: _SyncRead
    ) -> Generator[Action, tuple[float, Outcome], Failed | None]:
        """Whether the sync may go on: a run's state that nobody holds any more, or settings
        we cannot share, stop this member (out of the ring first); settings that others will
        change fail the attempt."""
        trained = int(read.steps.max()) != FRESH  # (else rank 0's state is adopted)
        if not trained and self.committed == FRESH and self.seen_step > 0:
            yield from self._step_out()
            raise Abort(
                StateLostError(
                    (),
                    f"this mesh had committed {self.seen_step} steps, but no member of the "
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
            yield from self._step_out()
            raise Abort(ConfigError(problem.message))
        if problem is not None:
            return Failed(Failure.SETTINGS, problem.message)
        return None

    def _transfer(
        self, now: float, view: RingView, rank: int, read: _SyncRead, shards: bool
    ) -> Generator[Action, tuple[float, Outcome], tuple[float, Failed | None]]:
        """The sync's state transfer: fetch the newest state if we are behind, a barrier
        while others fetch, and the re-shard of the optimizer state in sharded mode."""
        plan = read.plan
        log.info(
            "sync on view %s rank %d/%d at step %d: steps %s -> target %d root %d behind %s",
            view.epoch,
            rank,
            view.size,
            self.committed,
            read.steps.tolist(),
            plan.target_step,
            plan.root,
            plan.behind,
        )
        if rank in plan.behind:
            now, out = yield Fetch(view, plan)
            if isinstance(out, Failed):
                return now, out
            self.last_sync_bytes = _fetched(out)
            self.committed = plan.target_step
        if plan.behind:
            # Nobody moves on (and, at the end, leaves) while others still fetch from it.
            now, out = yield Barrier(view)
            if isinstance(out, Failed):
                return now, out
        self.committed = plan.target_step
        if self.config.shard_optimizer and shards:
            everyone = tuple(range(view.size))
            candidates = plan.holders if plan.behind else everyone
            now, out = yield Reshard(view, plan.target_step, candidates)
            if isinstance(out, Failed):
                return now, out
            self.last_sync_bytes += _fetched(out)
        return now, None

    def _settle_on(
        self, now: float, view: RingView, carried: np.ndarray | None = None
    ) -> Generator[Action, tuple[float, Outcome], float]:
        """Every member of ``view`` holds our state: steps run on it without a sync. Who
        sits out the compute set comes from the sync's ``carried`` claims, or, after a
        planned departure or a loss (no sync), stays as it was
        (``ftmesh.training.stragglers``)."""
        self._synced_epoch = view.epoch
        self.held.settle(view.node_ids, synced=carried is not None)  # (a sync: all were in it)
        computing = self.pace.settled(view, carried, self.committed)
        self.ring.last_view = view.node_ids
        world = len(computing)
        if self.world != world:
            if self.world:
                now, _ = yield WorldChanged(self.world, world)
            self.world = world
        return now

    # -- fail-slow members -----------------------------------------------------------------

    def _pause(self, now: float) -> Generator[Action, tuple[float, Outcome], float]:
        """Out of the ring (role ``spare``: the others' next view is without us, and they do
        not wait for us in their quorum) for ``failslow_pause`` (doubled when it comes soon
        after the last one: :meth:`Pace.pause`); then the attempt joins again like a
        member that was away, and syncs."""
        seconds = self.pace.pause()
        yield SetRole("spare")
        self.ring.in_ring = False
        self.synced_epoch = ""
        end = now + seconds
        while now < end:
            if self.leave_requested:
                self._depart()
            now, _ = yield Sleep(min(SLOT_POLL_S, end - now))
        log.info("joining the ring again after a fail-slow pause")
        return now

    # -- planned departures ----------------------------------------------------------------

    def _leave_if_asked(self) -> None:
        """Depart at once if this member was asked to leave (``Ring``'s ``leave``)."""
        if self.leave_requested:
            self._depart()

    def _depart(self, report: StepReport | None = None) -> NoReturn:
        raise Leave(Depart(max(self.committed, 0), report))

    def _see_off(
        self, now: float, view: RingView, report: StepReport
    ) -> Generator[Action, tuple[float, Outcome], None]:
        """After a step in which members announced that they leave: one barrier on its view,
        so that no leaver goes before every member has committed the step (its leaving would
        abort collectives still running on the view); then the leavers depart, and the others
        wait for membership to show the view without them and take it without a sync (they
        hold the same state), or else sync as after any change."""
        gone = report.leaving
        now, _ = yield Barrier(view)  # a failure does not matter: the step is committed
        if self.me in gone:
            self._depart(report)
        end = now + DEPARTURE_WAIT_S
        now, seen = yield ReadView()
        current = _seen(seen)
        while current is not None and any(n in current.node_ids for n in gone):
            if now >= end:
                return
            now, seen = yield WaitViewChange(current.epoch, end - now)
            current = _seen(seen)
        rest = tuple(n for n in view.node_ids if n not in gone)
        if current is not None and current.node_ids == rest and not self.config.shard_optimizer:
            # (Sharded: the leavers' shards must be re-spread, which the sync does.)
            yield from self._settle_on(now, current)


# -- outcome accessors (the machine checks the type of every outcome in ``feed``) -----------


def _view(outcome: Outcome) -> RingView:
    view = _seen(outcome)
    if view is None:
        raise FtmeshError("WaitView returned no view")
    return view


def _seen(outcome: Outcome) -> RingView | None:
    assert isinstance(outcome, ViewSeen)
    return outcome.view


def _members(outcome: Outcome) -> tuple[MemberInfo, ...]:
    assert isinstance(outcome, Members)
    return outcome.members


def _reduced(outcome: Outcome) -> np.ndarray:
    assert isinstance(outcome, Reduced)
    return outcome.vector


def _fetched(outcome: Outcome) -> int:
    assert isinstance(outcome, Fetched)
    return outcome.nbytes


def _failed(outcome: Outcome) -> Failed:
    assert isinstance(outcome, Failed)
    return outcome
