"""SWIM + Lifeguard behaviour on the deterministic simulator (``local`` preset, so simulated
seconds are few). Every test prints its seed; a failure reproduces from it."""

from __future__ import annotations

import os
import random

import pytest

from ftmesh.errors import LocalUsageError
from ftmesh.membership.broadcast import BroadcastQueue
from ftmesh.membership.config import MembershipConfig
from ftmesh.membership.messages import Ack, Alive, Dead, MemberState, Ping, Suspect
from ftmesh.membership.suspicion import Suspicion
from ftmesh.membership.swim import MemberEvent, Send, Swim
from ftmesh.membership.wire import MAX_COUNTER, encoded_size
from ftmesh.sim.network import SeenEvent, SimNetwork, SimNode

LOCAL = MembershipConfig.preset("local")
# FTMESH_SEEDS=4,5,6 pytest tests/test_swim.py sweeps other seeds.
SEEDS = [int(s) for s in os.environ.get("FTMESH_SEEDS", "1,2,3").split(",")]


def build(
    n: int,
    seed: int,
    *,
    loss: float = 0.0,
    config: MembershipConfig = LOCAL,
) -> tuple[SimNetwork, list[SimNode]]:
    print(f"seed={seed} n={n} loss={loss}")
    net = SimNetwork(seed=seed, config=config, loss=loss)
    nodes = [net.add_node()]
    for _ in range(n - 1):
        nodes.append(net.add_node(join=[net.rng.choice(nodes).addr]))
    assert settle(net, 30.0), "mesh did not converge"
    net.events.clear()
    return net, nodes


def settle(net: SimNetwork, limit: float, step: float = 0.1) -> bool:
    """Run until converged; False if ``limit`` simulated seconds pass first."""
    end = net.now + limit
    while net.now < end:
        net.run_until(net.now + step)
        if net.converged():
            return True
    return False


def events(net: SimNetwork, kind: str, about: SimNode) -> list[SeenEvent]:
    return [
        e for e in net.events if e.event.kind == kind and e.event.member.node == about.swim.node_id
    ]


def observers(evs: list[SeenEvent]) -> set[str]:
    return {e.observer for e in evs}


def ids(nodes: list[SimNode]) -> set[str]:
    return {n.swim.node_id for n in nodes}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [2, 8, 40])
def test_converges(n: int, seed: int) -> None:
    _, nodes = build(n, seed)
    for node in nodes:
        assert node.swim.num_live() == n
        assert {m.node for m in node.swim.members()} == ids(nodes)


@pytest.mark.parametrize("seed", SEEDS)
def test_crash_detected_by_every_survivor_within_bound(seed: int) -> None:
    net, nodes = build(8, seed)
    victim = nodes[3]
    t0 = net.now
    net.crash(victim)
    bound = LOCAL.crash_detection_bound(8)
    net.run_until(t0 + bound + 1.0)
    deaths = events(net, "dead", victim)
    survivors = ids(nodes) - {victim.swim.node_id}
    assert observers(deaths) == survivors
    assert max(e.time for e in deaths) - t0 <= bound, (bound, deaths)
    assert net.converged()


@pytest.mark.parametrize("seed", SEEDS)
def test_crash_detected_under_loss(seed: int) -> None:
    net, nodes = build(16, seed, loss=0.05)
    victim = nodes[5]
    t0 = net.now
    net.crash(victim)
    net.run_until(t0 + 2 * LOCAL.crash_detection_bound(16))
    assert observers(events(net, "dead", victim)) == ids(nodes) - {victim.swim.node_id}
    assert not [
        e
        for e in net.events
        if e.event.kind == "dead" and e.event.member.node != victim.swim.node_id
    ]


@pytest.mark.parametrize("seed", SEEDS)
def test_pause_past_suspicion_then_rejoin(seed: int) -> None:
    net, nodes = build(8, seed)
    sleeper = nodes[2]
    inc_before = sleeper.swim.incarnation
    t0 = net.now
    net.pause(sleeper)
    net.run_until(t0 + LOCAL.crash_detection_bound(8) + 1.0)
    others = ids(nodes) - {sleeper.swim.node_id}
    assert observers(events(net, "dead", sleeper)) == others
    net.events.clear()
    net.resume(sleeper)
    assert settle(net, 10.0), "the resumed member did not rejoin"
    # It learned that it was declared dead and refuted under a higher incarnation.
    assert sleeper.swim.incarnation > inc_before
    assert sleeper.swim.counters.get("refutes", 0) >= 1
    back = events(net, "joined", sleeper) + events(net, "alive", sleeper)
    assert observers(back) == others
    for node in nodes:
        snap = node.swim.member(sleeper.swim.node_id)
        assert snap is not None
        assert snap.state == MemberState.ALIVE and snap.incarnation == sleeper.swim.incarnation


@pytest.mark.parametrize("seed", SEEDS)
def test_short_pause_is_never_dead(seed: int) -> None:
    net, nodes = build(8, seed)
    sleeper = nodes[4]
    t0 = net.now
    net.pause(sleeper)
    net.run_until(t0 + 0.5 * LOCAL.suspicion_min_timeout(8))
    net.resume(sleeper)
    assert settle(net, 10.0)
    assert events(net, "dead", sleeper) == []
    for node in nodes:
        snap = node.swim.member(sleeper.swim.node_id)
        assert snap is not None and snap.state == MemberState.ALIVE


@pytest.mark.parametrize("seed", SEEDS)
def test_graceful_leave_is_left_never_dead(seed: int) -> None:
    net, nodes = build(8, seed)
    leaver = nodes[6]
    net.leave(leaver)
    net.run_until(net.now + 3 * LOCAL.gossip_interval)
    net.crash(leaver)  # the process exits after announcing
    net.run_until(net.now + 2 * LOCAL.crash_detection_bound(8))
    others = ids(nodes) - {leaver.swim.node_id}
    assert observers(events(net, "left", leaver)) == others
    assert events(net, "dead", leaver) == []
    assert events(net, "suspect", leaver) == []
    for node in nodes:
        if node is not leaver:
            snap = node.swim.member(leaver.swim.node_id)
            assert snap is None or snap.state == MemberState.LEFT


@pytest.mark.parametrize("seed", SEEDS)
def test_metadata_changed_just_before_a_leave_reaches_everyone(seed: int) -> None:
    """A member that changes its metadata and leaves at once (a departing trainer's last
    progress and role) leaves no member with the older metadata: the leave goes to each in
    one datagram behind the new Alive, so nobody hears of the leave first (it has the same
    incarnation and would shut the newer metadata out)."""
    net, nodes = build(8, seed)
    leaver = nodes[3]
    net.update_meta(leaver, {"role": "leaving", "step": 7})
    net.leave(leaver)  # no gossip round in between
    net.run_until(net.now + 3 * LOCAL.gossip_interval)
    net.crash(leaver)
    net.run_until(net.now + LOCAL.crash_detection_bound(8))
    for node in nodes:
        if node is not leaver:
            snap = node.swim.member(leaver.swim.node_id)
            assert snap is not None and snap.state == MemberState.LEFT, snap
            assert snap.meta == {"role": "leaving", "step": 7}, snap.meta


@pytest.mark.parametrize("seed", SEEDS)
def test_metadata_update_reaches_everyone(seed: int) -> None:
    net, nodes = build(8, seed)
    node = nodes[1]
    inc = node.swim.incarnation
    net.update_meta(node, {"role": "trainer", "step": 42})
    assert node.swim.incarnation == inc + 1
    # Gossip reaches nearly everyone within a few gossip rounds; whoever it misses (at small
    # n each rumour is sent only 4 times per member) gets it from the next push-pull.
    others = ids(nodes) - {node.swim.node_id}
    end = net.now + 3 * LOCAL.push_pull_interval
    while net.now < end and observers(events(net, "updated", node)) != others:
        net.run_until(net.now + 0.1)
    assert observers(events(net, "updated", node)) == others
    for other in nodes:
        snap = other.swim.member(node.swim.node_id)
        assert snap is not None and snap.meta == {"role": "trainer", "step": 42}
    with pytest.raises(LocalUsageError):
        node.swim.update_meta(net.now, {"k": "v" * 10_000})


@pytest.mark.parametrize("seed", SEEDS)
def test_partition_then_heal_merges_views(seed: int) -> None:
    net, nodes = build(10, seed)
    left, right = nodes[:5], nodes[5:]
    net.partition([left, right])
    net.run_until(net.now + 2 * LOCAL.crash_detection_bound(10))
    for node in left:
        assert node.swim.num_live() == 5  # each side declared the other dead
    net.heal()
    # Reconnecting push-pulls (every ~push_pull_interval) merge the two views.
    assert settle(net, 12 * LOCAL.push_pull_interval, step=0.5), "views did not merge"
    for node in nodes:
        assert node.swim.num_live() == 10


@pytest.mark.parametrize("seed", SEEDS)
def test_suspicion_refuted_by_live_member(seed: int) -> None:
    net, nodes = build(8, seed)
    accused, accuser = nodes[0], nodes[1]
    inc = accused.swim.incarnation
    # A rumour (say, from a member with a flaky link) accuses a healthy member.
    net.inject(
        accuser,
        accuser.addr,
        (Suspect(node=accused.swim.node_id, incarnation=inc, accuser=accuser.swim.node_id),),
    )
    assert accuser.swim.member(accused.swim.node_id).state == MemberState.SUSPECT  # type: ignore[union-attr]
    net.run_until(net.now + LOCAL.crash_detection_bound(8) + 1.0)
    assert accused.swim.incarnation > inc
    assert events(net, "dead", accused) == []
    assert observers(events(net, "alive", accused)) >= {accuser.swim.node_id}
    assert net.converged()


def test_lone_member_and_seed_to_self() -> None:
    net = SimNetwork(seed=4, config=LOCAL)
    solo = net.add_node()
    assert solo.swim.join(0.0, [solo.addr]) == []  # never joins itself
    net.run_until(5.0)
    assert solo.swim.num_live() == 1 and net.converged()


# ---------------------------------------------------------------------- unit level


def machine(seed: int = 0, node_id: str = "a" * 32) -> Swim:
    return Swim(
        node_id=node_id,
        name="me",
        addr=("10.0.0.1", 7946),
        config=LOCAL,
        rng=random.Random(seed),
        now=0.0,
    )


def test_stale_accusation_does_not_raise_incarnation() -> None:
    swim = machine()
    swim.receive(0.0, ("h", 1), [Suspect(node=swim.node_id, incarnation=1, accuser="b" * 32)])
    assert swim.incarnation == 2
    # The same old accusation again: repeated Alive, no new incarnation.
    swim.receive(0.1, ("h", 1), [Dead(node=swim.node_id, incarnation=1, accuser="b" * 32)])
    assert swim.incarnation == 2
    swim.receive(0.2, ("h", 1), [Dead(node=swim.node_id, incarnation=2, accuser="b" * 32)])
    assert swim.incarnation == 3


def test_incarnation_capped_at_wire_maximum() -> None:
    swim = machine()
    swim.receive(
        0.0, ("h", 1), [Suspect(node=swim.node_id, incarnation=MAX_COUNTER, accuser="b" * 32)]
    )
    assert swim.incarnation == MAX_COUNTER  # still encodable


def test_resuspicion_at_newer_incarnation_restarts_timer() -> None:
    """Regression: a suspect re-suspected at a newer incarnation (it refuted the first
    suspicion in a rumour we missed) must not be declared dead under the old incarnation."""
    swim = machine()
    other = "b" * 32
    swim.receive(0.0, ("h", 1), [Alive(node=other, name="b", addr=("10.0.0.2", 1), incarnation=1)])
    swim.receive(0.0, ("h", 1), [Suspect(node=other, incarnation=1, accuser="c" * 32)])
    swim.receive(0.5, ("h", 1), [Suspect(node=other, incarnation=2, accuser="c" * 32)])
    assert swim.member(other).incarnation == 2  # type: ignore[union-attr]
    # The suspicion expires, the final direct probe goes unanswered, then it is dead.
    effects = swim.tick(100.0) + swim.tick(101.0)
    deaths = [e for e in effects if isinstance(e, MemberEvent) and e.kind == "dead"]
    assert [d.member.incarnation for d in deaths] == [2]


def test_last_chance_probe_saves_a_live_suspect() -> None:
    """A suspect whose refutation was lost answers the final direct probe: not declared
    dead; the probe carries the accusation so it can refute."""
    swim = machine()
    other = "b" * 32
    swim.receive(0.0, ("h", 1), [Alive(node=other, name="b", addr=("10.0.0.2", 1), incarnation=1)])
    swim.receive(0.0, ("h", 1), [Suspect(node=other, incarnation=1, accuser="c" * 32)])
    effects = swim.tick(100.0)
    pings = [
        (e.msgs[0], e.msgs[1:])
        for e in effects
        if isinstance(e, Send) and e.dest == ("10.0.0.2", 1) and isinstance(e.msgs[0], Ping)
    ]
    assert pings, effects
    ping, rest = pings[-1]
    assert any(isinstance(m, Suspect) and m.node == other for m in rest)
    swim.receive(100.01, ("10.0.0.2", 1), [Ack(seq=ping.seq, source=other)])
    effects = swim.tick(101.0)
    assert not [e for e in effects if isinstance(e, MemberEvent) and e.kind == "dead"]
    assert swim.member(other).state == MemberState.SUSPECT  # type: ignore[union-attr]
    # It refutes: alive again.
    swim.receive(
        101.1, ("10.0.0.2", 1), [Alive(node=other, name="b", addr=("10.0.0.2", 1), incarnation=2)]
    )
    assert swim.member(other).state == MemberState.ALIVE  # type: ignore[union-attr]


def test_confirmations_stop_after_k() -> None:
    susp = Suspicion(1, 0.0, 1.0, 6.0, 2, {"a"})
    assert susp.deadline == 6.0
    assert susp.confirm("b") and susp.confirm("c")
    assert susp.deadline == 1.0
    assert not susp.confirm("d")  # enough: no more rebroadcasts, no growth
    assert not susp.confirm("b")
    assert len(susp.accusers) == 3


def test_broadcast_queue_newest_replaces_and_limit() -> None:
    q = BroadcastQueue(encoded_size)
    q.push(Alive(node="x" * 32, name="x", addr=("h", 1), incarnation=1))
    q.push(Alive(node="x" * 32, name="x", addr=("h", 1), incarnation=2))
    q.push(Suspect(node="y" * 32, incarnation=1, accuser="z" * 32))
    assert len(q) == 2
    got = q.take(1400, limit=2)
    assert {type(m).__name__ for m in got} == {"Alive", "Suspect"}
    assert [m.incarnation for m in got if isinstance(m, Alive)] == [2]
    assert len(q.take(1400, limit=2)) == 2
    assert q.take(1400, limit=2) == [] and len(q) == 0
    # Bounded memory under churn of replacements.
    for i in range(10_000):
        q.push(Alive(node="x" * 32, name="x", addr=("h", 1), incarnation=i))
    assert q._entries <= 2 * len(q) + 65


def test_packets_stay_within_budget() -> None:
    swim = machine()
    for i in range(300):
        swim.receive(
            0.0,
            ("h", 1),
            [Alive(node=f"{i:032x}", name=f"n{i}", addr=("10.0.0.2", 1000 + i), incarnation=1)],
        )
    sends = [e for e in swim.tick(1.0) if isinstance(e, Send)]
    assert sends
    for s in sends:
        assert sum(encoded_size(m) for m in s.msgs) <= LOCAL.packet_budget


def test_broadcast_queue_never_repeats_a_rumour_in_one_packet() -> None:
    q = BroadcastQueue(encoded_size)
    for i in range(50):
        q.push(Alive(node=f"{i:032x}", name="x", addr=("h", 1), incarnation=1))
        got = q.take(700, limit=5)
        assert len({m.node for m in got}) == len(got)


def test_round_trips_are_timed_on_direct_acks_only() -> None:
    """A probe's direct ack times the link (``take_round_trips``); an ack that comes after the
    indirect pings went out (it may have come through a helper) is not timed, and a machine
    made without ``round_trips`` keeps nothing."""
    swim = Swim(
        node_id="a" * 32,
        name="me",
        addr=("10.0.0.1", 7946),
        config=LOCAL,
        rng=random.Random(0),
        now=0.0,
        round_trips=4,
    )
    other, third = "b" * 32, "c" * 32
    for node, port in ((other, 1), (third, 2)):
        swim.receive(
            0.0, ("h", 1), [Alive(node=node, name=node[:1], addr=("10.0.0.2", port), incarnation=1)]
        )

    def next_ping(now: float) -> tuple[float, Ping]:
        while True:
            pings = [
                e.msgs[0]
                for e in swim.tick(now)
                if isinstance(e, Send) and isinstance(e.msgs[0], Ping)
            ]
            if pings:
                return now, pings[0]
            now = swim.next_deadline()

    t, ping = next_ping(0.0)
    swim.receive(t + 0.0123, ("10.0.0.2", 1), [Ack(seq=ping.seq, source=ping.target)])
    assert swim.take_round_trips() == [(ping.target, pytest.approx(0.0123))]
    assert swim.take_round_trips() == []
    # the next probe goes unanswered past the probe timeout: indirect pings go out, then the
    # target's ack arrives (maybe relayed): not a measurement of the link
    t, ping = next_ping(t + LOCAL.probe_interval)
    swim.tick(t + LOCAL.probe_timeout * 1.01)
    swim.receive(t + LOCAL.probe_timeout * 1.02, ("h", 9), [Ack(seq=ping.seq, source=ping.target)])
    assert swim.take_round_trips() == []
    assert machine().take_round_trips() == []
