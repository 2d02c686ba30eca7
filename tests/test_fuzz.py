"""Hypothesis invariants: the decoder only ever refuses with ``RemoteProtocolError``; the SWIM
machine survives any decoded-valid message sequence with its invariants intact; membership
converges under random loss in the simulator."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftmesh.errors import RemoteProtocolError
from ftmesh.membership import wire
from ftmesh.membership.config import MembershipConfig
from ftmesh.membership.messages import (
    Ack,
    Alive,
    Dead,
    IndirectPing,
    MemberSnapshot,
    MemberState,
    Message,
    Nack,
    Ping,
    PushPull,
    Suspect,
)
from ftmesh.membership.swim import Send, StartPushPull, Swim
from ftmesh.membership.wire import PacketCodec
from ftmesh.security import MeshAuth
from ftmesh.sim.network import SimNetwork

NOW = 1_700_000_000.0
FAST = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
LOCAL = MembershipConfig.preset("local")

# A small pool of ids so that messages collide on the same members.
SELF = "5e1f" * 8
IDS = [SELF, *(f"{i:x}" * 32 for i in range(1, 6))]
ids = st.sampled_from(IDS)
addrs = st.tuples(st.sampled_from(["10.0.0.1", "10.0.0.2", "h"]), st.integers(1, 65535))
counters = st.integers(0, wire.MAX_COUNTER)
small_inc = st.integers(0, 6) | counters
meta = st.dictionaries(
    st.text(max_size=8),
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
    max_size=3,
)

messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Ping, seq=st.integers(0, 40), target=ids, source=ids, source_addr=addrs),
    st.builds(
        IndirectPing,
        seq=st.integers(0, 40),
        target=ids,
        target_addr=addrs,
        source=ids,
        source_addr=addrs,
        want_nack=st.booleans(),
    ),
    st.builds(Ack, seq=st.integers(0, 40), source=ids),
    st.builds(Nack, seq=st.integers(0, 40), source=ids),
    st.builds(
        Alive, node=ids, name=st.text(max_size=5), addr=addrs, incarnation=small_inc, meta=meta
    ),
    st.builds(Suspect, node=ids, incarnation=small_inc, accuser=ids),
    st.builds(Dead, node=ids, incarnation=small_inc, accuser=ids),
)
snapshots = st.builds(
    MemberSnapshot,
    node=ids,
    name=st.text(max_size=5),
    addr=addrs,
    incarnation=small_inc,
    state=st.sampled_from(list(MemberState)),
    meta=meta,
)
push_pulls = st.builds(
    PushPull,
    source=ids,
    members=st.lists(snapshots, max_size=6).map(tuple),
    join=st.booleans(),
    observer=st.booleans(),
)


def open_or_refuse(codec: PacketCodec, data: bytes, cap: int = wire.MAX_DATAGRAM) -> None:
    try:
        codec.open(data, NOW, cap=cap)
    except RemoteProtocolError as exc:
        assert exc.reason in {
            "malformed",
            "oversized",
            "bad_version",
            "wrong_mesh",
            "bad_mac",
            "unauthenticated",
            "replayed",
            "stale",
            "encryption_mismatch",  # a flipped flag bit claims the other encryption mode
        }


@FAST
@given(st.binary(max_size=2048))
def test_decoder_arbitrary_bytes(data: bytes) -> None:
    open_or_refuse(PacketCodec("m", MeshAuth.none()), data)
    open_or_refuse(PacketCodec("m", MeshAuth.from_secrets([b"k" * 16])), data)
    open_or_refuse(PacketCodec("m", MeshAuth.none()), b"FM\x01\x00" + data)


@FAST
@given(st.lists(messages, min_size=0, max_size=6), st.data())
def test_decoder_mutated_valid_packets(msgs: list[Message], data: st.DataObject) -> None:
    auth = data.draw(st.booleans())
    codec = PacketCodec("m", MeshAuth.from_secrets([b"k" * 16]) if auth else MeshAuth.none())
    packet = bytearray(codec.seal(msgs, NOW, data.draw(st.binary(min_size=8, max_size=8))))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "dup"]))
        pos = data.draw(st.integers(0, max(len(packet) - 1, 0)))
        if op == "flip" and packet:
            packet[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del packet[pos : pos + data.draw(st.integers(1, 16))]
        elif op == "insert":
            packet[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            packet += packet[pos:]
    open_or_refuse(codec, bytes(packet), cap=wire.MAX_FRAME)


@FAST
@given(push_pulls)
def test_push_pull_round_trip(pp: PushPull) -> None:
    codec = PacketCodec("m", MeshAuth.none())
    assert codec.open(codec.seal([pp], NOW, b"\0" * 8), NOW, cap=wire.MAX_FRAME) == [pp]


# ---------------------------------------------------------------------- the machine

steps = st.lists(
    st.one_of(
        st.tuples(st.just("rx"), st.lists(messages, min_size=1, max_size=4)),
        st.tuples(st.just("pp"), push_pulls),
        st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
        st.tuples(st.just("meta"), meta),
        st.tuples(st.just("unreachable"), ids),
        st.tuples(st.just("closed"), ids),
        st.tuples(st.just("icmp"), addrs),
        st.tuples(st.just("leave"), st.none()),
    ),
    max_size=40,
)


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(steps, st.integers(0, 2**32))
def test_swim_invariants(script: list[tuple[str, object]], seed: int) -> None:
    swim = Swim(
        node_id=SELF,
        name="me",
        addr=("10.0.0.9", 7946),
        config=LOCAL,
        rng=random.Random(seed),
        now=0.0,
    )
    now = 0.0
    seen_inc: dict[str, int] = {SELF: swim.incarnation}
    for kind, arg in script:
        if kind == "rx":
            assert isinstance(arg, list)
            effects = swim.receive(now, ("10.0.0.1", 1), arg)
        elif kind == "pp":
            assert isinstance(arg, PushPull)
            effects = swim.merge_push_pull(now, arg)
        elif kind == "tick":
            assert isinstance(arg, float)
            now += arg
            effects = swim.tick(now)
        elif kind == "meta":
            assert isinstance(arg, dict)
            effects = swim.update_meta(now, arg)
        elif kind == "unreachable":
            assert isinstance(arg, str)
            effects = swim.report_unreachable(now, arg)
        elif kind == "closed":
            assert isinstance(arg, str)
            effects = swim.connection_closed(now, arg)
        elif kind == "icmp":
            assert isinstance(arg, tuple)
            effects = swim.port_unreachable(now, arg)
        else:
            effects = swim.leave(now)
        codec = PacketCodec("m", MeshAuth.none())
        for eff in effects:
            if isinstance(eff, Send):
                # Everything we send decodes at the peer (no cap or range violated).
                assert codec.open(codec.seal(eff.msgs, NOW, b"\0" * 8), NOW) == list(eff.msgs)
                assert len(eff.msgs) <= wire.MAX_MSGS_PER_PACKET
            elif isinstance(eff, StartPushPull):
                assert eff.dest != ("10.0.0.9", 7946)
        me = swim.member(SELF)
        assert me is not None
        # A member never declares itself dead or left, unless it is leaving.
        assert me.state == MemberState.ALIVE
        # Incarnations never go down, ours or anyone's (a member forgotten after
        # dead_reclaim may come back from scratch: it starts a fresh record).
        current = {m.node: m.incarnation for m in swim.members()}
        for node, inc in current.items():
            assert inc >= seen_inc.get(node, 0), (node, inc, seen_inc.get(node))
        seen_inc = current
        assert swim.incarnation <= wire.MAX_COUNTER
        # Memory stays bounded by what we were told about.
        assert len(swim.members()) <= len(IDS)
        assert len(swim._probes) <= 64 and len(swim._relays) <= 64
        assert len(swim._suspicions) <= len(IDS)
        assert len(swim._timers) <= 64 + 8 * len(script)
    assert swim.incarnation >= 1


@settings(deadline=None, max_examples=100)
@given(
    st.lists(st.tuples(small_inc, st.sampled_from(["alive", "suspect", "dead"])), max_size=30),
    st.integers(0, 2**16),
)
def test_incarnation_of_a_member_never_goes_down(updates: list[tuple[int, str]], seed: int) -> None:
    swim = Swim(
        node_id=SELF,
        name="me",
        addr=("10.0.0.9", 7946),
        config=LOCAL,
        rng=random.Random(seed),
        now=0.0,
    )
    other = IDS[1]
    swim.receive(0.0, ("h", 1), [Alive(node=other, name="o", addr=("h", 1), incarnation=0)])
    last = 0
    for i, (inc, kind) in enumerate(updates):
        msg: Message
        if kind == "alive":
            msg = Alive(node=other, name="o", addr=("h", 1), incarnation=inc)
        elif kind == "suspect":
            msg = Suspect(node=other, incarnation=inc, accuser=IDS[2])
        else:
            msg = Dead(node=other, incarnation=inc, accuser=IDS[2])
        swim.receive(i * 0.01, ("h", 1), [msg])
        snap = swim.member(other)
        assert snap is not None and snap.incarnation >= last
        last = snap.incarnation


# ---------------------------------------------------------------------- the simulator


@settings(deadline=None, max_examples=12)
@given(st.integers(0, 2**32), st.floats(0.0, 0.2), st.integers(3, 12))
def test_membership_converges_under_loss(seed: int, loss: float, n: int) -> None:
    print(f"seed={seed} loss={loss} n={n}")
    net = SimNetwork(seed=seed, config=LOCAL, loss=loss)
    nodes = [net.add_node()]
    for _ in range(n - 1):
        nodes.append(net.add_node(join=[net.rng.choice(nodes).addr]))
    # Joins over a lossy network may need the periodic push-pull; allow a few periods.
    end = 6 * LOCAL.push_pull_interval
    while net.now < end and not net.converged():
        net.run_until(net.now + 0.25)
    # At up to 20% loss a member may be falsely declared dead along the way (SWIM trades that
    # against detection time); it refutes and the views still converge to everyone alive.
    assert net.converged()
