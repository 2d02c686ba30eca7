"""Mesh-secret rotation on real ``ftmesh node`` processes (loopback, no root needed).

A secret file holds one secret per line: the first signs, all verify. A member that only holds
[old] cannot read packets signed with new, so a rotation without a flag day goes through
configurations where every two *adjacent* ones can talk both ways:

    [old] -> [old, new] -> [new, old] -> [new]

(each step a rolling restart, one member at a time). Members with [new, old] and [old] do not
coexist: the [old] one drops everything the other signs with new.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ftmesh.errors import DeadlineExceeded
from ftmesh.lab.procs import NodeGroup, NodeProcess, member_states, view

pytestmark = pytest.mark.slow

OLD = "the old mesh secret, long enough"
NEW = "the new mesh secret, long enough"


def _wait_one_view(nodes: list[NodeProcess], timeout: float) -> None:
    want = frozenset(n.node_id for n in nodes)
    deadline = time.monotonic() + timeout
    while True:
        views = [view(n) for n in nodes]
        sus = [
            k for n in nodes for m, k in member_states(n).items() if m in want and k == "suspect"
        ]
        if all(v == want for v in views) and not sus:
            return
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"no single view: {[len(v) for v in views]}, suspects {sus}")
        time.sleep(0.1)


def test_rolling_key_rotation(node_group: NodeGroup, tmp_path: Path) -> None:
    files = {}
    for label, lines in {
        "old": [OLD],
        "old_new": [OLD, NEW],
        "new_old": [NEW, OLD],
        "new": [NEW],
    }.items():
        files[label] = tmp_path / f"{label}.secret"
        files[label].write_text("\n".join(lines) + "\n")

    def start(label: str) -> NodeProcess:
        return node_group.start("--secret-file", str(files[label]))

    members = [start("old") for _ in range(3)]
    _wait_one_view(members, 20)
    for label in ("old_new", "new_old", "new"):
        for i in range(len(members)):
            members[i].stop()
            members[i] = start(label)
            # Mixed configurations (e.g. two [old] and one [old, new]) form one mesh.
            _wait_one_view(members, 20)
    # After the rotation, the old secret alone no longer gets in.
    stale = start("old")
    time.sleep(4)
    for m in members:
        assert stale.node_id not in view(m)
    assert [s.record["event"] for s in stale.records] == ["self"]
