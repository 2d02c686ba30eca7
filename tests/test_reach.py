"""Reachability, sans-IO: when a member accuses a neighbour and withdraws it
(``ReachTracker``), and which members the ring leaves out given everyone's accusations
(``exclusions``), including what insiders that lie in their accusations can do."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmesh.collective.reach import (
    ACCUSES_MANY,
    BAD_FRAMES,
    BAD_STATE,
    CYCLE,
    MAX_ACCUSATIONS,
    STALLED,
    UNREACHABLE,
    Accuse,
    BadBytes,
    Connected,
    ConnectEnded,
    ConnectFailed,
    Connecting,
    Probe,
    ProbeDone,
    ReachConfig,
    ReachTracker,
    RingFailed,
    RingWorked,
    Withdraw,
    exclusions,
    format_reports,
    parse_reports,
)
from ftmesh.errors import ConfigError
from ftmesh.membership.messages import MemberSnapshot, MemberState
from ftmesh.mesh.core import ring_members, view_of
from ftmesh.mesh.meta import ring_exclusions

B = "b" * 32
ADDR = "10.0.0.2:4000"
ALIVE = {B: ADDR}


def tracker(**cfg: float) -> ReachTracker:
    return ReachTracker("a" * 32, ReachConfig(**cfg))  # type: ignore[arg-type]


def accused(effects: list[object]) -> list[Accuse]:
    return [e for e in effects if isinstance(e, Accuse)]


def test_a_live_member_that_cannot_be_connected_to_is_accused_after_the_threshold() -> None:
    t = tracker(unreachable_after=3.0)
    t.receive(Connecting(10.0, B, ADDR))
    t.receive(ConnectFailed(10.1, B, ADDR, "ConnectionRefusedError(111)"))
    assert t.tick(12.9, ALIVE) == []
    assert t.next_deadline() == pytest.approx(13.0)
    [acc] = accused(t.tick(13.0, ALIVE))
    assert (acc.peer, acc.reason, acc.addr) == (B, UNREACHABLE, ADDR)
    assert "ConnectionRefusedError" in acc.detail
    assert t.published() == {B: UNREACHABLE}


def test_no_accusation_when_the_connect_succeeds_or_the_member_is_not_alive() -> None:
    t = tracker(unreachable_after=3.0)
    t.receive(Connecting(10.0, B, ADDR))
    t.receive(Connected(11.0, B))
    assert t.tick(20.0, ALIVE) == []
    # A suspect (not alive) that does not answer says nothing about its address, and its
    # failures do not carry over once it is back.
    t.receive(Connecting(30.0, B, ADDR))
    assert t.tick(31.0, {}) == []
    assert t.tick(34.0, ALIVE) == []
    t.receive(ConnectEnded(35.0, B))
    assert t.tick(36.0, ALIVE) == []
    # An old failure with no attempt since does not count later.
    t.receive(Connecting(40.0, B, ADDR))
    t.receive(ConnectEnded(40.5, B))
    assert t.tick(44.0, ALIVE) == []  # no attempt for longer than the threshold
    t.receive(Connecting(50.0, B, ADDR))
    assert t.tick(52.0, ALIVE) == []  # a fresh run of failures starts at 50
    assert accused(t.tick(53.0, ALIVE))


def readmitted_at(t: ReachTracker, now: float, results: list[bool]) -> float | None:
    """Answer each probe the tracker asks for with the next result (one per second); the
    time it withdraws its accusation."""
    for ok in results:
        effects = t.tick(now, ALIVE)
        if any(isinstance(e, Withdraw) for e in effects):
            return now
        [probe] = [e for e in effects if isinstance(e, Probe)]
        assert probe == Probe(B, ADDR)
        assert t.tick(now, ALIVE) == []  # one probe at a time
        t.receive(ProbeDone(now, B, ok))
        now += 1.0
    return None


def test_readmission_after_probes_succeed_for_the_hold_with_backoff_for_flappers() -> None:
    t = tracker(unreachable_after=1.0, min_hold=2.0, max_hold=8.0, probe_interval=1.0)
    t.receive(Connecting(0.0, B, ADDR))
    assert accused(t.tick(1.0, ALIVE))
    # Probes at 1, 2 fail, from 3 on they answer: withdrawn once they answered for 2 s.
    assert readmitted_at(t, 1.0, [False, False, True, True, True, True]) == 5.0
    assert t.published() == {}
    # It flaps: accused again within the backoff memory, its hold doubles (4 s), then 8 s
    # (the cap).
    for hold in (4.0, 8.0, 8.0):
        t.receive(Connecting(10.0, B, ADDR))
        assert accused(t.tick(11.0, ALIVE))
        assert readmitted_at(t, 11.0, [True] * 10) == 11.0 + hold
    # Long after, the backoff is forgotten.
    t.receive(Connecting(100.0, B, ADDR))
    assert accused(t.tick(101.0, ALIVE))
    assert readmitted_at(t, 101.0, [True] * 10) == 103.0


def test_a_failed_probe_restarts_the_hold() -> None:
    t = tracker(unreachable_after=1.0, min_hold=2.0, probe_interval=0.5)
    t.receive(Connecting(0.0, B, ADDR))
    assert accused(t.tick(1.0, ALIVE))
    t.tick(1.0, ALIVE)
    t.receive(ProbeDone(1.0, B, True))
    t.tick(1.5, ALIVE)
    t.receive(ProbeDone(1.5, B, False))
    t.tick(2.0, ALIVE)
    t.receive(ProbeDone(2.0, B, True))
    assert not any(isinstance(e, Withdraw) for e in t.tick(3.5, ALIVE))
    assert any(isinstance(e, Withdraw) for e in t.tick(4.0, ALIVE))


def test_bad_frames_and_state_are_counted_within_the_window() -> None:
    t = tracker(bad_bytes_strikes=3, bad_bytes_window=10.0, bad_bytes_hold=60.0)
    for at in (0.0, 1.0):
        t.receive(RingFailed(at, B, "protocol", True, "data frame of 4294967040 bytes"))
    assert t.tick(2.0, ALIVE) == []
    t.receive(RingFailed(20.0, B, "protocol", True, "data frame of 4294967040 bytes"))
    assert t.tick(20.0, ALIVE) == []  # the first two fell out of the window
    t.receive(RingFailed(21.0, B, "protocol", True, "x"))
    t.receive(RingFailed(22.0, B, "lost", False, "closed"))  # not bad bytes
    t.receive(RingFailed(23.0, B, "protocol", False, "data frame of 4294967040 bytes"))
    [acc] = accused(t.tick(23.0, ALIVE))
    assert acc.reason == BAD_FRAMES and "4294967040" in acc.detail
    # No probe can clear it: it stands for its hold.
    assert t.tick(80.0, ALIVE) == []
    assert t.tick(83.0, ALIVE) == [Withdraw(B, BAD_FRAMES, "its 60s hold ran out")]
    u = tracker(bad_bytes_strikes=2)
    u.receive(BadBytes(0.0, B, BAD_STATE, "bad_chunk"))
    u.receive(BadBytes(1.0, B, BAD_STATE, "bad_chunk"))
    assert [a.reason for a in accused(u.tick(1.0, ALIVE))] == [BAD_STATE]


def test_rings_that_stall_before_carrying_data_are_strikes() -> None:
    t = tracker(stall_strikes=2)
    t.receive(RingFailed(0.0, B, "stalled", True, "no data"))  # worked before: not a strike
    t.receive(RingFailed(1.0, B, "stalled", False, "no data"))
    assert t.tick(1.0, ALIVE) == []
    t.receive(RingWorked(2.0, (B, "c" * 32)))  # a ring with it carried data: start over
    t.receive(RingFailed(3.0, B, "stalled", False, "no data"))
    assert t.tick(3.0, ALIVE) == []
    t.receive(RingFailed(4.0, B, "stalled", False, "no data"))
    assert [a.reason for a in accused(t.tick(4.0, ALIVE))] == [STALLED]


def test_members_gone_for_long_are_forgotten_and_published_accusations_are_bounded() -> None:
    t = tracker(unreachable_after=1.0, forget_after=5.0)
    peers = {f"{i:032x}": f"10.0.0.{i}:1" for i in range(MAX_ACCUSATIONS + 2)}
    for p, addr in peers.items():
        t.receive(Connecting(0.0, p, addr))
    assert len(accused(t.tick(1.0, peers))) == len(peers)
    assert len(t.published()) == MAX_ACCUSATIONS
    gone = dict(list(peers.items())[1:])
    t.tick(2.0, gone)
    assert t.tick(6.9, gone) == [] or all(isinstance(e, Probe) for e in t.tick(6.9, gone))
    withdrawn = [e for e in t.tick(7.0, gone) if isinstance(e, Withdraw)]
    assert [w.peer for w in withdrawn] == [next(iter(peers))]


def test_our_own_id_is_never_accused() -> None:
    t = tracker(unreachable_after=1.0)
    t.receive(Connecting(0.0, t.me, ADDR))
    assert t.tick(5.0, {t.me: ADDR}) == []


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError):
        ReachConfig(unreachable_after=0)
    with pytest.raises(ConfigError):
        ReachConfig(min_hold=5.0, max_hold=1.0)


# -- the metadata form -------------------------------------------------------------------


def test_reports_round_trip_and_garbage_is_refused() -> None:
    acc = {B: UNREACHABLE, "c" * 32: BAD_FRAMES}
    assert parse_reports(format_reports(acc)) == acc
    assert parse_reports(None) is None and parse_reports("") == {}
    for bad in (
        "garbage",
        f"{B}:nonsense",
        12,
        f"{B}",
        ",".join(f"{i:032x}:state" for i in range(9)),
    ):
        with pytest.raises(ValueError):
            parse_reports(bad)


@given(st.one_of(st.text(max_size=400), st.integers(), st.floats(), st.booleans(), st.none()))
def test_any_metadata_value_parses_or_raises_value_error(value: object) -> None:
    try:
        found = parse_reports(value)
    except ValueError:
        return
    assert found is None or all(
        r in (UNREACHABLE, STALLED, BAD_FRAMES, BAD_STATE) for r in found.values()
    )


# -- who is left out ---------------------------------------------------------------------


def test_exclusions_examples() -> None:
    a, b, c, m = "a", "b", "c", "m"
    u = UNREACHABLE
    assert exclusions({}, "abc") == {}
    # One accusation: the accused goes.
    assert set(exclusions({a: {b: u}}, "abc")) == {b}
    # Accusing two members: the accuser goes, and its accusations do not count.
    out = exclusions({m: {a: u, b: u}}, "abm")
    assert set(out) == {m} and out[m].reason == ACCUSES_MANY
    # Mutual accusation (a link broken both ways, or an insider answering an accusation).
    assert {k: v.reason for k, v in exclusions({a: {b: u}, b: {a: u}}, "abc").items()} == {
        a: CYCLE,
        b: CYCLE,
    }
    # An accused member's own accusation does not count.
    assert set(exclusions({a: {b: u}, b: {c: u}}, "abc")) == {b}
    # Accusations by or of non-candidates do not count.
    assert exclusions({"x": {a: u}, a: {"y": u}}, "abc") == {}
    # A second honest accuser of an insider that answered the first accusation: the insider
    # goes and the honest member it accused stays.
    assert set(exclusions({a: {m: BAD_FRAMES}, m: {a: u}, c: {m: BAD_FRAMES}}, "acm")) == {m}


ids = st.sampled_from([f"n{i}" for i in range(8)])


@settings(max_examples=300, deadline=None)
@given(
    honest=st.dictionaries(ids, ids, max_size=8),
    insiders=st.dictionaries(ids, st.sets(ids, max_size=4), max_size=3),
    seed=st.integers(0, 1000),
)
def test_exclusions_are_deterministic_resolve_every_accusation_and_bound_insiders(
    honest: dict[str, str], insiders: dict[str, set[str]], seed: int
) -> None:
    """Honest members accuse at most one member (their right neighbour); insiders publish
    whatever they like. Whatever the input order, every member computes the same exclusions;
    no member left in the ring is accused by one left in it; and honest members that only
    insiders accuse are left out at most once for a lone insider, 3k times for k."""
    members = [f"n{i}" for i in range(8)]
    honest = {r: a for r, a in honest.items() if r not in insiders}
    reports: dict[str, dict[str, str]] = {r: {a: UNREACHABLE} for r, a in honest.items()}
    for r, acc in insiders.items():
        reports[r] = {a: BAD_FRAMES for a in acc}
    out = exclusions(reports, members)
    shuffled = list(reports.items())
    random.Random(seed).shuffle(shuffled)
    again = exclusions(
        {r: dict(random.Random(seed).sample(sorted(v.items()), len(v))) for r, v in shuffled},
        random.Random(seed).sample(members, len(members)),
    )
    assert again == out
    ring = [n for n in members if n not in out]
    for r in ring:
        for a in reports.get(r, {}):
            assert a == r or a in out, f"{r} in the ring accuses {a}, also in the ring"
    accused_by_honest = {a for r, a in honest.items() if a != r}
    victims = [
        n
        for n in out
        if n not in insiders and n not in accused_by_honest and out[n].reason != ACCUSES_MANY
    ]
    bound = 1 if len(insiders) == 1 else len(insiders) * (1 + MAX_ACCUSATIONS // 2)
    assert len(victims) <= bound, (victims, reports, out)
    for n, ex in out.items():
        if ex.reason == ACCUSES_MANY:  # it alone accuses two members
            alone = [
                a
                for a in reports[n]
                if a != n and sum(a in acc for r, acc in reports.items() if r != a) == 1
            ]
            assert len(alone) >= 2, (n, reports)


# -- the view: membership less the exclusions --------------------------------------------


def member(node: str, state: MemberState = MemberState.ALIVE, **meta: object) -> MemberSnapshot:
    full = {"role": "train", "data": f"10.0.0.{len(node)}:4000", **meta}
    return MemberSnapshot(
        node=node, name=node, addr=("10.0.0.1", 1), incarnation=1, state=state, meta=full
    )  # type: ignore[arg-type]


def test_the_view_leaves_out_accused_members_and_garbage_accusations() -> None:
    a, b, c, d, e = (ch * 32 for ch in "abcde")
    members = [
        member(a, reach=format_reports({b: UNREACHABLE})),
        member(b),
        member(c, MemberState.SUSPECT, reach=format_reports({a: UNREACHABLE, d: UNREACHABLE})),
        member(d),
        member(e, reach="garbage"),
    ]
    out = ring_exclusions(members)
    # b accused by a; c (suspect: its accusations still count) alone accuses two: c goes and
    # its accusations do not count; e's accusations do not parse.
    assert {k: v.reason for k, v in out.items()} == {b: UNREACHABLE, c: ACCUSES_MANY, e: "bad_meta"}
    view = view_of(ring_members(members))
    assert view is not None and view.node_ids == (a, d)
    # A dead reporter's accusation no longer counts.
    members[0] = member(a, MemberState.DEAD, reach=format_reports({b: UNREACHABLE}))
    assert b not in ring_exclusions(members)
