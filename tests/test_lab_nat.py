"""A member behind NAT joins a mesh (issue 31, item 3), on network namespaces the test
creates: two public machines on a lab LAN (``VirtualLan``), and a third machine on a private
network behind a router, a lab host whose nftables forward its public address's fixed ports
to it (DNAT) and masquerade what it sends (SNAT)::

    h0 10.77.0.1 ─┐
    h1 10.77.0.2 ─┼─ bridge      h2 10.77.0.3 (router) ── 192.168.77.2 inside
                  └──────────────┘  DNAT 7946/udp+tcp, 7947, 7948 -> inside

The member inside runs the command of docs/guide/running.md, ``ftmesh worker --discovery
seeds --join 10.0.0.4:7946 --bind 0.0.0.0 --advertise 203.0.113.7 --port 7946 --data-port
7947 --state-port 7948 train.py``, with the lab's addresses: ``--advertise 10.77.0.3`` (an
address it does not own) with fixed ``--port``, ``--data-port`` and ``--state-port``. The
mesh of three forms; everyone sees the inside member at 10.77.0.3 on its fixed ports
(gossip, data, state); an allreduce runs over every ring link, across the NAT both ways; a
public member fetches the inside member's state through the forwarded state port. Root only
(namespaces, nftables); no torch, so it takes seconds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tests_support import ROOT

from ftmesh.lab import VirtualLan

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
        reason="needs root (and iproute2, nftables) to create network namespaces and NAT "
        "rules; CI runs as root",
    ),
]

SCRIPT = str(ROOT / "tests" / "scripts" / "nat_member.py")
PORTS = {"port": 7946, "data": 7947, "state": 7948}
PRIVATE = ("192.168.77.1", "192.168.77.2")  # the router's inside address, the member's
WAIT_S = 120.0


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=15)


@contextmanager
def behind_nat(lan: VirtualLan, router: int) -> Iterator[str]:
    """A namespace on a private network behind lab host ``router``, which forwards its public
    address's gossip, data and state ports to it and masquerades its traffic; yields the
    namespace's name (deleted on exit)."""
    ns = lan.ns_name(99)  # (named like a lab host: a killed run's leftover is cleaned up)
    rns = lan.ns_name(router)
    _run(["ip", "netns", "add", ns])
    try:
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", rns, "link", "add", "in0", "type", "veth", "peer", "eth0", "netns", ns])
        _run(["ip", "-n", rns, "addr", "add", f"{PRIVATE[0]}/24", "dev", "in0"])
        _run(["ip", "-n", rns, "link", "set", "in0", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{PRIVATE[1]}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "route", "add", "default", "via", PRIVATE[0]])
        _run(["ip", "netns", "exec", rns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        tcp = ", ".join(str(p) for p in PORTS.values())
        rules = f"""
        table ip natlab {{
            chain pre {{
                type nat hook prerouting priority dstnat; policy accept;
                iifname "eth0" tcp dport {{ {tcp} }} dnat to {PRIVATE[1]}
                iifname "eth0" udp dport {PORTS["port"]} dnat to {PRIVATE[1]}
            }}
            chain post {{
                type nat hook postrouting priority srcnat; policy accept;
                oifname "eth0" ip saddr {PRIVATE[1]} masquerade
            }}
        }}
        """
        subprocess.run(
            ["ip", "netns", "exec", rns, "nft", "-f", "-"],
            input=rules,
            check=True,
            capture_output=True,
            text=True,
            timeout=15,
        )
        yield ns
    finally:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            subprocess.run(["kill", "-9", pid], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _worker(ns: str, flags: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FTMESH_")}
    argv = [sys.executable, "-m", "ftmesh", "worker", "--discovery", "seeds", *flags, SCRIPT]
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *argv],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**clean, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env},
    )


def _record(log: Path) -> dict[str, Any]:
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("NATLAB ")]
    assert lines, log.read_text()[-3000:]
    record: dict[str, Any] = json.loads(lines[-1][len("NATLAB ") :])
    return record


def test_a_member_behind_nat_joins_through_its_forwarded_fixed_ports(tmp_path: Path) -> None:
    fixed = [f"--{k}-port" if k != "port" else "--port" for k in PORTS]
    ports = [x for flag, p in zip(fixed, PORTS.values(), strict=True) for x in (flag, str(p))]
    with VirtualLan(hosts=3) as lan, behind_nat(lan, router=2) as inside:
        public = lan.host_ip(2)
        seed = f"{lan.host_ip(0)}:{PORTS['port']}"
        env = {"NAT_MEMBERS": "3"}
        logs = {name: tmp_path / f"{name}.log" for name in ("h0", "h1", "inside")}
        # The running page's command behind NAT: bind all, advertise the router's address.
        nat_flags = ["--join", seed, "--bind", "0.0.0.0", "--advertise", public, *ports]
        nat_flags += ["--name", "inside"]
        procs = {
            "h0": _worker(lan.ns_name(0), [*ports, "--name", "h0"], env, logs["h0"]),
            "h1": _worker(
                lan.ns_name(1),
                [*ports, "--join", seed, "--name", "h1"],
                {**env, "NAT_FETCH_FROM": "inside"},
                logs["h1"],
            ),
            "inside": _worker(
                inside,
                nat_flags,
                env,
                logs["inside"],
            ),
        }
        try:
            for name, proc in procs.items():
                rc = proc.wait(timeout=WAIT_S)
                assert rc == 0, f"{name} exited {rc}:\n{logs[name].read_text()[-3000:]}"
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    records = {name: _record(log) for name, log in logs.items()}
    for name, rec in records.items():
        assert rec["view"] == 3, (name, rec)
        assert rec["sum"] == 3.0, (name, rec)  # every ring link carried its share
        # Everyone knows the inside member by its public address, on its fixed ports.
        assert rec["gossip"]["inside"] == f"{public}:{PORTS['port']}", (name, rec)
        assert rec["meta"]["inside"] == {
            "data": f"{public}:{PORTS['data']}",
            "state": f"{public}:{PORTS['state']}",
        }, (name, rec)
    assert records["h1"]["fetched"], records["h1"]  # through the forwarded state port
