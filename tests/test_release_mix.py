"""Which releases may share a mesh (CHANGELOG.md): every member publishes its ftmesh release
(``major.minor``) in its metadata, and the ring leaves out a training member of another
release, with a WARNING on both sides and a counter, instead of mixing two wire formats and
two trainers in one ring. Real in-process members on loopback; the second one's published
release is patched at start (the release it would publish were it another install)."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest
from tests_support import local_mesh_config

from ftmesh.membership.messages import MemberSnapshot, MemberState
from ftmesh.membership.wire import MAGIC, PROTOCOL_VERSION
from ftmesh.mesh import core
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.mesh.meta import RELEASE, RELEASE_KEY, ROLE_KEY, ring_exclusions


def _member(node: str, **meta: str) -> MemberSnapshot:
    return MemberSnapshot(
        node=node,
        name=node,
        addr=("127.0.0.1", 1),
        incarnation=0,
        state=MemberState.ALIVE,
        meta={ROLE_KEY: "train", **meta},
    )


def test_the_rule() -> None:
    members = [
        _member("a", **{RELEASE_KEY: "0.1"}),
        _member("b", **{RELEASE_KEY: "0.2"}),
        _member("c"),  # before the key existed: no way to tell, not left out
    ]
    out = ring_exclusions(members, release="0.1")
    assert list(out) == ["b"] and out["b"].reason == "release" and out["b"].by == ("0.2",)
    assert list(ring_exclusions(members, release="0.2")) == ["a"]


def test_a_member_of_another_release_is_left_out_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ftmesh.mesh")
    cfg = local_mesh_config(tmp_path / "reg", "releases")
    with SyncMesh.start(cfg) as ours:
        ours.set_role("train")
        monkeypatch.setattr(core, "RELEASE", "9.9")
        with SyncMesh.start(cfg) as other:
            other.set_role("train")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                seen = {m.node: m.meta.get(RELEASE_KEY) for m in ours.members()}
                if seen.get(other.node_id) == "9.9" and other.node_id in ours.exclusions():
                    break
                time.sleep(0.05)
            assert ours.exclusions()[other.node_id].reason == "release"
            view = ours.view()
            assert view is not None and view.node_ids == (ours.node_id,)
            assert ours.mesh.node.me().meta[RELEASE_KEY] == RELEASE
            deadline = time.monotonic() + 10
            text = ""
            while f"runs ftmesh 9.9.x and this member {RELEASE}.x" not in text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
                text = caplog.text
            counters = ours.call_sync(lambda: dict(ours.mesh.reach.counters))
            assert counters.get("left_out_release") == 1, counters


def test_a_packet_of_another_wire_protocol_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A membership datagram of another wire protocol (another release) is dropped and
    counted as before, and the WARNING says what it means instead of looking like an attack."""
    caplog.set_level(logging.WARNING, logger="ftmesh")
    with SyncMesh.start(local_mesh_config(tmp_path / "reg", "wire")) as ours:
        addr = ours.mesh.node.me().addr
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(MAGIC + bytes((PROTOCOL_VERSION + 1, 0)) + bytes(64), tuple(addr))
        deadline = time.monotonic() + 10
        while "members of different ftmesh releases cannot share a mesh" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        assert f"version {PROTOCOL_VERSION + 1}" in caplog.text
        assert ours.call_sync(ours.mesh.node.statistics).get("rx_dropped_bad_version") == 1
