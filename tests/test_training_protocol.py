"""The pure parts of fault-tolerant training: the sync decision and the elastic sampler."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmesh.errors import LocalUsageError
from ftmesh.torch.sampler import ElasticSampler
from ftmesh.training.protocol import (
    FRESH,
    LEAVE_BITS,
    LEAVE_SLOTS,
    leave_slots,
    leavers,
    own_slots_intact,
    plan_sync,
    round_tag,
    sync_vector,
)

D0 = "0" * 64
D1 = "f" * 64


def reduce(*contribs: np.ndarray) -> np.ndarray:
    out = contribs[0].copy()
    for c in contribs[1:]:
        np.maximum(out, c, out=out)
    return out


def test_all_fresh_members_adopt_rank_zero() -> None:
    v = reduce(*(sync_vector(r, 3, FRESH, 100 + r, D0) for r in range(3)))
    plan = plan_sync(v)
    assert (plan.target_step, plan.root, plan.behind, plan.nbytes) == (0, 0, (1, 2), 100)


def test_member_behind_gets_newest_state() -> None:
    v = reduce(
        sync_vector(0, 3, 7, 10, D0), sync_vector(1, 3, 8, 11, D1), sync_vector(2, 3, 8, 11, D1)
    )
    plan = plan_sync(v)
    assert (plan.target_step, plan.root, plan.behind, plan.nbytes) == (8, 1, (0,), 11)
    assert (plan.digest, plan.holders) == (D1, (1, 2))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=32, max_size=32))
def test_the_full_digest_travels_in_the_vector(raw: bytes) -> None:
    digest = raw.hex()
    plan = plan_sync(reduce(sync_vector(0, 2, 3, 9, D0), sync_vector(1, 2, 4, 9, digest)))
    assert (plan.root, plan.behind, plan.digest, plan.holders) == (1, (0,), digest, (1,))


def test_same_step_different_state_is_resolved() -> None:
    # Two sides of a healed partition at the same step: the first rank's state wins.
    v = reduce(sync_vector(0, 2, 5, 10, D0), sync_vector(1, 2, 5, 10, D1))
    plan = plan_sync(v)
    assert (plan.root, plan.behind) == (0, (1,))


def test_in_sync_members_do_nothing() -> None:
    v = reduce(*(sync_vector(r, 4, 3, 10, D1) for r in range(4)))
    assert plan_sync(v).root == -1


def test_single_member() -> None:
    assert plan_sync(sync_vector(0, 1, FRESH, 10, D0)).behind == ()


def test_a_vector_of_another_round_is_recognised() -> None:
    own = sync_vector(1, 3, 7, 100, "ab" * 32)
    reduced = np.maximum.reduce(
        [own, sync_vector(0, 3, 7, 100, "cd" * 32), sync_vector(2, 3, 6, 9, "ef" * 32)]
    )
    assert own_slots_intact(reduced, own, 1, 3)
    # The same members one step earlier (what a stale stream would deliver):
    stale = np.maximum.reduce([sync_vector(r, 3, 6, 100, "12" * 32) for r in range(3)])
    assert not own_slots_intact(stale, own, 1, 3)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**7), st.integers(1, 256))
def test_round_tag_sum_is_exact_and_tells_steps_apart(step: int, size: int) -> None:
    tag = np.float32(round_tag(step))
    total = np.add.reduce(np.full(size, tag, dtype=np.float32), dtype=np.float32)
    assert float(total) == round_tag(step) * size
    assert round_tag(step + 1) != round_tag(step)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(50, 400),
    batch=st.integers(1, 50),
    views=st.lists(st.integers(1, 7), min_size=1, max_size=60),
)
def test_sampler_covers_each_sample_once_per_epoch(n: int, batch: int, views: list[int]) -> None:
    """Whatever the view at each step, a step's shares are disjoint and cover its global
    batch, and an epoch's steps cover each sample at most once (exactly once but the tail)."""
    if batch > n:
        batch = n
    s = ElasticSampler(n, batch, seed=3)
    seen: dict[int, list[int]] = {}
    for step in range(2 * s.steps_per_epoch):
        size = views[step % len(views)]
        members = [f"{i:032x}" for i in range(size)]
        shares = [s.indices(step, members, m) for m in members]
        union = np.concatenate(shares)
        assert len(union) == batch
        assert sorted(union.tolist()) == sorted(s.global_indices(step).tolist())
        seen.setdefault(s.epoch_of(step), []).extend(union.tolist())
    for epoch, samples in seen.items():
        assert len(samples) == len(set(samples)) == s.steps_per_epoch * batch, epoch


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(LocalUsageError):
        ElasticSampler(10, 0)
    with pytest.raises(LocalUsageError):
        ElasticSampler(10, 11)
    with pytest.raises(LocalUsageError):
        ElasticSampler(10, 2).indices(0, ["a"], "b")


def test_leave_slots_name_the_leavers_whatever_the_order_they_are_added_in() -> None:
    size = 200
    ranks = [0, 5, 23, 24, 150, 199]
    parts = [leave_slots(r) for r in ranks] + [np.zeros(LEAVE_SLOTS, np.float32)] * 3
    for order in (parts, parts[::-1], parts[2:] + parts[:2]):
        total = np.zeros(LEAVE_SLOTS, np.float32)
        for p in order:  # float32 sums, as the ring's reduction does
            total = (total + p).astype(np.float32)
        assert leavers(total, size) == tuple(ranks)
    assert leavers(np.zeros(LEAVE_SLOTS, np.float32), size) == ()


def test_leave_slots_from_another_round_are_refused() -> None:
    assert leavers(leave_slots(7), 7) is None  # rank 7 is not in a view of 7
    bad = np.zeros(LEAVE_SLOTS, np.float32)
    bad[0] = 2.5
    assert leavers(bad, 10) is None
    bad[0] = -1
    assert leavers(bad, 10) is None
    assert not leave_slots(LEAVE_SLOTS * LEAVE_BITS).any()  # beyond the slots: unannounced
