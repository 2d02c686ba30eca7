"""Members with skewed or stepped wall clocks in a mesh with a secret (probe 4 of issue #17).

Real nodes in one process (SWIM over loopback UDP and TCP, same-host discovery); each node's
wall clock, the one replay protection reads, is shifted through ``open_node(wall_clock=)``.
Before clocks were measured over push-pull, a member 90 s ahead was refused forever (its
datagrams "stale"), and a member whose clock jumped 60 s was cut off and declared dead. The
last test runs real workers under ``faketime``."""

from __future__ import annotations

import logging
import os
import shutil
import time
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio
from tests_support import Worker

from ftmesh.membership.config import MembershipConfig
from ftmesh.membership.messages import MemberState
from ftmesh.net.node import Node, NodeConfig, open_node
from ftmesh.security import MeshAuth

AUTH = MeshAuth.from_secrets([b"a mesh secret of enough bytes"])
WITHIN = 10.0
"""Seconds within which a skewed member must be a full member (the probe's bound)."""


class ShiftedClock:
    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def __call__(self) -> float:
        return time.time() + self.offset


def config(registry: Path) -> NodeConfig:
    return NodeConfig(
        mesh="clocks",
        discovery="local",
        registry_dir=str(registry),
        auth=AUTH,
        membership=MembershipConfig.preset("local"),
    )


def alive_ids(node: Node) -> set[str]:
    return {m.node for m in node.members() if m.state == MemberState.ALIVE}


async def whole(nodes: list[Node], timeout: float) -> None:
    want = {n.node_id for n in nodes}
    with trio.fail_after(timeout):
        while any(alive_ids(n) != want for n in nodes):
            await trio.sleep(0.05)


async def test_skewed_and_stepped_clocks_keep_the_mesh_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clocks = [ShiftedClock(), ShiftedClock(), ShiftedClock(90.0)]
    caplog.set_level(logging.WARNING, logger="ftmesh.node")
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(open_node(config(tmp_path), wall_clock=c))
            for c in clocks
        ]
        await whole(nodes, WITHIN)  # the member 90 s ahead joined
        ahead = nodes[2].address
        for n in nodes[:2]:
            assert abs(n.clocks.offset(ahead) - 90.0) < 1.0, n.clocks.offsets()
        assert "is 90.0 s ahead of ours" in caplog.text
        # Every rumour of a failure from here on is a false one.
        events = [n.subscribe() for n in nodes]
        clocks[1].offset = 60.0  # an NTP step on a running member
        await trio.sleep(8.0)  # (the local preset declares a silent member dead in ~3 s)
        await whole(nodes, 1.0)
        stepped = nodes[1].address
        for i in (0, 2):
            want = clocks[1].offset - clocks[i].offset
            assert abs(nodes[i].clocks.offset(stepped) - want) < 1.0, nodes[i].clocks.offsets()
        for recv in events:
            seen = []
            while True:
                try:
                    seen.append(recv.receive_nowait().kind)
                except trio.WouldBlock:
                    break
            assert "dead" not in seen, seen


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (scripts/setup.sh)")
def test_two_workers_90_s_apart_start_and_train_together(tmp_path: Path) -> None:
    """The probe as a user meets it: two ``ftmesh worker --start-peers 2`` with a secret, one
    of them on a host whose clock is 90 s ahead. Before, each trained alone after 60 s, both
    exiting 0 into the same checkpoint directory; now they start together, say how far apart
    their clocks are, and end with the same state."""
    secret = tmp_path / "secret"
    secret.write_text("a mesh secret of enough bytes\n")
    env = {**os.environ, "FTMESH_REGISTRY_DIR": str(tmp_path / "registry"), "FTMESH_LOG": "WARNING"}
    args = (
        *("--mesh", "skew", "--discovery", "local", "--preset", "local"),
        *("--secret-file", str(secret), "--start-peers", "2"),
    )
    script = ("--epochs", "1", "--step-delay", "0", "--digest-every", "0")
    workers = [
        Worker(tmp_path / "w0.log", env, *args, script_args=script),
        Worker(
            tmp_path / "w1.log", env, *args, prefix=("faketime", "-f", "+90s"), script_args=script
        ),
    ]
    try:
        for w in workers:
            w.wait(lambda w: w.proc.poll() is not None, 240, "the end of training")
    finally:
        for w in workers:
            w.stop()
    for w in workers:
        assert w.proc.returncode == 0, w.text()[-3000:]
        steps = w.steps()
        assert steps[0]["step"] == 1 and steps[0]["members"] == 2, steps[0]
        assert all(r["members"] == 2 for r in steps if "done" not in r)
        assert "starting without the others" not in w.text()
    assert "s ahead of ours" in workers[0].text() and "s behind ours" in workers[1].text()
    assert len({w.steps()[-1]["digest"] for w in workers}) == 1
