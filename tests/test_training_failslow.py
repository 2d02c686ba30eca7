"""Fail-slow members (#15 item 4): ``ftmesh.torch.freezes.FreezeWatch`` notices a process that was
stopped and continued (a real SIGSTOP/SIGCONT of a real process), and the step machine makes
a member that froze in ``failslow_freezes`` of its last ``straggler_steps`` steps ask, in
its next step's row, to step out of the ring; when that step commits it steps out as a spare
for ``failslow_pause``, then joins again (and syncs); the others' quorum does not wait for a
member that stepped out. Agreed through the rows: a freeze that half of the others share
(the whole host stalled) does not count, and no request leaves fewer than two members
computing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from test_training_step import _alone_until_compute, _machine, _synced, _view, walk_round

from ftmesh.membership.messages import MemberState
from ftmesh.training.actions import (
    Advertise,
    Barrier,
    Compute,
    Done,
    Finished,
    MemberInfo,
    Members,
    PrepareJoin,
    ReadMembers,
    ReadView,
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

WATCHER = """
import json, sys, time
from ftmesh.torch.freezes import FreezeWatch
w = FreezeWatch(0.2).start()
print("ready", flush=True)
sys.stdin.readline()
time.sleep(0.1)
taken = [w.take(), w.take()]
print(json.dumps({"count": w.count, "seconds": w.total_seconds, "taken": taken}), flush=True)
"""


def test_the_watch_notices_a_stopped_process_and_nothing_else() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WATCHER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # running normally: no freeze
        for _ in range(2):
            proc.send_signal(signal.SIGSTOP)
            time.sleep(0.5)
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.2)
        proc.stdin.write("\n")
        proc.stdin.flush()
        got = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(timeout=10)
    print(got)
    assert got["count"] == 2
    assert 0.8 < got["seconds"] < 2.0 and got["taken"] == [got["seconds"], 0.0]


def _commit(m, view, frozen: float, now: float = 0.0, froze=()):  # type: ignore[no-untyped-def]
    a = _alone_until_compute(m, view, now)
    out = walk_round(m, now=now, frozen=frozen, froze=froze)[0]
    while isinstance(out, Advertise):
        out = m.feed(now, Done())
    assert isinstance(out, Finished), out
    return a


def test_a_member_that_keeps_freezing_steps_out_and_comes_back() -> None:
    m = _machine("b", failslow_freezes=2, straggler_steps=4, failslow_pause=3.0)
    view = _view("a", "b", "c")
    for frozen in (0.0, 0.4, 0.0, 0.0, 0.0, 0.3):  # two in a window of 4: not yet
        _commit(m, view, frozen)
    assert not m.pace.sit_out
    _commit(m, view, 0.5)  # the second freeze within the last 4 steps: it asks
    assert m.pace.wants_out and not m.pace.sit_out
    _commit(m, view, 0.0)  # the step whose row asked: it may go (two others compute)
    assert m.pace.sit_out and not m.pace.wants_out
    a = m.begin(10.0)
    assert a == SetRole("spare")
    slept = []
    now = 10.0
    while isinstance(a, SetRole | Sleep):
        if isinstance(a, Sleep):
            assert not m.in_ring
            slept.append(a.seconds)
            now += a.seconds
        a = m.feed(now, Done())
    assert sum(slept) >= 3.0 and all(s <= 1.0 for s in slept)
    # joins again like a member that was away (the same run goes on to its step), through
    # the gate as one that only joins a running mesh: if the others finished meanwhile, the
    # gate stops it (TrainingFinishedError) rather than letting it train the rest alone
    assert isinstance(a, Settle)
    a = m.feed(now, Done())
    assert a == WaitToStart(a.timeout, rejoin=True)
    a = m.feed(now, Done())
    while not isinstance(a, Compute):
        if isinstance(a, Sync):
            a = m.feed(now, _synced(m, a.view))
        elif isinstance(a, WaitView | ReadView | WaitViewChange):
            a = m.feed(now, ViewSeen(view))
        else:
            assert isinstance(a, Settle | SetRole | PrepareJoin | Sleep | Barrier), a
            a = m.feed(now, Done())
    assert m.in_ring and m.synced_epoch == view.epoch  # it synced on its way back
    assert m.statistics().failslow_pauses_total == 1  # (ftmesh_train_failslow_pauses_total)


def _pause_and_return(m, view, now: float) -> float:  # type: ignore[no-untyped-def]
    """Drive ``m`` (about to step out) through its pause and back to a Compute on ``view``;
    the seconds it stayed out."""
    a = m.begin(now)
    assert a == SetRole("spare")
    slept = 0.0
    while not isinstance(a, Compute):
        if isinstance(a, Sleep):
            slept += a.seconds
            now += a.seconds
        if isinstance(a, Sync):
            a = m.feed(now, _synced(m, a.view))
        elif isinstance(a, WaitView | ReadView | WaitViewChange):
            a = m.feed(now, ViewSeen(view))
        else:
            a = m.feed(now, Done())
    out = walk_round(m, now=now)[0]  # (that step, without a freeze)
    while isinstance(out, Advertise):
        out = m.feed(now, Done())
    assert isinstance(out, Finished), out
    return slept


def test_a_member_fail_slow_again_soon_after_it_came_back_stays_out_longer() -> None:
    m = _machine("b", failslow_freezes=2, straggler_steps=4, failslow_pause=3.0, readmit_steps=6)
    view = _view("a", "b", "c")
    pauses = []
    for clean in (0, 0, 0, 0, 6, 0):  # clean steps after coming back, before two freezes
        for _ in range(clean):
            _commit(m, view, 0.0)
        _commit(m, view, 0.4)
        _commit(m, view, 0.4)
        _commit(m, view, 0.0)  # (its row asks)
        pauses.append(_pause_and_return(m, view, 100.0 * len(pauses)))
    # soon again: 2x, 4x, 8x, and no more; after readmit_steps clean steps back to 1x
    assert pauses == [3.0, 6.0, 12.0, 24.0, 3.0, 6.0], pauses
    assert m.statistics().failslow_pauses_total == 6


def test_off_alone_or_in_a_pair_never_steps_out() -> None:
    """Stepping out of a pair would leave one member training alone (and on a host that
    stalls as a whole every member freezes alike: the ring would empty one by one)."""
    off = _machine("b", failslow_freezes=0)
    alone = _machine("b", failslow_freezes=1)
    pair = _machine("b", failslow_freezes=1)
    three = _machine("b", failslow_freezes=1)
    for _ in range(3):
        _commit(off, _view("a", "b", "c"), 1.0)
        _commit(alone, _view("b"), 1.0)
        _commit(pair, _view("a", "b"), 1.0)
    _commit(three, _view("a", "b", "c"), 1.0)
    _commit(three, _view("a", "b", "c"), 0.0)
    for m in (off, alone, pair):
        assert not m.pace.sit_out and not m.pace.wants_out
    assert three.pace.sit_out  # (the same freezes in a view of three)


def test_a_stall_of_the_whole_host_is_nobodys_fault() -> None:
    """When half of the others froze in the same step too (a loaded host starving every
    member at once), a freeze does not count: nobody steps out, however often it happens;
    one the others did not share counts as before."""
    view = _view("a", "b", "c", "d", "e")
    m = _machine("b", failslow_freezes=2, straggler_steps=10)
    for _ in range(6):
        _commit(m, view, 0.5, froze=("a", "c"))  # two of the four others froze too
    assert not m.pace.wants_out and not m.pace.sit_out
    _commit(m, view, 0.5, froze=("a",))  # one of four: ours
    _commit(m, view, 0.5)
    assert m.pace.wants_out


def test_a_request_that_would_leave_one_member_computing_is_refused() -> None:
    """Two of three ask to step out in the same step's rows: ``may_step_out`` lets the
    first by node id go (two keep computing), the other stays, on every member alike; with
    one asking in a view that lost a member meanwhile (two computing), nobody goes."""
    b = _machine("b", failslow_freezes=1)
    c = _machine("c", failslow_freezes=1)
    view = _view("a", "b", "c")
    for wants in (False, True):  # a clean step first, then one whose rows both ask in
        for m in (b, c):
            m.pace.wants_out = wants  # (as if both reached the count in the step before)
            _alone_until_compute(m, view)
        for m, out in zip((b, c), walk_round(b, c), strict=True):
            while isinstance(out, Advertise):
                out = m.feed(0.0, Done())
            assert isinstance(out, Finished), out
    assert b.pace.sit_out and not c.pace.sit_out and not c.pace.wants_out
    lone = _machine("c", failslow_freezes=1)
    lone.pace.wants_out = True
    _commit(lone, _view("a", "c"), 0.0)
    assert not lone.pace.sit_out and not lone.pace.wants_out


def test_the_quorum_does_not_wait_for_a_member_that_stepped_out() -> None:
    m = _machine("a", quorum="majority")
    _commit(m, _view("a", "b"), 0.0)  # last view: a, b
    a = m.begin(1.0)
    assert isinstance(a, WaitView)
    a = m.feed(1.0, ViewSeen(_view("a")))
    assert a == ReadMembers()  # b is missing: is it gone?
    spare = MemberInfo("b", MemberState.ALIVE, "spare", True, False)
    me = MemberInfo("a", MemberState.ALIVE, "train", True, False)
    # b chose to stay out: on at once (without a sync: nothing failed, a's state is the last
    # committed one, Held.needless in training/held.py)
    assert m.feed(1.0, Members((me, spare))) == WorldChanged(2, 1)
    # (b alive and still a trainer, only not in our view: that one waits for a quorum)
    m = _machine("a", quorum="majority")
    _commit(m, _view("a", "b"), 0.0)
    m.begin(1.0)
    m.feed(1.0, ViewSeen(_view("a")))
    trainer = MemberInfo("b", MemberState.ALIVE, "train", True, False)
    assert isinstance(m.feed(1.0, Members((me, trainer))), WaitViewChange)
