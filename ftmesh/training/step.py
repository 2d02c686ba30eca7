"""The fault-tolerant training step, as a sans-IO state machine.

Theory of operation. :class:`StepMachine` decides everything a member does to commit one step
of ``ftmesh.training.protocol``: when it enters the ring, which view it trains on, whether it
has a quorum, when it syncs state and with whom, what it computes, what a failure costs, when
it gives up. It performs nothing itself: it returns *actions* (frozen dataclasses: wait for a
view, run the sync allreduce, fetch state, compute this share, write a checkpoint...) and the
driver (``ftmesh.torch.ElasticTrainer``) carries each one out and feeds back its *outcome*
(a typed value: a view, a reduced vector, bytes fetched, a :class:`Failed` with a
:class:`Failure` kind). Time comes in with every outcome and the machine draws nothing at
random (the retry pauses are fixed), so a test drives the machine through any sequence of
views, failures and timeouts instantly and reproducibly (``tests/test_training_step.py``),
with no process, thread or socket.

One call of :meth:`StepMachine.begin` starts a *run*: a step (``"step"``), a join without
computing (``"join"``: enter the ring and sync; ``ElasticTrainer.epochs`` positions a joiner
before its loop starts), or the final sync before leaving (``"finish"``). A run is a sequence
of *attempts*:

1. **Enter** (outside the ring only): into a mesh that is already training, at once (no
   wait for quiet membership: the next step boundary after we have the view and the state,
   issue #30); on a cold start, let membership settle first (``join_settle``: members
   started together find each other before step 1, ``ftmesh.training.entry``); pass the start
   gate (``ftmesh.training.start``: in a mesh that has not started, wait for ``start_peers``
   members, a majority at the timeout, else ``MeshNotFormedError``; a member started to join
   a running mesh waits for one); as a cold spare, wait for a free slot; then take the role
   ``train``.
2. **View**: wait for a view of ``min_peers`` (on a cold start, one unchanged for
   ``join_settle / 4`` that holds the members still seen at the start gate, so that the
   first sync runs on all the members that entered together); a cold spare that is one too
   many steps back out; without a quorum of the last view, wait for another view.
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
   micro-batches; the driver runs backward and the gradient allreduce, and the step's
   header goes through the machine (``_header``): the driver feeds ``Measured`` when the
   micro-batches end, the machine answers ``Reduce`` (the speed slots and our leave bit to
   fill in before the last bucket's allreduce), the driver feeds ``Contributed`` (our header
   as we added it), the machine answers ``Gather`` (our row for the allgather of every
   member's own contribution), the driver feeds ``Gathered`` (the reduced header and the
   rows), and the machine judges them (:meth:`StepMachine.check_step`,
   ``ftmesh.training.verdicts``: typed verdicts, offenders named) and answers ``Apply``; the
   driver runs the optimizer (skipped alike by every member when some member's gradients
   were not finite) and feeds ``Computed``: the step is committed.

5. **Departures** (``ftmesh.training.protocol``, 4): the step's reduced leave slots and the
   ``FLAG_LEAVING`` bits of its gathered rows say who leaves after it. Everyone passes one
   barrier on the step's view; a leaver then departs (the ``Depart`` action: it leaves the
   mesh, the call raises ``ftmesh.Departed``); the others' run ends, and their next one
   begins by waiting briefly for the view without the leavers and taking it without a sync
   (they all hold the same state): whatever the loop does between the two steps overlaps the
   leave spreading through membership. A member
   asked to leave (:meth:`StepMachine.request_leave`, fed by the driver) announces in the
   step it is computing, with its leave bit if the header has not gone out yet, else in its
   row, else in the next step it computes; outside the ring, at the start gate, as a cold
   spare, while waiting for a view, or after a failed attempt it departs at once.

A failure in 3 or 4 (a peer lost, a ring that disagreed, data of another round) costs one
attempt: the machine forgets the synced view (the next attempt syncs again, unless the sync
is needless, as in 3), pauses as the failure calls for (``Ring.await_change``: after a
lost peer, until a view without a member of the failed one arrives, at most
``LOSS_WAIT_S``: never a sleep the view change does not end, nor an immediate retry on the
view that has just lost a member), and starts over at 1 or 2. The step's global batch never changes
between attempts, only its split; the deadline ``step_timeout`` bounds the whole run.

*The recovery policy* (``TrainerConfig.recovery``). Under ``"keep"`` the machine remembers
the split of an attempt once its micro-batches ended (``Measured``: the driver then keeps
its local contribution, ``ftmesh.torch.keep``), and the retry after a loss is a *kept
attempt* (``Compute.kept``) when every member of the new view computed that attempt: each
sends again what it kept, and the step commits over ``Compute.trained`` samples, the lost
members' shares skipped and counted (``StepReport.skipped``). Anything else (a joiner or a
spare in the view, a failure no loss explains) computes the step again, as under the default
``"redo"``; the reduced header's sample count checks that every member did the same. A DiLoCo
round always works this way (``TrainerConfig.keeps_contribution``): its retry after a loss
sends the outer gradients kept from the failed attempt when every member of the new view ran
the round's inner steps on that attempt's split, and runs them again on the new split
otherwise (``ftmesh.torch.diloco``), so that no round mixes two splits.

The machine owns the run, written as one generator per phase (enter and view, quorum, sync
or settle, compute, commit, failure, retry pause). Parts of its own hold the rest of a
member's step state, fed and read by the machine through small typed methods: its place in
the ring (``ftmesh.training.entry.Ring``: the start gate, spares' slots, the quorum, the
wait before a retry), the sync (``ftmesh.training.syncing.Syncer``: agreeing on state,
fetching it, settling on a view, taking the view without the leavers, the final sync), the
*pace* (``ftmesh.training.pace.Pace``: speeds, split weights, who sits out, fail-slow
pauses), the *judge* of step headers (``ftmesh.training.verdicts.HeaderJudge``), what the
others hold (``ftmesh.training.held.Held``: when a view is taken without a sync) and the
counters, reports and published progress (``ftmesh.training.reports``). The driver talks
to the machine only through :meth:`StepMachine.begin`, :meth:`StepMachine.feed`, the
inputs and the outputs the class docstring lists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, TypeAlias

import numpy as np

from ..collective.view import RingView
from ..errors import (
    DeadlineExceeded,
    LocalUsageError,
)
from ..stats import TrainerStatistics
from .actions import (
    EXPECTS,
    Action,
    Advertise,
    Apply,
    Barrier,
    Checkpoint,
    Compute,
    Computed,
    Contributed,
    Depart,
    DropRing,
    Failed,
    Failure,
    FallBack,
    Finished,
    Gather,
    Gathered,
    Loaded,
    Measured,
    Outcome,
    Raise,
    Reduce,
    Saved,
    SetRole,
    Sleep,
    WaitView,
)
from .config import TrainerConfig
from .entry import SLOT_POLL_S, Ring
from .held import LOSSES, Held
from .pace import Pace
from .protocol import (
    FLAG_FROZE,
    FLAG_LEAVING,
    FLAG_NONFINITE,
    FLAG_STEPS_OUT,
    FRESH,
    split_share,
)
from .reports import Counters, Ending, StepReport
from .runs import Abort, Leave, Steps, failed_of, seen_of, view_of
from .shards import SharedSettings
from .start import StartConfig
from .stragglers import Stragglers
from .syncing import Syncer
from .verdicts import NONFINITE_LIMIT, HeaderJudge, StepVerdict, flagged, leaving

if TYPE_CHECKING:
    from ..mesh.meta import Progress

__all__ = ["NONFINITE_LIMIT", "StepMachine", "StepReport", "StepVerdict"]

log = logging.getLogger("ftmesh.training")

REANNOUNCE_EVERY = 20
"""Failed attempts after which a member that never trained re-enters the ring."""

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
    lost: bool = False
    """Its last failure was a loss (``held.LOSSES``): a kept contribution may be sent again."""


@dataclass(slots=True)
class KeptSplit:
    """``TrainerConfig.keeps_contribution``: the split our kept contribution of step ``index`` was
    computed on (the driver keeps the gradients themselves): each member's sample count."""

    index: int
    counts: dict[str, int]


class StepMachine:
    """One member's step machine; see the module docstring. ``batch_size(index)`` gives the
    size of step ``index``'s global batch (the sampler's).

    The driver runs it with :meth:`begin` and :meth:`feed` (actions out, outcomes in), and
    tells it what it learns besides outcomes through its inputs: :meth:`registered` (the
    registered state's parts and layout, once), :meth:`saw_step` (the newest step the mesh
    published, while we have none), :meth:`adopt_snapshot` (a snapshot or checkpoint
    loaded), :meth:`forget_sync` (a step's body raised) and :meth:`request_leave`. It reads
    the outputs: ``committed``, the reports, :meth:`progress`, :meth:`statistics`. A
    ``Compute``'s header goes through outcomes and actions too (``Measured`` ... ``Apply``,
    ``_header``); its pure helpers (:meth:`row`, :meth:`check_step`...) stay public."""

    def __init__(
        self,
        config: TrainerConfig,
        me: str,
        batch_size: Callable[[int], int],
        *,
        start: StartConfig | None = None,
    ) -> None:
        self.config = config
        self.me = me
        self.batch_size = batch_size
        self.start = start or StartConfig()
        """How this member starts (``ftmesh.training.start``; the driver's ``WaitToStart``)."""
        self.leave_requested = False
        """A planned departure was asked for (:meth:`request_leave`)."""
        self._committed = FRESH
        self._advertised_on = ""
        """The view epoch of our last ``Advertise``: the first step we commit on a view,
        synced or taken without a sync, publishes our state's size (a joiner waits for a
        training member that advertises one, ``training/start.py``)."""
        self.held = Held()
        """When a view is taken without a sync (``ftmesh.training.held``)."""
        self.recoveries = 0
        self.fallbacks = 0
        self.ring = Ring(config, me, self.start, self._leave_if_asked)
        """Our place in the ring: entering it, spares' slots, the quorum (``training.entry``)."""
        self.pace = Pace(config, me, batch_size)
        """Speeds, shares, stragglers and fail-slow pauses (``ftmesh.training.pace``)."""
        self.judge = HeaderJudge(config, me, batch_size, self.pace)
        """Judges each step's reduced header and gathered rows (``ftmesh.training.verdicts``)."""
        self._stats = Counters()
        self.syncer = Syncer(config, me, self, (self.ring, self.pace, self.held, self._stats))
        """Agrees on state with the others (``ftmesh.training.syncing``)."""
        self.parts = 0
        """Check slots of the header (the registered parts: :meth:`registered`)."""
        self.seen_step = FRESH
        """The newest committed step a member of the mesh published (:meth:`saw_step`)."""
        self.layout = (0, 0, 0)
        """(state, bucket, data) layout hashes (``SharedSettings``; :meth:`registered`)."""
        self._run: _Run | None = None
        self._pending: Action | None = None
        self.kept: KeptSplit | None = None
        """``keeps_contribution``: the split of the attempt whose local contribution the
        driver keeps (set when its micro-batches ended; ``None`` after a commit, or a failure
        that was not a loss)."""

    @property
    def committed(self) -> int:
        """Steps committed (``FRESH``: never trained in this mesh)."""
        return self._committed

    @committed.setter
    def committed(self, step: int) -> None:
        self.adopt_snapshot(step)

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
        return self.syncer.synced_epoch

    @synced_epoch.setter
    def synced_epoch(self, epoch: str) -> None:
        self.syncer.synced_epoch = epoch
        self.held.forget()  # (set from outside: the next attempt syncs, whatever the view)

    # -- inputs besides outcomes ------------------------------------------------------------

    def registered(self, parts: int, layout: tuple[int, int, int]) -> None:
        """Input: the registered state is final: its ``parts`` (the header's check slots)
        and its (state, bucket, data) ``layout`` hashes, which every member must share
        (``SharedSettings``, compared in every sync)."""
        self.parts = parts
        self.layout = layout

    def saw_step(self, step: int) -> None:
        """Input: the newest committed step a member of the mesh published
        (``Progress.step``), fed while we have none (before a run and each outcome). A sync
        that then finds nobody in the view with a committed state fails loudly instead of
        restarting the run from step 1 (issue #26 item 5)."""
        self.seen_step = step

    def adopt_snapshot(self, step: int) -> None:
        """Input: the driver loaded a snapshot or checkpoint of ``step`` as our state; that
        state is ours alone (the next view change syncs)."""
        self._committed = step
        self.held.forget()

    def forget_sync(self) -> None:
        """Input: a step's body raised, so its collectives are out of order with the
        others': the next attempt syncs, whatever the view."""
        self.synced_epoch = ""

    def request_leave(self) -> None:
        """Input: this member was asked to leave (``SyncMesh.leave_requested``; the driver
        calls this before it feeds an outcome). It announces in the next step it computes, or
        departs at once where there is nothing to announce (see the module docstring)."""
        self.leave_requested = True

    # -- driving ---------------------------------------------------------------------------

    def begin(self, now: float, kind: str = "step", timeout: float | None = None) -> Action:
        """Start a run (``step``, ``join`` or ``finish``; ``timeout`` bounds a ``finish``) and
        return its first action."""
        if kind == "step":
            run = self._attempts(now, compute=True)
        elif kind == "join":
            run = self._attempts(now, compute=False)
        elif kind == "finish":
            run = self.syncer.final(now, 60.0 if timeout is None else timeout)
        else:
            raise LocalUsageError(f"unknown run {kind!r}")
        self._run = run
        return self._advance(lambda: next(run))

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

    # -- pure helpers (the driver's ``Sync``; a ``Compute``'s header round, ``_header``) ------

    @property
    def settings(self) -> SharedSettings:
        """What every member must share (``Syncer.settings``)."""
        return self.syncer.settings

    def sync_vector(self, view: RingView, nbytes: int, digest: str) -> np.ndarray:
        """Our contribution to the pending ``Sync`` (:meth:`Syncer.sync_vector`)."""
        return self.syncer.sync_vector(view, nbytes, digest)

    def check_reduction(
        self,
        action: Compute,
        header: Sequence[float],
        own_checks: Sequence[int] | None,
        announced: bool = False,
    ) -> Failed | tuple[int, ...] | None:
        """Check the reduced header of ``action`` (:meth:`HeaderJudge.check_reduction`)."""
        return self.judge.check_reduction(action, header, own_checks, announced)

    def row(
        self, header: np.ndarray, nonfinite: bool, leaves: bool = False, frozen: bool = False
    ) -> np.ndarray:
        """Our row for the step's gathered claims: our own header contribution as we added
        it, then our flags (``protocol.FLAG_NONFINITE``, ``FLAG_LEAVING`` with ``leaves``,
        ``FLAG_FROZE`` with ``frozen``, ``FLAG_STEPS_OUT`` when we are fail-slow and ask to
        step out: ``Pace.wants_out``; ``protocol.row_faults``); float64, which holds the
        float32 header exactly. Made for
        the pending ``Compute``'s ``Gather``, once the driver fed ``Contributed`` (after the
        gradient allreduce): from then on the others can commit the step without us, so that
        a failure after it syncs on the next view (``Held.needless``)."""
        self.held.row_out = True
        flags = (FLAG_NONFINITE if nonfinite else 0) + (FLAG_LEAVING if leaves else 0)
        flags += (FLAG_FROZE if frozen else 0) + (FLAG_STEPS_OUT if self.pace.wants_out else 0)
        return np.append(np.asarray(header, dtype=np.float64), float(flags))

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
        own contribution and flags, :meth:`row`): ``ftmesh.training.verdicts``."""
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

    def leaving(
        self, action: Compute, header: Sequence[float], rows: np.ndarray | None = None
    ) -> tuple[str, ...]:
        """The members that announced that they leave after ``action``'s step, in its
        reduced header (checked with :meth:`check_reduction`) or in their gathered ``rows``
        (judged with :meth:`check_step`)."""
        return leaving(action, header, rows)

    def progress(self, backend: str = "tcp") -> Progress:
        """What the member publishes after a committed step (``Counters.progress``)."""
        return self._stats.progress(self.committed, backend)

    def statistics(self) -> TrainerStatistics:
        """A frozen snapshot of this member's counters (for metrics)."""
        p = self.pace
        nonfinite = self.judge.nonfinite_steps
        return self._stats.statistics(
            self.committed,
            p.straggler_steps,
            p.pauses,
            nonfinite,
            recoveries=self.recoveries,
            fallbacks=self.fallbacks,
            sync=(self.syncer.last_bytes, self.syncer.last_seconds),
        )

    # -- a run -----------------------------------------------------------------------------

    def _attempts(self, now: float, *, compute: bool) -> _Run:
        """A run of attempts (the module docstring's 1 to 4), until one commits a step (or,
        without ``compute``, settles on a view)."""
        run = _Tries(now, now + self.config.step_timeout, max(self.committed, 0))
        now = yield from self.syncer.without_leavers(now)  # after a step some members left
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
        settle = 0.0
        if not self.in_ring:
            now, run.deadline, training = yield from self.ring.enter(now, run.deadline, back)
            if not training:
                # A cold start: the members that entered together wait until their roles
                # have spread, so that the first sync runs on all of them rather than on a
                # part of them that the next view supersedes (a lost attempt, not a wrong
                # step). Into a training mesh the first view that holds us will do.
                settle = cfg.join_settle / 4
        now, seen = yield WaitView(cfg.min_peers, settle, max(run.deadline - now, 0.1))
        if self.leave_requested and seen_of(seen) is None:
            self._depart()
        view = view_of(seen)
        if settle:
            now, view = yield from self.ring.gather(now, view, run.deadline)
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
            now = yield from self.syncer.settle_on(now, view)
            return now, None
        now, failure = yield from self.syncer.sync(now, view, shards=True)
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
        action = self._kept_attempt(view, run)
        if action is None:
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
        if isinstance(out, Measured):  # (else Failed: ``Computed`` comes only after ``Apply``)
            if self.config.keeps_contribution and not action.kept:
                # the driver now keeps our local contribution, as it goes out
                workers = sorted(action.workers)
                counts = split_share(self.batch_size(index), action.weights, len(workers))
                self.kept = KeptSplit(index, dict(zip(workers, counts, strict=True)))
            now, out = yield from _header(self, now, action, out)
        if isinstance(out, Computed):
            return (yield from self._commit(now, action, out, run))
        failure = failed_of(out)
        if self.held.row_out or failure.kind not in LOSSES:
            self.held.forget()  # others may have committed it, or we differ
        return now, failure

    def _kept_attempt(self, view: RingView, run: _Tries) -> Compute | None:
        """``keeps_contribution``: the attempt that sends our kept contribution again, when the
        last failure was a loss and every member of ``view`` computed the attempt we kept
        (every member decides the same from the same view; a joiner or a spare in it, or
        nothing left to train: ``None``, compute the step again)."""
        kept = self.kept
        if kept is None or kept.index != self.committed or not run.lost:
            return None
        members = view.node_ids
        if not all(m in kept.counts for m in members):
            return None
        trained = sum(kept.counts[m] for m in members)
        if trained == 0:
            return None
        batch = self.batch_size(kept.index)
        log.info(
            "step %d: the survivors send the gradients they kept (%d of %d samples; %d skipped)",
            kept.index + 1,
            trained,
            batch,
            batch - trained,
        )
        return Compute(
            view=view,
            index=kept.index,
            workers=members,
            weights=None,
            check=self.config.check_due(kept.index),
            attempt=run.attempts,
            kept=True,
            trained=trained,
        )

    def _commit(
        self, now: float, action: Compute, out: Computed, run: _Tries
    ) -> Generator[Action, tuple[float, Outcome], tuple[float, StepReport]]:
        """``action`` committed: count it, advertise our state on a new view, checkpoint
        when due, and see off the members that announced their departure."""
        view = action.view
        self._committed = action.index + 1
        self.kept = None
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
            # One barrier on its view, so that no leaver goes before every member has
            # committed the step (its leaving would abort collectives still running on it).
            now, _ = yield Barrier(view)  # a failure does not matter: the step is committed
            if self.me in out.leaving:
                self._depart(report)
            self.syncer.saw_off(view, out.leaving)  # (the next run takes the view without them)
        return now, report

    def _failed(
        self, now: float, view: RingView, failure: Failed, run: _Tries
    ) -> Generator[Action, tuple[float, Outcome], float]:
        """An attempt on ``view`` failed: forget the synced view, fall back to a checkpoint
        when the state is lost, give up past the deadline, else pause before the retry."""
        self.held.tried.add(view.epoch)
        run.failed_at = now if run.failed_at is None else run.failed_at
        run.lost = failure.kind in LOSSES
        if not run.lost:
            self.kept = None  # (a failure no loss explains: the step is computed again)
        self._stats.last_fault = f"step {self.committed + 1}: {failure.detail}"
        if failure.kind is Failure.DESYNC:
            log.warning(
                "collective data from another round on view %s: %s", view.epoch, failure.detail
            )
            now, _ = yield DropRing(view)
        elif failure.kind is Failure.HEADER:
            log.warning("malformed step header on view %s: %s", view.epoch, failure.detail)
        self.syncer.synced_epoch = ""  # agree on state again first (unless needless)
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
            yield from self.syncer.step_out()
            return now
        return (yield from self.ring.await_change(now, view, failure))

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
        sync = self.syncer.last_bytes, self.syncer.last_seconds
        ending = Ending(self.committed, samples, view, run.attempts, *sync)
        if computed is None:  # adopted
            return self._stats.adopted(ending, len(self.pace.compute_set(view)))
        out, action = computed
        return self._stats.computed(ending, out, action.workers, run.synced, action.trained)

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


def _header(
    m: StepMachine, now: float, action: Compute, measured: Measured
) -> Generator[Action, tuple[float, Outcome], tuple[float, Outcome]]:
    """A ``Compute``'s header, once its micro-batches ended (``Measured``): the slots we fill
    in (:meth:`StepMachine.speed_slots`, our leave bit), our row once the gradient allreduce
    finished (:meth:`StepMachine.row`), then the verdict on the reduced header and gathered
    rows (:meth:`StepMachine.check_step`) for the driver to apply. Returns the outcome that
    ends the compute (``Computed``, or a ``Failed`` at any point)."""
    announce = m.leave_requested
    # (a kept attempt computed nothing: it leaves our measured speed as it was)
    seconds = 0.0 if action.kept else measured.seconds
    slots = m.speed_slots(action, measured.share, seconds)
    now, out = yield Reduce(slots, announce)
    if not isinstance(out, Contributed):
        return now, out
    # Asked to leave since our leave bit went out (the driver feeds the request before
    # ``Contributed``): say so in our row, instead of computing one more step to announce.
    late = m.leave_requested and not announce
    row = m.row(out.header, out.nonfinite, leaves=late, frozen=out.frozen)
    now, out = yield Gather(action.view, row)
    if not isinstance(out, Gathered):
        return now, out
    checks, header = measured.checks, out.header
    verdict = m.check_step(action, header, out.rows, checks, announce, out.reduced_finite)
    m.pace.read_rows(
        flagged(action, out.rows, FLAG_FROZE), flagged(action, out.rows, FLAG_STEPS_OUT)
    )
    return (yield Apply(verdict, leaving(action, header, out.rows)))
