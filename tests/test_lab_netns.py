"""The lab itself: partitions and LAN-wide loss in nftables, persistent labs, ``ftmesh lab``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftmesh.cli import lab_cmd
from ftmesh.lab import VirtualLan
from ftmesh.lab.netns import LabError, _list_netns, cleanup_named

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
    reason="needs root to create network namespaces (and iproute2, nftables); CI runs as root",
)

# Counts UDP datagrams carrying this measurement's tag (argv[1]) on port 9999 until the test
# says on stdin that the sender is done, then stops after a silence: 0.7 s once something
# came, 3 s if nothing did yet (ARP may have to be resolved again after a partition), and in
# any case after 60 s. (It used to wait 3 s for the first datagram from its start: on a
# loaded host the two sender processes took longer than that to start, and it counted 0.)
# The tag keeps out datagrams of an earlier measurement that the kernel held back (queued
# while ARP could not resolve during a partition) and released on heal.
_RECV = (
    "import select, socket, sys, time\n"
    "tag = sys.argv[1].encode()\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('0.0.0.0', 9999))\n"
    "print('ready', flush=True)\n"
    "n, done, last = 0, None, time.monotonic(); end = last + 60\n"
    "while time.monotonic() < end:\n"
    "    r, _, _ = select.select([s] if done else [s, sys.stdin], [], [], 0.1)\n"
    "    if s in r: n += s.recv(64) == tag; last = time.monotonic()\n"
    "    if sys.stdin in r: sys.stdin.readline(); done = time.monotonic()\n"
    "    if done is not None and time.monotonic() - max(last, done) > (0.7 if n else 3.0):\n"
    "        break\n"
    "print(n)\n"
)
_SEND_WARMUP = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "for _ in range(5):\n"
    "    s.sendto(b'w', (sys.argv[1], 9998)); time.sleep(0.05)\n"
)
_SEND = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "for _ in range(int(sys.argv[2])):\n"
    "    s.sendto(sys.argv[3].encode(), (sys.argv[1], 9999)); time.sleep(0.001)\n"
)


def _delivered(lan: VirtualLan, src: int, dst: int, n: int = 400) -> int:
    tag = os.urandom(6).hex()
    recv = lan.popen(
        dst,
        [sys.executable, "-c", _RECV, tag],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert recv.stdout is not None
    assert recv.stdout.readline().strip() == "ready"  # bound: no datagram can be missed
    # A few unmeasured datagrams first, so ARP is resolved again after a partition.
    lan.run(src, [sys.executable, "-c", _SEND_WARMUP, lan.host_ip(dst)])
    lan.run(src, [sys.executable, "-c", _SEND, lan.host_ip(dst), str(n), tag])
    out, _ = recv.communicate("sent\n", timeout=70)
    return int(out)


@pytest.mark.netns
@pytest.mark.timing  # a loss rate: 30 % end to end (a starved receiver would drop more)
@needs_root
def test_partition_heal_and_lan_loss() -> None:
    with VirtualLan(hosts=3) as lan:
        lan.partition([[0], [1, 2]])
        assert _delivered(lan, 1, 2) == 400
        assert _delivered(lan, 0, 1) == 0
        assert lan.faults()["partition"] == [[0], [1, 2]]
        lan.heal()
        # Healed, and ARP resolved again while nothing is lost: with 30 % loss ARP requests
        # and replies are dropped too, and a retry every second can outlast the receiver.
        assert _delivered(lan, 0, 1, 100) == 100
        lan.set_lan_loss(30)
        got = _delivered(lan, 0, 1, 1000)
        assert 550 < got < 850, got  # 30 % end to end (binomial, 1000 tries)
        lan.set_lan_loss(0)
        assert _delivered(lan, 0, 2) == 400
        with pytest.raises(LabError):
            lan.partition([[0, 1], [1, 2]])


@pytest.mark.netns
@needs_root
def test_persistent_lab_outlives_its_object() -> None:
    name = f"ftmt{os.getpid() % 100000}"
    try:
        lan = VirtualLan(hosts=2, name=name, subnet="10.79.0.0/24")
        lan.set_loss(1, 5)
        lan.detach()
        state = json.loads(json.dumps(lan.to_state()))
        with pytest.raises(LabError, match="already exists"):
            VirtualLan(hosts=1, name=name)
        again = VirtualLan.attach(state)
        assert again.host_ip(1) == "10.79.0.2"
        assert again.faults()["loss_percent"] == {1: 5.0}
        assert again.run(1, ["ip", "-br", "addr"]).stdout.count("10.79.0.2") == 1
        again.down()
        assert not [ns for ns in _list_netns() if ns.startswith(name)]
        with pytest.raises(LabError, match="gone"):
            VirtualLan.attach(state)
    finally:
        cleanup_named(name)


@pytest.mark.netns
@needs_root
def test_a_reused_pid_does_not_inherit_a_dead_labs_names() -> None:
    """Pids are reused (``pid_max`` may be 32768), so a SIGKILLed creator's leftover lab can
    carry this process's pid and the very name its next lab would get. Building that lab
    sweeps the leftover (this process made none of it) instead of failing on the taken name,
    and keeps this process's own live lab."""
    with VirtualLan(hosts=1, prefix="ftmpid") as mine:
        counter = int(mine.prefix.rsplit("x", 1)[1])
        left = f"ftmpid{os.getpid()}x{counter + 1}"  # the next lab's name in this process
        leftovers = [f"{left}br", f"{left}h0"]
        try:
            for ns in leftovers:
                subprocess.run(["ip", "netns", "add", ns], check=True, timeout=15)
            with VirtualLan(hosts=1, prefix="ftmpid") as after:
                assert after.prefix == left
                assert after.run(0, ["ip", "-br", "addr"]).stdout.count("10.77.0.1") == 1
                assert {f"{mine.prefix}br", f"{mine.prefix}h0"} <= set(_list_netns())
        finally:
            for ns in leftovers:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=15)
    assert not [ns for ns in _list_netns() if ns.startswith("ftmpid")]


def _lab(tmp_path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FTMESH_LAB_DIR": str(tmp_path / "state")}
    argv = [sys.executable, "-m", "ftmesh.cli.lab_cmd", "lab", "--name", "ftmclit", *args]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    if check:
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


@pytest.mark.netns
@needs_root
def test_cli_up_run_faults_down(tmp_path: Path) -> None:
    try:
        up = json.loads(_lab(tmp_path, "up", "--hosts", "3", "--json").stdout)
        assert [h["ip"] for h in up["hosts"]] == ["10.78.0.1", "10.78.0.2", "10.78.0.3"]
        assert _lab(tmp_path, "up", "--hosts", "2", check=False).returncode == 2
        r = _lab(tmp_path, "run", "2", "--", "ip", "-br", "addr", "show", "eth0")
        assert "10.78.0.3" in r.stdout
        _lab(tmp_path, "run", "-d", "1", "--", "sleep", "60")
        _lab(tmp_path, "partition", "0", "1,2")
        _lab(tmp_path, "loss", "all", "5")
        _lab(tmp_path, "rate", "h1", "1mbit")
        _lab(tmp_path, "link", "0", "down")
        st = json.loads(_lab(tmp_path, "status", "--json").stdout)
        assert st["faults"]["partition"] == [[0], [1, 2]]
        assert st["faults"]["links_down"] == [0]
        assert st["faults"]["rates"] == {"1": "1mbit"}
        assert len(st["hosts"][1]["pids"]) == 1
        _lab(tmp_path, "freeze", "1")
        _lab(tmp_path, "thaw", "1")
        _lab(tmp_path, "heal")
        _lab(tmp_path, "kill", "1")
        st = json.loads(_lab(tmp_path, "status", "--json").stdout)
        assert st["faults"]["partition"] == [] and st["hosts"][1]["pids"] == []
    finally:
        down = _lab(tmp_path, "down", check=False)
    assert down.returncode == 0, down.stderr
    assert not [ns for ns in _list_netns() if ns.startswith("ftmclit")]
    assert _lab(tmp_path, "status", check=False).returncode == 2


@pytest.mark.netns
@needs_root
def test_cli_down_sweeps_a_lab_whose_state_file_is_lost(tmp_path: Path) -> None:
    _lab(tmp_path, "up", "--hosts", "2")
    for f in (tmp_path / "state").glob("*.json"):
        f.unlink()
    _lab(tmp_path, "down")
    assert not [ns for ns in _list_netns() if ns.startswith("ftmclit")]


def test_not_root_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lab_cmd, "is_root", lambda: False)
    parser = argparse.ArgumentParser()
    lab_cmd.add_lab_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["lab", "up", "--hosts", "2"])
    with pytest.raises(LabError, match="needs root"):
        lab_cmd.run_lab(args)


_TCP_SERVE = (
    "import socket, sys\n"
    "s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(8)\n"
    "print('ready', flush=True)\n"
    "while True: s.accept()[0].close()\n"
)
_TCP_CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0).close()\n"
    "    print('ok')\n"
    "except OSError:\n"
    "    print('fail')\n"
)


def _connects(lan: VirtualLan, src: int, dst: int, port: int) -> bool:
    out = lan.run(src, [sys.executable, "-c", _TCP_CONNECT, lan.host_ip(dst), str(port)])
    return out.stdout.strip() == "ok"


@pytest.mark.netns
@needs_root
def test_one_way_links_and_blocked_ports() -> None:
    """A one-way link passes datagrams one way only, and no TCP connection either way; a
    blocked port refuses TCP to that port only; both heal."""
    with VirtualLan(hosts=3) as lan:
        servers = [
            lan.popen(h, [sys.executable, "-c", _TCP_SERVE, str(port)], stdout=subprocess.PIPE)
            for h in (0, 1)
            for port in (7001, 7002)
        ]
        try:
            for srv in servers:
                assert srv.stdout is not None and srv.stdout.readline().strip() == b"ready"
            lan.one_way(0, 1)
            assert lan.faults()["one_way"] == [(0, 1)]
            assert _delivered(lan, 1, 0, 100) == 100  # the other way passes
            assert _delivered(lan, 0, 1, 100) == 0
            assert not _connects(lan, 0, 1, 7001) and not _connects(lan, 1, 0, 7001)
            assert _connects(lan, 2, 1, 7001) and _connects(lan, 2, 0, 7001)
            lan.block_port(1, 7002)
            assert _connects(lan, 2, 1, 7001) and not _connects(lan, 2, 1, 7002)
            lan.one_way(0, 1, broken=False)
            lan.block_port(1, 7002, blocked=False)
            assert _connects(lan, 0, 1, 7001) and _connects(lan, 1, 0, 7002)
            assert _connects(lan, 2, 1, 7002)
            with pytest.raises(LabError):
                lan.one_way(1, 1)
        finally:
            for srv in servers:
                srv.kill()
                srv.wait()
