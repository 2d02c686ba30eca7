"""The ring planner's second input, measured throughput (``ftmesh.collective.topology``): rate
buckets, the version-2 summary, sites that round trips cannot see, and the cases that must
never split (a LAN, a small gap, a member that measured nothing). Pure, no I/O."""

from __future__ import annotations

import pytest

from ftmesh.cli.status_cmd import ring_plan_lines
from ftmesh.collective.topology import (
    MAX_BUCKET,
    MAX_CROSS_RATE_BUCKET,
    MAX_LINKS,
    LinkEstimator,
    MemberLinks,
    format_links,
    links_of,
    parse_links,
    parse_summary,
    plan_ring,
    rate_bounds,
    rate_bucket,
    rtt_bucket,
)
from ftmesh.membership.messages import MemberSnapshot, MemberState
from ftmesh.mesh.core import view_of
from ftmesh.mesh.meta import DATA_KEY, LINKS_KEY, ROLE_KEY

MBIT = 1e6 / 8  # bytes per second


def nid(i: int) -> str:
    import hashlib

    return hashlib.blake2b(f"r{i}".encode(), digest_size=16).hexdigest()


def rated(
    sites: list[list[str]], inside: float, across: float, rtt: float = 1e-4
) -> list[MemberLinks]:
    """Every member timed every peer: ``inside`` bytes/s within a site, ``across`` between
    sites; the same round trip ``rtt`` everywhere (no site in the round trips)."""
    where = {n: i for i, s in enumerate(sites) for n in s}
    out = []
    for a in where:
        peers = [b for b in where if b != a]
        rate = {b: rate_bucket(inside if where[a] == where[b] else across) for b in peers}
        out.append(MemberLinks.of(a, rtt={b: rtt_bucket(rtt) for b in peers}, rate=rate))
    return out


def test_rate_buckets_are_half_octaves_from_1_mbit() -> None:
    assert rate_bucket(0.0) == 0 and rate_bucket(0.5 * MBIT) == 0
    assert rate_bucket(20 * MBIT) == 9
    assert rate_bucket(1000 * MBIT) == 20
    assert rate_bucket(100 * MBIT) == MAX_CROSS_RATE_BUCKET  # about 125 Mbit/s at most
    assert rate_bucket(4000 * MBIT) - rate_bucket(1000 * MBIT) == 4  # 4x is 4 buckets
    for b in range(1, MAX_BUCKET):
        lo, hi = rate_bounds(b)
        assert rate_bucket(lo / 8 * 1.0001) == b and rate_bucket(hi / 8 * 0.9999) == b


def test_throughput_finds_two_sites_the_round_trips_cannot_see() -> None:
    ids = [nid(i) for i in range(4)]
    a, b = [ids[0], ids[2]], [ids[1], ids[3]]  # alternating ids: the unplanned ring crosses 4x
    plan = plan_ring(rated([a, b], inside=1000 * MBIT, across=20 * MBIT))
    assert plan.source == "throughput" and plan.hierarchical
    assert {frozenset(s.members) for s in plan.sites} == {frozenset(a), frozenset(b)}
    # the same plan whatever order the members come in
    assert plan_ring(reversed(rated([a, b], 1000 * MBIT, 20 * MBIT))).hash == plan.hash


@pytest.mark.parametrize(
    ("inside", "across"),
    [
        (1000 * MBIT, 300 * MBIT),  # a slower LAN segment: above the cross-site ceiling
        (1000 * MBIT, 150 * MBIT),  # (still above it)
        (60 * MBIT, 20 * MBIT),  # under 4x apart
        (20 * MBIT, 20 * MBIT),  # one slow network, no shape
    ],
)
def test_no_split_without_a_wide_gap_below_the_ceiling(inside: float, across: float) -> None:
    ids = [nid(i) for i in range(4)]
    plan = plan_ring(rated([ids[:2], ids[2:]], inside, across))
    assert plan.flat and plan.source == "measured"


def test_a_member_that_timed_nothing_never_splits() -> None:
    ids = [nid(i) for i in range(4)]
    links = rated([ids[:2], ids[2:]], 1000 * MBIT, 20 * MBIT)
    # the last member published no rates and nobody timed it: not connected in the rates
    last = ids[3]
    cut = [
        MemberLinks(m.node, "", m.rtt, tuple((p, r) for p, r in m.rate if p != last))
        for m in links
        if m.node != last
    ]
    assert plan_ring([*cut, MemberLinks.of(last)]).flat
    # one direction of a pair is enough: it takes the known one
    one_way = [m if m.node != last else MemberLinks(m.node, "", m.rtt, ()) for m in links]
    assert plan_ring(one_way).hierarchical


def test_a_pair_is_slow_only_when_both_directions_read_slow() -> None:
    a, b, c, d = (nid(i) for i in range(4))
    fast, slow = rate_bucket(1000 * MBIT), rate_bucket(20 * MBIT)
    rates = {
        a: {b: fast, c: slow, d: slow},
        b: {a: fast, c: slow, d: slow},
        c: {d: fast, a: slow, b: slow},
        d: {c: fast, a: slow, b: slow},
    }
    assert plan_ring(MemberLinks.of(n, rate=r) for n, r in rates.items()).hierarchical
    # c reads d as slow, d reads c as fast: the faster direction holds the site together
    skew = {**rates, c: {d: slow, a: slow, b: slow}}
    plan = plan_ring(MemberLinks.of(n, rate=r) for n, r in skew.items())
    assert sorted(len(s.members) for s in plan.sites) == [2, 2]
    # a and b read each other fast, but c and d read a and b fast too: one site
    leaky = {**rates, c: {d: fast, a: fast, b: slow}, a: {b: fast, c: fast, d: slow}}
    assert plan_ring(MemberLinks.of(n, rate=r) for n, r in leaky.items()).flat


def test_round_trip_sites_come_first() -> None:
    ids = [nid(i) for i in range(4)]
    by_rate = rated([[ids[0], ids[1]], [ids[2], ids[3]]], 1000 * MBIT, 20 * MBIT)
    # the round trips say {0, 2} and {1, 3} (50 ms apart): they decide
    far = {ids[0]: 0, ids[2]: 0, ids[1]: 1, ids[3]: 1}
    links = [
        MemberLinks.of(
            m.node,
            rtt={
                p: rtt_bucket(1e-4 if far[p] == far[m.node] else 0.05) for p in ids if p != m.node
            },
            rate=dict(m.rate),
        )
        for m in by_rate
    ]
    plan = plan_ring(links)
    assert plan.source == "measured"
    assert {frozenset(s.members) for s in plan.sites} == {
        frozenset((ids[0], ids[2])),
        frozenset((ids[1], ids[3])),
    }


def test_summary_version_2_round_trip_and_bounds() -> None:
    ids = [nid(i) for i in range(60)]
    rtt = {n: i % 36 for i, n in enumerate(ids) if i % 5}  # some peers without a round trip
    rates = {n: (7 * i) % 36 for i, n in enumerate(ids) if i % 3}  # some without a rate
    text = format_links(rtt, rates)
    assert text[0] == "2" and len(text) == 1 + MAX_LINKS * 10 <= 512
    back_rtt, back_rate = parse_summary(text)
    kept = set(links_of({**back_rtt, **back_rate}, ids))
    assert len(kept) == MAX_LINKS
    # the nearest peers were kept: every peer with a round trip comes before those without
    assert (
        sorted(kept, key=lambda p: (rtt.get(p, 99), p))
        == sorted(set(rtt) | set(rates), key=lambda p: (rtt.get(p, 99), p))[:MAX_LINKS]
    )
    assert links_of(back_rtt, ids) == {p: rtt[p] for p in kept if p in rtt}
    assert links_of(back_rate, ids) == {p: rates[p] for p in kept if p in rates}
    assert parse_links(text) == back_rtt
    # without rates, version 1 as before (members of older releases read it)
    assert format_links(rtt)[0] == "1" and parse_summary(format_links(rtt))[1] == {}
    assert parse_summary("2") == ({}, {})


@pytest.mark.parametrize(
    "bad",
    ["2" + "0" * 9, "2" + "0" * 8 + "a", "2" + "0" * 8 + "a_", "2" + "0" * 8 + "Aa",
     "2" + "0" * 8 + "aa" + "0" * 8 + "bb", "2" + "a" * 600],
)  # fmt: skip
def test_summary_version_2_parser_refuses_malformed_values(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_summary(bad)


def test_rate_estimator_takes_the_median_with_hysteresis() -> None:
    est = LinkEstimator.for_rates(window=5, min_samples=3)
    peer = nid(1)
    est.add(peer, 20 * MBIT)
    est.add(peer, 20 * MBIT)
    assert est.buckets() == {}  # too few samples
    est.add(peer, 900 * MBIT)  # a bunched pair: too fast
    assert est.buckets() == {peer: rate_bucket(20 * MBIT)}
    est.add(peer, 1 * MBIT)  # a spread one: too slow
    est.add(peer, 20 * MBIT)
    assert est.buckets() == {peer: rate_bucket(20 * MBIT)}
    _lo, hi = rate_bounds(9)
    for _ in range(5):
        est.add(peer, hi / 8 * 2**0.2)  # 0.4 of a bucket past the edge: held
    assert est.buckets() == {peer: 9}
    for _ in range(5):
        est.add(peer, hi / 8 * 2**0.3)
    assert est.buckets() == {peer: 10}


def test_members_publishing_rates_plan_the_view_and_status_shows_the_links_between() -> None:
    """The metadata path: each member publishes a version-2 summary (round trips alike, rates
    fast inside, 20 Mbit/s across); every member's view is the same two-site hierarchical
    plan from throughput, and ``ftmesh status`` says what was measured between the sites."""
    ids = [nid(i) for i in range(4)]
    where = [0, 1, 0, 1]
    near = rtt_bucket(2e-4)
    members = []
    for i in range(4):
        peers = [j for j in range(4) if j != i]
        rtt = {ids[j]: near for j in peers}
        rate = {ids[j]: rate_bucket((1000 if where[i] == where[j] else 20) * MBIT) for j in peers}
        members.append(
            MemberSnapshot(
                node=ids[i],
                name=f"m{i}",
                addr=(f"10.0.0.{i + 1}", 7946),
                incarnation=1,
                state=MemberState.ALIVE,
                meta={
                    ROLE_KEY: "train",
                    DATA_KEY: f"10.0.0.{i + 1}:7947",
                    LINKS_KEY: format_links(rtt, rate),
                },
            )
        )
    view = view_of(members)
    assert view is not None and view.plan is not None and view.hierarchical
    assert view.plan.source == "throughput"
    assert {frozenset(s.members) for s in view.plan.sites} == {
        frozenset(ids[0::2]),
        frozenset(ids[1::2]),
    }
    lines = ring_plan_lines(members)
    assert lines[0].startswith("ring plan: 2 sites (throughput) ~1[2] ~2[2], hierarchical")
    lo, hi = rate_bounds(rate_bucket(20 * MBIT))
    assert "  between sites (measured): round trips 0.2" in lines[3], lines
    assert f"rates {lo / 1e6:.3g}-{hi / 1e6:.3g} Mbit/s" in lines[3], lines
