"""What ``ftmesh status`` says of members' devices and of the view's backend (issue #24, item
6), on member lists as an observer reads them: the cells, the JSON, and the backend line
with its reasons, which must agree with ``view_backend`` (what the members choose). The same
output from real members is in ``tests/test_live_view.py``."""

from __future__ import annotations

from typing import Any

import pytest

from ftmesh.cli.gpu_view import describe_view, devices_cell, devices_json, nccl_version
from ftmesh.collective.backend import DEVICES_KEY, Backend
from ftmesh.membership.messages import MemberSnapshot, MemberState
from ftmesh.mesh.meta import DATA_KEY, ROLE_KEY


def _member(
    name: str, devices: Any = None, role: str = "train", state: MemberState = MemberState.ALIVE
) -> MemberSnapshot:
    meta: dict[str, Any] = {ROLE_KEY: role, DATA_KEY: f"127.0.0.1:{7000 + sum(map(ord, name))}"}
    if devices is not None:
        meta[DEVICES_KEY] = devices
    addr = ("127.0.0.1", 7946)
    return MemberSnapshot(
        node=f"node-{name}", name=name, addr=addr, incarnation=1, state=state, meta=meta
    )


def test_nccl_version_codes() -> None:
    assert nccl_version(22105) == "2.21.5"
    assert nccl_version(23203) == "2.32.3"
    assert nccl_version(20900) == "2.9.0"
    assert nccl_version(2804) == "2.8.4"  # (before 2.9: one digit less)
    assert nccl_version(7) == "7"


@pytest.mark.parametrize(
    ("entry", "cell"),
    [
        (None, "cpu"),
        ("cuda=0,nccl=0", "cpu"),
        ("cuda=0,nccl=22105", "cpu"),
        ("cuda=2,nccl=22105", "cuda=2,nccl=2.21.5"),
        ("cuda=1,nccl=0", "cuda=1,nccl=none"),
        ("cuda=x", "?"),
        (42, "?"),
        ("cuda=1,nccl=22105\x1b[31m", "?"),
        ("cuda=99999,nccl=1", "?"),
    ],
)
def test_devices_cell(entry: Any, cell: str) -> None:
    meta = {} if entry is None else {DEVICES_KEY: entry}
    assert devices_cell(meta) == cell


def test_devices_json() -> None:
    assert devices_json({}) == {"devices": None}
    ok = devices_json({DEVICES_KEY: "cuda=1,nccl=22105"})
    assert ok == {"devices": {"cuda": 1, "nccl": 22105, "nccl_version": "2.21.5"}}
    bad = devices_json({DEVICES_KEY: "\x1bcuda"})
    assert bad["devices"] is None and "does not parse" in bad["devices_problem"]
    assert "\x1b" not in bad["devices_problem"]


def test_every_member_on_one_nccl_is_nccl() -> None:
    members = [_member("a", "cuda=1,nccl=22105"), _member("b", "cuda=8,nccl=22105")]
    members.append(_member("obs", "cuda=x", role="observer"))  # not in the view: not counted
    members.append(_member("gone", None, state=MemberState.DEAD))
    view = describe_view(members)
    assert view is not None and view.gpu is Backend.NCCL and view.nccl == 22105
    assert view.members == ("a", "b")
    assert view.line() == (
        "view backend (2 members): nccl (NCCL 2.21.5 on every member; host buffers: tcp ring)"
    )
    js = view.as_json()
    assert js["gpu_buffers"] == "nccl" and js["host_buffers"] == "tcp"
    assert js["nccl_version"] == "2.21.5" and js["staged_because"] == []


def test_staging_names_every_reason() -> None:
    members = [
        _member("a", "cuda=1,nccl=22105"),
        _member("b", "cuda=1,nccl=21803"),
        _member("c", None),
        _member("d", "cuda=0,nccl=0"),
        _member("e", "cuda=1,nccl=0"),
        _member("f", "cuda=1;nccl=22105"),
    ]
    view = describe_view(members)
    assert view is not None and view.gpu is Backend.STAGING and view.nccl == 0
    assert view.staged_because == (
        "f: devices entry does not parse",
        "c d: no GPU",
        "e: a GPU but no NCCL",
        "NCCL versions differ (2.18.3 on b, 2.21.5 on a)",
    )
    assert view.line().startswith(
        "view backend (6 members): tcp ring (host buffers; GPU buffers staged: f: devices"
    )
    assert view.as_json()["gpu_buffers"] == "staging"


def test_many_members_are_named_briefly_and_names_are_escaped() -> None:
    members = [_member(f"w{i}") for i in range(7)] + [_member("\x1b[31mx", "cuda=?")]
    view = describe_view(members)
    assert view is not None
    assert view.staged_because == (
        "\\x1b[31mx: devices entry does not parse",
        "w0 w1 w2 w3 +3 more: no GPU",
    )
    assert "\x1b" not in view.line()


def test_no_training_member_no_view() -> None:
    assert describe_view([]) is None
    assert describe_view([_member("o", "cuda=1,nccl=22105", role="observer")]) is None


def test_status_says_when_there_is_no_view() -> None:
    from ftmesh.cli.status_cmd import backend_line

    assert backend_line(describe_view([_member("s", role="starting")])) == (
        "view backend: none (no alive training member, no view)"
    )
