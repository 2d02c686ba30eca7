"""Stragglers (#15 item 4, ``ftmesh.training.stragglers``): the rule on agreed speeds (with
and without speed shares, the streak, the trial after ``readmit_steps``, never the last one
computing), the step machine's compute set (identical on every member, reset by a new view,
a hot spare takes the slot), and trainers on the fake mesh where one member computes 20x
slower for a while: it sits out as a hot spare, comes back after the slowdown, every sample
trains exactly once per epoch, and all members end bitwise equal."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_training_shares import _commit, run_with_a_slow_member
from test_training_step import DIGEST, _alone_until_compute, _machine, _view
from trainer_sim import trainer_of

from ftmesh.collective.view import RingView
from ftmesh.errors import ConfigError
from ftmesh.training.actions import (
    Action,
    Compute,
    Done,
    Fetch,
    Fetched,
    Finished,
    ReadView,
    Reduced,
    Sync,
    ViewSeen,
    WaitView,
    WaitViewChange,
)
from ftmesh.training.config import TrainerConfig
from ftmesh.training.protocol import SHARE_FLOOR
from ftmesh.training.step import StepMachine
from ftmesh.training.stragglers import StragglerRule, Stragglers

FAST = 400.0

# -- the rule ---------------------------------------------------------------------------------


def _rule(steps: int = 3, readmit: int = 5, factor: float = 1.5) -> StragglerRule:
    return StragglerRule(factor, steps, readmit)


def _observe(s: Stragglers, steps: range, speeds: dict[str, float]) -> list[str]:
    out = []
    for k in steps:
        workers = sorted(w for w in speeds if w not in s.out)
        out.append(s.observe(k, workers, [speeds[w] for w in workers], 64))
    return out


def test_equal_shares_evict_a_member_at_a_quarter_speed_after_the_streak() -> None:
    s = Stragglers(_rule(), proportional=False, floor=SHARE_FLOOR)
    # equal shares of 64 among 4: the slow one takes 16/100 = 0.16 s, without it 22/400
    got = _observe(s, range(5), {"a": FAST, "b": 100.0, "c": FAST, "d": FAST})
    assert got == ["", "", "b", "", ""] and set(s.out) == {"b"}


def test_speed_shares_keep_a_member_at_a_quarter_speed() -> None:
    s = Stragglers(_rule(), proportional=True, floor=SHARE_FLOOR)
    assert _observe(s, range(10), {"a": FAST, "b": 100.0, "c": FAST, "d": FAST}) == [""] * 10


def test_speed_shares_evict_a_member_too_slow_for_its_floor_share() -> None:
    # (at a 20th of the speed its floor share of 64, one sample, still takes less time
    # than 21 samples elsewhere; at a 100th, 10 ms against 55 ms without it)
    s = Stragglers(_rule(), proportional=True, floor=SHARE_FLOOR)
    got = _observe(s, range(4), {"a": FAST, "b": FAST / 20, "c": FAST, "d": FAST})
    assert got == [""] * 4
    got = _observe(s, range(4, 8), {"a": FAST, "b": FAST / 100, "c": FAST, "d": FAST})
    assert got == ["", "", "b", ""]


def test_noise_resets_the_streak() -> None:
    s = Stragglers(_rule(), proportional=False, floor=SHARE_FLOOR)
    slow = {"a": FAST, "b": 100.0, "c": FAST}
    even = {"a": FAST, "b": FAST, "c": FAST}
    assert _observe(s, range(2), slow) == ["", ""]
    assert _observe(s, range(2, 3), even) == [""]
    assert _observe(s, range(3, 5), slow) == ["", ""] and not s.out
    assert _observe(s, range(5, 6), slow) == ["b"]


def test_a_straggler_is_retried_and_sent_back_at_once_if_still_slow() -> None:
    """Back after ``readmit`` steps: a probe step at the share of its last speed, then one at
    the normal split; too slow in either, it goes back out at once, for twice as long."""
    s = Stragglers(_rule(steps=3, readmit=5), proportional=False, floor=SHARE_FLOOR)
    speeds = {"a": FAST, "b": 100.0, "c": FAST}
    assert _observe(s, range(3), speeds)[-1] == "b"  # out from step 3
    assert _observe(s, range(3, 7), speeds) == [""] * 4 and "b" in s.out
    assert _observe(s, range(7, 8), speeds) == [""] and not s.out  # back at step 8
    # the probe (a small share, judged as split) passes; the first equal step does not
    assert _observe(s, range(8, 9), speeds) == [""]
    assert _observe(s, range(9, 10), speeds) == ["b"] and s.sits_out("b") == 10
    assert _observe(s, range(10, 19), speeds) == [""] * 9 and "b" in s.out
    # fast again: the probe and the first equal step pass, and it stays
    assert _observe(s, range(19, 30), {**speeds, "b": FAST}) == [""] * 11 and not s.out
    assert s.sits_out("b") == 5  # (the backoff is forgotten after a trial that passed)


def test_failed_trials_back_off() -> None:
    s = Stragglers(_rule(steps=1, readmit=2), proportional=False, floor=SHARE_FLOOR)
    speeds = {"a": FAST, "b": 10.0}
    out = [k for k, m in enumerate(_observe(s, range(60), speeds)) if m]
    # out for 2, 4, 8, 16, 16 steps (at most 8 x readmit), each time sent back by its probe
    assert [b - a - 1 for a, b in itertools.pairwise(out)] == [2, 4, 8, 16, 16], out


def test_never_the_last_one_computing_and_off_means_off() -> None:
    s = Stragglers(_rule(steps=1), proportional=False, floor=SHARE_FLOOR)
    assert _observe(s, range(3), {"a": FAST, "b": 10.0}) == ["b", "", ""]
    assert s.observe(3, ["a"], [1.0], 64) == ""  # alone: nobody to give its share to
    off = Stragglers(StragglerRule(0, 1, 1), proportional=False, floor=SHARE_FLOOR)
    assert _observe(off, range(5), {"a": FAST, "b": 1.0}) == [""] * 5


def test_the_rule_is_checked_and_shared() -> None:
    for bad in ({"straggler_factor": 1.0}, {"straggler_factor": -2}, {"straggler_steps": 0}):
        with pytest.raises(ConfigError):
            TrainerConfig.of(**bad)
    assert StragglerRule(0, 20, 50).key == 0
    keys = {StragglerRule(f, s, r).key for f, s, r in [(1.5, 20, 50), (2, 20, 50), (1.5, 5, 50)]}
    assert len(keys) == 3 and 0 not in keys
    a, b = (
        _machine("a", straggler_factor=1.5, straggler_steps=5),
        _machine("a", straggler_factor=1.5),
    )
    assert a.settings != b.settings  # a member with another rule gets a ConfigError


# -- the step machine --------------------------------------------------------------------------


def _sets_with_b_at(
    b_speeds: list[float], **cfg: object
) -> tuple[list[tuple[str, ...]], list[StepMachine]]:
    """Machines a, b, c (equal shares unless ``cfg`` says) commit one step per entry of
    ``b_speeds``, a and c at ``FAST`` and b at its entry: the compute set of each step
    (identical on every member), and the machines."""
    view = _view("a", "b", "c")
    machines = [_machine(n, **{"shares": "equal", **cfg}) for n in "abc"]
    sets = []
    for b in b_speeds:
        actions = [_alone_until_compute(m, view) for m in machines]
        assert len({a.workers for a in actions}) == 1
        sets.append(actions[0].workers)
        _commit(machines, actions, [FAST, b, FAST])
    return sets, machines


def test_the_machine_moves_a_straggler_out_identically_everywhere() -> None:
    cfg = {"straggler_factor": 1.5, "straggler_steps": 2, "readmit_steps": 3}
    sets, _ = _sets_with_b_at([50.0] * 7, **cfg)
    assert sets[:2] == [("a", "b", "c")] * 2
    assert sets[2:5] == [("a", "c")] * 3  # out for readmit_steps
    assert sets[5] == ("a", "b", "c")  # on trial, still slow
    assert sets[6] == ("a", "c")


def test_a_member_stalled_on_most_steps_is_judged_on_its_throughput() -> None:
    """A member fast on one step in four and 20x slower on the others (a CPU quota whose
    period is longer than its compute, as in the lab) runs at about a 15th of the speed over
    them: it goes out after the streak. (An EWMA of samples per second jumped back at each
    fast step, the streak restarted, and it never went out.)"""
    b = [FAST if k < 2 or k % 4 == 1 else FAST / 20 for k in range(16)]
    cfg = {"straggler_factor": 3.0, "straggler_steps": 5, "readmit_steps": 50}
    sets, machines = _sets_with_b_at(b, **cfg)
    assert ("a", "c") in sets, sets
    assert machines[1].speed < FAST / 8


def test_a_trial_is_judged_on_its_step_at_the_normal_split() -> None:
    """The probe's small share mostly times the step's fixed cost (here it measures a 10th of
    the speed): the confirm step's measurement replaces it, so a member that recovered stays.
    (Smoothed with the probe's, it was judged at about a 7th of its speed and sent back.)"""
    b = [FAST / 20] * 3 + [FAST / 10] + [FAST] * 3  # out at step 1; probe; recovered
    cfg = {"straggler_factor": 3.0, "straggler_steps": 1, "readmit_steps": 2}
    sets, _ = _sets_with_b_at(b, **cfg)
    assert sets[1:3] == [("a", "c")] * 2
    assert sets[3:] == [("a", "b", "c")] * 4, sets


def test_speed_shares_give_a_retried_member_the_share_of_its_last_speed() -> None:
    view = _view("a", "b", "c")
    cfg = {"shares": "speed", "straggler_factor": 1.5, "straggler_steps": 1, "readmit_steps": 2}
    machines = [_machine(n, **cfg) for n in "abc"]
    speeds = [FAST, FAST / 40, FAST]
    actions = []
    for _ in range(3):  # step 1 evicts b (equal shares), it sits out steps 2-3
        actions = [_alone_until_compute(m, view) for m in machines]
        _commit(machines, actions, speeds)
    actions = [_alone_until_compute(m, view) for m in machines]
    assert actions[0].workers == ("a", "b", "c")  # retried...
    w = actions[0].weights
    assert w is not None and w[1] == pytest.approx(min(w)) and w[1] < 0.05  # ...with a floor share
    assert len({a.weights for a in actions}) == 1


def _sync_to_compute(machines: list[StepMachine], view: RingView) -> list[Compute]:
    """Drive every member of ``view`` (``machines``, in view order) through one sync on it,
    with the allreduce(max) of their real sync vectors, to their next Compute."""

    def advance(m: StepMachine, a: Action) -> Action:
        while not isinstance(a, Compute | Sync):
            if isinstance(a, WaitView | ReadView | WaitViewChange):
                a = m.feed(0.0, ViewSeen(view))
            elif isinstance(a, Fetch):
                a = m.feed(0.0, Fetched(100))
            elif isinstance(a, Finished):  # a joiner's run ends with the step it adopted
                a = m.begin(0.0)
            else:
                a = m.feed(0.0, Done())
        return a

    actions = [advance(m, m.begin(0.0)) for m in machines]
    assert all(isinstance(a, Sync) for a in actions), actions
    reduced = Reduced(np.maximum.reduce([m.sync_vector(view, 100, DIGEST) for m in machines]))
    actions = [advance(m, m.feed(0.0, reduced)) for m in machines]
    assert all(isinstance(a, Compute) for a in actions), actions
    return actions  # type: ignore[return-value]


def test_speed_shares_start_from_the_carried_speeds_after_a_sync() -> None:
    """Before, every sync split the next step equally (a 20x member then took a whole equal
    share); now the sync carries the members' last speeds and every member, the joiner too,
    starts from them, the joiner at the median speed."""
    cfg = {"shares": "speed", "straggler_factor": 0}
    machines = [_machine(n, **cfg) for n in "abc"]
    view = _view("a", "b", "c")
    speeds = [FAST, FAST / 4, FAST]
    for _ in range(2):
        actions = [_alone_until_compute(m, view) for m in machines]
        _commit(machines, actions, speeds)
    machines.append(_machine("d", **cfg))
    actions = _sync_to_compute(machines, _view("a", "b", "c", "d"))
    assert len({(a.workers, a.weights) for a in actions}) == 1
    w = actions[0].weights
    assert w is not None and w == pytest.approx((4 / 13, 1 / 13, 4 / 13, 4 / 13), rel=1e-3)


def test_a_join_keeps_a_straggler_out() -> None:
    """Before, every sync put the straggler back to compute for a whole new streak; now the
    sync carries who sits out, since when and its failed trials, and the joiner learns it."""
    cfg = {"shares": "equal", "straggler_factor": 1.5, "straggler_steps": 2, "readmit_steps": 4}
    machines = [_machine(n, **cfg) for n in "abc"]
    speeds = {"a": FAST, "b": 50.0, "c": FAST, "d": FAST}
    sets = []
    view = _view("a", "b", "c")
    for k in range(8):
        if k == 3:  # b sat out step 2; d joins before step 3 (a sync on the new view)
            machines.append(_machine("d", **cfg))
            view = _view("a", "b", "c", "d")
            actions = _sync_to_compute(machines, view)
        else:
            actions = [_alone_until_compute(m, view) for m in machines]
        assert len({(a.workers, a.weights) for a in actions}) == 1
        sets.append(actions[0].workers)
        _commit(machines, actions, [speeds[m.me] for m in machines])
    assert sets[:2] == [("a", "b", "c")] * 2
    assert sets[2:6] == [("a", "c"), *[("a", "c", "d")] * 3]  # out for readmit_steps
    assert sets[6] == ("a", "b", "c", "d")  # on trial when it was due, still slow
    assert sets[7] == ("a", "c", "d")  # and back out at once


def _claims(*members: Stragglers, view: tuple[str, ...]) -> np.ndarray:
    return np.maximum.reduce([m.sync_slots(view) for m in members])


def test_a_straggler_away_for_a_view_is_still_out_when_it_is_back() -> None:
    """b sits out; it is suspected (a view without it, synced) and comes back (a view with
    it, synced): the members that stayed still claim it, and a joiner learns it."""
    a, c = (Stragglers(_rule(steps=1, readmit=5), False, SHARE_FLOOR) for _ in "ac")
    for s in (a, c):
        assert _observe(s, range(2), {"a": FAST, "b": 50.0, "c": FAST}) == ["b", ""]
    without = ("a", "c")
    for s in (a, c):
        s.adopt(_claims(a, c, view=without), without, 2)
    assert a.out == {"b": 1}  # (not in the view: no decision on it, only a memory)
    full = ("a", "b", "c", "d")
    fresh = [Stragglers(_rule(steps=1, readmit=5), False, SHARE_FLOOR) for _ in "bd"]
    claims = _claims(a, c, *fresh, view=full)
    for s in (a, c, *fresh):
        s.adopt(claims, full, 3)
        assert s.out == {"b": 1} and s.known["b"] == pytest.approx(50.0)
    # A claim from the future (a buggy member) keeps nobody out longer than one time out.
    claims[1] = 1 << 60
    claims[4 + 1] = 1 << 60  # failed trials
    a.adopt(claims, full, 3)
    assert a.out == {"b": 3} and a.sits_out("b") == 5 << 3


def test_a_sync_carries_a_streak_and_a_trial() -> None:
    """A sync in the middle of b's slow streak, then in the middle of its trial: the streak
    goes on where it was, the trial is judged at the next step (at the normal split: a
    confirm), on the members that stayed and on a joiner alike."""
    rule = _rule(steps=3, readmit=2)
    a, c = (Stragglers(rule, False, SHARE_FLOOR) for _ in "ac")
    speeds = {"a": FAST, "b": 100.0, "c": FAST}
    for s in (a, c):
        assert _observe(s, range(2), speeds) == ["", ""]  # a streak of 2 of 3
    full = ("a", "b", "c", "d")
    d = Stragglers(rule, False, SHARE_FLOOR)
    claims = _claims(a, c, d, view=full)
    for s in (a, c, d):
        s.adopt(claims, full, 2)
        assert _observe(s, range(2, 3), {**speeds, "d": FAST}) == ["b"]  # one more step
    for s in (a, c, d):  # out for 2 steps, then its probe step passes (judged as split)
        assert _observe(s, range(3, 6), {**speeds, "d": FAST}) == ["", "", ""]
        assert not s.out
    claims = _claims(a, c, d, view=full)
    for s in (a, c, d):
        s.adopt(claims, full, 6)
        assert _observe(s, range(6, 7), {**speeds, "d": FAST}) == ["b"]  # a failed confirm
        assert s.sits_out("b") == 4


def test_a_stale_streak_of_a_member_that_is_not_slow_ends_at_once() -> None:
    s = Stragglers(_rule(steps=3), False, SHARE_FLOOR)
    view = ("a", "b", "c")
    claims = s.sync_slots(view)
    claims[3 * 3 + 1] = 2  # somebody claims b is 2 steps into a slow streak
    s.adopt(claims, view, 10)
    even = {"a": FAST, "b": FAST, "c": FAST}
    assert _observe(s, range(10, 11), even) == [""] and not s._streak
    assert _observe(s, range(11, 13), {**even, "b": 100.0}) == ["", ""] and not s.out


def test_a_planned_departure_keeps_a_straggler_out() -> None:
    s = Stragglers(_rule(steps=1, readmit=5), proportional=False, floor=SHARE_FLOOR)
    assert _observe(s, range(2), {"a": FAST, "b": 50.0, "c": FAST, "d": FAST}) == ["b", ""]
    s.keep_only(["a", "b", "c"])  # d left
    assert s.out == {"b": 1} and "d" not in s.known


# -- trainers on the fake mesh -----------------------------------------------------------------


@pytest.mark.quiet  # speeds from sleeps in threads: at load 13 the slow member looked fast
def test_a_member_20x_slower_sits_out_and_comes_back() -> None:
    steps = 44
    shares, members = run_with_a_slow_member(
        steps, range(4, 24), 20, fixed_s=0.003, shares="speed", straggler_factor=1.5,
        straggler_steps=3, readmit_steps=6,
    )  # fmt: skip
    out = [k for k in range(steps) if shares["b"][k] == 0]
    assert out and min(out) < 24, shares["b"]  # sat out while slow
    assert np.mean(shares["b"][-6:]) > 3, shares["b"]  # computing again after
    # the exporter's ftmesh_train_straggler_steps_total counts the steps b sat out
    assert trainer_of(members["b"]).statistics().straggler_steps_total == len(out)


def test_a_recovered_straggler_is_judged_on_its_speed_now() -> None:
    """Its smoothed speed is of the slow days: the trial's measurement replaces it (else a
    recovered member at 4x its old speed would still look 2x too slow and go back out)."""
    cfg = {"straggler_factor": 1.5, "straggler_steps": 1, "readmit_steps": 2}
    sets, _ = _sets_with_b_at([50.0] * 2 + [FAST] * 4, **cfg)
    assert sets == [("a", "b", "c"), ("a", "c"), ("a", "c")] + [("a", "b", "c")] * 3
