"""Real ``ftmesh node`` processes on loopback: join, crash, pause, leave, hostile input."""

from __future__ import annotations

import os
import random
import signal
import socket
import time

import pytest

from ftmesh.lab.procs import NodeGroup, NodeProcess
from ftmesh.membership.config import MembershipConfig

pytestmark = pytest.mark.slow

LOCAL = MembershipConfig.preset("local")
SCHED_SLACK = 1.5
"""Seconds added to protocol bounds for process scheduling on a loaded 2-core CI machine."""


def _dead_time(node: NodeProcess, victim: str, timeout: float) -> float:
    seen = node.wait_seen(lambda r: r["event"] == "dead" and r["node"] == victim, timeout)
    return seen.mono


def test_eight_nodes_form_one_view_and_see_kill9(node_group: NodeGroup) -> None:
    nodes = [node_group.start() for _ in range(8)]
    node_group.wait_converged(nodes, timeout=30)
    victim = nodes[3]
    survivors = [n for n in nodes if n is not victim]
    killed_at = time.monotonic()
    victim.kill()
    bound = LOCAL.crash_detection_bound(8) + SCHED_SLACK
    latest = max(_dead_time(n, victim.node_id, timeout=bound + 5) for n in survivors)
    assert latest - killed_at <= bound, f"last dead event {latest - killed_at:.2f}s after kill"
    # Nobody else was declared dead.
    for n in survivors:
        for other in survivors:
            assert "dead" not in n.events_about(other.node_id)


def test_sigstop_past_suspicion_is_dead_then_rejoins(node_group: NodeGroup) -> None:
    nodes = [node_group.start() for _ in range(4)]
    node_group.wait_converged(nodes, timeout=30)
    paused, others = nodes[0], nodes[1:]
    paused.signal(signal.SIGSTOP)
    try:
        for n in others:
            _dead_time(n, paused.node_id, timeout=LOCAL.crash_detection_bound(4) + 5)
    finally:
        paused.signal(signal.SIGCONT)
    # It learns it was declared dead and refutes with a higher incarnation...
    paused.wait_for(lambda r: r["event"] == "self" and r["incarnation"] > 1, timeout=15)
    # ...and every other member takes it back under that higher incarnation.
    for n in others:
        n.wait_for(
            lambda r: (
                r["node"] == paused.node_id and r["event"] == "joined" and r["incarnation"] > 1
            ),
            timeout=15,
        )


def test_graceful_leave_is_left_not_dead(node_group: NodeGroup) -> None:
    nodes = [node_group.start() for _ in range(4)]
    node_group.wait_converged(nodes, timeout=30)
    leaver = nodes[2]
    assert leaver.stop() == 0
    for n in nodes:
        if n is not leaver:
            n.wait_for(lambda r: r["event"] == "left" and r["node"] == leaver.node_id, 10)
    time.sleep(LOCAL.crash_detection_bound(3))  # a late "dead" would show up by now
    for n in nodes:
        if n is not leaver:
            assert "dead" not in n.events_about(leaver.node_id)


def test_junk_flood_changes_nothing(node_group: NodeGroup) -> None:
    nodes = [node_group.start() for _ in range(3)]
    node_group.wait_converged(nodes, timeout=30)
    target = nodes[0]
    host, port = target.addr.rsplit(":", 1)
    rng = random.Random(1234)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    valid_prefix = b"FM\x01\x00"
    sent = 0
    with sock:
        for i in range(5000):
            size = rng.choice([0, 1, 3, 4, 20, 200, 1400, 9000])
            body = rng.randbytes(size)
            if i % 3 == 0:
                body = valid_prefix + body  # gets past the magic check, fails later
            sock.sendto(body, (host, int(port)))
            sent += 1
            if i % 500 == 0:
                time.sleep(0.05)  # bounded rate; lets the node breathe
    time.sleep(1.0)
    for n in nodes:
        for other in nodes:
            if other is not n:
                assert "dead" not in n.events_about(other.node_id)
    assert target.proc.poll() is None, "the flooded node crashed"
    assert target.stop() == 0
    stats = target.wait_for(lambda r: r["event"] == "stats", 5)["counters"]
    dropped = sum(v for k, v in stats.items() if k.startswith("rx_dropped_"))
    assert dropped >= sent * 0.9, stats


def test_status_lists_members(node_group: NodeGroup, tmp_path: object) -> None:
    import json
    import subprocess
    import sys

    nodes = [node_group.start("--meta", "role=trainer") for _ in range(3)]
    node_group.wait_converged(nodes, timeout=30)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftmesh",
            "status",
            "--mesh",
            node_group.mesh,
            "--json",
            "--registry-dir",
            str(node_group.registry),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    members = json.loads(out.stdout)
    assert {m["node"] for m in members} == {n.node_id for n in nodes}
    assert all(m["state"] == "alive" and m["meta"] == {"role": "trainer"} for m in members)
    assert os.path.isdir(node_group.registry)
