"""A member's closed connection, reported to a real node (``Node.connection_closed``), against a
real ``ftmesh node`` process on loopback: once the process is killed its gossip port answers
the probe with ICMP *port unreachable* (read from the socket's error queue, ``IP_RECVERR``),
which settles the probe at once; while it lives, the probe is answered and nothing happens.
The probe timeout here is long (1 s), so a suspicion well within it can only come from the
port's answer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
import trio

from ftmesh.membership.config import MembershipConfig
from ftmesh.membership.messages import MemberState
from ftmesh.net.node import IP_RECVERR, Node, NodeConfig, open_node

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

SLOW_PROBES = replace(MembershipConfig.preset("local"), probe_timeout=1.0, probe_interval=4.0)


@asynccontextmanager
async def node_and_peer(mesh: str) -> AsyncIterator[tuple[Node, subprocess.Popen[bytes], str]]:
    config = NodeConfig(mesh=mesh, discovery="none", bind="127.0.0.1", membership=SLOW_PROBES)
    async with open_node(config) as a:
        host, port = a.me().addr
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTMESH_")}
        b = subprocess.Popen(
            [sys.executable, "-m", "ftmesh", "node", "--mesh", mesh, "--name", "b",
             "--discovery", "none", "--join", f"{host}:{port}", "--preset", "local"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )  # fmt: skip
        try:
            with trio.fail_after(60):
                while not any(m.name == "b" for m in a.alive_members()):
                    await trio.sleep(0.05)
            yield a, b, next(m.node for m in a.alive_members() if m.name == "b")
        finally:
            if b.poll() is None:
                b.kill()
            b.wait()


def state_of(a: Node, node: str) -> MemberState | None:
    return next((m.state for m in a.members() if m.node == node), None)


@pytest.mark.skipif(IP_RECVERR is None, reason="datagram errors are read on Linux only")
async def test_a_killed_members_closed_connection_and_closed_port_suspect_it_at_once() -> None:
    async with node_and_peer("closed-port") as (a, b, b_id):
        b.send_signal(signal.SIGKILL)
        b.wait()  # its sockets are closed
        start = trio.current_time()
        a.connection_closed(b_id)
        with trio.fail_after(SLOW_PROBES.probe_timeout):  # not its timeout: its port's answer
            while state_of(a, b_id) != MemberState.SUSPECT:
                await trio.sleep(0.005)
        print(f"suspected {1000 * (trio.current_time() - start):.1f} ms after the report")
        stats = a.statistics()
        assert stats["closed_port_unreachable"] == 1, stats
        assert stats["rx_port_unreachable"] >= 1, stats
        assert stats["closed_suspects"] == 1, stats


async def test_a_live_member_whose_connection_closed_is_left_alone() -> None:
    async with node_and_peer("closed-live") as (a, b, b_id):
        before = next(m.incarnation for m in a.members() if m.node == b_id)
        a.connection_closed(b_id)
        await trio.sleep(2 * SLOW_PROBES.probe_timeout)
        assert state_of(a, b_id) == MemberState.ALIVE
        assert next(m.incarnation for m in a.members() if m.node == b_id) == before
        stats = a.statistics()
        assert stats["closed_probes"] == 1, stats
        assert "closed_suspects" not in stats and "closed_port_unreachable" not in stats
        assert b.poll() is None


@pytest.mark.skipif(IP_RECVERR is None, reason="datagram errors are read on Linux only")
async def test_a_closed_port_alone_suspects_nobody() -> None:
    """Without a closed connection, a probe's ICMP answer is only counted: the suspicion
    comes from the probe's own timeout, as before."""
    async with node_and_peer("closed-icmp-only") as (a, b, b_id):
        b.send_signal(signal.SIGKILL)
        b.wait()
        with trio.fail_after(30):
            while not a.statistics().get("port_unreachable_ignored"):
                await trio.sleep(0.01)
            ignored_at = trio.current_time()
            while state_of(a, b_id) == MemberState.ALIVE:
                await trio.sleep(0.01)
        # The probe that met the closed port failed only at its end (the probe interval).
        assert trio.current_time() - ignored_at >= SLOW_PROBES.probe_timeout / 2
        assert "closed_port_unreachable" not in a.statistics()


@pytest.mark.skipif(IP_RECVERR is None, reason="datagram errors are read on Linux only")
async def test_datagrams_to_a_dead_member_cost_no_datagram_to_a_live_one() -> None:
    """With ``IP_RECVERR`` the kernel reports a dead member's ICMP answer on the *next* send,
    whoever it goes to, and drops that datagram: gossip to the dead (``gossip_to_dead``) then
    cost every other datagram to the living (lost pings, lost rumours). Every one of those
    sends is sent again, so none fails, and a live member hears each metadata change."""
    async with node_and_peer("closed-next-send") as (a, b, _b_id):
        host, port = a.me().addr
        config = NodeConfig(mesh="closed-next-send", discovery="none", bind="127.0.0.1",
                            membership=SLOW_PROBES, join=[f"{host}:{port}"])  # fmt: skip
        async with open_node(config) as c:
            with trio.fail_after(30):
                while len(c.alive_members()) < 3:
                    await trio.sleep(0.05)
            b.send_signal(signal.SIGKILL)
            b.wait()
            with trio.fail_after(30):  # a's gossip and probes reach the dead port
                while a.statistics().get("rx_port_unreachable", 0) < 5:
                    await trio.sleep(0.05)
            for i in range(20):  # each change must reach c (before: about half were lost)
                a.update_meta({"i": str(i)})
                with trio.fail_after(5):
                    while next(m for m in c.members() if m.node == a.node_id).meta.get("i") != str(
                        i
                    ):
                        await trio.sleep(0.01)
            stats = a.statistics()
            assert stats.get("tx_resent_after_error", 0) >= 1, stats
            assert "tx_errors" not in stats, stats
