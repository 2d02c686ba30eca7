"""MdnsDiscovery: TXT parsing (pure) and real multicast between processes on a virtual LAN of
network namespaces (root only; nothing is sent on the host's own interfaces). Also the lab
library's fault injection and stale cleanup, which the mDNS test relies on."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ftmesh.discovery import Advert, MdnsDiscovery, make_discovery
from ftmesh.discovery.mdns import advert_to_txt, instance_name, parse_txt
from ftmesh.errors import ConfigError, RemoteProtocolError
from ftmesh.lab import LabError, VirtualLan, cleanup_stale

REPO = Path(__file__).resolve().parent.parent
PROBE = str(REPO / "tests" / "scripts" / "mdns_probe.py")
NODE_ID = uuid.uuid4().hex

needs_lab = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root to create network namespaces",
)


def good_txt(**over: bytes | None) -> dict[bytes, bytes | None]:
    txt: dict[bytes, bytes | None] = {
        b"mesh": b"lab",
        b"id": NODE_ID.encode(),
        b"name": b"box-1",
        b"port": b"7946",
        b"v": b"1",
    }
    for k, v in over.items():
        txt[k.encode()] = v
    return txt


# --- TXT parsing, pure -------------------------------------------------------------------------


def test_txt_round_trip() -> None:
    a = Advert(mesh="lab", node_id=NODE_ID, name="box-1", host="10.0.0.7", port=7946)
    txt = {k.encode(): v.encode() for k, v in advert_to_txt(a).items()}
    assert parse_txt(txt, "10.0.0.7") == a
    assert parse_txt(good_txt(extra=b"ignored"), "10.0.0.7") == a


@pytest.mark.parametrize(
    ("txt", "host"),
    [
        (good_txt(mesh=None), "10.0.0.7"),  # key present without value
        ({k: v for k, v in good_txt().items() if k != b"id"}, "10.0.0.7"),  # missing
        (good_txt(id=b"XYZ"), "10.0.0.7"),
        (good_txt(id=b"0" * 31), "10.0.0.7"),
        (good_txt(id=NODE_ID.upper().encode()), "10.0.0.7"),
        (good_txt(name=b""), "10.0.0.7"),
        (good_txt(name=b"\xff\xfe"), "10.0.0.7"),  # not UTF-8
        (good_txt(name=b"n" * 65), "10.0.0.7"),
        (good_txt(name=b"n" * 300), "10.0.0.7"),
        (good_txt(mesh=b"../etc"), "10.0.0.7"),
        (good_txt(port=b"0"), "10.0.0.7"),
        (good_txt(port=b"65536"), "10.0.0.7"),
        (good_txt(port=b"-1"), "10.0.0.7"),
        (good_txt(port=b"79x"), "10.0.0.7"),
        (good_txt(port=b"\xd9\xa3"), "10.0.0.7"),  # Arabic-Indic digit: isdigit() but not ASCII
        (good_txt(port=b"9" * 400), "10.0.0.7"),
        (good_txt(v=b""), "10.0.0.7"),
        (good_txt(v=b"1.0"), "10.0.0.7"),
        (good_txt(), "fe80::1"),
        (good_txt(), "not-an-ip"),
    ],
)
def test_malformed_txt_is_rejected(txt: dict[bytes, bytes | None], host: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        parse_txt(txt, host)
    assert e.value.reason == "malformed"


def test_instance_name_is_one_dns_label() -> None:
    assert instance_name("box-1", NODE_ID) == f"box-1-{NODE_ID[:8]}"
    long = instance_name("ü.x/" + "y" * 100, NODE_ID)
    assert len(long.encode()) <= 63 and long.endswith(NODE_ID[:8]) and "." not in long
    assert instance_name("...", NODE_ID) == f"ftmesh-{NODE_ID[:8]}"


async def test_bad_interface_choices_are_config_errors() -> None:
    # None of these reach the network: they fail before zeroconf is started.
    with pytest.raises(ConfigError):
        MdnsDiscovery("eth0")
    with pytest.raises(ConfigError):
        make_discovery("mdns", interface_ip="::1")
    me = Advert(mesh="m", node_id=NODE_ID, name="n", host="0.0.0.0", port=7946)
    for ip in ("127.0.0.1", "0.0.0.0", "224.0.0.251", "192.0.2.77"):  # last: not ours
        with pytest.raises(ConfigError):
            await MdnsDiscovery(ip).run(me, lambda a: None)
    with pytest.raises(ConfigError, match=r"loopback|LAN"):
        await MdnsDiscovery("127.0.0.1").browse("m", 1.0)


# --- real multicast in a virtual LAN (root) -----------------------------------------------------


def _probe(lan: VirtualLan, host: int, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return lan.popen(
        host,
        [sys.executable, PROBE, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def _events(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _lab_namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


@needs_lab
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_zero_config_discovery_on_a_virtual_lan() -> None:
    t0 = time.monotonic()
    with VirtualLan(hosts=5) as lan:
        prefix = lan.prefix
        # h0..h2: mesh "a"; h3: mesh "b" on the same LAN; h4: a one-shot browse of mesh "a".
        procs = [
            _probe(lan, i, "--mesh", "a", "--name", f"h{i}", "--expect", "2", "--linger", "4")
            for i in range(3)
        ]
        procs.append(_probe(lan, 3, "--mesh", "b", "--name", "h3", "--expect", "99", "--max", "8"))
        procs.append(_probe(lan, 4, "--browse", "a", "--delay", "1.5", "--max", "3"))
        results = []
        for p in procs:
            out, err = p.communicate(timeout=40)
            assert p.returncode == 0, err[-3000:]
            results.append(_events(out))

        started = [next(e for e in ev if e["event"] == "started") for ev in results[:4]]
        for i, s in enumerate(started):
            assert s["ip"] == lan.host_ip(i)  # the default-route interface, no configuration
        ids = [s["node_id"] for s in started]
        for i in range(3):
            found = {e["node_id"]: e for e in results[i] if e["event"] == "found"}
            assert set(found) == {ids[j] for j in range(3) if j != i}, results[i]
            for j in range(3):
                if j != i:
                    assert found[ids[j]]["host"] == lan.host_ip(j)
                    assert found[ids[j]]["port"] == 7946
                    assert found[ids[j]]["mesh"] == "a"
            done = results[i][-1]
            assert done["event"] == "done"
            assert done["stats"]["other_mesh"] >= 1  # it did see mesh "b", and ignored it
            assert done["stats"]["malformed"] == 0
            # zeroconf's loop and browser threads are joined; only trio's idle workers remain.
            assert all(t.startswith("Trio thread") for t in done["threads"]), done["threads"]
        assert not [e for e in results[3] if e["event"] == "found"]  # b never sees a
        browsed = results[4][-1]
        assert browsed["event"] == "browse"
        assert {a["node_id"] for a in browsed["adverts"]} == set(ids[:3])

        # The documented default refuses a host whose only route is loopback.
        lan.run(4, ["ip", "route", "del", "default"], timeout=5)
        lan.run(4, ["ip", "link", "set", "eth0", "down"], timeout=5)
        check = lan.run(
            4,
            [sys.executable, "-c", "from ftmesh.discovery import default_interface_ip as f; f()"],
            timeout=20,
        )
        assert "ConfigError" in check.stderr and "local" in check.stderr
    assert _lab_namespaces(prefix) == []
    assert time.monotonic() - t0 < 45


@needs_lab
@pytest.mark.netns
def test_virtual_lan_faults_and_cleanup() -> None:
    echo = (
        "import socket;s=socket.socket(2,2);s.bind(('',7))\nwhile 1:d,a=s.recvfrom(9);s.sendto(d,a)"
    )
    ping = (
        "import socket,sys;s=socket.socket(2,2);s.settimeout(0.2);n=0\n"
        "for _ in range(int(sys.argv[2])):\n"
        " s.sendto(b'x',(sys.argv[1],7))\n"
        " try:s.recv(9);n+=1\n"
        " except OSError:pass\n"
        "print(n)"
    )

    def pings(lan: VirtualLan, dst: int, n: int) -> int:
        r = lan.run(0, [sys.executable, "-c", ping, lan.host_ip(dst), str(n)], timeout=20)
        return int(r.stdout)

    with VirtualLan(hosts=2, prefix="ftmt", subnet="10.78.0.0/29") as lan:
        assert lan.host_ip(1) == "10.78.0.2"
        server = lan.popen(1, [sys.executable, "-c", echo])
        time.sleep(0.3)
        assert pings(lan, 1, 3) == 3
        lan.set_loss(1, 100)
        assert pings(lan, 1, 2) == 0
        lan.set_loss(1, 0)
        lan.set_rate(1, "10mbit")
        assert pings(lan, 1, 2) == 2
        lan.set_rate(1, None)
        lan.link(1, False)
        assert pings(lan, 1, 2) == 0
        lan.link(1, True)
        assert lan.kill_host(1, signal.SIGTERM) == 1
        assert server.wait(5) == -signal.SIGTERM
        with pytest.raises(LabError):
            lan.host_ip(2)
        lan.down()
        lan.down()  # idempotent
    assert _lab_namespaces(lan.prefix) == []

    # A run killed with SIGKILL leaves its namespaces; cleanup_stale removes them.
    crashed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os,signal\nfrom ftmesh.lab import VirtualLan\n"
            "print(VirtualLan(hosts=1, prefix='ftmt').prefix, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    prefix = crashed.stdout.strip()
    assert prefix.startswith("ftmt") and len(_lab_namespaces(prefix)) == 2
    assert sorted(cleanup_stale("ftmt")) == sorted(f"{prefix}{s}" for s in ("br", "h0"))
    assert _lab_namespaces(prefix) == []


def test_lab_argument_errors() -> None:
    with pytest.raises(LabError):
        VirtualLan(hosts=0)
    with pytest.raises(LabError):
        VirtualLan(hosts=2, prefix="Bad-Prefix")
    with pytest.raises(LabError):
        VirtualLan(hosts=9, subnet="10.0.0.0/29")
