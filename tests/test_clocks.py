"""Members with skewed or stepped wall clocks in a mesh with a secret (probe 4 of issue #17).

Real nodes in one process (SWIM over loopback UDP and TCP, same-host discovery); each node's
wall clock, the one replay protection reads, is shifted through ``open_node(wall_clock=)``.
Before clocks were measured over push-pull, a member 90 s ahead was refused forever (its
datagrams "stale"), and a member whose clock jumped 60 s was cut off and declared dead."""

from __future__ import annotations

import logging
import time
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

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
