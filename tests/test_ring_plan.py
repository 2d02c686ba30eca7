"""The ring planner (``ftmesh.collective.topology``): sites from labels or measured round
trips, the ring order, flat or hierarchical, and the plan's hash; pure, so no I/O here."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmesh.collective.topology import (
    MAX_LINKS,
    LinkEstimator,
    MemberLinks,
    bucket_bounds,
    check_label,
    format_links,
    links_of,
    parse_links,
    plan_ring,
    rtt_bucket,
)
from ftmesh.collective.view import Peer, RingView, view_epoch
from ftmesh.errors import LocalUsageError
from ftmesh.membership.messages import MemberSnapshot, MemberState
from ftmesh.mesh.core import view_of
from ftmesh.mesh.meta import DATA_KEY, LINKS_KEY, ROLE_KEY, SITE_KEY, MetadataGate


def nid(i: int, salt: str = "") -> str:
    """A node id like the mesh's (32 hex characters), distinct per ``i``."""
    import hashlib

    return hashlib.blake2b(f"{salt}{i}".encode(), digest_size=16).hexdigest()


def measured(sites: list[list[str]], near: float, far: float) -> list[MemberLinks]:
    """Every member measured every peer: ``near`` seconds inside a site, ``far`` across."""
    where = {n: i for i, s in enumerate(sites) for n in s}
    out = []
    for a in where:
        rtt = {b: rtt_bucket(near if where[a] == where[b] else far) for b in where if b != a}
        out.append(MemberLinks.of(a, rtt=rtt))
    return out


def test_buckets_are_half_octaves_from_50us() -> None:
    assert rtt_bucket(0.0) == 0 and rtt_bucket(40e-6) == 0
    assert rtt_bucket(5e-3) == 14  # MIN_CROSS_BUCKET: about 5 ms
    assert rtt_bucket(4 * 1e-3) - rtt_bucket(1e-3) == 4  # 4x is 4 buckets
    for b in range(1, 35):
        lo, hi = bucket_bounds(b)
        assert rtt_bucket(lo * 1.0001) == b and rtt_bucket(hi * 0.9999) == b


def test_no_labels_no_measurement_is_one_site_ordered_by_id() -> None:
    ids = [nid(i) for i in range(5)]
    plan = plan_ring(MemberLinks.of(n) for n in ids)
    assert plan.flat and not plan.hierarchical and plan.source == "none"
    assert plan.order == tuple(sorted(ids))


def test_labels_make_sites_in_label_order_and_members_by_id() -> None:
    ids = [nid(i) for i in range(4)]
    labels = {ids[0]: "west", ids[1]: "east", ids[2]: "west", ids[3]: "east"}
    plan = plan_ring(MemberLinks.of(n, site=labels[n]) for n in ids)
    assert [s.label for s in plan.sites] == ["east", "west"]
    assert plan.sites[0].members == tuple(sorted([ids[1], ids[3]]))
    assert plan.sites[1].members == tuple(sorted([ids[0], ids[2]]))
    assert plan.hierarchical and plan.source == "labels"
    assert plan.order == plan.sites[0].members + plan.sites[1].members
    assert plan.site_of(ids[0]) == 1
    assert "2 sites (labels) east[2] west[2], hierarchical" in plan.describe()


def test_labels_win_over_measurement_and_unlabeled_members_form_a_site() -> None:
    ids = [nid(i) for i in range(4)]
    links = measured([ids[:2], ids[2:]], near=1e-4, far=0.05)  # measured: {0,1} {2,3}
    relabel = {ids[0]: "a", ids[2]: "a"}  # labels say {0,2}, and {1,3} unlabeled
    plan = plan_ring(MemberLinks(m.node, relabel.get(m.node, ""), m.rtt) for m in links)
    assert [s.label for s in plan.sites] == ["", "a"]
    assert set(plan.sites[1].members) == {ids[0], ids[2]}
    assert plan.source == "labels"


def test_unequal_sites_reduce_hierarchically_in_blocks_of_the_smallest_site() -> None:
    """3 + 2: hierarchical, 2 blocks; the third member of the larger site has no cross-site
    group. 2 + 1: 1 block. Sites of one member each: the flat ring."""
    ids = [nid(i) for i in range(5)]
    plan = plan_ring(MemberLinks.of(n, site="a" if i < 3 else "b") for i, n in enumerate(ids))
    assert len(plan.sites) == 2 and plan.hierarchical and plan.blocks == 2
    assert plan.why_flat == "" and "a[3] b[2], hierarchical" in plan.describe()
    assert plan.order == tuple(sorted(ids[:3])) + tuple(sorted(ids[3:]))
    view = RingView.of(peers(ids), plan)
    a, b = plan.sites
    crosses = {n: view.groups(n)[1] for n in ids}
    assert crosses[a.members[2]] is None
    for k in range(2):
        for n in (a.members[k], b.members[k]):
            cross = crosses[n]
            assert cross is not None and cross.node_ids == (a.members[k], b.members[k])
    small = plan_ring(MemberLinks.of(n, site="a" if i < 2 else "b") for i, n in enumerate(ids[:3]))
    assert small.hierarchical and small.blocks == 1
    single = plan_ring(MemberLinks.of(n, site=str(i)) for i, n in enumerate(ids[:2]))
    assert not single.hierarchical and single.why_flat == "one member per site"


def test_measured_two_sites() -> None:
    ids = [nid(i) for i in range(6)]
    truth = [ids[0::2], ids[1::2]]
    plan = plan_ring(measured(truth, near=3e-4, far=0.04))
    assert plan.source == "measured" and plan.hierarchical
    assert {frozenset(s.members) for s in plan.sites} == {frozenset(s) for s in truth}
    assert [s.label for s in plan.sites] == ["~1", "~2"]
    assert plan.sites[0].members[0] == min(ids)  # measured sites: by their smallest id


def test_gap_too_small_or_cross_too_fast_is_one_site() -> None:
    ids = [nid(i) for i in range(4)]
    # 3x slower across: below the ~4x gap
    assert plan_ring(measured([ids[:2], ids[2:]], near=1e-3, far=3e-3)).flat
    # 10x slower but only 2 ms: a LAN, not two sites
    assert plan_ring(measured([ids[:2], ids[2:]], near=2e-4, far=2e-3)).flat
    # 4x and 8 ms: two sites
    assert not plan_ring(measured([ids[:2], ids[2:]], near=2e-3, far=8e-3)).flat


def test_missing_measurements_never_split() -> None:
    ids = [nid(i) for i in range(4)]
    links = measured([ids[:2], ids[2:]], near=1e-4, far=0.05)
    # a newcomer nobody measured yet, which measured nobody: one site until it is
    plan = plan_ring([*links, MemberLinks.of(nid(99))])
    assert plan.flat and plan.source == "measured"
    # every link between the sites unknown: no evidence that they are far apart
    inside = [MemberLinks(m.node, "", tuple((p, b) for p, b in m.rtt if b < 10)) for m in links]
    assert plan_ring(inside).flat
    # one direction known is enough (the other member has not probed it yet)
    one_way = [links[0], *(MemberLinks(m.node) for m in links[1:])]
    assert plan_ring(one_way).flat  # (only links from member 0: the others are isolated)


def test_symmetrised_with_the_larger_direction() -> None:
    a, b, c, d = (nid(i) for i in range(4))
    near, far = rtt_bucket(1e-4), rtt_bucket(0.05)
    base = {
        a: {b: near, c: far, d: far},
        b: {a: near, c: far, d: far},
        c: {d: near, a: far, b: far},
        d: {c: near, a: far, b: far},
    }
    assert plan_ring(MemberLinks.of(n, rtt=r) for n, r in base.items()).hierarchical
    # b says a is far: the larger direction wins, a and b are sites of their own
    skew = {**base, b: {a: far, c: far, d: far}}
    plan = plan_ring(MemberLinks.of(n, rtt=r) for n, r in skew.items())
    assert sorted(len(s.members) for s in plan.sites) == [1, 1, 2]
    assert plan.hierarchical and plan.blocks == 1
    # a direction nobody measured takes the other one's bucket
    half = {**base, b: {c: far, d: far}}
    assert plan_ring(MemberLinks.of(n, rtt=r) for n, r in half.items()).hierarchical


def test_three_tiers_take_the_finest_split_over_5ms() -> None:
    # racks (0.1 ms) inside zones (1 ms: under the 5 ms floor) inside two regions (60 ms)
    ids = [nid(i) for i in range(8)]
    region = {n: i // 4 for i, n in enumerate(ids)}
    zone = {n: i // 2 for i, n in enumerate(ids)}
    links = []
    for a in ids:
        rtt = {}
        for b in ids:
            if b != a:
                rtt[b] = rtt_bucket(
                    1e-4 if zone[a] == zone[b] else 1e-3 if region[a] == region[b] else 0.06
                )
        links.append(MemberLinks.of(a, rtt=rtt))
    plan = plan_ring(links)
    assert {frozenset(s.members) for s in plan.sites} == {frozenset(ids[:4]), frozenset(ids[4:])}


def test_hash_depends_on_the_plan_not_on_the_inputs() -> None:
    ids = [nid(i) for i in range(4)]
    a = plan_ring(measured([ids[:2], ids[2:]], near=1e-4, far=0.05))
    b = plan_ring(measured([ids[:2], ids[2:]], near=3e-4, far=0.2))
    assert a.sites == b.sites and a.hash == b.hash  # other buckets, same plan
    c = plan_ring(measured([[ids[0], ids[2]], [ids[1], ids[3]]], near=1e-4, far=0.05))
    assert c.hash != a.hash and len(a.hash) == 16
    flat = plan_ring(MemberLinks.of(n) for n in ids)
    assert flat.hash != a.hash


def test_links_format_round_trip_and_bounds() -> None:
    ids = [nid(i) for i in range(60)]
    buckets = {n: i % 36 for i, n in enumerate(ids)}
    text = format_links(buckets)
    assert len(text) == 1 + MAX_LINKS * 9 <= 512
    back = parse_links(text)
    assert len(back) == MAX_LINKS
    resolved = links_of(back, ids)
    # the nearest MAX_LINKS peers were kept
    kept = sorted(buckets.items(), key=lambda kv: (kv[1], kv[0]))[:MAX_LINKS]
    assert resolved == dict(kept)
    assert parse_links("1") == {}


@pytest.mark.parametrize(
    "bad",
    [
        None,
        7,
        "",
        "3",
        "2" + "0" * 9,
        "1abc",
        "1" + "g" * 9,
        "1" + "A" * 9,
        "1" + "0" * 18,
        "1" + "a" * 500,
    ],
)
def test_links_parser_refuses_malformed_values(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_links(bad)


def test_links_of_ignores_unknown_and_shared_prefixes() -> None:
    a, b = "deadbeef" + "0" * 24, "deadbeef" + "1" * 24
    c = "cafebabe" + "2" * 24
    assert links_of({"deadbeef": 3, "cafebabe": 5, "01234567": 9}, [a, b, c]) == {c: 5}


def test_labels_are_checked() -> None:
    assert check_label("eu-west-1a") == "eu-west-1a"
    for bad in ("", "-x", "a b", "x" * 64, "é", "~1"):
        with pytest.raises(ValueError):
            check_label(bad)


def test_estimator_holds_a_bucket_until_the_estimate_leaves_it_by_half_a_bucket() -> None:
    est = LinkEstimator(window=4, min_samples=1)
    peer = nid(1)
    lo, hi = bucket_bounds(10)
    est.add(peer, (lo * hi) ** 0.5)
    assert est.buckets() == {peer: 10}
    # samples just over the upper edge: a new minimum never comes, but the window fills
    for _ in range(4):
        est.add(peer, hi * 1.05)
    assert est.buckets() == {peer: 10}  # within half a bucket past the edge: held
    for _ in range(4):
        est.add(peer, hi * 2**0.3)  # 0.6 bucket past the edge
    assert est.buckets() == {peer: 11}
    # back down only below 10.5
    for _ in range(4):
        est.add(peer, lo * 2**0.45)  # position 10.9: still 11 - 0.5 <= pos
    assert est.buckets() == {peer: 11}
    for _ in range(4):
        est.add(peer, lo * 1.01)
    assert est.buckets() == {peer: 10}
    # the minimum of the window: one slow sample (queueing) does not move it
    est.add(peer, 1.0)
    assert est.buckets() == {peer: 10}
    est.add(peer, float("nan"))
    est.forget([])
    assert est.buckets() == {}


def test_a_link_is_published_only_once_it_has_enough_samples() -> None:
    """A process's first round trips (imports, a loaded host) may all be slow: a link
    published from one of them could split a site off and flip the plan, and the view, for a
    links interval."""
    est = LinkEstimator(window=8, min_samples=3)
    peer = nid(1)
    lo, hi = bucket_bounds(10)
    est.add(peer, 0.02)  # a slow first sample (bucket 16: a site's distance)
    est.add(peer, 0.02)
    assert est.buckets() == {}  # not yet: an unpublished link splits nothing
    est.add(peer, (lo * hi) ** 0.5)
    assert est.buckets() == {peer: 10}  # the minimum of the three


# -- properties ------------------------------------------------------------------------------

shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4)


def world(
    shape: list[int], salt: int, near: float, far: float
) -> tuple[list[list[str]], list[MemberLinks]]:
    sites, k = [], 0
    for size in shape:
        sites.append([nid(k + i, str(salt)) for i in range(size)])
        k += size
    return sites, measured(sites, near, far)


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(0, 10**6), st.randoms(use_true_random=False))
def test_permutation_invariance(shape: list[int], salt: int, rnd: random.Random) -> None:
    _, links = world(shape, salt, 1e-4, 0.05)
    plan = plan_ring(links)
    shuffled = list(links)
    rnd.shuffle(shuffled)
    shuffled = [MemberLinks(m.node, m.site, tuple(rnd.sample(m.rtt, len(m.rtt)))) for m in shuffled]
    again = plan_ring(shuffled)
    assert again == plan and again.hash == plan.hash and again.order == plan.order


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(0, 10**6))
def test_clean_measurements_find_the_true_sites(shape: list[int], salt: int) -> None:
    sites, links = world(shape, salt, 2e-4, 0.03)
    plan = plan_ring(links)
    multi = [s for s in sites if s]
    if len(multi) == 1:
        assert plan.flat
        return
    if all(len(s) == 1 for s in multi):
        # singletons only: every link is a "cross" link, no threshold leaves two components
        assert plan.flat
        return
    # (a singleton site next to larger ones is found too: its links are all far)
    assert {frozenset(s.members) for s in plan.sites} == {frozenset(s) for s in multi}
    assert plan.hierarchical == (max(len(s) for s in multi) >= 2)
    assert plan.blocks == min(len(s) for s in multi)


@settings(max_examples=60, deadline=None)
@given(
    shapes,
    st.integers(0, 10**6),
    st.lists(st.floats(-0.15, 0.15), min_size=64, max_size=64),
)
def test_noise_inside_a_bucket_changes_nothing(
    shape: list[int], salt: int, noise: list[float]
) -> None:
    """Times at bucket centres, jittered by up to +-15% (a bucket is +-19% around its
    centre): the same buckets, so the same plan and hash."""
    centre = {b: (bucket_bounds(b)[0] * bucket_bounds(b)[1]) ** 0.5 for b in (6, 20)}
    sites, clean = world(shape, salt, centre[6], centre[20])
    where = {n: i for i, s in enumerate(sites) for n in s}
    noisy = []
    for j, m in enumerate(clean):
        rtt = {}
        for k, (peer, _) in enumerate(m.rtt):
            base = centre[6] if where[m.node] == where[peer] else centre[20]
            rtt[peer] = rtt_bucket(base * (1 + noise[(j * 7 + k) % len(noise)]))
        noisy.append(MemberLinks.of(m.node, rtt=rtt))
    assert plan_ring(noisy) == plan_ring(clean)


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.text("0123456789abcdef", min_size=32, max_size=32), st.integers(0, 35), max_size=70
    )
)
def test_links_round_trip_property(buckets: dict[str, int]) -> None:
    back = links_of(parse_links(format_links(buckets)), buckets)
    kept = dict(sorted(buckets.items(), key=lambda kv: (kv[1], kv[0]))[:MAX_LINKS])
    # every resolved entry is right; only shared prefixes are lost
    assert all(kept[n] == b for n, b in back.items())
    prefixes = [n[:8] for n in buckets]
    assert set(back) == {n for n in kept if prefixes.count(n[:8]) == 1}


# -- the plan in the view ----------------------------------------------------------------------


def peers(ids: list[str]) -> list[Peer]:
    return [Peer(n, "127.0.0.1", 9000 + i) for i, n in enumerate(ids)]


def test_a_one_site_view_keeps_its_epoch_and_order() -> None:
    ids = [nid(i) for i in range(4)]
    bare = RingView.of(peers(ids))
    for plan in (
        plan_ring(MemberLinks.of(n) for n in ids),
        plan_ring(MemberLinks.of(n, site="lab") for n in ids),
        plan_ring(measured([ids], 1e-4, 0.05)),
    ):
        planned = RingView.of(peers(ids), plan)
        assert planned.epoch == bare.epoch == view_epoch(ids)
        assert planned.node_ids == tuple(sorted(ids)) and planned == bare
        assert not planned.hierarchical


def test_a_planned_view_follows_the_plan_and_its_epoch_holds_the_plan() -> None:
    ids = [nid(i) for i in range(4)]
    a = plan_ring(MemberLinks.of(n, site="a" if i % 2 else "b") for i, n in enumerate(ids))
    b = plan_ring(MemberLinks.of(n, site="a" if i < 2 else "b") for i, n in enumerate(ids))
    va, vb = RingView.of(peers(ids), a), RingView.of(peers(ids), b)
    assert va.node_ids == a.order and vb.node_ids == b.order
    # the same members, two plans: two epochs, neither the unplanned one
    assert len({va.epoch, vb.epoch, view_epoch(ids)}) == 3
    assert va.epoch == RingView.of(reversed(peers(ids)), a).epoch  # input order is irrelevant
    assert va.right_of(a.order[-1]).node_id == a.order[0] and va.hierarchical
    with pytest.raises(LocalUsageError):
        RingView.of(peers(ids[:3]), a)


def test_sub_views_have_their_own_epochs() -> None:
    ids = [nid(i) for i in range(4)]
    plan = plan_ring(MemberLinks.of(n, site="a" if i < 2 else "b") for i, n in enumerate(ids))
    view = RingView.of(peers(ids), plan)
    seen = {view.epoch}
    for n in ids:
        site, cross = view.groups(n)
        assert cross is not None
        assert n in site and n in cross and site.size == 2 and cross.size == 2
        assert site.parent == cross.parent == view.epoch
        assert site.node_ids == plan.sites[plan.site_of(n)].members  # in the plan's order
        seen |= {site.epoch, cross.epoch}
    # 2 sites + 2 cross groups, derived alike by every member, none equal to a real view's
    assert len(seen) == 5
    assert all(view_epoch(s) not in seen for s in ([ids[0], ids[1]], [ids[2], ids[3]]))
    # the same members under another parent: other epochs
    other = RingView.of(
        peers(ids), plan_ring(MemberLinks.of(n, site=f"x{i < 2}") for i, n in enumerate(ids))
    )
    assert not {g.epoch for n in ids for g in other.groups(n) if g is not None} & seen
    with pytest.raises(LocalUsageError):
        RingView.of(peers(ids)).groups(ids[0])


def _member(i: int, ids: list[str], **meta: object) -> MemberSnapshot:
    return MemberSnapshot(
        node=ids[i],
        name=f"m{i}",
        addr=("127.0.0.1", 7000 + i),
        incarnation=1,
        state=MemberState.ALIVE,
        meta={ROLE_KEY: "train", DATA_KEY: f"127.0.0.1:{9000 + i}", **meta},  # type: ignore[dict-item]
    )


def test_the_mesh_view_is_planned_from_metadata() -> None:
    ids = [nid(i) for i in range(4)]
    where = [0, 1, 0, 1]
    labelled = [_member(i, ids, **{SITE_KEY: f"s{where[i]}"}) for i in range(4)]
    view = view_of(labelled)
    assert view is not None and view.hierarchical
    assert [view.plan.site_of(n) for n in view.node_ids] == [0, 0, 1, 1]  # type: ignore[union-attr]
    # measured: every member publishes its buckets
    near, far = rtt_bucket(1e-4), rtt_bucket(0.05)
    measured_members = [
        _member(
            i,
            ids,
            **{
                LINKS_KEY: format_links(
                    {ids[j]: near if where[i] == where[j] else far for j in range(4) if j != i}
                )
            },
        )
        for i in range(4)
    ]
    mview = view_of(measured_members)
    assert mview is not None and mview.plan is not None and mview.plan.source == "measured"
    assert {frozenset(s.members) for s in mview.plan.sites} == {
        frozenset(ids[0::2]),
        frozenset(ids[1::2]),
    }
    # a member whose links do not parse keeps its place, measured nothing: one site; counted
    gate = MetadataGate()
    broken = [*measured_members[:3], _member(3, ids, **{LINKS_KEY: "1zz"})]
    bview = view_of(broken, gate=gate)
    assert bview is not None and bview.size == 4 and bview.plan is not None
    assert gate.bad_meta == 1
    # (member 3's links gone, but the others' links to it still separate the sites)
    assert bview.hierarchical
    # a bad site label: that member is unusable (left out, counted)
    gate = MetadataGate()
    bad_label = [*labelled[:3], _member(3, ids, **{SITE_KEY: "not a label"})]
    lview = view_of(bad_label, gate=gate)
    assert lview is not None and lview.size == 3 and gate.bad_meta == 1
