"""Invariants of the sharding math (pure; Hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmesh.collective.view import Peer, RingView
from ftmesh.errors import LocalUsageError
from ftmesh.state import ShardLayout, StateLostError, plan_recovery, shard_holders, shard_ranges

members_st = st.integers(1, 12).map(lambda n: [f"m{i:02d}" for i in range(n)])


@given(members_st, st.integers(0, 5000))
def test_every_element_owned_exactly_once(members: list[str], length: int) -> None:
    ranges = shard_ranges(members, length)
    covered = [0] * length
    for a, b in ranges.values():
        assert 0 <= a <= b <= length
        for k in range(a, b):
            covered[k] += 1
    assert all(c == 1 for c in covered)
    sizes = [b - a for a, b in ranges.values()]
    assert max(sizes) - min(sizes) <= 1  # balanced


@given(members_st, st.integers(0, 500), st.integers(1, 5))
def test_every_shard_held_r_times(members: list[str], length: int, r: int) -> None:
    lay = ShardLayout.of(members, length, r)
    for i, (_rng, holders) in enumerate(shard_holders(members, length, r)):
        assert len(set(holders)) == min(r, len(members))
        assert holders[0] == members[i]
        for h in holders:
            assert i in lay.held_by(h)
    assert sum(len(lay.held_by(m)) for m in members) == len(members) * min(r, len(members))


def _lost_by_brute_force(lay: ShardLayout, dead: set[str]) -> list[int]:
    return [
        i
        for i in range(lay.n)
        if set(lay.holders(i)) <= dead and lay.shard_range(i)[0] < lay.shard_range(i)[1]
    ]


def _check_plan(old: list[str], new: list[str], length: int, r: int) -> None:
    plan = plan_recovery(old, new, length, r)
    old_lay = ShardLayout.of(old, length, r)
    for t in plan.transfers:
        assert t.src in new and t.dest in new
        # the source really held those elements in the old layout
        held = [old_lay.shard_range(i) for i in old_lay.held_by(t.src)] if t.src in old else []
        assert any(a <= t.start and t.stop <= b for a, b in held), t
    for dest in new:
        want = sorted(k for j in plan.new.held_by(dest) for k in range(*plan.new.shard_range(j)))
        got = sorted(k for t in plan.transfers if t.dest == dest for k in range(t.start, t.stop))
        assert got == want  # exactly what it must hold, each element once


@settings(max_examples=300)
@given(st.data())
def test_fewer_than_r_losses_recoverable(data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 10))
    r = data.draw(st.integers(1, 4))
    old = [f"m{i:02d}" for i in range(n)]
    k = data.draw(st.integers(0, min(r, n) - 1))
    dead = set(data.draw(st.permutations(old))[:k])
    joiners = [f"j{i}" for i in range(data.draw(st.integers(0, 2)))]
    new = sorted([m for m in old if m not in dead] + joiners)
    _check_plan(old, new, data.draw(st.integers(0, 300)), r)


@given(st.integers(2, 10), st.integers(1, 4), st.integers(0, 9), st.integers(0, 200))
def test_r_adjacent_losses_lose_state(n: int, r: int, start: int, extra: int) -> None:
    if n <= r:
        r = n - 1 if n > 1 else 1
    old = [f"m{i:02d}" for i in range(n)]
    length = n + extra
    dead = {old[(start + k) % n] for k in range(r)}
    new = [m for m in old if m not in dead] or ["fresh"]
    with pytest.raises(StateLostError) as info:
        plan_recovery(old, new, length, r)
    lay = ShardLayout.of(old, length, r)
    assert [i for i, *_ in info.value.lost] == _lost_by_brute_force(lay, dead)
    assert "checkpoint" in str(info.value)


@settings(max_examples=300)
@given(st.data())
def test_loss_detected_iff_some_shard_has_no_surviving_holder(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 9))
    r = data.draw(st.integers(1, 4))
    old = [f"m{i:02d}" for i in range(n)]
    dead = {m for m in old if data.draw(st.booleans())}
    new = [m for m in old if m not in dead] or ["fresh"]
    length = data.draw(st.integers(0, 100))
    expected = _lost_by_brute_force(ShardLayout.of(old, length, r), dead)
    if expected:
        with pytest.raises(StateLostError):
            plan_recovery(old, new, length, r)
    else:
        _check_plan(old, new, length, r)


def test_accepts_a_ring_view_and_names_lost_shards() -> None:
    view = RingView.of(Peer(f"n{i}", "127.0.0.1", 1000 + i) for i in range(4))
    assert shard_ranges(view, 8) == {"n0": (0, 2), "n1": (2, 4), "n2": (4, 6), "n3": (6, 8)}
    plan = plan_recovery(view, ["n0", "n2", "n3"], 8)  # n1 died: its shard is on n2
    assert plan.sources[1] == ("n2",)
    assert all(t.src != "n1" for t in plan.transfers)
    with pytest.raises(StateLostError, match=r"shard 1 \[2:4\)"):
        plan_recovery(view, ["n0", "n3"], 8)  # n1 and n2: adjacent, r=2
    with pytest.raises(LocalUsageError):
        ShardLayout.of([], 4)
