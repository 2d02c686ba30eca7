"""Wire format: round trips, caps, and every way a packet is refused (``RemoteProtocolError``
with a stable ``reason``)."""

from __future__ import annotations

import msgpack
import pytest

from ftmesh.errors import RemoteProtocolError
from ftmesh.membership import wire
from ftmesh.membership.messages import (
    TYPE_OF,
    Ack,
    Alive,
    Dead,
    IndirectPing,
    MemberSnapshot,
    MemberState,
    Message,
    Meta,
    MsgType,
    Nack,
    PacketPair,
    Ping,
    PushPull,
    Suspect,
)
from ftmesh.membership.wire import PacketCodec, check_meta
from ftmesh.security import MeshAuth

NOW = 1_700_000_000.0
SECRET_A = b"a" * 32
SECRET_B = b"b" * 32
NODE = "0123456789abcdef0123456789abcdef"
PEER = "fedcba9876543210fedcba9876543210"

_nonce_counter = 0


def nonce() -> bytes:
    global _nonce_counter
    _nonce_counter += 1
    return _nonce_counter.to_bytes(8, "big")


def plain(mesh: str = "m") -> PacketCodec:
    return PacketCodec(mesh, MeshAuth.none())


def authed(*secrets: bytes, mesh: str = "m", window: float = 30.0) -> PacketCodec:
    return PacketCodec(mesh, MeshAuth.from_secrets(list(secrets)), window)


SNAP = MemberSnapshot(
    node=NODE,
    name="host-1",
    addr=("10.0.0.1", 7946),
    incarnation=3,
    state=MemberState.SUSPECT,
    meta={"role": "trainer", "gpus": 2, "lr": 0.5, "ok": True, "none": None},
)
EVERY_MESSAGE: list[Message] = [
    Ping(seq=1, target=PEER, source=NODE, source_addr=("127.0.0.1", 7000)),
    IndirectPing(
        seq=2**32 - 1,
        target=PEER,
        target_addr=("10.1.2.3", 1),
        source=NODE,
        source_addr=("127.0.0.1", 65535),
        want_nack=False,
    ),
    Ack(seq=0, source=PEER),
    Nack(seq=7, source=PEER),
    Alive(
        node=NODE,
        name="host-1",
        addr=("10.0.0.1", 7946),
        incarnation=wire.MAX_COUNTER,
        meta={"data": "10.0.0.1:9000", "step": -5},
    ),
    Alive(node=NODE, name="", addr=("h", 2), incarnation=0),
    Suspect(node=NODE, incarnation=4, accuser=PEER),
    Dead(node=NODE, incarnation=5, accuser=NODE),
    PushPull(source=NODE, members=(SNAP,), join=True, observer=False),
    PushPull(source=NODE, members=(), join=False, observer=True),
    PacketPair(seq=9, part=1, source=NODE, filler=wire.MAX_PAIR_FILLER),
    PacketPair(seq=0, part=0, source=PEER),
]


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in EVERY_MESSAGE} == set(TYPE_OF)


@pytest.mark.parametrize(
    "fields",
    [
        [int(MsgType.PACKET_PAIR), 1, 2, NODE, ()],  # part 0 or 1 only
        [int(MsgType.PACKET_PAIR), 1, 0, NODE, (0,) * (wire.MAX_PAIR_FILLER + 1)],
        [int(MsgType.PACKET_PAIR), 1, 0, NODE, b"\0" * 100],  # a bin: old members refuse it
        [int(MsgType.PACKET_PAIR), 1, 0, NODE],
    ],
)
def test_a_malformed_packet_pair_is_refused(fields: list[object]) -> None:
    with pytest.raises(RemoteProtocolError):
        wire.decode_message(tuple(fields))


def test_a_packet_pair_pads_with_an_array_that_old_envelopes_accept() -> None:
    """Members of older releases open the envelope with the same caps (a ``bin`` of at most
    the nonce's 8 bytes) and skip the unknown type: a pair must not fail their envelope."""
    codec = plain()
    data = codec.seal([PacketPair(seq=1, part=0, source=NODE, filler=1100)], NOW, nonce())
    assert 1100 < len(data) < 1200
    assert codec.open(data, NOW) == [PacketPair(seq=1, part=0, source=NODE, filler=1100)]


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("auth", [False, True])
def test_round_trip(msg: Message, auth: bool) -> None:
    codec = authed(SECRET_A) if auth else plain()
    data = codec.seal([msg], NOW, nonce())
    assert data[:2] == wire.MAGIC and data[2] == wire.PROTOCOL_VERSION
    assert codec.open(data, NOW, cap=wire.MAX_FRAME) == [msg]
    assert wire.encoded_size(msg) == len(msgpack.packb(wire.message_fields(msg)))


def test_many_messages_in_one_packet_keep_their_order() -> None:
    codec = plain()
    msgs = EVERY_MESSAGE[:8] * 3
    assert codec.open(codec.seal(msgs, NOW, nonce()), NOW) == msgs


def test_unknown_message_type_from_a_newer_peer_is_skipped() -> None:
    codec = plain()
    body = msgpack.packb(["m", int(NOW * 1000), nonce(), [[999, "future"], [3, 1, PEER]]])
    data = wire.MAGIC + bytes((wire.PROTOCOL_VERSION, 0)) + body
    assert codec.open(data, NOW) == [Ack(seq=1, source=PEER)]


# ---------------------------------------------------------------------- refusals


def reason_of(
    codec: PacketCodec, data: bytes, now: float = NOW, cap: int = wire.MAX_DATAGRAM
) -> str:
    with pytest.raises(RemoteProtocolError) as info:
        codec.open(data, now, cap=cap)
    return info.value.reason


def raw(envelope: object, *, version: int = wire.PROTOCOL_VERSION, flags: int = 0) -> bytes:
    body: bytes = msgpack.packb(envelope)
    return wire.MAGIC + bytes((version, flags)) + body


def test_wrong_mesh() -> None:
    data = plain("other").seal([Ack(seq=1, source=PEER)], NOW, nonce())
    assert reason_of(plain("m"), data) == "wrong_mesh"


def test_bad_version() -> None:
    data = bytearray(plain().seal([Ack(seq=1, source=PEER)], NOW, nonce()))
    data[2] = wire.PROTOCOL_VERSION + 1
    assert reason_of(plain(), bytes(data)) == "bad_version"


@pytest.mark.parametrize("data", [b"", b"F", b"XX\x01\x00", b"FM", b"\x00" * 100])
def test_bad_magic(data: bytes) -> None:
    assert reason_of(plain(), data) == "malformed"


def test_bad_mac_flipped_bit() -> None:
    codec = authed(SECRET_A)
    data = bytearray(codec.seal([Ack(seq=1, source=PEER)], NOW, nonce()))
    data[-1] ^= 1
    assert reason_of(codec, bytes(data)) == "bad_mac"
    data[-1] ^= 1
    data[10] ^= 0x40  # tamper with the body instead of the tag
    assert reason_of(codec, bytes(data)) == "bad_mac"


def test_bad_mac_other_secret() -> None:
    data = authed(SECRET_B).seal([Ack(seq=1, source=PEER)], NOW, nonce())
    assert reason_of(authed(SECRET_A), data) == "bad_mac"


def test_missing_mac() -> None:
    data = plain().seal([Ack(seq=1, source=PEER)], NOW, nonce())
    assert reason_of(authed(SECRET_A), data) == "unauthenticated"
    # The auth flag set but the tag cut off.
    signed = authed(SECRET_A).seal([Ack(seq=1, source=PEER)], NOW, nonce())
    assert reason_of(authed(SECRET_A), signed[:5]) == "unauthenticated"


def test_member_without_secret_refuses_authenticated_packets() -> None:
    data = authed(SECRET_A).seal([Ack(seq=1, source=PEER)], NOW, nonce())
    assert reason_of(plain(), data) == "unauthenticated"


def test_replay_same_nonce() -> None:
    sender, receiver = authed(SECRET_A), authed(SECRET_A)
    n = nonce()
    data = sender.seal([Ack(seq=1, source=PEER)], NOW, n)
    assert receiver.open(data, NOW) == [Ack(seq=1, source=PEER)]
    assert reason_of(receiver, data, NOW + 1) == "replayed"
    # A different packet reusing the nonce is a replay too.
    other = sender.seal([Ack(seq=2, source=PEER)], NOW, n)
    assert reason_of(receiver, other, NOW + 2) == "replayed"


@pytest.mark.parametrize("skew", [-31.0, 31.0, -3600.0])
def test_stale_timestamp(skew: float) -> None:
    data = authed(SECRET_A).seal([Ack(seq=1, source=PEER)], NOW + skew, nonce())
    assert reason_of(authed(SECRET_A, window=30.0), data) == "stale"


def test_timestamp_inside_window_accepted() -> None:
    data = authed(SECRET_A).seal([Ack(seq=1, source=PEER)], NOW - 29.0, nonce())
    assert authed(SECRET_A, window=30.0).open(data, NOW) == [Ack(seq=1, source=PEER)]


def test_replay_cache_is_bounded() -> None:
    sender, receiver = authed(SECRET_A), authed(SECRET_A, window=1.0)
    for i in range(200):
        receiver.open(sender.seal([], NOW + i * 0.1, nonce()), NOW + i * 0.1)
    # Only nonces that could still pass the window (2 s = 20 packets) are kept.
    assert len(receiver._nonces) <= 22


def test_key_rotation() -> None:
    old, new = SECRET_A, SECRET_B
    msg = [Ack(seq=1, source=PEER)]
    rotating = authed(new, old)  # signs with new, accepts both
    assert rotating.open(authed(old).seal(msg, NOW, nonce()), NOW) == msg
    assert rotating.open(authed(new).seal(msg, NOW, nonce()), NOW) == msg
    # A member still on the old key only accepts the rotating member if it holds the new one.
    assert authed(old, new).open(rotating.seal(msg, NOW, nonce()), NOW) == msg
    assert reason_of(authed(old), rotating.seal(msg, NOW, nonce())) == "bad_mac"
    # Once the old key is retired, its signers are refused.
    assert reason_of(authed(new), authed(old).seal(msg, NOW, nonce())) == "bad_mac"


# ---------------------------------------------------------------------- caps

LONG_ID = "a" * (wire.MAX_NODE_ID + 1)


@pytest.mark.parametrize(
    "msg",
    [
        Ping(seq=1, target=LONG_ID, source=NODE, source_addr=("h", 1)),
        Ping(seq=1, target="", source=NODE, source_addr=("h", 1)),
        Ping(seq=-1, target=PEER, source=NODE, source_addr=("h", 1)),
        Ping(seq=wire.MAX_COUNTER + 1, target=PEER, source=NODE, source_addr=("h", 1)),
        Ping(seq=1, target=PEER, source=NODE, source_addr=("h", 0)),
        Ping(seq=1, target=PEER, source=NODE, source_addr=("h", 65536)),
        Ping(seq=1, target=PEER, source=NODE, source_addr=("h" * (wire.MAX_HOST + 1), 1)),
        Alive(node=NODE, name="n" * (wire.MAX_NAME + 1), addr=("h", 1), incarnation=1),
        Alive(node=NODE, name="n", addr=("h", 1), incarnation=wire.MAX_COUNTER + 1),
        Alive(
            node=NODE,
            name="n",
            addr=("h", 1),
            incarnation=1,
            meta={"k" * (wire.MAX_META_KEY + 1): 1},
        ),
        Alive(
            node=NODE,
            name="n",
            addr=("h", 1),
            incarnation=1,
            meta={"k": "v" * (wire.MAX_META_STR + 1)},
        ),
        Alive(
            node=NODE,
            name="n",
            addr=("h", 1),
            incarnation=1,
            meta={f"k{i}": i for i in range(wire.MAX_META_ENTRIES + 1)},
        ),
        Alive(node=NODE, name="n", addr=("h", 1), incarnation=1, meta={"k": 2**63}),
        Alive(node=NODE, name="n", addr=("h", 1), incarnation=1, meta={"k": float("nan")}),
        Suspect(node=NODE, incarnation=True, accuser=PEER),  # bool is not an int
        Dead(node=NODE, incarnation=1, accuser=LONG_ID),
        PushPull(
            source=NODE,
            members=(
                MemberSnapshot(
                    node=NODE,
                    name="n",
                    addr=("h", 1),
                    incarnation=1,
                    state=MemberState.ALIVE,
                    meta={"k": "v" * (wire.MAX_META_STR + 1)},
                ),
            ),
        ),
    ],
    ids=lambda m: type(m).__name__,
)
def test_field_caps(msg: Message) -> None:
    assert reason_of(plain(), plain().seal([msg], NOW, nonce())) == "malformed"


def test_meta_bytes_cap() -> None:
    meta: Meta = {f"k{i}": "v" * 500 for i in range(5)}  # every entry fits, the total does not
    msg = Alive(node=NODE, name="n", addr=("h", 1), incarnation=1, meta=meta)
    assert reason_of(plain(), plain().seal([msg], NOW, nonce())) == "oversized"
    with pytest.raises(RemoteProtocolError):
        check_meta(meta)
    assert check_meta({"a": 1}) == {"a": 1}


def test_datagram_size_cap() -> None:
    data = plain().seal([Ack(seq=1, source=PEER)], NOW, nonce()) + b"\0" * wire.MAX_DATAGRAM
    assert reason_of(plain(), data) == "oversized"
    small = plain().seal([Ack(seq=1, source=PEER)], NOW, nonce())
    assert reason_of(plain(), small, cap=len(small) - 1) == "oversized"


def test_messages_per_packet_cap() -> None:
    msgs = [Ack(seq=i, source=PEER) for i in range(wire.MAX_MSGS_PER_PACKET + 1)]
    assert reason_of(plain(), plain().seal(msgs, NOW, nonce())) == "malformed"
    ok = msgs[: wire.MAX_MSGS_PER_PACKET]
    assert len(plain().open(plain().seal(ok, NOW, nonce()), NOW)) == wire.MAX_MSGS_PER_PACKET


def test_members_cap() -> None:
    # A push-pull claiming more than MAX_MEMBERS entries is refused before any is decoded.
    env = ["m", int(NOW * 1000), nonce(), [[8, NODE, [0] * (wire.MAX_MEMBERS + 1), False, False]]]
    assert reason_of(plain(), raw(env), cap=wire.MAX_FRAME) == "malformed"


def test_frame_cap() -> None:
    data = raw(["m", 0, nonce(), []]) + b"\0" * wire.MAX_FRAME
    assert reason_of(plain(), data, cap=wire.MAX_FRAME) == "oversized"


@pytest.mark.parametrize(
    "env",
    [
        ["m", 0, b"1234567", []],  # short nonce
        ["m", 0, b"123456789", []],  # long nonce (msgpack bin cap)
        ["m", -1, b"12345678", []],  # negative timestamp
        ["m", 0, b"12345678"],  # missing field
        ["m", 0, b"12345678", {}],  # messages not a list
        ["m", 0, b"12345678", [[]]],  # empty message
        ["m", 0, b"12345678", [[3, 1]]],  # ack with a missing field
        ["m", 0, b"12345678", [[3, 1, PEER, 4]]],  # ack with an extra field
        ["m", 0, b"12345678", [["3", 1, PEER]]],  # type not an int
        ["m", 0, b"12345678", [[5, NODE, "n", ["h", 1, 2], 1, {}]]],  # bad address
        ["m", 0, b"12345678", [[5, NODE, "n", ["h", 1], 1, {1: 2}]]],  # non-str meta key
        ["m", 0, b"12345678", [[5, NODE, "n", ["h", 1], 1, {"k": [1]}]]],  # list meta value
        ["m", 0, b"12345678", [[8, NODE, [[NODE, "n", ["h", 1], 1, 9, {}]], False, False]]],
        "just a string",
        ["m" * (wire.MAX_META_STR + 1), 0, b"12345678", []],  # string over the decoder cap
    ],
)
def test_malformed_envelopes(env: object) -> None:
    assert reason_of(plain(), raw(env)) == "malformed"


def test_msgpack_garbage_and_ext_types() -> None:
    head = wire.MAGIC + bytes((wire.PROTOCOL_VERSION, 0))
    for body in (b"\xc1", b"\x94", b"\xd4\x01\x00", b"\xdd\xff\xff\xff\xff", b"\x91\x91" * 600):
        assert reason_of(plain(), head + body) == "malformed"
