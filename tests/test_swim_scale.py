"""What lets the simulator run 10,000 members in one process (issue 30, item 6): forgotten
members leave no search behind, members can start from one shared member list (a batched join),
and the simulator's queries loop in C. Each test checks the behaviour the shortcut must keep."""

from __future__ import annotations

import copy
import json
import random

import pytest

from ftmesh.cli.main import run as ftmesh_cli
from ftmesh.errors import LocalUsageError
from ftmesh.membership.broadcast import BroadcastQueue
from ftmesh.membership.config import MembershipConfig
from ftmesh.membership.messages import (
    Ack,
    Address,
    Alive,
    Dead,
    MemberSnapshot,
    MemberState,
    Message,
    Nack,
    Ping,
    PushPull,
    Suspect,
)
from ftmesh.membership.swim import Send, Swim
from ftmesh.membership.wire import encoded_size
from ftmesh.sim.bench import format_report, run_membership_bench
from ftmesh.sim.network import SimNetwork

LOCAL = MembershipConfig.preset("local")


def machine(seed: int = 0) -> Swim:
    return Swim(
        node_id="a" * 32,
        name="me",
        addr=("10.0.0.1", 7946),
        config=LOCAL,
        rng=random.Random(seed),
        now=0.0,
    )


def peer(i: int, incarnation: int = 1) -> Alive:
    return Alive(
        node=f"{i:032x}", name=f"n{i}", addr=("10.0.1.1", 1000 + i), incarnation=incarnation
    )


def run(swim: Swim, now: float, until: float, living: set[int]) -> tuple[float, set[Address]]:
    """Tick ``swim`` every 50 ms until ``until``; members in ``living`` answer its pings.
    Returns the time reached and the addresses it sent to."""
    sent_to: set[Address] = set()
    while now < until:
        now += 0.05
        for e in swim.tick(now):
            if not isinstance(e, Send):
                continue
            sent_to.add(e.dest)
            i = e.dest[1] - 1000
            for m in e.msgs:
                if isinstance(m, Ping) and i in living:
                    swim.receive(now, e.dest, [Ack(seq=m.seq, source=f"{i:032x}")])
    return now, sent_to


def test_forgotten_members_are_never_picked_and_return_to_one_slot() -> None:
    swim = machine()
    for i in range(40):
        swim.receive(0.0, ("h", 1), [peer(i)])
    for i in range(30):
        swim.receive(0.0, ("h", 1), [Dead(node=f"{i:032x}", incarnation=1, accuser="b" * 32)])
    now, _ = run(swim, 0.0, LOCAL.dead_reclaim + 2, set(range(30, 40)))
    assert {m.node for m in swim.members()[1:]} == {f"{i:032x}" for i in range(30, 40)}
    # Gossip and probes went to the dead until they were forgotten; from then on only to the
    # living.
    for i in range(40, 45):  # news to spread, so gossip rounds send packets
        swim.receive(now, ("h", 1), [peer(i)])
    # 50 probe periods (5 s when the local preset probed every 0.1 s): every member is
    # probed or gossiped to in that time.
    window = 50 * LOCAL.probe_interval
    now, sent_to = run(swim, now, now + window, set(range(30, 45)))
    assert sent_to == {("10.0.1.1", 1000 + i) for i in range(30, 45)}
    # Five of the forgotten come back: each is known once and picked like any other.
    for i in range(5):
        swim.receive(now, ("h", 1), [peer(i, incarnation=2)])
    known = {m.node for m in swim.members()[1:]}
    assert len(known) == 20 and swim.num_live() == 21
    assert sorted(swim._peer_ids) == sorted(set(swim._peer_ids))
    assert set(swim._peer_ids) - swim._stale == known
    now, sent_to = run(swim, now, now + window, set(range(5)) | set(range(30, 45)))
    assert sent_to == {("10.0.1.1", 1000 + i) for i in [*range(5), *range(30, 45)]}
    assert swim.num_live() == 21


def test_forgotten_ids_are_compacted_away() -> None:
    swim = machine()
    for i in range(100):
        swim.receive(0.0, ("h", 1), [peer(i)])
    for i in range(90):
        swim.receive(0.0, ("h", 1), [Dead(node=f"{i:032x}", incarnation=1, accuser="b" * 32)])
    run(swim, 0.0, LOCAL.dead_reclaim + 2, set(range(90, 100)))
    assert len(swim.members()) == 11
    # Stale ids are bounded by half the list (plus a little): the list does not grow with
    # every member ever forgotten.
    assert len(swim._stale) <= 16 + len(swim._peer_ids) // 2
    assert len(swim._peer_ids) < 100
    assert set(swim._peer_ids) - swim._stale == {f"{i:032x}" for i in range(90, 100)}
    assert swim.state_of(f"{95:032x}") == MemberState.ALIVE


def test_converged_checks_every_view_exactly() -> None:
    net = SimNetwork(seed=5, config=LOCAL)
    nodes = [net.add_node()]
    for _ in range(5):
        nodes.append(net.add_node(join=[nodes[0].addr]))
    net.run_until(3.0)
    assert net.converged()
    a, b = nodes[1], nodes[2]
    assert a.swim.alive_among(n.swim.node_id for n in nodes) == 5
    # A member that someone sees as dead, while that one sees a stranger alive: the number
    # of live members is right, so only the member-by-member check can tell.
    net.inject(a, ("h", 1), (Dead(node=b.swim.node_id, incarnation=1, accuser="x" * 32),))
    # (The stranger's address is a member's, which answers no ping meant for another id.)
    stranger = Alive(node="f" * 32, name="stranger", addr=nodes[5].addr, incarnation=1)
    net.inject(a, ("h", 1), (stranger,))
    assert a.swim.num_live() == len(nodes)
    assert a.swim.alive_among(n.swim.node_id for n in nodes) == 4
    assert not net.converged()
    # A crash: not converged until every survivor has declared it dead (and the stranger,
    # who answers no probe, is dead too).
    net.run_until(net.now + 3 * LOCAL.crash_detection_bound(6))
    assert net.converged()
    net.crash(nodes[3])
    assert not net.converged()
    net.run_until(net.now + LOCAL.crash_detection_bound(6) + 1)
    assert net.converged()


def test_settled_mesh_shares_records_and_runs_the_protocol() -> None:
    net = SimNetwork(seed=3, config=LOCAL, loss=0.02)
    nodes = net.add_settled(40)
    assert net.converged() and not net.events
    ids = [n.swim.node_id for n in nodes]
    # Every table holds the same record objects: one per member, not one per pair.
    first = nodes[0].swim.member(ids[5])
    assert first is not None and first.state == MemberState.ALIVE and first.incarnation == 1
    assert all(n.swim.member(ids[5]) is first for n in nodes if n is not nodes[5])
    net.run_until(5.0)
    assert net.converged()
    assert not [e for e in net.events if e.event.kind in ("suspect", "dead")]
    # The protocol runs as on a mesh that joined one by one: a crash is detected by all,
    # and a joiner becomes known to all.
    net.crash(nodes[7])
    joiner = net.add_node(join=[nodes[0].addr])
    net.run_until(net.now + LOCAL.crash_detection_bound(40) + 1.0)
    assert net.converged()
    deaths = [e for e in net.events if e.event.kind == "dead"]
    assert {e.event.member.node for e in deaths} == {ids[7]}
    assert {e.observer for e in deaths} >= set(ids) - {ids[7]}
    assert all(n.swim.state_of(joiner.swim.node_id) == MemberState.ALIVE for n in nodes[8:])


def test_adopt_adds_only_the_unknown_and_keeps_departed_ones_departed() -> None:
    swim = machine()
    swim.receive(0.0, ("h", 1), [peer(1, incarnation=3)])
    records = {
        f"{i:032x}": MemberSnapshot(
            node=f"{i:032x}",
            name=f"n{i}",
            addr=("10.0.1.1", 1000 + i),
            incarnation=1,
            state=MemberState.DEAD if i == 4 else MemberState.ALIVE,
        )
        for i in range(1, 6)
    }
    records["a" * 32] = MemberSnapshot(
        node="a" * 32, name="me", addr=("10.0.0.1", 7946), incarnation=9, state=MemberState.DEAD
    )
    swim.adopt(1.0, records)
    assert swim.incarnation == 1 and swim.state_of("a" * 32) == MemberState.ALIVE
    kept = swim.member(f"{1:032x}")
    assert kept is not None and kept.incarnation == 3  # known already: left as it was
    assert swim.member(f"{2:032x}") is records[f"{2:032x}"]
    assert swim.num_live() == 1 + 4  # us, 1, 2, 3, 5
    assert swim.state_of(f"{4:032x}") == MemberState.DEAD
    # The dead one is forgotten after dead_reclaim like any other departed member.
    run(swim, 1.0, 2.0 + LOCAL.dead_reclaim, {1, 2, 3, 5})
    assert swim.member(f"{4:032x}") is None and swim.num_live() == 5


def test_bench_runs_either_way_of_joining() -> None:
    bound = LOCAL.crash_detection_bound(30)
    for joins in ("batch", "storm"):
        r = run_membership_bench(
            nodes=30, loss=0.01, preset="local", duration=10, crashes=3, seed=2, joins=joins
        )
        assert r.joins == joins and f"({joins} joins)" in format_report(r)
        assert r.converged_after_warmup and r.crashes == 3 and r.undetected == 0
        assert 0 < r.detect_first_p50_s <= r.detect_all_p99_s <= bound
        assert r.false_positive_deaths == 0 and 0 < r.join_dissemination_s < 5
    with pytest.raises(LocalUsageError, match="joins"):
        run_membership_bench(
            nodes=3, loss=0.0, preset="local", duration=1, crashes=0, seed=1, joins="all"
        )


def test_push_pull_bytes_are_counted_as_encoded() -> None:
    net = SimNetwork(seed=1, config=LOCAL)
    nodes = net.add_settled(20)
    net.run_until(1.0)
    swim = nodes[3].swim
    swim.update_meta(1.0, {"role": "train", "data": "10.0.0.9:29500", "n": 12345})
    for members in (0, 1, 15, 16, 21):
        for join in (False, True):
            state = swim.push_pull_state(join=join)
            pp = PushPull(source=state.source, members=state.members[:members], join=join)
            assert net._push_pull_size(pp) == encoded_size(pp)
            assert net._push_pull_size(pp) == encoded_size(pp)  # from the cache


def test_each_probe_round_visits_every_live_member_once() -> None:
    swim = machine(seed=4)
    for i in range(30):
        swim.receive(0.0, ("h", 1), [peer(i)])
    for i in range(5):
        swim.receive(0.0, ("h", 1), [Dead(node=f"{i:032x}", incarnation=1, accuser="b" * 32)])
    living = set(range(5, 30))
    probed: list[int] = []
    now = 0.0
    while len(probed) < 3 * len(living):
        now += 0.01
        for e in swim.tick(now):
            if not isinstance(e, Send):
                continue
            for m in e.msgs:
                if isinstance(m, Ping):
                    probed.append(e.dest[1] - 1000)
                    swim.receive(now, e.dest, [Ack(seq=m.seq, source=m.target)])
    rounds = [probed[k : k + 25] for k in range(0, 75, 25)]
    assert all(sorted(r) == sorted(living) for r in rounds)
    assert rounds[0] != rounds[1]  # a new random order each round


def test_adopt_refuses_suspects_and_changes_nothing_then() -> None:
    swim = machine()
    good = MemberSnapshot(
        node="b" * 32, name="b", addr=("10.0.0.2", 1), incarnation=1, state=MemberState.ALIVE
    )
    bad = MemberSnapshot(
        node="c" * 32, name="c", addr=("10.0.0.3", 1), incarnation=1, state=MemberState.SUSPECT
    )
    with pytest.raises(LocalUsageError, match="suspect"):
        swim.adopt(0.0, {good.node: good, bad.node: bad})
    assert swim.members()[1:] == [] and swim.num_live() == 1
    swim.adopt(0.0, {good.node: good})
    assert swim.members()[1:] == [good] and swim.num_live() == 2


def test_merging_shared_records_changes_nothing_but_counts_a_suspect_accuser() -> None:
    a, b = machine(seed=1), machine(seed=2)
    records = {
        f"{i:032x}": MemberSnapshot(
            node=f"{i:032x}",
            name=f"n{i}",
            addr=("10.0.1.1", 1000 + i),
            incarnation=1,
            state=MemberState.ALIVE,
        )
        for i in range(1, 8)
    }
    a.adopt(0.0, records)
    b.adopt(0.0, records)
    a.tick(1.0)
    assert a.merge_push_pull(1.0, b.push_pull_state()) == []  # nothing new: no event
    # A suspicion with room for confirmations (k = suspicion_mult - 2): a peer whose table
    # holds our very suspect record is one more accuser, as a fresh copy of it would be.
    x = f"{3:032x}"
    a.receive(1.0, ("h", 1), [Suspect(node=x, incarnation=1, accuser="c" * 32)])
    mine = a.member(x)
    assert mine is not None and mine.state == MemberState.SUSPECT
    before = a._suspicions[x].deadline
    a.merge_push_pull(1.0, PushPull(source="d" * 32, members=(mine,)))
    assert a._suspicions[x].accusers == {"c" * 32, "d" * 32}
    assert a._suspicions[x].deadline < before


def test_gossip_rounds_sleep_while_nothing_is_queued_and_resume_on_their_grid() -> None:
    swim = machine(seed=7)
    swim.receive(0.0, ("h", 1), [peer(i) for i in range(3)])
    gossip_times: list[float] = []
    deadlines: list[float] = []
    now = 0.0
    while now < 3.0:
        now = swim.next_deadline()
        for e in swim.tick(now):
            if not isinstance(e, Send):
                continue
            if not any(isinstance(m, Ping | Ack) for m in e.msgs):
                gossip_times.append(now)  # a packet of rumours alone: a gossip round
            for m in e.msgs:
                if isinstance(m, Ping):
                    swim.receive(now, e.dest, [Ack(seq=m.seq, source=m.target)])
        deadlines.append(swim.next_deadline() - now)
    interval = LOCAL.gossip_interval
    g0 = gossip_times[0]
    assert gossip_times[-1] < 1.0  # the rumours are spread, the rounds stop
    assert all(abs((t - g0) / interval - round((t - g0) / interval)) < 1e-6 for t in gossip_times)
    assert max(deadlines[-10:]) > interval  # no timer every gossip interval any more
    # A rumour at an odd time goes out at the next round of the old grid.
    at = now + 0.0123
    swim.receive(at, ("h", 1), [peer(9)])
    assert swim.next_deadline() <= at + interval
    sent = swim.tick(swim.next_deadline())
    when = swim._now
    assert any(isinstance(e, Send) and isinstance(e.msgs[0], Alive) for e in sent)
    k = (when - g0) / interval
    assert abs(k - round(k)) < 1e-6 and at <= when < at + interval


def _view(swim: Swim) -> tuple[object, ...]:
    """Everything a merge can change, in a comparable form (order aside)."""
    members = {m.node: (m.incarnation, m.state, m.name, m.addr, m.meta) for m in swim.members()}
    suspicions = {n: (s.incarnation, frozenset(s.accusers)) for n, s in swim._suspicions.items()}
    queued = {
        (type(r.msg).__name__, r.msg.node, r.msg.incarnation) for r in swim._queue._by_key.values()
    }
    return members, swim.num_live(), suspicions, set(swim._departed), queued, swim.incarnation


def test_settled_push_pulls_merge_and_count_as_the_full_state() -> None:
    """Members that adopted one table exchange only their departures from it: the outcome
    of each merge, and the bytes counted, are those of the full exchange."""
    net = SimNetwork(seed=11, config=LOCAL, loss=0.05)
    nodes = net.add_settled(24)
    rng = random.Random(5)
    net.run_until(1.0)
    for victim in rng.sample(nodes[1:], 4):
        net.crash(victim)
    net.pause(nodes[0])
    net.add_node(join=[nodes[1].addr])
    compared = 0
    resurrected = False
    for t in (3.0, 12.0, 40.0, 70.0):  # suspicions, deaths, then reaped members
        net.run_until(t)
        if t == 40.0:
            net.resume(nodes[0])
        live = [n for n in nodes if not n.crashed and not n.paused]
        pairs = [tuple(rng.sample(live, 2)) for _ in range(6)]
        if t == 40.0:
            # The member back from a pause still holds the shared records of members the
            # others have forgotten: its push-pull brings them back (as SWIM does).
            pairs[:0] = [(nodes[0], live[1]), (live[2], nodes[0])]
        for src, dest in pairs:
            a, b = copy.deepcopy((src.swim, dest.swim))
            a2, b2 = copy.deepcopy((src.swim, dest.swim))
            req, rep = a.push_pull_state(), b.push_pull_state()
            ev_b, ev_a = b.merge_push_pull(t, req), a.merge_push_pull(t, rep)
            _, a_own, a_dropped = a2.shared_table()
            _, b_own, b_dropped = b2.shared_table()
            req2 = a2.push_pull_subset(dict.fromkeys([*a_own, *b_dropped]))
            rep2 = b2.push_pull_subset(dict.fromkeys([*b_own, *a_dropped]))
            ev_b2, ev_a2 = b2.merge_push_pull(t, req2), a2.merge_push_pull(t, rep2)
            assert _view(a) == _view(a2) and _view(b) == _view(b2)
            assert sorted(map(repr, ev_a)) == sorted(map(repr, ev_a2))
            assert sorted(map(repr, ev_b)) == sorted(map(repr, ev_b2))
            settled = next(iter(net._settled.values()))
            assert net._settled_state_size(src, req2, a_own, a_dropped, settled) == encoded_size(
                req
            )
            compared += bool(a_own or b_dropped)
            resurrected |= len(b.members()) > len(dest.swim.members()) and src is nodes[0]
    assert compared >= 10  # most exchanges had departures to carry
    assert resurrected


def test_a_settled_push_pull_brings_back_what_the_peer_forgot() -> None:
    """The subset names the shared members the peer no longer holds: a member that still
    holds one's shared ALIVE record re-announces it to a peer that forgot it, as the full
    state would."""
    records = {
        f"{i:032x}": MemberSnapshot(
            node=f"{i:032x}",
            name=f"n{i}",
            addr=("10.0.1.1", 1000 + i),
            incarnation=1,
            state=MemberState.ALIVE,
        )
        for i in range(1, 9)
    }
    a, b = (
        Swim(
            node_id=f"{i:032x}",
            name=f"n{i}",
            addr=("10.0.1.1", 1000 + i),
            config=LOCAL,
            rng=random.Random(i),
            now=0.0,
        )
        for i in (1, 2)
    )
    a.adopt(0.0, records)
    b.adopt(0.0, records)
    x = f"{5:032x}"
    b.receive(0.0, ("h", 1), [Dead(node=x, incarnation=1, accuser="c" * 32)])
    run(b, 0.0, LOCAL.dead_reclaim + 2, set(range(1, 9)) - {5})
    assert b.member(x) is None and a.member(x) is records[x]
    _, a_own, _ = a.shared_table()
    _, _, b_dropped = b.shared_table()
    assert x in b_dropped and x not in a_own
    full = copy.deepcopy(b)
    full.merge_push_pull(40.0, a.push_pull_state())
    b.merge_push_pull(40.0, a.push_pull_subset(dict.fromkeys([*a_own, *b_dropped])))
    assert _view(b) == _view(full)
    assert b.state_of(x) == MemberState.ALIVE


def _converged_by_definition(net: SimNetwork) -> bool:
    nodes = [n for n in net.live_nodes() if not n.paused]
    running = {n.swim.node_id for n in nodes}
    return all(
        {m.node for m in n.swim.members() if m.state == MemberState.ALIVE} == running
        and not any(m.state == MemberState.SUSPECT for m in n.swim.members())
        for n in nodes
    )


def test_converged_on_a_settled_mesh_matches_the_definition() -> None:
    net = SimNetwork(seed=8, config=LOCAL, loss=0.02)
    nodes = net.add_settled(20)
    answers = []
    for t, action in [
        (1.0, "crash"),
        (1.2, "pause"),
        (8.0, "resume"),
        (20.0, "inject"),
        (20.5, ""),
        (40.0, "join"),
        (45.0, ""),
        (80.0, ""),
    ]:
        net.run_until(t)
        if action == "crash":
            net.crash(nodes[3])
        elif action == "pause":
            net.pause(nodes[4])
        elif action == "resume":
            net.resume(nodes[4])
        elif action == "inject":
            a, b = nodes[5], nodes[6]
            net.inject(a, ("h", 1), (Dead(node=b.swim.node_id, incarnation=9, accuser="x" * 32),))
            stranger = Alive(node="f" * 32, name="s", addr=nodes[7].addr, incarnation=1)
            net.inject(a, ("h", 1), (stranger,))
        elif action == "join":
            net.add_node(join=[nodes[0].addr])
        for dt in (0.0, 0.3, 1.0, 3.0):
            net.run_until(net.now + dt)
            answers.append(net.converged())
            assert answers[-1] == _converged_by_definition(net), (t, dt)
    assert True in answers and False in answers


def test_a_table_counted_once_is_still_checked_for_each_machine() -> None:
    """adopt counts a table's states once for all the machines adopting it; a suspect
    record is refused by every machine but the suspect itself (whose own record is not
    adopted)."""
    ids = [f"{i:032x}" for i in range(1, 5)]
    records = {
        n: MemberSnapshot(
            node=n,
            name=n[-1],
            addr=("10.0.1.1", 1000 + i),
            incarnation=1,
            state=MemberState.SUSPECT if i == 1 else MemberState.ALIVE,
        )
        for i, n in enumerate(ids, start=1)
    }

    def swim(node: str) -> Swim:
        return Swim(
            node_id=node,
            name="x",
            addr=("10.0.0.9", 1),
            config=LOCAL,
            rng=random.Random(1),
            now=0.0,
        )

    first = swim(ids[0])
    first.adopt(0.0, records)  # its own (suspect) record is not adopted
    assert first.num_live() == 4
    for node in ids[1:]:
        other = swim(node)
        with pytest.raises(LocalUsageError, match="suspects"):
            other.adopt(0.0, records)
        assert other.num_live() == 1 and other.members()[1:] == []


def test_probe_bytes_are_counted_as_encoded() -> None:
    net = SimNetwork(seed=1, config=LOCAL)
    msgs: list[Message] = []
    for seq in (0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1):
        for node in ("a" * 32, "b" * 31, "é" * 16):
            for host in ("10.0.0.1", "192.168.100.200"):
                msgs.append(Ping(seq=seq, target=node, source="c" * 32, source_addr=(host, 7946)))
                msgs.append(Ping(seq=seq, target="c" * 32, source=node, source_addr=(host, 80)))
            msgs.append(Ack(seq=seq, source=node))
            msgs.append(Nack(seq=seq, source=node))
    for m in msgs + msgs:  # the second time from the cache
        assert net._probe_size(m) == encoded_size(m), m


def test_a_lone_rumour_is_taken_as_any_other() -> None:
    q = BroadcastQueue(encoded_size)
    rumour = Suspect(node="x" * 32, incarnation=1, accuser="y" * 32)
    q.push(rumour)
    size = encoded_size(rumour)
    assert q.take(size - 1, limit=3) == [] and len(q) == 1  # does not fit: left as it was
    assert q.take(size, limit=3) == [rumour]
    assert q.take(1400, limit=3) == [rumour]
    newer = Suspect(node="x" * 32, incarnation=2, accuser="y" * 32)
    q.push(newer)  # replaces it, and starts its own count
    for _ in range(3):
        assert q.take(1400, limit=3) == [newer]
    assert q.take(1400, limit=3) == [] and len(q) == 0 and q._entries == 0


def test_cli_bench_membership_takes_the_way_of_joining(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "membership", "--nodes", "12", "--preset", "local", "--duration", "4"]
    assert ftmesh_cli([*args, "--crashes", "1", "--joins", "storm", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["joins"] == "storm" and report["nodes"] == 12 and report["crashes"] == 1
    assert ftmesh_cli([*args, "--crashes", "1"]) == 0
    assert "(batch joins)" in capsys.readouterr().out


def test_an_acked_probe_leaves_no_wake_up_and_a_silent_one_times_out_on_time() -> None:
    swim = machine(seed=3)
    swim.receive(0.0, ("h", 1), [peer(i) for i in range(4)])
    silent = peer(2).node
    wake_ups: list[float] = []
    pinged: dict[str, list[float]] = {}
    indirect: list[float] = []
    now = 0.0
    while now < 30 * LOCAL.probe_interval:  # 30 probe periods
        now = swim.next_deadline()
        wake_ups.append(now)
        for e in swim.tick(now):
            if not isinstance(e, Send):
                continue
            for m in e.msgs:
                if isinstance(m, Ping):
                    pinged.setdefault(m.target, []).append(now)
                    if m.target != silent:
                        swim.receive(now + 0.001, e.dest, [Ack(seq=m.seq, source=m.target)])
                elif type(m).__name__ == "IndirectPing":
                    indirect.append(now)
    timeout = LOCAL.probe_timeout
    # (The silent member's last-chance probe, when its suspicion expires, can go out at the
    # same time as a probe of another member, and has a timer of its own at the same delay.)
    answered = [t for n, ts in pinged.items() if n != silent for t in ts if t not in pinged[silent]]
    assert len(answered) >= 10
    # No wake-up at the timeout of a probe that was acked...
    assert not any(abs(w - (t + timeout)) < 1e-9 for t in answered for w in wake_ups)
    # ...and the silent member's first probe (every probe before it acked: no awareness
    # stretch) still times out on time, into indirect probes.
    first = pinged[silent][0]
    assert any(abs(w - (first + timeout)) < 1e-9 for w in indirect)


def test_reaping_is_armed_only_while_departed_members_wait_and_keeps_its_grid() -> None:
    swim = machine(seed=4)
    swim.receive(0.0, ("h", 1), [peer(i) for i in range(4)])

    def reap_armed() -> bool:
        return any(kind == "reap" for _, _, kind, _ in swim._timers)

    def drive(until: float) -> float:
        now = 0.0
        while (nxt := swim.next_deadline()) <= until:
            now = nxt
            for e in swim.tick(now):
                if isinstance(e, Send):
                    for m in e.msgs:
                        if isinstance(m, Ping):  # all answer (peer 1 dies by rumour)
                            swim.receive(now, e.dest, [Ack(seq=m.seq, source=m.target)])
        return now

    drive(2.0)
    assert not reap_armed()  # nothing departed: no reap rounds
    died = 2.3456
    swim.receive(died, ("h", 1), [Dead(node=peer(1).node, incarnation=1, accuser=peer(0).node)])
    assert reap_armed()
    # Forgotten at the first point of the 1 s grid (from the machine's start) more than
    # dead_reclaim after its death, as a reap run every second would.
    due = next(g for g in (1.0 + k for k in range(1000)) if g - died > LOCAL.dead_reclaim)
    drive(due - 0.01)
    assert swim.member(peer(1).node) is not None
    drive(due + 0.01)
    assert swim.member(peer(1).node) is None
    assert not reap_armed()


def test_a_probe_round_draws_as_a_shuffle_of_a_copy_and_stores_only_its_swaps() -> None:
    """``_ProbeRound`` against the shuffle it replaces (a copy of the ids, one Fisher-Yates
    step per draw), through members added during the round, ids appended to the shared list
    and pending() searches; it holds no more swapped positions than draws."""
    from ftmesh.membership.swim import _ProbeRound

    for seed in range(20):
        script = random.Random(seed)
        ids = [f"m{i}" for i in range(script.randrange(0, 40))]
        reference, ref_pos = list(ids), 0
        ours = _ProbeRound(ids)
        rng_ref, rng_ours = random.Random(seed), random.Random(seed)
        draws = 0
        for step in range(120):
            action = script.random()
            if action < 0.15:
                node = f"new{seed}-{step}"
                reference.append(node)
                ours.add(node)
                ids.append(f"late{step}")  # the shared list grows: not part of this round
            elif action < 0.25:
                node = script.choice([*ids, "absent"])
                assert ours.pending(node) == (node in reference[ref_pos:])
            else:
                expected = None
                if ref_pos < len(reference):
                    pick = ref_pos + rng_ref.randrange(len(reference) - ref_pos)
                    reference[ref_pos], reference[pick] = reference[pick], reference[ref_pos]
                    expected = reference[ref_pos]
                    ref_pos += 1
                    draws += 1
                assert ours.draw(rng_ours) == expected
            assert len(ours) == len(reference) and ours.pos == ref_pos
            assert len(ours._swapped) <= draws
