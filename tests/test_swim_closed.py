"""A closed connection as evidence (``Swim.connection_closed``), on the deterministic simulator
and at unit level (``local`` preset). The data plane reports a peer that closed, reset or
refused a connection; membership probes it at once and suspects it only if that probe's
short timeout passes unanswered. Every simulated test prints its seed; a failure reproduces
from it (``FTMESH_SEEDS=4,5,6`` sweeps others)."""

from __future__ import annotations

import os
import random

import pytest

from ftmesh.membership.config import MembershipConfig
from ftmesh.membership.messages import (
    Ack,
    Alive,
    Dead,
    IndirectPing,
    MemberState,
    Ping,
    Suspect,
)
from ftmesh.membership.swim import MemberEvent, Send, Swim
from ftmesh.sim.network import SeenEvent, SimNetwork, SimNode

LOCAL = MembershipConfig.preset("local")
SEEDS = [int(s) for s in os.environ.get("FTMESH_SEEDS", "1,2,3").split(",")]
LATENCY = (0.0002, 0.002)  # the simulator's default one-way delay


def build(n: int, seed: int) -> tuple[SimNetwork, list[SimNode]]:
    print(f"seed={seed} n={n}")
    net = SimNetwork(seed=seed, config=LOCAL, latency=LATENCY)
    nodes = [net.add_node()]
    for _ in range(n - 1):
        nodes.append(net.add_node(join=[net.rng.choice(nodes).addr]))
    end = net.now + 30.0
    while net.now < end and not net.converged():
        net.run_until(net.now + 0.1)
    assert net.converged(), "mesh did not converge"
    net.events.clear()
    return net, nodes


def events(net: SimNetwork, kind: str, about: SimNode) -> list[SeenEvent]:
    return [
        e for e in net.events if e.event.kind == kind and e.event.member.node == about.swim.node_id
    ]


def observers(evs: list[SeenEvent]) -> set[str]:
    return {e.observer for e in evs}


def ids(nodes: list[SimNode]) -> set[str]:
    return {n.swim.node_id for n in nodes}


def first_seen(evs: list[SeenEvent]) -> dict[str, float]:
    """Each observer's first time."""
    return {e.observer: e.time for e in reversed(evs)}


def run_converged(net: SimNetwork, limit: float = 10.0) -> None:
    end = net.now + limit
    while net.now < end and not net.converged():
        net.run_until(net.now + 0.1)
    assert net.converged()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_crashed_members_closed_connections_drop_it_within_the_probe_timeout(
    seed: int,
) -> None:
    """Its two ring neighbours see their connections close: every survivor suspects the
    victim within one probe timeout and a datagram's trip (where the probe round takes up
    to a probe interval to reach it and another to suspect it); the unanswered probe
    confirms the suspicion, so it dies at the minimum suspicion timeout; nobody else dies."""
    net, nodes = build(8, seed)
    victim, left, right = nodes[3], nodes[2], nodes[4]
    t0 = net.now
    net.crash(victim)
    net.connection_closed(left, victim)
    net.connection_closed(right, victim)
    net.run_until(t0 + LOCAL.crash_detection_bound(8) + 1.0)
    survivors = ids(nodes) - {victim.swim.node_id}
    suspects = first_seen(events(net, "suspect", victim))
    assert set(suspects) == survivors
    bound = LOCAL.probe_timeout + LATENCY[1] + 1e-9
    assert max(suspects.values()) - t0 <= bound, (bound, suspects)
    assert left.swim.counters["closed_suspects"] == 1
    deaths = first_seen(events(net, "dead", victim))
    assert set(deaths) == survivors
    bound = 3 * LOCAL.probe_timeout + LOCAL.suspicion_min_timeout(8) + 2 * LATENCY[1]
    assert max(deaths.values()) - t0 <= bound, (bound, deaths)
    others = [
        e
        for e in net.events
        if e.event.kind == "dead" and e.event.member.node != victim.swim.node_id
    ]
    assert others == []


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("starved", [0.0, LOCAL.probe_timeout / 2])
def test_a_live_member_that_closed_its_connections_is_not_suspected(
    seed: int, starved: float
) -> None:
    """A member that gave a ring up without a word (it believed us lost, it restarted its
    data plane) or whose data port refuses answers the probe, even a little late: no
    suspicion anywhere, not even one it must refute."""
    net, nodes = build(8, seed)
    member = nodes[5]
    inc = member.swim.incarnation
    if starved:
        net.pause(member)
    for _ in range(3):
        for other in (nodes[4], nodes[6]):
            net.connection_closed(other, member)
        if starved:
            net.run_until(net.now + starved)
            net.resume(member)
        net.run_until(net.now + LOCAL.probe_interval)
    net.run_until(net.now + 2 * LOCAL.crash_detection_bound(8))
    assert events(net, "suspect", member) == []
    assert member.swim.incarnation == inc
    assert nodes[4].swim.counters["closed_probes"] == 3
    assert "closed_suspects" not in nodes[4].swim.counters
    assert net.converged()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_graceful_leave_stays_left_when_its_connections_close_after_it(seed: int) -> None:
    """The leaver announces, keeps running a little, exits; its connections close as it
    exits. It is ``left`` everywhere: never suspected, never dead."""
    net, nodes = build(8, seed)
    leaver = nodes[6]
    net.leave(leaver)
    net.run_until(net.now + 3 * LOCAL.gossip_interval)
    net.crash(leaver)
    for other in (nodes[5], nodes[7]):
        net.connection_closed(other, leaver)
    net.run_until(net.now + 2 * LOCAL.crash_detection_bound(8))
    assert observers(events(net, "left", leaver)) == ids(nodes) - {leaver.swim.node_id}
    assert events(net, "suspect", leaver) == []
    assert events(net, "dead", leaver) == []
    assert nodes[5].swim.counters["closed_ignored"] == 1


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("exits_after", [0.0, 3 * LOCAL.gossip_interval])
def test_a_graceful_leave_stays_left_when_its_connections_close_before_it(
    seed: int, exits_after: float
) -> None:
    """The leaver gave its ring up (its connections close) a moment before it announces its
    leave, and exits at once or a little later: ``left`` everywhere, never dead (and not
    suspected while it still answers)."""
    net, nodes = build(8, seed)
    leaver = nodes[1]
    for other in (nodes[0], nodes[2]):
        net.connection_closed(other, leaver)
    net.run_until(net.now + LATENCY[0] / 2)
    net.leave(leaver)
    net.run_until(net.now + exits_after)
    net.crash(leaver)
    net.run_until(net.now + 2 * LOCAL.crash_detection_bound(8))
    assert observers(events(net, "left", leaver)) == ids(nodes) - {leaver.swim.node_id}
    assert events(net, "dead", leaver) == []
    if exits_after:
        assert events(net, "suspect", leaver) == []
    for node in nodes:
        if node is not leaver:
            snap = node.swim.member(leaver.swim.node_id)
            assert snap is None or snap.state == MemberState.LEFT


@pytest.mark.parametrize("seed", SEEDS)
def test_a_starved_member_whose_connection_closed_is_suspected_but_never_dead(
    seed: int,
) -> None:
    """A closed connection and a missed probe timeout (a process starved of CPU) make a
    suspicion, never a death, as long as the starvation is shorter than the minimum
    suspicion timeout: the member refutes once it runs again."""
    net, nodes = build(8, seed)
    sleeper = nodes[2]
    inc = sleeper.swim.incarnation
    net.pause(sleeper)
    net.connection_closed(nodes[1], sleeper)
    net.run_until(net.now + 0.8 * LOCAL.suspicion_min_timeout(8))
    assert nodes[1].swim.member(sleeper.swim.node_id).state == MemberState.SUSPECT  # type: ignore[union-attr]
    assert nodes[1].swim.counters["closed_suspects"] == 1
    net.resume(sleeper)
    run_converged(net)
    assert events(net, "dead", sleeper) == []
    assert sleeper.swim.incarnation > inc
    for node in nodes:
        snap = node.swim.member(sleeper.swim.node_id)
        assert snap is not None and snap.state == MemberState.ALIVE


# ---------------------------------------------------------------------- unit level

OTHER = "b" * 32
OTHER_ADDR = ("10.0.0.2", 1)
HELPER = "c" * 32
HELPER_ADDR = ("10.0.0.3", 1)


def machine(seed: int = 0) -> Swim:
    swim = Swim(
        node_id="a" * 32,
        name="me",
        addr=("10.0.0.1", 7946),
        config=LOCAL,
        rng=random.Random(seed),
        now=0.0,
    )
    for node, addr in ((OTHER, OTHER_ADDR), (HELPER, HELPER_ADDR)):
        swim.receive(0.0, addr, [Alive(node=node, name=node[0], addr=addr, incarnation=1)])
    return swim


def pings_to(effects: list[object], addr: tuple[str, int]) -> list[Ping]:
    return [
        m
        for e in effects
        if isinstance(e, Send) and e.dest == addr
        for m in e.msgs
        if isinstance(m, Ping)
    ]


def kinds(effects: list[object], about: str = OTHER) -> list[str]:
    """The events about ``about`` (the helper, which answers nothing here, is suspected by
    the machine's own probe rounds in a long tick)."""
    return [e.kind for e in effects if isinstance(e, MemberEvent) and e.member.node == about]


def suspects_sent(effects: list[object]) -> set[tuple[str, int]]:
    return {
        e.dest
        for e in effects
        if isinstance(e, Send) and any(isinstance(m, Suspect) and m.node == OTHER for m in e.msgs)
    }


def test_an_unanswered_probe_suspects_at_the_probe_timeout_fully_confirmed() -> None:
    swim = machine()
    effects = swim.connection_closed(1.0, OTHER)
    assert kinds(effects) == [] and not suspects_sent(effects)
    assert len(pings_to(effects, OTHER_ADDR)) == 1
    relays = [
        m for e in effects if isinstance(e, Send) for m in e.msgs if isinstance(m, IndirectPing)
    ]
    assert [r.target for r in relays] == [OTHER]  # indirect at once, through the helper
    assert kinds(swim.tick(1.0 + LOCAL.probe_timeout * 0.9)) == []
    effects = swim.tick(1.0 + LOCAL.probe_timeout)
    assert kinds(effects) == ["suspect"]
    assert suspects_sent(effects) >= {OTHER_ADDR, HELPER_ADDR}  # it too: a live one refutes
    assert swim.counters["closed_suspects"] == 1
    # The probe's end (the whole interval) adds nothing: suspected once, by us once.
    assert kinds(swim.tick(1.0 + LOCAL.probe_interval)) == []
    # Fully confirmed: the minimum timeout, then the final direct probe goes out and stays
    # unanswered (its timeout is scaled by our awareness, raised here by the helper's
    # silence): dead, long before the unconfirmed timeout (5x the minimum) would end.
    end = 1.0 + LOCAL.probe_timeout + LOCAL.suspicion_min_timeout(3)
    assert kinds(swim.tick(end - 0.001)) == []
    dead = kinds(swim.tick(end)) + kinds(swim.tick(end + 0.5))
    assert dead == ["dead"]
    assert end + 0.5 < 1.0 + LOCAL.suspicion_max_timeout_mult * LOCAL.suspicion_min_timeout(3)


def test_a_direct_or_indirect_ack_within_the_timeout_saves_it() -> None:
    for via in ("direct", "indirect"):
        swim = machine()
        effects = swim.connection_closed(1.0, OTHER)
        if via == "direct":
            seq = pings_to(effects, OTHER_ADDR)[0].seq
            swim.receive(1.01, OTHER_ADDR, [Ack(seq=seq, source=OTHER)])
        else:
            (relay,) = [
                m
                for e in effects
                if isinstance(e, Send)
                for m in e.msgs
                if isinstance(m, IndirectPing)
            ]
            swim.receive(1.02, HELPER_ADDR, [Ack(seq=relay.seq, source=OTHER)])
        assert kinds(swim.tick(1.0 + LOCAL.probe_interval + 0.01)) == [], via
        assert swim.member(OTHER).state == MemberState.ALIVE, via  # type: ignore[union-attr]
        assert "closed_suspects" not in swim.counters, via


def test_a_suspect_whose_connection_closed_is_confirmed_by_an_unanswered_probe() -> None:
    swim = machine()
    swim.receive(1.0, HELPER_ADDR, [Suspect(node=OTHER, incarnation=1, accuser=HELPER)])
    effects = swim.connection_closed(1.01, OTHER)
    assert pings_to(effects, OTHER_ADDR)
    swim.tick(1.01 + LOCAL.probe_timeout)
    assert swim.counters["closed_suspects"] == 1
    gossip = swim.tick(1.01 + LOCAL.probe_timeout + LOCAL.gossip_interval)
    assert [
        m
        for e in gossip
        if isinstance(e, Send)
        for m in e.msgs
        if isinstance(m, Suspect) and m.accuser == swim.node_id
    ]  # our confirmation is gossiped on
    end = 1.0 + LOCAL.suspicion_min_timeout(3)
    assert kinds(swim.tick(end) + swim.tick(end + 0.5)) == ["dead"]


def test_only_a_live_member_is_probed_and_only_once_at_a_time() -> None:
    swim = machine()
    assert swim.connection_closed(0.5, "d" * 32) == []  # unknown
    first = swim.connection_closed(1.0, OTHER)
    again = swim.connection_closed(1.01, OTHER)
    assert pings_to(first, OTHER_ADDR) and not pings_to(again, OTHER_ADDR)
    assert swim.counters["closed_probes"] == 1
    # Left: never probed, never suspected, never dead.
    swim = machine()
    swim.receive(1.0, OTHER_ADDR, [Dead(node=OTHER, incarnation=1, accuser=OTHER)])
    assert swim.connection_closed(1.1, OTHER) == []
    assert kinds(swim.tick(5.0)) == []
    assert swim.member(OTHER).state == MemberState.LEFT  # type: ignore[union-attr]
    assert swim.counters["closed_ignored"] == 1


def test_a_leave_after_the_suspicion_is_still_left() -> None:
    """A leaver that stopped answering before its leave arrived is suspected, then its
    leave overrides the suspicion: ``left``, not ``dead``."""
    swim = machine()
    swim.connection_closed(1.0, OTHER)
    assert kinds(swim.tick(1.0 + LOCAL.probe_timeout)) == ["suspect"]
    effects = swim.receive(1.05, OTHER_ADDR, [Dead(node=OTHER, incarnation=1, accuser=OTHER)])
    assert kinds(effects) == ["left"]
    assert kinds(swim.tick(5.0) + swim.tick(6.0)) == []  # (forgotten only at dead_reclaim)
    assert swim.member(OTHER).state == MemberState.LEFT  # type: ignore[union-attr]


def test_a_leaving_member_reports_nothing() -> None:
    swim = machine()
    swim.leave(1.0)
    assert pings_to(swim.connection_closed(1.01, OTHER), OTHER_ADDR) == []
    assert swim.counters["closed_ignored"] == 1


def test_a_closed_port_settles_a_closed_probe_at_once() -> None:
    """ICMP port unreachable from the member's gossip address while its closed connection is
    probed: the probe fails now, not at its timeout, and only once."""
    swim = machine()
    swim.connection_closed(1.0, OTHER)
    effects = swim.port_unreachable(1.001, OTHER_ADDR)
    assert kinds(effects) == ["suspect"]
    assert suspects_sent(effects) >= {OTHER_ADDR, HELPER_ADDR}
    assert swim.counters["closed_port_unreachable"] == 1
    assert kinds(swim.tick(1.0 + LOCAL.probe_interval)) == []
    assert swim.counters["closed_suspects"] == 1  # (not again at the timeout)
    end = 1.001 + LOCAL.suspicion_min_timeout(3)
    assert kinds(swim.tick(end) + swim.tick(end + 0.5)) == ["dead"]


def test_a_closed_port_alone_is_only_counted() -> None:
    """Without a closed connection being probed (an ICMP message is not authenticated), or
    from another address, nothing happens."""
    swim = machine()
    effects = swim.port_unreachable(1.0, OTHER_ADDR)
    assert effects == [] and swim.counters["port_unreachable_ignored"] == 1
    swim.connection_closed(1.0, OTHER)
    assert kinds(swim.port_unreachable(1.001, HELPER_ADDR)) == []
    assert swim.member(OTHER).state == MemberState.ALIVE  # type: ignore[union-attr]
    assert swim.counters["port_unreachable_ignored"] == 2
