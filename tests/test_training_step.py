"""The step machine (``ftmesh.training.step``) without processes, threads or sockets: scripted
runs of one machine, and a seeded lockstep world of several machines on a fake mesh with
kills, joins and collectives that complete for some members only. Time is simulated, so
every test runs instantly; each world test prints its seed (``FTMESH_SEEDS`` sweeps more)."""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from ftmesh.collective.view import Peer, RingView
from ftmesh.errors import ConfigError, DeadlineExceeded, LocalUsageError, TrainingFinishedError
from ftmesh.membership.messages import MemberState
from ftmesh.training.actions import (
    Action,
    Advertise,
    Apply,
    Barrier,
    Checkpoint,
    Compute,
    Computed,
    Contributed,
    Depart,
    Done,
    DropRing,
    Failed,
    Failure,
    Fetch,
    Fetched,
    Finished,
    Gather,
    Gathered,
    Measured,
    MemberInfo,
    Members,
    Outcome,
    PrepareJoin,
    Raise,
    ReadMembers,
    ReadView,
    Reduce,
    Reduced,
    Reshard,
    SetRole,
    Settle,
    Sleep,
    Sync,
    ViewSeen,
    WaitToStart,
    WaitView,
    WaitViewChange,
    WorldChanged,
)
from ftmesh.training.config import DiLoCo, TrainerConfig
from ftmesh.training.entry import GATHER_SETTLES, LOSS_WAIT_S
from ftmesh.training.protocol import (
    FLAG_FROZE,
    FLAG_LEAVING,
    FLAG_NONFINITE,
    FLAG_STEPS_OUT,
    FRESH,
    LEAVE_SLOTS,
    leave_slots,
    round_tag,
    split_share,
)
from ftmesh.training.start import StartConfig
from ftmesh.training.step import (
    StepMachine,
    StepVerdict,
)

BATCH = 8
DIGEST = "ab" * 32


def _view(*names: str) -> RingView:
    return RingView.of(Peer(n, "127.0.0.1", 1) for n in names)


def _machine(me: str = "a", **config: Any) -> StepMachine:
    # (without straggler detection: the handmade headers here have no speed slots)
    cfg = TrainerConfig.of(**{"join_settle": 0.0, "quorum": "any", "straggler_factor": 0, **config})
    return StepMachine(cfg, me, lambda _: BATCH)


def _synced(m: StepMachine, view: RingView) -> Reduced:
    """The reduced sync vector of ``view`` where every other member is a twin of ``m`` at the
    same step with the same state."""
    vecs = []
    for peer in view.node_ids:
        twin = StepMachine(m.config, peer, lambda _: BATCH)
        twin.committed, twin.layout = m.committed, m.layout
        vecs.append(twin.sync_vector(view, 100, DIGEST))
    reduced = np.maximum.reduce(vecs)
    m.sync_vector(view, 100, DIGEST)  # (what m would contribute: the same)
    return Reduced(reduced)


def _alone_until_compute(m: StepMachine, view: RingView, now: float = 0.0) -> Compute:
    """Drive a fresh machine to its first Compute on ``view`` (the others its twins)."""
    a = m.begin(now)
    while not isinstance(a, Compute):
        if isinstance(a, Sync):
            a = m.feed(now, _synced(m, a.view))
        elif isinstance(a, WaitView | ReadView | WaitViewChange):
            a = m.feed(now, ViewSeen(view))
        elif isinstance(a, Fetch | Reshard):
            a = m.feed(now, Fetched(100))
        else:
            assert isinstance(a, Settle | SetRole | PrepareJoin | Sleep | Barrier), a
            a = m.feed(now, Done())
    return a


def walk_round(
    *machines: StepMachine,
    now: float = 0.0,
    seconds: Sequence[float] | None = None,
    checks: Sequence[Sequence[int] | None] | None = None,
    leavers: Collection[str] = (),
    loss_sum: float = float("nan"),
    frozen: float = 0.0,
    fail: Collection[str] = (),
    strict: bool = True,
    froze: Collection[str] = (),
) -> list[Action]:
    """Walk the header round of each machine's pending ``Compute`` (one step on one view,
    in lockstep) as the trainer does (``ElasticTrainer._reduce``): ``Measured`` -> ``Reduce``
    -> ``Contributed`` -> ``Gather`` -> ``Gathered`` -> ``Apply`` -> ``Computed``. Every
    member computes its share of the split; a member of the view without a machine here is a
    twin (the first machine's checks, no speed; its leave bit set when in ``leavers``).
    ``seconds``: each machine's compute time (its speed); ``checks``: each machine's check
    values (default: ``1`` per registered part on a check step); ``fail``: members whose
    allgather fails after their row went out; ``frozen``: seconds each machine stood still
    (``FLAG_FROZE`` in its row), ``froze``: twins whose rows say they froze too; a kept
    attempt (``Compute.kept``) sends each
    member's kept share (``StepMachine.kept``), and a member whose own ``Compute`` differs
    from the first one's sends its own share of it. ``strict``: every verdict must let the
    step go on (else a failed verdict is fed back, as the trainer does). Returns each
    machine's next action."""
    actions = [m.pending for m in machines]
    computes = [a for a in actions if isinstance(a, Compute)]
    assert len(computes) == len(machines), actions
    first = computes[0]
    index, view, parts = first.index, first.view, machines[0].parts
    share = _shares(machines[0], first)
    own_share = {m.me: _shares(m, a).get(m.me, 0) for m, a in zip(machines, computes, strict=True)}
    defaults = [
        (1,) * m.parts if a.check else None for m, a in zip(machines, computes, strict=True)
    ]
    own = list(checks or defaults)
    fills = []
    for i, m in enumerate(machines):
        secs = seconds[i] if seconds is not None else 0.01
        fill = m.feed(now, Measured(own_share[m.me], secs, own[i]))
        assert isinstance(fill, Reduce), fill
        fills.append(fill)
    rows = []
    by_name = {m.me: i for i, m in enumerate(machines)}
    for rank, name in enumerate(view.node_ids):
        i = by_name.get(name)
        if i is None:
            assert not machines[0].config.measures_speed, "a twin claims no speed"
        announce = fills[i].announce if i is not None else name in leavers
        leave = leave_slots(rank) if announce else np.zeros(LEAVE_SLOTS)
        mine = own[i if i is not None else 0]
        slots = fills[i].slots if i is not None else ()
        loss = loss_sum if rank == 0 else 0.0
        count = own_share[name] if i is not None else share.get(name, 0)
        rows.append([count, loss, round_tag(index), *leave, *(mine or [0] * parts)])
        flags = 0.0
        if i is not None:
            flags = (FLAG_FROZE if frozen > 0 else 0) + (
                FLAG_STEPS_OUT if machines[i].pace.wants_out else 0
            )
        elif name in froze:
            flags = FLAG_FROZE
        rows[-1] += [*slots, float(flags)]  # (then the flags)
    table = np.asarray(rows, dtype=np.float64)
    header = tuple(float(np.float32(v)) for v in table[:, :-1].sum(axis=0))
    out: list[Action] = []
    for m in machines:
        row = table[view.rank_of(m.me)]
        gather = m.feed(now, Contributed(row[:-1].astype(np.float32), False, frozen > 0))
        assert isinstance(gather, Gather), gather
        assert np.array_equal(gather.row, row, equal_nan=True)  # (our row, as we added it)
    for m in machines:
        if m.me in fail:
            out.append(m.feed(now, Failed(Failure.VIEW, "the allgather failed")))
            continue
        apply = m.feed(now, Gathered(header, table.copy(), True))
        assert isinstance(apply, Apply), apply
        v = apply.verdict
        if v.failed is not None and not strict:
            out.append(m.feed(now, v.failed))
            continue
        assert v.failed is None and not v.diverged, v
        n = own_share[m.me]
        done = Computed(n, loss_sum, apply.leaving, v.speeds, frozen, v.nonfinite, v.skip)
        out.append(m.feed(now, done))
    return out


def _shares(m: StepMachine, action: Compute) -> dict[str, int]:
    """Each member's sample count in ``action`` as ``m`` sees it: its split of the global
    batch, or the kept shares of a kept attempt."""
    if action.kept:
        assert m.kept is not None and m.kept.index == action.index
        return {n: m.kept.counts[n] for n in action.workers}
    counts = split_share(m.batch_size(action.index), action.weights, len(action.workers))
    return dict(zip(sorted(action.workers), counts, strict=True))


def test_a_lone_member_commits_its_first_step() -> None:
    m = _machine()
    view = _view("a")
    a = m.begin(0.0)
    assert a == Settle(0.0, 300.0)
    assert m.feed(0.0, Done()) == PrepareJoin()
    assert m.feed(0.0, Done()) == SetRole("train")
    a = m.feed(0.0, Done())
    assert isinstance(a, WaitView) and a.min_members == 1
    a = m.feed(0.0, ViewSeen(view))
    assert a == Sync(view)
    a = m.feed(0.0, Reduced(m.sync_vector(view, 100, DIGEST)))
    assert isinstance(a, Compute) and (a.index, a.workers, a.attempt) == (0, ("a",), 1)
    assert a.check  # the first step carries the state check
    assert walk_round(m, now=0.1, loss_sum=4.0) == [Advertise()]
    done = m.feed(0.1, Done())
    assert isinstance(done, Finished) and done.report is not None
    r = done.report
    assert (r.step, r.samples, r.share, r.attempts, r.synced, r.adopted) == (
        1,
        BATCH,
        8,
        1,
        True,
        False,
    )
    assert r.loss == 0.5
    assert m.committed == 1 and m.pending is None
    # The next step needs no sync on the same view.
    a = m.begin(0.2)
    assert isinstance(a, WaitView)
    assert isinstance(m.feed(0.2, ViewSeen(view)), Compute)


def test_feeding_the_wrong_outcome_is_refused() -> None:
    m = _machine()
    m.begin(0.0)
    with pytest.raises(ValueError, match="Settle expects Done, got Reduced"):
        m.feed(0.0, Reduced(np.zeros(3, dtype=np.int64)))


def test_computed_before_the_attempts_apply_is_refused() -> None:
    """``Computed`` commits a step only after the machine judged its header (``Apply``): fed
    at any earlier point of the round it is a local usage error, and the machine stays where
    it was (the round then goes on as usual)."""
    m = _machine()
    view = _view("a", "b")
    compute = _alone_until_compute(m, view)
    with pytest.raises(LocalUsageError, match="Compute expects Measured or Failed, got Computed"):
        m.feed(0.0, Computed(4))
    assert m.pending == compute and m.committed == 0
    assert isinstance(m.feed(0.0, Measured(4, 0.01)), Reduce)
    with pytest.raises(LocalUsageError, match="Reduce expects Contributed or Failed"):
        m.feed(0.0, Computed(4))
    assert isinstance(
        m.feed(0.0, Contributed(np.zeros(3 + LEAVE_SLOTS, np.float32), False)), Gather
    )
    with pytest.raises(LocalUsageError, match="Gather expects Gathered or Failed"):
        m.feed(0.0, Computed(4))
    assert m.committed == 0
    # A retry's Compute refuses it too: the Apply of an earlier attempt does not count.
    assert isinstance(m.feed(0.1, Failed(Failure.VIEW, "the ring moved on")), WaitView)
    again = m.feed(0.2, ViewSeen(view))
    while not isinstance(again, Compute):
        assert isinstance(again, Sync), again
        again = m.feed(0.2, _synced(m, view))
    assert again.attempt == 2
    with pytest.raises(LocalUsageError, match="Compute expects Measured or Failed"):
        m.feed(0.2, Computed(4))
    assert walk_round(m, now=0.3) == [Advertise()] and m.committed == 1


def test_a_lost_peer_costs_an_attempt_on_the_same_step() -> None:
    m = _machine()
    view2 = _view("a", "b")
    a = _alone_until_compute(m, view2)
    # b's slots: it is fresh too, so rank 0 (a) is the root; nothing to fetch for a.
    assert a.index == 0
    # b died during the gradient allreduce, before our row went out (``row`` not called):
    # nobody can have committed the step without our row.
    a = m.feed(1.0, Failed(Failure.PEER_LOST, "b died", peer="b"))
    assert a == WaitViewChange(view2.epoch, 0.5)  # wait for the view to drop b
    a = m.feed(1.5, ViewSeen(_view("a")))
    assert isinstance(a, WaitView)
    alone = _view("a")
    # Every member of the new view kept the state of the last sync: no sync, straight on.
    assert m.feed(1.5, ViewSeen(alone)) == WorldChanged(2, 1)
    a = m.feed(1.5, Done())
    assert isinstance(a, Compute) and (a.index, a.attempt, a.workers) == (0, 2, ("a",))
    assert m.synced_epoch == alone.epoch
    assert walk_round(m, now=1.6) == [Advertise()]  # (this run began with a sync)
    r = m.feed(1.6, Done())
    assert isinstance(r, Finished) and r.report is not None and r.report.attempts == 2
    assert r.report.members == ("a",)
    stats = m.statistics()
    assert m.recoveries == 1 and stats.recovery_seconds.count == 1
    assert stats.recovery_seconds.total == pytest.approx(0.6)


def _keep_until_retry(
    m: StepMachine, first: RingView, then: RingView, kind: Failure = Failure.PEER_LOST
) -> Compute:
    """``m`` computes step 1 on ``first`` (its micro-batches end: ``Measured``), the attempt
    fails with ``kind`` (c lost), and ``then`` arrives: the retry's ``Compute``."""
    a = _alone_until_compute(m, first)
    assert isinstance(a, Compute) and not a.kept and a.trained is None
    share = _shares(m, a)[m.me]
    assert isinstance(m.feed(0.1, Measured(share, 0.01)), Reduce)
    a = m.feed(0.2, Failed(kind, "c died", peer="c"))
    while not isinstance(a, Compute):
        if isinstance(a, Sync):
            a = m.feed(0.3, _synced(m, a.view))
        elif isinstance(a, WaitView | WaitViewChange):
            a = m.feed(0.3, ViewSeen(then))
        else:
            assert isinstance(a, WorldChanged | DropRing | Barrier), a
            a = m.feed(0.3, Done())
    return a


def test_keep_sends_the_kept_gradients_again_without_the_lost_share() -> None:
    """``recovery="keep"``: after the loss of c in step 1, a and b send again what they had
    computed (their shares of the split of a, b, c), and the step commits with c's share
    skipped and counted; the loss is the mean over the samples trained."""
    m = _machine(recovery="keep")
    three, two = _view("a", "b", "c"), _view("a", "b")
    a = _keep_until_retry(m, three, two)
    # (BATCH 8 over a, b, c: 3, 3, 2; c's 2 are skipped)
    assert m.kept is not None and m.kept.counts == {"a": 3, "b": 3, "c": 2}
    assert a.kept and a.trained == 6 and a.workers == ("a", "b") and a.attempt == 2
    assert walk_round(m, now=0.4, loss_sum=3.0) == [Advertise()]
    r = m.feed(0.4, Done())
    assert isinstance(r, Finished) and r.report is not None
    assert (r.report.step, r.report.samples, r.report.skipped) == (1, BATCH, 2)
    assert r.report.share == 3 and r.report.loss == pytest.approx(3.0 / 6)
    stats = m.statistics()
    assert stats.samples_skipped_total == 2 and stats.samples_total == 3
    assert m.kept is None  # (dropped with the commit)
    # The next step is computed on the view's split, as always.
    a = m.begin(1.0)
    a = m.feed(1.0, ViewSeen(two))
    assert isinstance(a, Compute) and a.index == 1 and not a.kept and a.trained is None


def test_a_kept_attempt_checks_the_count_it_trains() -> None:
    """The reduced header of a kept attempt must count the kept shares: the full batch (a
    member that computed the step again) or a member that sent nothing is a ``DESYNC``
    failure, after which every member computes the step again."""
    m = _machine(recovery="keep")
    three, two = _view("a", "b", "c"), _view("a", "b")
    a = _keep_until_retry(m, three, two)
    header = [6.0, 0.0, 2 * round_tag(0), *[0.0] * LEAVE_SLOTS]
    assert m.check_reduction(a, header, None) is None
    for total in (float(BATCH), 3.0):
        bad = m.check_reduction(a, [total, *header[1:]], None)
        assert isinstance(bad, Failed) and bad.kind is Failure.DESYNC
    # A DESYNC fails the attempt: the next one computes the step on the view's split.
    assert isinstance(m.feed(0.4, Measured(3, 0.0)), Reduce)
    a = m.feed(0.4, Failed(Failure.DESYNC, "3 samples reduced"))
    while not isinstance(a, Compute):
        if isinstance(a, Sync):
            a = m.feed(0.5, _synced(m, a.view))
        else:
            a = m.feed(0.5, ViewSeen(two) if isinstance(a, WaitView | WaitViewChange) else Done())
    assert not a.kept and a.trained is None and a.workers == ("a", "b")


@pytest.mark.parametrize(
    ("recovery", "kind", "then", "kept"),
    [
        ("redo", Failure.PEER_LOST, ("a", "b"), False),  # the default computes again
        ("keep", Failure.PEER_LOST, ("a", "b"), True),
        ("keep", Failure.VIEW, ("a", "b"), True),  # (a neighbour gave up the ring)
        ("keep", Failure.PEER_LOST, ("a", "b", "c"), True),  # nobody lost: nothing skipped
        ("keep", Failure.PEER_LOST, ("a", "b", "j"), False),  # a joiner has kept nothing
        ("keep", Failure.INPUT_MISMATCH, ("a", "b"), False),  # not a loss
        ("keep", Failure.HEADER, ("a", "b", "c"), False),
    ],
)
def test_keep_only_where_every_member_kept_and_a_loss_failed_the_attempt(
    recovery: str, kind: Failure, then: tuple[str, ...], kept: bool
) -> None:
    m = _machine(recovery=recovery)
    a = _keep_until_retry(m, _view("a", "b", "c"), _view(*then), kind)
    assert a.kept == kept and a.workers == tuple(sorted(then))
    if kept:
        assert a.trained == sum({"a": 3, "b": 3, "c": 2}[n] for n in then)
    else:
        assert a.trained is None
    assert walk_round(m, now=0.4) == [Advertise()]
    r = m.feed(0.4, Done())
    assert isinstance(r, Finished) and r.report is not None
    assert r.report.skipped == (BATCH - (a.trained or BATCH))


def test_recovery_is_redo_or_keep_and_keep_is_for_synchronous_steps() -> None:
    assert TrainerConfig().recovery == "redo"
    with pytest.raises(ConfigError, match="recovery"):
        TrainerConfig(recovery="skip")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="DiLoCo"):
        TrainerConfig(recovery="keep", sync=DiLoCo(4))


def _after_a_loss(view: RingView) -> tuple[StepMachine, Action]:
    """A machine whose step on ``view`` failed with the loss of b (dead, or a neighbour
    that gave up the ring for another member's death): its next action."""
    m = _machine()
    _alone_until_compute(m, view)
    return m, m.feed(0.0, Failed(Failure.PEER_LOST, "b broke its ring", peer="b"))


def test_a_retry_after_a_loss_waits_for_the_view_without_a_member() -> None:
    """After a loss the next attempt starts the moment a view without a member of the failed
    one arrives, never on the failed view while membership still holds the dead peer (the
    retry failed again then: issue #30), and never after a random pause."""
    view = _view("a", "b", "c")
    m, a = _after_a_loss(view)
    # Not a sleep: a wait for the view to change, the same for every member (no draw).
    assert a == WaitViewChange(view.epoch, LOSS_WAIT_S)
    assert _after_a_loss(view)[1] == a
    # A view that only adds a member (a joiner) still holds the dead one: a retry on it
    # would fail again, so the wait goes on, for what is left of it.
    joined = _view("a", "b", "c", "j")
    assert m.feed(0.1, ViewSeen(joined)) == WaitViewChange(joined.epoch, pytest.approx(0.4))
    # The view without c arrives (c died; b only gave up the ring for it): the retry
    # starts at once, on that view.
    smaller = _view("a", "b", "j")
    a = m.feed(0.15, ViewSeen(smaller))
    assert isinstance(a, WaitView) and a.settle == 0.0
    a = m.feed(0.15, ViewSeen(smaller))
    assert isinstance(a, Sync | WorldChanged) and m.pending is not None
    # No view comes within the wait (a peer that closed its connection but lives on):
    # the same view is retried, after LOSS_WAIT_S and no longer.
    m, a = _after_a_loss(view)
    assert isinstance(m.feed(LOSS_WAIT_S, ViewSeen(view)), WaitView)


def _lost_c(m: StepMachine, three: RingView, *, row_out: bool, kind: Failure) -> Action:
    """``m`` has committed a step on ``three``; the next one fails (after our row went out,
    or before) and c dies: the next action once the view without c has come."""
    a = _alone_until_compute(m, three)
    assert walk_round(m) == [Advertise()]
    assert isinstance(m.feed(0.0, Done()), Finished)
    a = m.begin(1.0)
    a = m.feed(1.0, ViewSeen(three))
    assert isinstance(a, Compute) and a.index == 1
    if row_out:  # the gradient allreduce finished, our row goes out, the allgather fails
        assert isinstance(m.feed(1.1, Measured(3, 0.01)), Reduce)
        assert isinstance(m.feed(1.1, Contributed(np.zeros(4, np.float32), False)), Gather)
    a = m.feed(1.1, Failed(kind, "c died", peer="c"))
    if kind is Failure.PEER_LOST:
        assert a == WaitViewChange(three.epoch, LOSS_WAIT_S)
        a = m.feed(1.2, ViewSeen(_view("a", "b")))
    assert isinstance(a, WaitView)
    return m.feed(1.2, ViewSeen(_view("a", "b")))


def test_a_loss_after_a_commit_skips_the_sync() -> None:
    """c dies while the next step's gradients are reduced (our row not out): no member can
    have committed it without our row, and b, if it committed one we did not, would have
    sent its row of it and syncs itself; so a and b go on without a sync."""
    for kind in (Failure.PEER_LOST, Failure.VIEW):
        m = _machine()
        two = _view("a", "b")
        assert _lost_c(m, _view("a", "b", "c"), row_out=False, kind=kind) == WorldChanged(3, 2)
        a = m.feed(1.2, Done())
        assert isinstance(a, Compute) and (a.view, a.index, a.attempt) == (two, 1, 2)
        assert a.workers == ("a", "b")
        # The first step committed on a view advertises our state, synced or not: a
        # joiner enters only once a training member advertises one.
        assert walk_round(m, now=1.3) == [Advertise()]
        r = m.feed(1.3, Done())
        assert isinstance(r, Finished) and r.report is not None
        assert (r.report.step, r.report.synced, r.report.attempts) == (2, False, 2)
        # The next loss on the smaller view skips it again; a joiner's view does not.
        a = m.begin(2.0)
        assert isinstance(m.feed(2.0, ViewSeen(two)), Compute)
        assert isinstance(m.feed(2.1, Failed(Failure.VIEW, "aborted")), WaitView)
        assert m.feed(2.2, ViewSeen(_view("a"))) == WorldChanged(2, 1)
        m.feed(2.2, Done())
        assert isinstance(m.feed(2.3, Failed(Failure.VIEW, "aborted")), WaitView)
        joined = _view("a", "j")
        assert m.feed(2.4, ViewSeen(joined)) == Sync(joined)


def test_a_loss_where_states_may_differ_syncs() -> None:
    # Our row went out: b may have gathered every row and committed the step without us.
    m = _machine()
    assert _lost_c(m, _view("a", "b", "c"), row_out=True, kind=Failure.PEER_LOST) == Sync(
        _view("a", "b")
    )
    # Another failure before our row (our collectives out of order with a member that
    # syncs, a malformed header, ...): sync.
    m = _machine()
    a = _lost_c(m, _view("a", "b", "c"), row_out=False, kind=Failure.INPUT_MISMATCH)
    assert a == Sync(_view("a", "b"))
    # Sharded optimizer state: the sync re-spreads the shards of the lost member.
    m = _machine(shard_optimizer=True)
    a = _lost_c(m, _view("a", "b", "c"), row_out=False, kind=Failure.PEER_LOST)
    assert a == Sync(_view("a", "b"))


def test_a_view_is_taken_without_a_sync_at_most_once_until_a_step_commits() -> None:
    """A member of the view may sync while we compute (it missed a step's end): where the
    mismatch of the two comes back as any failure, not as ``INPUT_MISMATCH``, we must not
    take that view without a sync again, or neither side would ever give way."""
    m = _machine()
    three, two = _view("a", "b", "c"), _view("a", "b")
    assert _lost_c(m, three, row_out=False, kind=Failure.PEER_LOST) == WorldChanged(3, 2)
    a = m.feed(1.2, Done())
    assert isinstance(a, Compute) and a.view == two
    assert isinstance(m.feed(1.3, Failed(Failure.VIEW, "mismatched contributions")), WaitView)
    assert m.feed(1.3, ViewSeen(two)) == Sync(two)
    # The old view, still shown after a lost peer's wait: a sync on it (failing at its
    # agreement, where nothing of our state changed) keeps what we hold for the next view.
    m = _machine()
    a = _alone_until_compute(m, three)
    walk_round(m)
    m.feed(0.0, Done())
    m.begin(1.0)
    assert isinstance(m.feed(1.0, ViewSeen(three)), Compute)
    a = m.feed(1.1, Failed(Failure.PEER_LOST, "c died", peer="c"))
    assert isinstance(a, WaitViewChange)
    assert isinstance(m.feed(1.6, ViewSeen(three)), WaitView)  # (unchanged within the wait)
    assert m.feed(1.6, ViewSeen(three)) == Sync(three)
    a = m.feed(1.7, Failed(Failure.PEER_LOST, "c died", peer="c"))
    assert a == WaitViewChange(three.epoch, LOSS_WAIT_S)
    assert isinstance(m.feed(1.8, ViewSeen(two)), WaitView)
    assert m.feed(1.5, ViewSeen(two)) == WorldChanged(3, 2)


def test_a_failed_sync_or_a_state_set_from_outside_syncs_again() -> None:
    three, two = _view("a", "b", "c"), _view("a", "b")
    # A sync that failed (here: its fetch) may have changed our state.
    m = _machine()
    a = m.begin(0.0)
    while not isinstance(a, Sync):
        a = m.feed(0.0, ViewSeen(three) if isinstance(a, WaitView) else Done())
    vecs = [m.sync_vector(three, 100, DIGEST)]
    for peer in ("b", "c"):
        theirs = StepMachine(m.config, peer, lambda _: BATCH)
        theirs.committed, theirs.layout = 3, m.layout
        vecs.append(theirs.sync_vector(three, 120, "cd" * 32))
    a = m.feed(0.0, Reduced(np.maximum.reduce(vecs)))
    assert isinstance(a, Fetch)
    assert isinstance(m.feed(0.1, Failed(Failure.VIEW, "holder gone")), WaitView)
    assert m.feed(0.2, ViewSeen(two)) == Sync(two)
    # The trainer abandons an attempt whose body raised (its collectives out of order), or
    # loads a snapshot: the next view change syncs.
    for outside in ("synced_epoch", "committed"):
        m = _machine()
        _alone_until_compute(m, three)
        walk_round(m)
        m.feed(0.0, Done())
        if outside == "synced_epoch":
            m.synced_epoch = ""
        else:
            m.committed = 5
        m.begin(1.0)
        assert m.feed(1.0, ViewSeen(two)) == Sync(two), outside


def test_a_step_others_committed_is_adopted_not_computed() -> None:
    m = _machine()
    view = _view("a", "b")
    a = _alone_until_compute(m, view)
    assert walk_round(m, loss_sum=2.0 * BATCH) == [Advertise()]
    assert isinstance(m.feed(0.0, Done()), Finished)
    assert m.statistics().loss == 2.0  # (the metrics' loss gauge: the step's mean)
    a = m.begin(1.0)
    a = m.feed(1.0, ViewSeen(view))
    assert isinstance(a, Compute) and a.index == 1
    # Our allreduce failed at its very end (after our row went out); b's completed, so b
    # committed step 2.
    m.row(np.zeros(4, dtype=np.float32), False)
    a = m.feed(2.0, Failed(Failure.VIEW, "aborted"))
    assert isinstance(a, WaitView)
    a = m.feed(2.0, ViewSeen(view))
    assert a == Sync(view)
    ours = m.sync_vector(view, 100, DIGEST)
    theirs = StepMachine(m.config, "b", lambda _: BATCH)
    theirs.committed, theirs.layout = 2, m.layout
    reduced = np.maximum(ours, theirs.sync_vector(view, 120, "cd" * 32))
    a = m.feed(2.0, Reduced(reduced))
    assert isinstance(a, Fetch) and a.plan.target_step == 2 and a.plan.holders == (1,)
    assert m.feed(2.1, Fetched(120)) == Barrier(view)
    done = m.feed(2.2, Done())
    assert isinstance(done, Finished) and done.report is not None
    assert done.report.adopted and done.report.step == 2 and done.report.sync_bytes == 120
    assert m.committed == 2
    assert np.isnan(m.statistics().loss)  # an adopted step's loss is not known here


def test_the_deadline_ends_a_step_that_keeps_failing() -> None:
    m = _machine(step_timeout=10.0)
    view = _view("a", "b")
    a = _alone_until_compute(m, view)
    now = 0.0
    for _ in range(3):
        now += 4.0
        a = m.feed(now, Failed(Failure.INPUT_MISMATCH, "another collective"))
        if isinstance(a, Raise):
            break
        while not isinstance(a, Compute | Raise):
            if isinstance(a, Sync):
                a = m.feed(now, _synced(m, view))
            else:
                a = m.feed(now, ViewSeen(view))
    assert isinstance(a, Raise) and isinstance(a.error, DeadlineExceeded)
    assert "did not commit within 10.0s" in str(a.error) and "another collective" in str(a.error)


def test_without_quorum_an_isolated_member_waits() -> None:
    m = _machine(quorum="majority", quorum_grace=5.0)
    three = _view("a", "b", "c")
    a = _alone_until_compute(m, three)
    walk_round(m)
    m.feed(0.0, Done())
    alone = _view("a")
    a = m.begin(1.0)
    a = m.feed(1.0, ViewSeen(alone))
    assert a == ReadMembers()
    suspects = (
        MemberInfo("b", MemberState.SUSPECT, "train"),
        MemberInfo("c", MemberState.DEAD, "train"),
    )
    a = m.feed(1.0, Members(suspects))
    assert a == WaitViewChange(alone.epoch, 1.0)  # 1 of 3 (c dead for less than the grace)
    a = m.feed(2.0, ViewSeen(alone))
    a = m.feed(2.0, ViewSeen(alone))
    dead = (MemberInfo("b", MemberState.DEAD, "train"), MemberInfo("c", MemberState.DEAD, "train"))
    a = m.feed(2.0, Members(dead))
    assert isinstance(a, WaitViewChange)  # both dead, but not for 5 s yet
    a = m.feed(7.5, ViewSeen(alone))
    a = m.feed(7.5, ViewSeen(alone))
    # Past the grace: the mesh shrinks to us, without a sync (b and c cannot have committed
    # a step without our row, nor can any member of the view lack one we committed).
    assert m.feed(7.5, Members(dead)) == WorldChanged(3, 1)
    assert isinstance(m.feed(7.5, Done()), Compute)


def _members(*infos: tuple[str, str, bool]) -> Members:
    return Members(
        tuple(MemberInfo(n, MemberState.ALIVE, role, started) for n, role, started in infos)
    )


def test_a_joiner_into_a_training_mesh_waits_for_no_settle() -> None:
    """A member that finds a training mesh (a ``train`` member that advertises a committed
    state) enters at once and takes the first view that holds it: no wait for quiet
    membership (``join_settle``), no settled view (issue #30)."""
    m = _machine("j", join_settle=2.0, min_peers=1)
    assert m.begin(0.0) == ReadMembers()
    a = m.feed(0.0, _members(("j", "joining", False), ("a", "train", True)))
    assert a == PrepareJoin()
    assert m.feed(0.0, Done()) == SetRole("train")
    a = m.feed(0.0, Done())
    assert a == WaitView(1, 0.0, 300.0)
    assert m.feed(0.01, ViewSeen(_view("a", "j"))) == Sync(_view("a", "j"))


def test_a_cold_start_settles_first() -> None:
    """No training mesh yet: members started together must find each other before step 1,
    or each would commit steps of a lonely mesh of its own (thrown away when the meshes
    merge): wait for quiet membership, then for a view unchanged for ``join_settle / 4``
    (so the first sync runs on all that entered together). A member that only starts (role
    ``starting``), or trains without a committed state yet, is not a training mesh."""
    for seen in (
        _members(("a", "joining", False)),
        _members(("a", "joining", False), ("b", "starting", False), ("c", "train", False)),
        Members((MemberInfo("c", MemberState.SUSPECT, "train", True),)),
    ):
        m = _machine("a", join_settle=2.0)
        assert m.begin(0.0) == ReadMembers()
        assert m.feed(0.0, seen) == Settle(2.0, 300.0)
        assert m.feed(2.0, Done()) == ReadMembers()
        assert m.feed(2.0, seen) == PrepareJoin()
        assert m.feed(2.0, Done()) == SetRole("train")
        assert m.feed(2.0, Done()) == WaitView(1, 0.5, 298.0)


def test_a_cold_start_waits_for_the_members_still_at_the_start_gate() -> None:
    """The first view of a cold start waits (at most ``GATHER_SETTLES * join_settle``) until
    it holds the members still seen at the start gate (role ``starting``): under CPU
    starvation their role ``train`` can take longer than the view's settle to spread, and
    step 1 ran without them (seen in a parallel suite run at load 15)."""
    ab, abc = _view("a", "b"), _view("a", "b", "c")
    m = _machine("a", join_settle=2.0)
    assert m.begin(0.0) == ReadMembers()
    assert m.feed(0.0, _members(("a", "joining", False))) == Settle(2.0, 300.0)
    assert m.feed(2.0, Done()) == ReadMembers()
    assert m.feed(2.0, _members(("a", "joining", False))) == PrepareJoin()
    assert m.feed(2.0, Done()) == SetRole("train")
    assert m.feed(2.0, Done()) == WaitView(1, 0.5, 298.0)
    assert m.feed(2.5, ViewSeen(ab)) == ReadMembers()
    gate = _members(("a", "train", False), ("b", "train", False), ("c", "starting", False))
    assert m.feed(2.5, gate) == WaitViewChange(ab.epoch, GATHER_SETTLES * 2.0)
    assert m.feed(3.0, ViewSeen(abc)) == ReadMembers()
    all_in = _members(("a", "train", False), ("b", "train", False), ("c", "train", False))
    assert m.feed(3.0, all_in) == Sync(abc)
    # Bounded: a member that stays at the gate is waited for only so long.
    m = _machine("a", join_settle=2.0)
    m.begin(0.0)
    m.feed(0.0, _members(("a", "joining", False)))
    m.feed(2.0, Done())
    m.feed(2.0, _members(("a", "joining", False)))
    m.feed(2.0, Done())
    m.feed(2.0, Done())
    assert m.feed(2.5, ViewSeen(ab)) == ReadMembers()
    assert isinstance(m.feed(2.5, gate), WaitViewChange)
    assert m.feed(6.5, ViewSeen(ab)) == Sync(ab)


def test_a_training_mesh_found_while_settling_ends_the_settle() -> None:
    """The driver ends ``Settle`` early when a training mesh shows up; the member then
    takes the first view that holds it, as any joiner."""
    m = _machine("j", join_settle=2.0)
    assert m.begin(0.0) == ReadMembers()
    assert m.feed(0.0, _members(("j", "joining", False))) == Settle(2.0, 300.0)
    assert m.feed(0.2, Done()) == ReadMembers()
    assert m.feed(0.2, _members(("a", "train", True))) == PrepareJoin()
    assert m.feed(0.2, Done()) == SetRole("train")
    assert m.feed(0.2, Done()) == WaitView(1, 0.0, pytest.approx(299.8))


def test_a_fresh_mesh_passes_the_start_gate_before_it_enters() -> None:
    """``start_peers`` > 1 (or ``join_running``): the driver waits at the start gate
    (``ftmesh.torch.starting``) before the member enters the ring; with 1, no gate at all."""
    cfg = TrainerConfig.of(join_settle=0.0)
    m = StepMachine(cfg, "a", lambda _: BATCH, start=StartConfig(3, 5.0))
    assert isinstance(m.begin(0.0), Settle)
    assert m.feed(0.0, Done()) == WaitToStart(300.0)
    assert m.feed(2.0, Done()) == PrepareJoin()
    joiner = StartConfig(1, 5.0, join_running=True)
    m = StepMachine(cfg, "j", lambda _: BATCH, start=joiner)
    m.begin(0.0)
    assert isinstance(m.feed(0.0, Done()), WaitToStart)
    m = StepMachine(cfg, "b", lambda _: BATCH, start=StartConfig(1))
    m.begin(0.0)
    assert m.feed(0.0, Done()) == PrepareJoin()


def test_a_member_asked_to_leave_at_the_start_gate_departs_at_once() -> None:
    cfg = TrainerConfig.of(join_settle=0.0)
    m = StepMachine(cfg, "a", lambda _: BATCH, start=StartConfig(3, 5.0))
    m.begin(0.0)
    assert isinstance(m.feed(0.0, Done()), WaitToStart)
    m.request_leave()  # the gate returned early because of it
    assert m.feed(1.0, Done()) == Depart(0, None)
    assert m.pending is None
    # Outside the ring, asked before the step: leaves before entering it.
    m = _machine()
    m.request_leave()
    assert m.begin(0.0) == Depart(0, None)


def _leave_header(view: RingView, *leavers: str) -> list[float]:
    slots = sum((leave_slots(view.rank_of(n)) for n in leavers), np.zeros(LEAVE_SLOTS))
    return [BATCH, 0.0, round_tag(0) * view.size, *slots.tolist()]


def test_a_leaver_announces_sees_off_and_departs() -> None:
    m = _machine("b")
    view = _view("a", "b", "c")
    a = _alone_until_compute(m, view)
    m.request_leave()
    header = _leave_header(view, "b")
    assert m.check_reduction(a, header, None, announced=True) is None
    # our bit missing, or set when we did not announce: data of another round
    bad = m.check_reduction(a, _leave_header(view), None, announced=True)
    assert isinstance(bad, Failed) and bad.kind is Failure.DESYNC
    assert isinstance(m.check_reduction(a, header, None), Failed)
    assert m.leaving(a, header) == ("b",)
    assert walk_round(m, loss_sum=0.0) == [Advertise()]  # (our leave bit: we announce)
    assert m.feed(0.0, Done()) == Barrier(view)
    out = m.feed(0.0, Done())
    assert isinstance(out, Depart) and out.step == 1
    assert out.report is not None and out.report.leaving == ("b",) and out.report.step == 1


def test_the_header_goes_through_the_machine() -> None:
    """A ``Compute``'s header as the trainer drives it: ``Measured`` -> ``Reduce`` (the slots
    to fill in: our leave bit) -> ``Contributed`` -> ``Gather`` (our row) -> ``Gathered`` ->
    ``Apply`` (the verdict, who leaves) -> ``Computed``."""
    m = _machine("b")
    view = _view("a", "b", "c")
    a = _alone_until_compute(m, view)
    m.request_leave()
    fill = m.feed(0.0, Measured(3, 0.01))
    assert isinstance(fill, Reduce) and fill.announce and len(fill.slots) == 0
    shares = [3, 3, 2]
    rows = np.zeros((3, 3 + LEAVE_SLOTS + 1))
    for r, share in enumerate(shares):
        rows[r, :3] = share, 0.0, round_tag(0)
    rows[1, 3 : 3 + LEAVE_SLOTS] = leave_slots(1)
    mine = rows[1, :-1].astype(np.float32)
    assert not m.held.row_out
    gather = m.feed(0.0, Contributed(mine, False))
    assert isinstance(gather, Gather) and gather.view == view and m.held.row_out
    assert gather.row.tolist() == rows[1].tolist()
    header = tuple(rows[:, :-1].sum(axis=0).tolist())
    assert header == tuple(_leave_header(view, "b"))
    apply = m.feed(0.0, Gathered(header, rows, True))
    assert isinstance(apply, Apply)
    assert apply.verdict == StepVerdict() and apply.leaving == ("b",)
    assert apply.verdict == m.check_step(a, header, rows, None, True)
    assert m.feed(0.0, Computed(3, 0.0, ("b",))) == Advertise()
    assert m.feed(0.0, Done()) == Barrier(view)
    out = m.feed(0.0, Done())
    assert isinstance(out, Depart) and out.report is not None and out.report.leaving == ("b",)


def test_a_leave_asked_after_the_header_went_out_rides_in_the_row() -> None:
    """Asked to leave during the gradient allreduce (our leave bit had gone out without it):
    our row says ``FLAG_LEAVING``, every member reads it from the gathered rows, and we leave
    after this step instead of computing one more to announce."""
    m = _machine("b")
    view = _view("a", "b", "c")
    _alone_until_compute(m, view)
    fill = m.feed(0.0, Measured(3, 0.01))
    assert isinstance(fill, Reduce) and not fill.announce
    m.request_leave()  # (the driver feeds it before ``Contributed``)
    rows = np.zeros((3, 3 + LEAVE_SLOTS + 1))
    for r, share in enumerate([3, 3, 2]):
        rows[r, :3] = share, 0.0, round_tag(0)
    gather = m.feed(0.0, Contributed(rows[1, :-1].astype(np.float32), False))
    assert isinstance(gather, Gather) and gather.row[-1] == FLAG_LEAVING
    rows[1, -1] = FLAG_LEAVING
    header = tuple(rows[:, :-1].sum(axis=0).tolist())
    apply = m.feed(0.0, Gathered(header, rows, True))
    assert isinstance(apply, Apply) and apply.verdict.failed is None
    assert apply.leaving == ("b",) and not apply.verdict.skip
    assert m.feed(0.0, Computed(3, 0.0, ("b",))) == Advertise()
    assert m.feed(0.0, Done()) == Barrier(view)
    out = m.feed(0.0, Done())
    assert isinstance(out, Depart) and out.report is not None and out.report.leaving == ("b",)
    # Another member reads the same rows: b leaves, and both flags at once are one row's.
    other = _machine("a")
    a = _alone_until_compute(other, view)
    rows[1, -1] = FLAG_LEAVING + FLAG_NONFINITE
    verdict = other.check_step(a, header, rows, None)
    assert verdict.failed is None and verdict.skip and verdict.nonfinite == ("b",)
    assert other.leaving(a, header, rows) == ("b",) and other.leaving(a, header) == ()


def test_a_header_round_that_fails_or_a_row_that_lies_costs_an_attempt() -> None:
    """A failure at any point of the header's round fails the attempt; a member's row that
    is out of its range is a header fault, named in the verdict."""
    view = _view("a", "b")
    for where in ("reduce", "gather", "verdict"):
        m = _machine()
        _alone_until_compute(m, view)
        assert isinstance(m.feed(0.0, Measured(4, 0.01)), Reduce)
        if where != "reduce":
            assert isinstance(m.feed(0.0, Contributed(np.zeros(3 + LEAVE_SLOTS), False)), Gather)
        if where == "verdict":
            rows = np.zeros((2, 3 + LEAVE_SLOTS + 1))
            rows[:, :3] = (4, 0.0, round_tag(0))
            rows[1, 0] = 1e30
            header = tuple(rows[:, :-1].sum(axis=0).tolist())
            apply = m.feed(0.0, Gathered(header, rows, True))
            assert isinstance(apply, Apply) and apply.verdict.failed is not None
            assert apply.verdict.failed.kind is Failure.HEADER
            assert [o.rank for o in apply.verdict.offences] == [1]
            failed = apply.verdict.failed
        else:
            failed = Failed(Failure.VIEW, "the ring moved on")
        a = m.feed(0.1, failed)
        assert not isinstance(a, Compute | Finished) and m.committed == 0
        assert m.synced_epoch == ""


def _commit_the_step_c_leaves_after(m: StepMachine, barrier: Outcome) -> RingView:
    """Walk ``m`` (member "a" of a, b, c) through a step in which "c" announced its leave, up
    to the end of that run (``barrier``: the outcome of the step's barrier)."""
    view = _view("a", "b", "c")
    a = _alone_until_compute(m, view)
    assert m.check_reduction(a, _leave_header(view, "c"), None) is None
    assert walk_round(m, leavers=("c",), loss_sum=0.0) == [Advertise()]
    assert m.feed(0.0, Done()) == Barrier(view)
    done = m.feed(0.0, barrier)
    assert isinstance(done, Finished) and done.report is not None
    assert done.report.leaving == ("c",)
    return view


def test_the_others_take_the_view_without_the_leaver_without_a_sync() -> None:
    m = _machine("a")
    view = _commit_the_step_c_leaves_after(m, Failed(Failure.PEER_LOST, "c went"))
    # The next run, not this one, waits for the view without the leaver: the loop's work
    # between the two steps overlaps the leave. (The barrier's failure does not matter.)
    assert m.begin(0.5) == ReadView()
    assert m.feed(0.5, ViewSeen(view)) == WaitViewChange(view.epoch, 2.0)
    rest = _view("a", "b")
    assert m.feed(0.6, ViewSeen(rest)) == WorldChanged(3, 2)
    a = m.feed(0.6, Done())
    assert isinstance(a, WaitView)
    assert isinstance(m.feed(1.0, ViewSeen(rest)), Compute)  # no Sync: same state everywhere


def test_a_view_without_the_leaver_seen_by_the_next_run_is_taken_at_once() -> None:
    m = _machine("a")
    _commit_the_step_c_leaves_after(m, Done())
    rest = _view("a", "b")
    assert m.begin(0.5) == ReadView()
    assert m.feed(0.5, ViewSeen(rest)) == WorldChanged(3, 2)  # no wait: it is there already
    assert isinstance(m.feed(0.5, Done()), WaitView)
    assert isinstance(m.feed(0.5, ViewSeen(rest)), Compute)  # no Sync
    assert m.syncer.departed is None  # once only: the run after next goes to its view


def test_a_failed_announcing_attempt_departs_at_once() -> None:
    m = _machine("b")
    a = _alone_until_compute(m, _view("a", "b"))
    m.request_leave()
    assert a.attempt == 1
    out = m.feed(1.0, Failed(Failure.VIEW, "the ring moved on"))
    assert out == Depart(0, None)


def test_members_the_ring_leaves_out_do_not_count_for_the_quorum() -> None:
    m = _machine("a", quorum="majority")
    m.last_view = ("a", "b", "c")
    a = m.begin(0.0)
    while not isinstance(a, WaitView):
        a = m.feed(0.0, Done())
    alone = _view("a")
    assert m.feed(0.0, ViewSeen(alone)) == ReadMembers()
    out = (
        MemberInfo("b", MemberState.ALIVE, "train", excluded=True),
        MemberInfo("c", MemberState.ALIVE, "train", excluded=True),
    )
    assert m.feed(0.0, Members(out)) == Sync(alone)  # at once, no grace


def test_a_cold_spare_waits_for_a_slot_then_ends_with_the_training() -> None:
    m = _machine("s", max_peers=2, spares="cold")
    m.begin(0.0)
    assert m.feed(0.0, Done()) == SetRole("spare")
    assert m.feed(0.0, Done()) == ReadMembers()
    two = tuple(MemberInfo(n, MemberState.ALIVE, "train") for n in "ab")
    spare = MemberInfo("s", MemberState.ALIVE, "spare")
    assert m.feed(0.0, Members((*two, spare))) == WaitViewChange(None, 1.0)
    m.feed(1.0, ViewSeen(None))
    one = (MemberInfo("a", MemberState.ALIVE, "train"), MemberInfo("b", MemberState.DEAD, "train"))
    assert m.feed(1.0, Members((*one, spare))) == PrepareJoin()  # b died: a slot for us
    # Another spare, once the training has ended, gets TrainingFinishedError.
    m2 = _machine("t", max_peers=2, spares="cold")
    m2.begin(0.0)
    m2.feed(0.0, Done())
    m2.feed(0.0, Done())
    done = (MemberInfo("a", MemberState.LEFT, "train"), MemberInfo("b", MemberState.ALIVE, "done"))
    a = m2.feed(5.0, Members(done))
    assert isinstance(a, Raise) and isinstance(a.error, TrainingFinishedError)


def test_a_member_with_other_settings_steps_out_and_raises() -> None:
    m = _machine("a", check_every=10)
    view = _view("a", "b")
    a = m.begin(0.0)
    while not isinstance(a, Sync):
        a = m.feed(0.0, ViewSeen(view) if isinstance(a, WaitView) else Done())
    ours = m.sync_vector(view, 100, DIGEST)
    other = _machine("b", check_every=20)
    reduced = np.maximum(ours, other.sync_vector(view, 100, DIGEST))
    assert m.feed(0.0, Reduced(reduced)) == SetRole("joining")  # out of the ring first
    a = m.feed(0.0, Done())
    assert isinstance(a, Raise) and isinstance(a.error, ConfigError)
    assert "check_every: 10 on a; 20 on b" in str(a.error)
    assert not m.in_ring


def test_members_with_another_compression_raise_a_config_error() -> None:
    m = _machine("a", compression="int8")
    view = _view("a", "b")
    a = m.begin(0.0)
    while not isinstance(a, Sync):
        a = m.feed(0.0, ViewSeen(view) if isinstance(a, WaitView) else Done())
    ours = m.sync_vector(view, 100, DIGEST)
    other = _machine("b")
    reduced = np.maximum(ours, other.sync_vector(view, 100, DIGEST))
    assert m.feed(0.0, Reduced(reduced)) == SetRole("joining")
    a = m.feed(0.0, Done())
    assert isinstance(a, Raise) and isinstance(a.error, ConfigError)
    assert "compression: int8 on a; none on b" in str(a.error)


def test_members_with_another_recovery_policy_raise_a_config_error() -> None:
    """``recovery`` is mesh-wide: a member that redoes a step others send kept gradients for
    would make the step's sample count disagree (or, by chance, agree) on every loss."""
    m = _machine("a", recovery="keep")
    view = _view("a", "b")
    a = m.begin(0.0)
    while not isinstance(a, Sync):
        a = m.feed(0.0, ViewSeen(view) if isinstance(a, WaitView) else Done())
    ours = m.sync_vector(view, 100, DIGEST)
    reduced = np.maximum(ours, _machine("b").sync_vector(view, 100, DIGEST))
    assert m.feed(0.0, Reduced(reduced)) == SetRole("joining")
    a = m.feed(0.0, Done())
    assert isinstance(a, Raise) and isinstance(a.error, ConfigError)
    assert "recovery: keep on a; redo on b" in str(a.error)


def test_data_of_another_round_reconnects_the_ring() -> None:
    m = _machine()
    view = _view("a", "b")
    a = m.begin(0.0)
    while not isinstance(a, Sync):
        a = m.feed(0.0, ViewSeen(view) if isinstance(a, WaitView) else Done())
    vec = m.sync_vector(view, 100, DIGEST)
    vec[0] = 7  # our committed-step slot came back changed
    assert m.feed(0.0, Reduced(vec)) == DropRing(view)
    assert isinstance(m.feed(0.0, Done()), WaitView)


def test_check_reduction() -> None:
    m = _machine()
    a = _alone_until_compute(m, _view("a", "b"))
    tag = round_tag(0) * 2
    no = [0.0] * LEAVE_SLOTS  # nobody leaves
    assert m.check_reduction(a, [BATCH, 0.0, tag, *no, 6.0, 8.0], [3, 4]) is None
    bad_tag = m.check_reduction(a, [BATCH, 0.0, tag + 1, *no, 6.0, 8.0], [3, 4])
    assert isinstance(bad_tag, Failed) and bad_tag.kind is Failure.DESYNC
    bad_samples = m.check_reduction(a, [BATCH - 1, 0.0, tag, *no, 6.0, 8.0], [3, 4])
    assert isinstance(bad_samples, Failed) and "7 samples reduced" in bad_samples.detail
    assert m.check_reduction(a, [BATCH, 0.0, tag, *no, 6.0, 9.0], [3, 4]) == (1,)
    bad_leave = m.check_reduction(a, [BATCH, 0.0, tag, 0.5, *no[1:], 6.0, 8.0], [3, 4])
    assert isinstance(bad_leave, Failed) and "leave slots" in bad_leave.detail


# -- a world of machines ---------------------------------------------------------------------


def _digest(model: list[int]) -> str:
    return hashlib.blake2b(repr(model).encode(), digest_size=32).hexdigest()


@dataclass
class SimMember:
    name: str
    machine: StepMachine
    model: list[int] = field(default_factory=list)
    """The steps applied, in order: the whole "state"."""
    role: str = "joining"
    alive: bool = True
    action: Action | None = None
    waiting_since: float = 0.0
    reports: list[Any] = field(default_factory=list)
    finished: bool = False
    """Ran the final sync (``ElasticTrainer.finish``) and left the ring."""


class World:
    """Members in lockstep on a fake mesh. Each tick resolves every pending action that can
    complete; a collective completes when every member of its view waits in the same kind of
    collective on that view (else it fails for all of them); ``partial`` is the chance that a
    completed gradient allreduce fails for a random subset of its members."""

    def __init__(self, seed: int, total: int, partial: float, recovery: str = "redo") -> None:
        self.rng = random.Random(seed)
        self.total = total
        self.partial = partial
        self.recovery = recovery
        """``keep``: a loss fails a step after the members' micro-batches ended (``Measured``),
        as in the trainer, so that they keep their gradients; the headers are judged as
        they come (a kept attempt's count can disagree)."""
        self.mismatch = Failure.INPUT_MISMATCH if seed % 2 else Failure.VIEW
        """How members whose collectives differ learn of it: the collective layer says
        ``INPUT_MISMATCH``; other paths (a GPU process group's set-up) may say anything."""
        self.now = 0.0
        self.members: dict[str, SimMember] = {}
        self.history: list[str] = []

    def add(self, name: str) -> None:
        cfg = TrainerConfig.of(
            join_settle=0.0,
            quorum="any",
            step_timeout=1e9,
            check_every=3,
            straggler_factor=0,
            recovery=self.recovery,
        )
        m = StepMachine(cfg, name, lambda _: BATCH)
        m.registered(1, (0, 0, 0))  # (one part: its check value is the model's length)
        self.members[name] = SimMember(name, m)

    def view(self) -> RingView | None:
        names = sorted(n for n, m in self.members.items() if m.alive and m.role == "train")
        return _view(*names) if names else None

    def kill(self, name: str) -> None:
        self.members[name].alive = False
        self.history.append(f"{self.now:.1f} kill {name}")

    def live(self) -> list[SimMember]:
        return [m for m in self.members.values() if m.alive]

    def _answer(self, m: SimMember, outcome: Outcome) -> None:
        action = m.machine.feed(self.now, outcome)
        self._took(m, action)

    def _took(self, m: SimMember, action: Action) -> None:
        m.action, m.waiting_since = action, self.now
        if isinstance(action, Finished):
            if m.role == "done":
                m.finished = True
            if action.report is not None:
                r = action.report
                m.reports.append(r)
                assert r.step == m.machine.committed
            assert m.model == list(range(m.machine.committed)), (m.name, m.model)
            m.action = None
        elif isinstance(action, Raise):
            raise AssertionError(f"{m.name}: {action.error!r}")

    def tick(self) -> None:
        self.now += 0.05
        for m in self.live():
            if m.action is None and m.machine.committed < self.total:
                self._took(m, m.machine.begin(self.now))
            elif m.action is None and not m.finished:
                self._took(m, m.machine.begin(self.now, "finish", timeout=1e9))
        collectives: dict[str, list[SimMember]] = {}
        view = self.view()
        for m in self.live():
            a = m.action
            if isinstance(a, Sync | Barrier | Compute):
                collectives.setdefault(a.view.epoch, []).append(m)
            elif isinstance(a, Settle | SetRole | PrepareJoin | Sleep | Advertise | DropRing):
                if isinstance(a, SetRole):
                    m.role = a.role
                self._answer(m, Done())
            elif isinstance(a, Checkpoint | WorldChanged):
                self._answer(m, Done())
            elif isinstance(a, ReadMembers):
                infos = tuple(
                    MemberInfo(o.name, MemberState.ALIVE if o.alive else MemberState.DEAD, o.role)
                    for o in self.members.values()
                )
                self._answer(m, Members(infos))
            elif isinstance(a, ReadView):
                self._answer(m, ViewSeen(view))
            elif isinstance(a, WaitView):
                if view is not None and m.name in view and view.size >= a.min_members:
                    self._answer(m, ViewSeen(view))
            elif isinstance(a, WaitViewChange):
                if (
                    view.epoch if view else ""
                ) != a.epoch or self.now - m.waiting_since >= a.timeout:
                    self._answer(m, ViewSeen(view))
            elif isinstance(a, Fetch):
                holder = self.members[a.view.members[a.plan.holders[0]].node_id]
                if not holder.alive:
                    self._answer(m, Failed(Failure.PEER_LOST, "holder died"))
                else:
                    assert _digest(holder.model) == a.plan.digest
                    m.model = list(holder.model)
                    self._answer(m, Fetched(len(m.model)))
        for epoch, waiting in collectives.items():
            self._collective(epoch, waiting)

    def _collective(self, epoch: str, waiting: list[SimMember]) -> None:
        first = waiting[0].action
        assert isinstance(first, Sync | Barrier | Compute)
        ring = first.view
        dead = [n for n in ring.node_ids if not self.members[n].alive]
        if dead:
            for m in waiting:
                a = m.action
                if self.recovery == "keep" and isinstance(a, Compute):
                    share = _shares(m.machine, a).get(m.name, 0)
                    check = (len(m.model) + 1,) if a.check else None
                    assert isinstance(
                        m.machine.feed(self.now, Measured(share, 0.01, check)), Reduce
                    )
                self._answer(m, Failed(Failure.PEER_LOST, f"{dead[0]} died", peer=dead[0]))
            return
        current = self.view()
        if current is None or current.epoch != epoch:  # a member left the ring or joined
            for m in waiting:
                self._answer(m, Failed(Failure.VIEW, "view superseded"))
            return
        if len(waiting) < ring.size:
            return  # the others are not there yet
        kinds = {(type(m.action), getattr(m.action, "index", None)) for m in waiting}
        steps = {m.action.index for m in waiting if isinstance(m.action, Compute)}
        # Members computing different steps on one view would each find the other's round
        # tag wrong in the gathered rows: a header fault, an accusation of an honest member.
        assert len(steps) <= 1, f"{epoch}: steps {steps} computed together: {self.history}"
        if len(kinds) > 1:
            for m in waiting:
                self._answer(m, Failed(self.mismatch, "different collectives"))
            return
        waiting.sort(key=lambda m: m.name)
        if isinstance(first, Sync):
            vecs = [m.machine.sync_vector(ring, len(m.model), _digest(m.model)) for m in waiting]
            reduced = np.maximum.reduce(vecs)
            for m in waiting:
                self._answer(m, Reduced(reduced.copy()))
        elif isinstance(first, Barrier):
            for m in waiting:
                self._answer(m, Done())
        else:
            self._compute(first, waiting)

    def _compute(self, first: Compute, waiting: list[SimMember]) -> None:
        checks = [(len(m.model) + 1,) if first.check else None for m in waiting]
        failing: set[str] = set()
        if self.rng.random() < self.partial:
            failing = {m.name for m in waiting if self.rng.random() < 0.5}
        for m in waiting:
            action = m.action
            assert isinstance(action, Compute)
            assert action.index == len(m.model) == m.machine.committed  # never twice, none skipped
        # (the header round as the trainer walks it; the failing ones' allgather fails after
        # their rows went out)
        machines = [m.machine for m in waiting]
        strict = self.recovery == "redo"
        nexts = walk_round(*machines, now=self.now, checks=checks, fail=failing, strict=strict)
        for m, action in zip(waiting, nexts, strict=True):
            if m.machine.committed > first.index:  # (it applied the step)
                m.model.append(first.index)
            self._took(m, action)


def _seeds() -> list[int]:
    extra = int(os.environ.get("FTMESH_SEEDS", "0"))
    return list(range(6 + extra))


@pytest.mark.parametrize("recovery", ["redo", "keep"])
@pytest.mark.parametrize("seed", _seeds())
def test_a_world_of_machines_commits_every_step_once(seed: int, recovery: str) -> None:
    _world_run(seed, recovery)


def test_a_world_under_keep_skips_samples_where_members_were_lost() -> None:
    """The kept attempts happen: in the default seeds, some steps commit without a lost
    member's share (seeds 0, 3 and 5 at the time of writing)."""
    assert any(_world_run(seed, "keep") for seed in range(6))


def _world_run(seed: int, recovery: str) -> set[int]:
    """Under either recovery policy; with ``keep``, the surviving members that computed a
    step agree on what it skipped, and a step skips only where a member was lost during it
    (at most one step per kill)."""
    print(f"seed {seed}")
    total = 40
    world = World(seed, total, partial=0.15, recovery=recovery)
    names = ["m0", "m1", "m2", "m3"]
    for n in names:
        world.add(n)
    joins = 0
    for _ in range(20_000):
        world.tick()
        live = world.live()
        if all(m.machine.committed >= total and m.action is None for m in live):
            break
        r = world.rng.random()
        committed = max(m.machine.committed for m in world.members.values())
        if r < 0.02 and len(live) > 1 and committed < total - 5:
            world.kill(world.rng.choice(live).name)
        elif r < 0.04 and joins < 4 and committed < total - 5:
            joins += 1
            world.add(f"j{joins}")
    else:
        states = {m.name: (m.machine.committed, m.action) for m in world.live()}
        raise AssertionError(f"seed {seed}: the world did not finish: {states} {world.history}")
    live = world.live()
    assert live
    for m in live:
        assert m.model == list(range(total)), m.name
        steps = [r.step for r in m.reports]
        assert steps == sorted(set(steps)), f"{m.name} reported a step twice"
    assert max(m.machine.committed for m in world.members.values()) == total
    assert FRESH not in {m.machine.committed for m in live}
    joiners = [m for m in world.members.values() if m.name.startswith("j") and m.reports]
    assert all(m.reports[0].adopted or m.reports[0].step == 1 for m in joiners)
    skipped: dict[int, set[int]] = {}
    for m in live:  # (a member that died may have committed a step the survivors redid)
        for r in m.reports:
            if not r.adopted:
                skipped.setdefault(r.step, set()).add(r.skipped)
    assert all(len(v) == 1 for v in skipped.values()), skipped
    lossy = {s for s, v in skipped.items() if v != {0}}
    if recovery == "redo":
        assert not lossy
    else:
        assert all(0 < n < BATCH for s in lossy for n in skipped[s])
        assert len(lossy) <= sum("kill" in h for h in world.history), world.history
    print(f"steps that skipped samples: {sorted(lossy)}")
    return lossy
