"""Speed-proportional shares (``TrainerConfig.shares="speed"``, #15 item 3): the weights from
agreed speeds (floor, hysteresis, unmeasured members), the sampler's exactly-once cut with
changing weights, the step machine's split (identical on every member, reset by a sync, a
disagreeing split caught by the split tag), and several trainers on the fake mesh
(``trainer_sim``) where one member is throttled for some steps: its share falls, then rises
back, every sample index trains once per epoch, and all members end bitwise equal."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils.data as tud
from test_training_loop import CLOSE
from test_training_step import BATCH, _alone_until_compute, _machine, _synced, _view, walk_round
from trainer_sim import (
    DATA_X,
    DATA_Y,
    Hub,
    Member,
    all_ok,
    max_diff,
    reference,
    start_loop,
    trainer_of,
    wait_all,
)

from ftmesh.errors import ConfigError
from ftmesh.torch import ElasticTrainer, Step
from ftmesh.torch.sampler import ElasticSampler
from ftmesh.training.actions import (
    Advertise,
    Compute,
    Done,
    DropRing,
    Failed,
    Failure,
    Finished,
    Sleep,
    Sync,
    ViewSeen,
    WaitView,
    WaitViewChange,
)
from ftmesh.training.config import TrainerConfig
from ftmesh.training.protocol import (
    SHARE_FLOOR,
    SHARE_HYSTERESIS,
    SPEED_SLOTS,
    header_size,
    round_tag,
    speed_weights,
    split_share,
)
from ftmesh.training.step import StepMachine

# -- weights and the sampler's cut ------------------------------------------------------------


def test_weights_are_proportional_to_speed() -> None:
    w = speed_weights([400.0, 100.0, 400.0, 100.0], [25, 25, 25, 25], None)
    assert w is not None
    assert w == pytest.approx((0.4, 0.1, 0.4, 0.1))
    assert split_share(100, w, 4) == [40, 10, 40, 10]


def test_the_floor_keeps_a_very_slow_member_computing() -> None:
    w = speed_weights([1000.0, 1.0], [32, 32], None)
    assert w is not None
    assert w[1] == pytest.approx(SHARE_FLOOR / 2 / (1 + SHARE_FLOOR / 2), rel=0.02)
    assert split_share(64, w, 2)[1] >= 3  # 0.1 of an equal share of 32


def test_hysteresis_keeps_the_split_while_compute_times_are_even() -> None:
    assert speed_weights([105.0, 100.0], [8, 8], None) is None  # times within 10 %: equal
    current = (0.8, 0.2)
    assert speed_weights([400.0, 110.0], [80, 20], current) == current  # 0.2 s vs 0.18 s
    moved = speed_weights([400.0, 200.0], [80, 20], current)  # 0.2 s vs 0.1 s
    assert moved == pytest.approx((2 / 3, 1 / 3))
    # compute time that hardly depends on the share (a fixed cost): the measured speed is
    # proportional to the share, the times are even, and the split stays where it is
    assert speed_weights([400.0, 100.0], [80, 20], current) == current


def test_unmeasured_members_count_at_the_median() -> None:
    assert speed_weights([0.0, 0.0], [4, 4], None) is None
    w = speed_weights([300.0, 0.0, 100.0, 100.0], [2, 2, 2, 2], None)
    assert w == pytest.approx((0.5, 1 / 6, 1 / 6, 1 / 6))


def test_largest_remainders_break_ties_by_rank() -> None:
    assert split_share(10, (1 / 3, 1 / 3, 1 / 3), 3) == [4, 3, 3]
    assert split_share(8, (4 / 9, 1 / 9, 4 / 9), 3) == [4, 1, 3]


def test_every_sample_once_per_epoch_with_changing_weights() -> None:
    sampler = ElasticSampler(100, 16, seed=3)  # 6 steps per epoch, a tail of 4 dropped
    rng = np.random.default_rng(0)
    members = ["a", "b", "c"]
    for epoch in range(3):
        seen = []
        for k in range(sampler.steps_per_epoch):
            step = epoch * sampler.steps_per_epoch + k
            weights = tuple(float(x) for x in rng.uniform(0.05, 1.0, 3))
            parts = [sampler.indices(step, members, m, weights) for m in members]
            assert [len(p) for p in parts] == split_share(16, weights, 3)
            seen.append(np.concatenate(parts))
        got = np.concatenate(seen)
        assert len(got) == len(set(got.tolist())) == 96
        expected = np.concatenate(
            [sampler.global_indices(epoch * 6 + k) for k in range(sampler.steps_per_epoch)]
        )
        assert sorted(got.tolist()) == sorted(expected.tolist())


def test_shares_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match="shares"):
        TrainerConfig(shares="fast")  # type: ignore[arg-type]


# -- the step machine --------------------------------------------------------------------------


def _share(m: StepMachine, a: Compute) -> int:
    """What ``m`` computes of ``a`` (0: a hot spare)."""
    if m.me not in a.workers:
        return 0
    return split_share(BATCH, a.weights, len(a.workers))[sorted(a.workers).index(m.me)]


def _reduce(machines: list[StepMachine], actions: list[Compute], speeds: list[float]) -> list[Any]:
    """The reduced header of one step where member i computed its share at ``speeds[i]``."""
    a0 = actions[0]
    header = np.zeros(header_size(0, speeds=True), dtype=np.float32)
    header[0] = BATCH
    header[2] = round_tag(a0.index) * a0.view.size
    for m, a, s in zip(machines, actions, speeds, strict=True):
        share = _share(m, a)
        header[-SPEED_SLOTS:] += m.speed_slots(a, share, share / s)
    return [float(v) for v in header]


def _commit(machines: list[StepMachine], actions: list[Compute], speeds: list[float]) -> None:
    """Every member commits its pending step, member i computing its share at
    ``speeds[i]`` (the header round walked: ``walk_round``)."""
    seconds = [_share(m, a) / s for m, a, s in zip(machines, actions, speeds, strict=True)]
    nexts = walk_round(*machines, now=1.0, seconds=seconds, loss_sum=0.0)
    for m, after in zip(machines, nexts, strict=True):
        while isinstance(after, Advertise):
            after = m.feed(1.0, Done())
        assert isinstance(after, Finished), after


def test_the_machine_splits_by_the_agreed_speeds_identically_everywhere() -> None:
    view = _view("a", "b", "c")
    machines = [_machine(n, shares="speed") for n in "abc"]
    actions = [_alone_until_compute(m, view) for m in machines]
    assert all(a.weights is None for a in actions)  # the first step: nothing measured
    _commit(machines, actions, [400.0, 100.0, 400.0])
    actions = [_alone_until_compute(m, view) for m in machines]
    assert len({a.weights for a in actions}) == 1
    assert actions[0].weights == pytest.approx((4 / 9, 1 / 9, 4 / 9))
    # Speeds smooth (EWMA): b at 400 again moves its weight, not all the way at once.
    _commit(machines, actions, [400.0, 400.0, 400.0])
    actions = [_alone_until_compute(m, view) for m in machines]
    w = actions[0].weights
    assert w is not None and 1 / 9 < w[1] < 1 / 3
    assert len({a.weights for a in actions}) == 1


def test_a_disagreeing_split_is_caught_and_the_retry_splits_as_the_sync_says() -> None:
    view = _view("a", "b")
    machines = [_machine(n, shares="speed") for n in "ab"]
    actions = [_alone_until_compute(m, view) for m in machines]
    _commit(machines, actions, [300.0, 100.0])
    actions = [_alone_until_compute(m, view) for m in machines]
    assert actions[0].weights == pytest.approx((0.75, 0.25))
    # b splits equally (say it missed the last step's end): the split tags differ
    wrong = [actions[0], Compute(view, actions[1].index, ("a", "b"), None, False, 1)]
    header = _reduce(machines, wrong, [300.0, 100.0])
    verdict = machines[0].check_reduction(actions[0], header, None)
    assert isinstance(verdict, Failed) and verdict.kind is Failure.DESYNC
    assert "split tag" in verdict.detail
    # the failed attempt syncs again, and the retry starts from the speeds the sync carried
    # (here every other member is a twin that knows none: equal shares)
    m, a = machines[0], machines[0].feed(1.0, verdict)
    while not isinstance(a, Compute):
        if isinstance(a, Sync):
            a = m.feed(1.0, _synced(m, a.view))
        elif isinstance(a, WaitView | WaitViewChange):
            a = m.feed(1.0, ViewSeen(view))
        else:
            assert isinstance(a, DropRing | Sleep), a
            a = m.feed(1.0, Done())
    assert a.weights is None and a.index == actions[0].index


def test_equal_mode_without_straggler_detection_has_no_speed_slots() -> None:
    m = _machine("a", shares="equal", straggler_factor=0)
    a = _alone_until_compute(m, _view("a", "b"))
    assert len(m.speed_slots(a, 4, 0.01)) == 0
    assert m.speeds([0.0] * header_size(0)) == ()


# -- several trainers on the fake mesh -------------------------------------------------------

PER_SAMPLE_S = 0.002
"""Every member's compute time per sample (a sleep: the tiny model's own cost is noise)."""
GLOBAL = 16  # 4 steps per epoch of the 64 samples


def run_with_a_slow_member(
    steps: int, slowed: range, factor: float, fixed_s: float = 0.0, **config: Any
) -> tuple[dict[str, list[int]], dict[str, Member]]:
    """Members a, b, c train ``steps`` steps of ``GLOBAL`` samples on the fake mesh; b
    computes ``factor`` times slower during the steps ``slowed`` (sleeps of ``fixed_s`` per
    micro-batch plus ``PER_SAMPLE_S`` per sample). Checks that every step's shares add up,
    that every sample index trains once per epoch and that all end bitwise equal; returns
    each member's share by step, and the members."""
    hub = Hub(start_with=3)
    computed: dict[tuple[str, int, int], np.ndarray] = {}
    committed: dict[str, dict[int, np.ndarray]] = {n: {} for n in "abc"}

    def body(t: ElasticTrainer, step: Step) -> None:
        me = t.mesh.node_id
        slow = factor if me == "b" and step.index in slowed else 1
        parts = []
        for idx in step.indices():
            time.sleep(fixed_s + len(idx) * PER_SAMPLE_S * slow)
            parts.append(idx)
            i = torch.as_tensor(idx)
            F.cross_entropy(t.model(DATA_X[i]), DATA_Y[i]).backward()  # type: ignore[no-untyped-call]
        t.optimizer.step()
        computed[me, step.index, step.attempt] = np.concatenate(parts or [np.empty(0, int)])

    def after_step(member: Member, t: ElasticTrainer, step: Step) -> None:
        if step.report is not None:
            key = (member.name, step.index, step.attempt)
            committed[member.name][step.index] = computed[key]

    try:
        members = start_loop(
            hub,
            "abc",
            total=steps,
            body=body,
            after_step=after_step,
            data=lambda: ElasticSampler(len(DATA_X), GLOBAL, seed=1),
            **config,
        )
        wait_all(hub, 90.0)
    finally:
        hub.shutdown()
    all_ok(members, "abc")
    shares = {n: [len(committed[n][k]) for k in range(steps)] for n in "abc"}
    print("b's shares by step:", shares["b"])
    assert all(sum(shares[n][k] for n in "abc") == GLOBAL for k in range(steps))
    # exactly once: every sample index of every epoch, in one committed step of one member
    for epoch in range(steps // 4):
        got = np.concatenate(
            [committed[n][k] for n in "abc" for k in range(4 * epoch, 4 * epoch + 4)]
        )
        assert sorted(got.tolist()) == list(range(len(DATA_X))), epoch
    # identical results everywhere
    states = [trainer_of(members[n]).model.state_dict() for n in "abc"]
    for st in states[1:]:
        assert all(torch.equal(st[k], states[0][k]) for k in st)
    return shares, members


@pytest.mark.quiet  # speeds from sleeps in threads: at load 13 the slow member looked fast
def test_a_throttled_members_share_falls_and_rises_back() -> None:
    shares, _ = run_with_a_slow_member(36, range(6, 18), 4, shares="speed")
    before = np.mean(shares["b"][2:6])
    throttled = np.mean(shares["b"][14:18])
    after = np.mean(shares["b"][32:36])
    print(f"b's mean share: before {before:.2f}, throttled {throttled:.2f}, after {after:.2f}")
    assert throttled < 0.6 * before, shares["b"]
    # Back near an equal share (16/3): the split only moves when the slowest member is more
    # than SHARE_HYSTERESIS above the mean, so 5 of 16 is as settled as 6 (and "before" was
    # itself measured on noisy sleeps: 5-7). A CI run saw after = 5.0 against 0.8 * 6.25.
    equal = GLOBAL / 3
    assert after >= equal * (1 - 2 * SHARE_HYSTERESIS) - 0.5, shares["b"]
    assert after > throttled + 1.5, shares["b"]


@pytest.mark.quiet  # (as above: a loaded run of the suite gave b its equal share)
def test_speed_shares_with_a_data_loader_give_the_single_process_model() -> None:
    """The loader API: a 4x-throttled member gets a smaller share (the loader's prefetch
    starts over when the split changes), and the model is single-process SGD's."""
    hub = Hub(start_with=3)
    total = 16
    dataset = tud.TensorDataset(DATA_X, DATA_Y)

    def body(t: ElasticTrainer, step: Step) -> None:
        slow = t.mesh.node_id == "b" and 2 <= step.index < 10
        for x, y in step.batches():
            time.sleep(len(x) * PER_SAMPLE_S * (4 if slow else 1))
            F.cross_entropy(t.model(x), y).backward()  # type: ignore[no-untyped-call]
        t.optimizer.step()

    try:
        members = start_loop(
            hub,
            "abc",
            total=total,
            body=body,
            data=lambda: tud.DataLoader(dataset, batch_size=8, shuffle=True),
            data_seed=1,
            shares="speed",
        )
        wait_all(hub, 60.0)
    finally:
        hub.shutdown()
    all_ok(members, "abc")
    b = [r.share for r in members["b"].reports]
    assert min(b) < 2 < max(b), b  # equal shares of 8 are 3, 3, 2... b's is 3
    for n in "abc":
        model = trainer_of(members[n]).model.state_dict()
        assert max_diff(model, reference("sgd", total)) < CLOSE
