"""Member metadata from the network (``ftmesh.mesh.meta``): every key the mesh reads, fuzzed
at the decode boundary (a sealed gossip packet carrying an ``Alive``), then read the way the
mesh reads it (view, state servers, size hints, roles). Whatever a member publishes, the
outcome is a usable member or one counted as unusable: never an exception."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftmesh.collective.topology import check_label, format_links
from ftmesh.discovery.base import advert_problem
from ftmesh.discovery.local import _parse_entry
from ftmesh.discovery.mdns import parse_txt
from ftmesh.errors import ConfigError, RemoteProtocolError
from ftmesh.membership.messages import Alive, MemberSnapshot, MemberState
from ftmesh.membership.wire import PacketCodec
from ftmesh.mesh.core import view_of
from ftmesh.mesh.meta import (
    DATA_KEY,
    LINKS_KEY,
    MAX_FAULT,
    MAX_STEP,
    PROGRESS_KEY,
    ROLE_KEY,
    ROLES,
    SITE_KEY,
    STATE_BYTES_KEY,
    STATE_KEY,
    BadMetadataError,
    MetadataGate,
    Progress,
    advertises_state,
    host_port,
    read_member,
    role_of,
)
from ftmesh.security import MeshAuth

ID = "ab" * 16
FAST = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
_addresses = st.one_of(
    st.builds(
        lambda h, p: f"{h}:{p}",
        st.sampled_from(["127.0.0.1", "h.local", "", "::1"]),
        st.integers(-5, 70000),
    ),
    st.text(max_size=30),
    st.sampled_from(["garbage", ":", "1.2.3.4:", ":80", "1.2.3.4:0", "1.2.3.4:65536", "a b:1"]),
)
_fields_of_progress = st.one_of(
    st.sampled_from(["0", "12", "1e3", "0.5", "1e-9", "-1", "nan", "inf", "1e999", "tcp", "TCP"]),
    st.sampled_from(["", " 1", "1_0", "99999999999999999", "1.5e+400", "9007199254740993"]),
    st.text(max_size=8),
)
_progress = st.one_of(
    st.lists(_fields_of_progress, min_size=5, max_size=8).map("|".join),
    st.builds(
        Progress,
        st.integers(0, MAX_STEP),
        st.floats(0, 1e9),
        st.integers(0, MAX_STEP),
        st.floats(0, 1e12),
        st.integers(0, MAX_STEP),
        st.sampled_from(["tcp", "nccl", "host+tcp"]),
        st.text(max_size=200),
    ).map(Progress.encode),
    st.text(max_size=60).map(lambda t: f"1|0.5|2|3.0|2|tcp|{t}"),  # the free-text field
    _scalars,
)
_values = {
    ROLE_KEY: st.one_of(st.sampled_from([*ROLES, "", "Train"]), _scalars),
    DATA_KEY: st.one_of(_addresses, _scalars),
    STATE_KEY: st.one_of(_addresses, _scalars),
    STATE_BYTES_KEY: st.one_of(st.integers(-3, 2**62), _scalars),
    PROGRESS_KEY: _progress,
    SITE_KEY: st.one_of(st.sampled_from(["lab", "eu-west-1a", "", "-x", "a b", "~1"]), _scalars),
    LINKS_KEY: st.one_of(
        st.dictionaries(
            st.text("0123456789abcdef", min_size=32, max_size=32), st.integers(-2, 40), max_size=60
        ).map(format_links),
        st.text("0123456789abcdefgz1", max_size=60),
        _scalars,
    ),
    "user": _scalars,
}
_meta = st.fixed_dictionaries({}, optional=_values)


def _through_the_wire(meta: dict[str, Any]) -> MemberSnapshot | None:
    """``meta`` as a receiving member holds it: sealed in an Alive, opened, or dropped."""
    codec = PacketCodec("m", MeshAuth.none())
    alive = Alive(node="ab" * 16, name="n", addr=("127.0.0.1", 5000), incarnation=1, meta=meta)
    try:
        (msg,) = codec.open(codec.seal([alive], 0.0, bytes(8)), 0.0)
    except RemoteProtocolError:  # membership's own caps: a documented drop
        return None
    assert isinstance(msg, Alive)
    return MemberSnapshot(
        node=msg.node,
        name=msg.name,
        addr=msg.addr,
        incarnation=1,
        state=MemberState.ALIVE,
        meta=msg.meta,
    )


@FAST
@given(_meta)
def test_every_metadata_key_parses_or_is_refused(meta: dict[str, Any]) -> None:
    m = _through_the_wire(meta)
    if m is None:
        return
    gate = MetadataGate()
    try:
        info = read_member(m)
    except BadMetadataError:
        assert gate.usable([m]) == [] and gate.bad_meta == 1
        assert view_of([m], gate=gate) is None
        assert role_of(m) == "" and not advertises_state(m)
        return
    assert info.role in ("", *ROLES)
    for addr in (info.data, info.state_addr):
        assert addr is None or (isinstance(addr[0], str) and 0 < addr[1] < 65536)
    assert info.state_bytes is None or (type(info.state_bytes) is int and info.state_bytes >= 0)
    p = info.progress
    if p is not None:
        assert all(type(v) is int and 0 <= v <= MAX_STEP for v in (p.step, p.share, p.world))
        assert all(type(v) is float and 0 <= v < float("inf") for v in (p.step_s, p.sps))
        assert len(p.fault) <= MAX_FAULT and p.fault.isprintable()
        assert Progress.parse(p.encode()).step == p.step  # what a reader shows, re-published
    view = view_of([m], gate=gate)
    assert gate.bad_meta == (1 if info.dropped else 0)  # a links value dropped, counted
    assert info.site == "" or check_label(info.site) == info.site
    assert (view is not None) == (info.role == "train")
    if view is not None:
        assert (view.members[0].host, view.members[0].port) == info.data
        assert view.plan is not None and view.plan.flat


def test_the_gate_counts_each_version_once_and_forgets_a_fixed_member() -> None:
    bad = MemberSnapshot(
        node="cd" * 16,
        name="bad",
        addr=("127.0.0.1", 7000),
        incarnation=3,
        state=MemberState.ALIVE,
        meta={ROLE_KEY: "train", DATA_KEY: "garbage"},
    )
    good = MemberSnapshot(
        node="ef" * 16,
        name="good",
        addr=("127.0.0.1", 7001),
        incarnation=1,
        state=MemberState.ALIVE,
        meta={ROLE_KEY: "train", DATA_KEY: "127.0.0.1:9000", STATE_BYTES_KEY: 10},
    )
    gate = MetadataGate()
    for _ in range(5):
        assert [m.node for m in gate.usable([bad, good])] == [good.node]
    assert gate.bad_meta == 1
    assert "garbage" in gate.problems()[bad.node]
    again = MemberSnapshot(**{**_fields(bad), "incarnation": 4, "meta": {ROLE_KEY: 7}})
    gate.usable([again, good])
    assert gate.bad_meta == 2
    fixed = MemberSnapshot(**{**_fields(bad), "incarnation": 5, "meta": {ROLE_KEY: "spare"}})
    assert len(gate.usable([fixed, good])) == 2 and gate.problems() == {}
    view = view_of([bad, good], gate=gate)
    assert view is not None and view.node_ids == (good.node,)


def _fields(m: MemberSnapshot) -> dict[str, Any]:
    return {k: getattr(m, k) for k in MemberSnapshot.__slots__}


def test_host_port_accepts_addresses_and_names_only() -> None:
    assert host_port("10.0.0.1:80", "data") == ("10.0.0.1", 80)
    assert host_port("pod-0.svc.cluster.local:29500", "data") == ("pod-0.svc.cluster.local", 29500)
    for text in ("garbage", "1.2.3.4:0", "::1:80", "a b:1", "1.2.3:4", ":80", "x:080000", 5):
        try:
            host_port(text, "data")
        except BadMetadataError as exc:
            assert exc.reason == "bad_meta"
        else:
            raise AssertionError(f"{text!r} accepted")


# -- the other door: discovery adverts (mDNS TXT records, same-host registry files) ----------

_txt_keys = st.sampled_from([b"mesh", b"id", b"name", b"port", b"v", b"x"])
_txt_values = st.one_of(
    st.none(),
    st.binary(max_size=80),
    st.sampled_from([b"m", b"ab" * 16, b"1", b"65535", b"65536", b"0", b"-1", "\u00e9".encode()]),
)


@FAST
@given(st.dictionaries(_txt_keys, _txt_values), st.sampled_from(["10.0.0.7", "x", "::1"]))
def test_mdns_txt_records_parse_or_are_refused(props: dict[bytes, bytes | None], host: str) -> None:
    try:
        advert = parse_txt(props, host)
    except RemoteProtocolError as exc:
        assert exc.reason == "malformed"
        return
    assert advert_problem(advert) is None


_json_values = st.recursive(
    _scalars | st.just(ID), lambda inner: st.lists(inner, max_size=3), max_leaves=8
)


@FAST
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "format": st.sampled_from([1, 2, "1"]),
            "pid": st.one_of(st.integers(-2, 2**32), _scalars),
            "pid_start": _json_values,
            "mesh": st.one_of(st.just("m"), _json_values),
            "node_id": st.one_of(st.just(ID), _json_values),
            "name": st.one_of(st.just("n"), _json_values),
            "host": st.one_of(st.just("127.0.0.1"), _json_values),
            "port": st.one_of(st.integers(-1, 70000), _json_values),
            "version": st.one_of(st.just(1), _json_values),
            "extra": _json_values,
        },
    )
)
def test_registry_entries_parse_or_are_refused(entry: dict[str, Any]) -> None:
    try:
        parsed = _parse_entry(json.dumps(entry).encode(), ID + ".json")
    except (ValueError, TypeError, RecursionError):
        return
    assert advert_problem(parsed.advert) is None and 1 <= parsed.pid < 2**31


def test_progress_is_checked_where_it_is_made_and_where_it_is_read() -> None:
    p = Progress(12, 0.031, 16, 512.3, 3, "nccl", "peer lost\n3f2a " + "x" * 200)
    assert len(p.fault) == MAX_FAULT and "\n" not in p.fault
    assert Progress.parse(p.encode()) == p
    for bad in ({"step": -1}, {"step": True}, {"step": 1.5}, {"step_s": float("nan")},
                {"sps": float("inf")}, {"world": MAX_STEP + 1}, {"backend": "TCP"},
                {"backend": ""}):  # fmt: skip
        with pytest.raises(ConfigError):
            Progress(**{"step": 1, **bad})  # type: ignore[arg-type]
    long_fault = "1|0|0|0|0|tcp|" + "y" * (MAX_FAULT + 1)
    for text in ("1|2|3", "x|0|0|0|0|tcp|", "1|nan|0|0|0|tcp|", "1|0|0|0|0|tcp|\x00",
                 long_fault, 7, None, "1|1e999|0|0|0|tcp|"):  # fmt: skip
        m = MemberSnapshot(
            node=ID,
            name="n",
            addr=("127.0.0.1", 7000),
            incarnation=1,
            state=MemberState.ALIVE,
            meta={ROLE_KEY: "train", DATA_KEY: "127.0.0.1:9000", PROGRESS_KEY: text},
        )
        with pytest.raises(BadMetadataError, match=PROGRESS_KEY):
            read_member(m)
        gate = MetadataGate()
        assert gate.usable([m]) == [] and gate.bad_meta == 1
