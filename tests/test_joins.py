"""Joins are retried, with backoff, whatever the discovery: a member started with
``--discovery none`` before the one it joins through is up joins it once it is (before, a
failed join was never tried again)."""

from __future__ import annotations

import socket

import trio

from ftmesh.membership.config import MembershipConfig
from ftmesh.net.node import JOIN_RETRY_BOUND, NodeConfig, open_node


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_join_through_an_address_not_up_yet_is_retried() -> None:
    port = _free_port()
    local = MembershipConfig.preset("local")
    joiner = NodeConfig(
        mesh="joins", discovery="none", join=(f"127.0.0.1:{port}",), membership=local
    )
    seed = NodeConfig(mesh="joins", discovery="none", port=port, membership=local)
    async with open_node(joiner) as b:
        await trio.sleep(2.5)  # a few attempts fail: nothing listens there yet
        assert b.statistics().get("push_pull_failed", 0) >= 1
        async with open_node(seed) as a:
            with trio.fail_after(JOIN_RETRY_BOUND + 2.0):
                while a.node_id not in {m.node for m in b.alive_members()}:
                    await trio.sleep(0.05)
