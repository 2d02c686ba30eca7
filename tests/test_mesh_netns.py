"""Real ``ftmesh node`` processes in network namespaces the test creates: mDNS discovery with
zero configuration, mesh-name isolation and mesh secrets. Multicast never leaves the lab."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from ftmesh.lab import VirtualLan
from ftmesh.lab.procs import NodeProcess, joined

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root (and iproute2) to create network namespaces; CI runs as root",
)
pytestmark = [pytest.mark.slow, pytest.mark.netns, needs_root]


def _node(lan: VirtualLan, host: int, mesh: str, secret: Path | None, log: Path) -> NodeProcess:
    argv = [
        "ip",
        "netns",
        "exec",
        lan.ns_name(host),
        sys.executable,
        "-m",
        "ftmesh",
        "node",
        "--mesh",
        mesh,
        "--discovery",
        "mdns",
        "--interface",
        lan.host_ip(host),
        "--preset",
        "local",
        "--events",
        "json",
    ]
    if secret is not None:
        argv += ["--secret-file", str(secret)]
    return NodeProcess(argv, stderr_path=log / f"h{host}.stderr")


def test_mdns_zero_config_isolation_and_secrets(tmp_path: Path) -> None:
    good = tmp_path / "good.secret"
    good.write_text("correct horse battery staple 1\n")
    other = tmp_path / "other.secret"
    other.write_text("a completely different secret\n")
    with VirtualLan(hosts=5) as lan:
        nodes: list[NodeProcess] = []
        try:
            members = [_node(lan, h, "alpha", good, tmp_path) for h in range(3)]
            nodes += members
            intruder = _node(lan, 3, "alpha", other, tmp_path)  # right mesh, wrong secret
            stranger = _node(lan, 4, "beta", good, tmp_path)  # right secret, other mesh
            nodes += [intruder, stranger]
            # The three members find each other across namespaces with no addresses given.
            for a in members:
                for b in members:
                    if a is not b:
                        a.wait_for(joined(b.node_id), timeout=30)
            # Give discovery a few refresh rounds to try (and fail) to merge the others.
            time.sleep(6)
            outsiders = {intruder.node_id, stranger.node_id}
            for n in members:
                assert not any(s.record.get("node") in outsiders for s in n.records[1:])
            for n in (intruder, stranger):
                assert [s.record["event"] for s in n.records] == ["self"]
        finally:
            for n in nodes:
                n.stop()
        # The intruder did knock (found by mDNS) and was refused by the members' MAC check.
        stats = [n.wait_for(lambda r: r["event"] == "stats", 5)["counters"] for n in members]
        refused = sum(
            v
            for s in stats
            for k, v in s.items()
            if k in ("rx_dropped_bad_mac", "rx_dropped_unauthenticated")
        )
        assert refused > 0, stats
