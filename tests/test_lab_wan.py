"""The two-site lab (issue 31, item 4): hosts on two bridges joined by one WAN link with a rate
and a one-way delay, made by a user-space forwarder between two TUN routers
(``ftmesh.lab.wan``), measured with real traffic inside the namespaces::

    h0 h1 ── bridge A ── r0 ══ 20 Mbit/s, 40 ms each way ══ r1 ── bridge B ── h2 h3

Round trips across the sites take twice the delay and within a site a fraction of a
millisecond; one TCP flow across runs at the link's rate and within a site much faster; the
forwarder counts what crossed; the link changes at run time; a mesh forms across the sites
with seeds; nothing is left after teardown, also when the lab's creator is killed. The link
model itself is checked without root. Root only otherwise (namespaces, TUN devices)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tests_support import ROOT

from ftmesh.lab import VirtualLan
from ftmesh.lab.errors import LabError
from ftmesh.lab.mesh import LabMesh
from ftmesh.lab.netns import _list_netns, cleanup_stale
from ftmesh.lab.wan import WanLink, _Line, is_forwarder, parse_delay_ms

pytestmark = pytest.mark.timeout(30)  # the module takes about 15 s, the longest test 6 s

needs_root = pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("ip") is None
    or shutil.which("nft") is None
    or not os.path.exists("/dev/net/tun"),
    reason="needs root (and iproute2, nftables, /dev/net/tun) to create network namespaces "
    "and TUN devices; CI runs as root",
)

PROBE = str(ROOT / "tests" / "scripts" / "wan_probe.py")
DELAY_MS = 40.0
RATE = "20mbit"
RATE_BPS = 20e6
JITTER_MS = 15.0
"""Scheduling slack on a loaded two-core machine: how much later than the link model a round
trip may come back (the forwarder wakes late, never early)."""


def _argv(*args: object) -> list[str]:
    return [sys.executable, PROBE, *map(str, args)]


def _probe(lan: VirtualLan, host: int, *args: object) -> subprocess.Popen[str]:
    return lan.popen(host, _argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "ready", (line, proc.stderr.read() if proc.stderr else "")


def _rtts(lan: VirtualLan, src: int, dst: int, count: int = 10) -> list[float]:
    """Round trips (ms) of ``count`` UDP probes from host ``src`` to an echo on ``dst``."""
    echo = _probe(lan, dst, "echo", 9000)
    try:
        _ready(echo)
        r = lan.run(src, _argv("ping", lan.host_ip(dst), 9000, count, 0.02))
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["lost"] == 0, out
        return list(out["rtt_ms"])
    finally:
        echo.kill()
        echo.communicate()


def _throughput(lan: VirtualLan, src: int, dst: int, total: int, skip: int) -> float:
    """Bits per second of one TCP flow of ``total`` bytes from ``src`` to ``dst``, after its
    first ``skip`` bytes."""
    sink = _probe(lan, dst, "sink", 9001, skip)
    try:
        _ready(sink)
        r = lan.run(src, _argv("send", lan.host_ip(dst), 9001, total))
        assert r.returncode == 0, r.stderr
        out, err = sink.communicate(timeout=30)
        assert sink.returncode == 0, err
        result = json.loads(out)
        assert result["bytes"] == total
        return float(result["bps"])
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.communicate()


def _tun_holders() -> list[int]:
    """Processes holding a TUN device open (a TUN lives as long as its holder or its
    namespace)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/net/tun":
                    out.append(int(pid))
                    break
            except OSError:
                continue
    return out


# --- the link model, no root ------------------------------------------------------------------


class _Sink:
    """A pipe standing in for the far TUN: what the line delivers, and when."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)

    def drain(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(os.read(self.r, 65536))
            except BlockingIOError:
                return out

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


def test_the_line_serialises_at_the_rate_then_delays_and_drops_beyond_its_queue() -> None:
    import random

    link = WanLink(rate="8mbit", delay_ms=40, queue_ms=10.5)  # 1000-byte packet: 1 ms
    line = _Line(link, random.Random(1))
    for _ in range(15):
        line.offer(b"x" * 1000, now=100.0)
    # 1 ms each on the line: the 12th would wait 11 ms > 10.5 ms of queue, so 11 fit.
    assert line.counts["dropped_queue"] == 4
    assert len(line.held) == 11
    dues = [due for due, _ in line.held]
    assert dues[0] == pytest.approx(100.041) and dues[-1] == pytest.approx(100.051)
    sink = _Sink()
    try:
        line.deliver(100.0405, sink.w)
        assert sink.drain() == []  # nothing early
        line.deliver(100.0455, sink.w)
        assert len(b"".join(sink.drain())) == 5000
        line.deliver(101.0, sink.w)
        assert line.stats() == {"packets": 11, "bytes": 11000, "dropped_loss": 0,
                                "dropped_queue": 4, "write_errors": 0, "queued": 0}  # fmt: skip
    finally:
        sink.close()
    # A shorter delay set at run time never lets a packet overtake one held before it.
    line.offer(b"a", now=200.0)
    line.link = replace(link, delay_ms=1)
    line.offer(b"b", now=200.001)
    assert [p for _, p in line.held] == [b"a", b"b"]
    assert line.held[1][0] >= line.held[0][0]
    lossy = _Line(WanLink(loss_percent=30), random.Random(2))
    for _ in range(2000):
        lossy.offer(b"y", now=0.0)
    assert 500 < lossy.counts["dropped_loss"] < 700


def test_link_settings_are_checked() -> None:
    assert parse_delay_ms("50ms") == 50 and parse_delay_ms("0.05s") == 50
    assert parse_delay_ms("500us") == 0.5 and parse_delay_ms("7") == 7
    with pytest.raises(LabError):
        parse_delay_ms("soon")
    assert WanLink(rate="20mbit").rate_bps == 20e6
    assert WanLink(rate="1MBps").rate_bps == 8e6
    for bad in ({"rate": "fast"}, {"delay_ms": -1}, {"loss_percent": 101}, {"queue_ms": 0}):
        with pytest.raises(LabError):
            WanLink(**bad)  # type: ignore[arg-type]
    with pytest.raises(LabError, match="two sites"):
        VirtualLan(hosts=2, wan=WanLink())
    with pytest.raises(LabError, match="sites"):
        VirtualLan(sites=(2, 0))
    with pytest.raises(LabError, match="holds 4"):
        VirtualLan(hosts=3, sites=(2, 2))


# --- the lab ---------------------------------------------------------------------------------


@pytest.mark.netns
@pytest.mark.quiet  # round trips within 15 ms of the model, a TCP flow within 30 % of the rate
@needs_root
def test_the_wan_delays_and_paces_crossing_traffic_and_counts_it() -> None:
    link = WanLink(rate=RATE, delay_ms=DELAY_MS)
    with VirtualLan(sites=(2, 2), wan=link) as lan:
        assert [lan.site_of(i) for i in range(4)] == [0, 0, 1, 1]
        assert lan.site_hosts(1) == [2, 3] and lan.sites == (2, 2)
        assert lan.host_ip(2) == "10.77.0.129" and lan.gateway(1) == "10.77.0.254"
        kinds = ("br", "h0", "h1", "br1", "h2", "h3", "r0", "r1")
        assert lan.namespaces() == [lan.prefix + k for k in kinds]
        pid = lan.to_state()["wan_pid"]
        assert is_forwarder(pid, lan.prefix)
        assert pid in _tun_holders()

        cross = _rtts(lan, 0, 2)
        local = _rtts(lan, 0, 1)
        print(f"RTT across: min {min(cross):.1f} median {statistics.median(cross):.1f} ms; "
              f"within a site: median {statistics.median(local):.2f} ms")  # fmt: skip
        assert min(cross) >= 2 * DELAY_MS - 0.5  # never early
        assert statistics.median(cross) <= 2 * DELAY_MS + JITTER_MS
        assert statistics.median(local) < 5.0

        before = lan.wan_stats()
        total = 4_000_000
        across = _throughput(lan, 0, 3, total, skip=1_000_000)
        after = lan.wan_stats()
        within = _throughput(lan, 2, 3, total, skip=1_000_000)
        print(f"TCP across: {across / 1e6:.1f} Mbit/s; within a site: {within / 1e6:.0f} Mbit/s")
        # Goodput tops out at 19.3 Mbit/s (1448 of every 1500 IP bytes); measured from the
        # first MB on it reads up to ~22, as loss recovery after slow start's queue overflow
        # releases out-of-order data held by the receiver all at once.
        assert 0.7 * RATE_BPS <= across <= 1.3 * RATE_BPS
        assert within > 5 * RATE_BPS
        # What crossed: the transfer once (plus TCP/IP headers, and some retransmissions
        # after the queue overflowed), only its ACKs back; the flow within site B: nothing.
        forward = after.a_to_b.bytes - before.a_to_b.bytes
        back = after.b_to_a.bytes - before.b_to_a.bytes
        print(f"crossed: {forward} bytes forward, {back} back, dropped "
              f"{after.a_to_b.dropped_queue - before.a_to_b.dropped_queue} (queue)")  # fmt: skip
        assert total < forward < 1.15 * total
        assert back < 0.1 * total
        later = lan.wan_stats()  # the flow within site B crossed nothing (a last ACK may)
        assert later.a_to_b.bytes - after.a_to_b.bytes < 500
        assert later.b_to_a.bytes - after.b_to_a.bytes < 500

        lan.set_wan(replace(link, delay_ms=5.0))  # at run time
        assert lan.wan == replace(link, delay_ms=5.0)
        assert lan.wan_stats().link.delay_ms == 5.0
        faster = _rtts(lan, 1, 3)
        assert 10.0 - 0.5 <= statistics.median(faster) <= 10.0 + JITTER_MS
        lan.partition([[0, 2], [1, 3]])  # across the WAN: by address at the sender's bridge
        blocked = lan.run(1, _argv("ping", lan.host_ip(2), 9, 1, 0))
        assert json.loads(blocked.stdout)["lost"] == 1
        assert len(_rtts(lan, 0, 2, 2)) == 2  # within a group, across the WAN: passes
        lan.heal()
        names = lan.namespaces()
    assert not is_forwarder(pid, lan.prefix)
    assert not set(names) & set(_list_netns())
    assert pid not in _tun_holders()


@pytest.mark.netns
@pytest.mark.slow
@needs_root
def test_a_mesh_forms_across_the_two_sites(tmp_path: Path) -> None:
    """``ftmesh node`` with seeds on every host, all joining through h0 (h2 and h3 across the
    WAN): one view of four within seconds, gossip crossing both ways. (Joining through a
    member that is itself still joining can take up to a push-pull interval to converge, on
    one bridge too; not what this test is about.)"""

    def argv(lan: VirtualLan, host: int) -> list[str]:
        out = ["ip", "netns", "exec", lan.ns_name(host), sys.executable, "-m", "ftmesh", "node"]
        out += ["--mesh", "wan", "--discovery", "seeds", "--bind", lan.host_ip(host)]
        out += ["--port", "7946", "--preset", "lan", "--events", "json", "--name", f"h{host}"]
        if host != 0:
            out += ["--join", f"{lan.host_ip(0)}:7946"]
        return out

    link = WanLink(rate=RATE, delay_ms=DELAY_MS)
    with (
        VirtualLan(sites=(2, 2), wan=link) as lan,
        LabMesh(lan, tmp_path, mesh="wan", preset="lan", argv_factory=argv) as mesh,
    ):
        mesh.start(0)
        for h in (1, 2, 3):
            mesh.start(h, wait=False)
        for h in (1, 2, 3):
            mesh.node(h).wait_started()
        took = mesh.wait_one_view(15)
        print(f"one view of 4 across the sites after {took:.1f}s")
        stats = lan.wan_stats()
        assert stats.a_to_b.packets > 0 and stats.b_to_a.packets > 0
        assert stats.a_to_b.dropped_queue == stats.b_to_a.dropped_queue == 0
        mesh.stop_all()


def _lab_cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FTMESH_LAB_DIR": str(state)}
    argv = [sys.executable, "-m", "ftmesh.cli.lab_cmd", "lab", "--name", "ftmwant", *args]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


@pytest.mark.netns
@needs_root
# six CLI processes, each importing ftmesh: 6 s alone, 24 s to over 30 s beside two other labs
# at load 20+ (the module's 30 s fits the other tests)
@pytest.mark.timeout(90)
def test_cli_two_sites_up_wan_status_down(tmp_path: Path) -> None:
    """docs/guide/lab.md's ``ftmesh lab up --sites 2x2 --wan-rate 20mbit --wan-delay 50ms``
    (with ``--name`` to keep the test's lab apart), then ``wan``, ``run``, ``status``,
    ``down``."""
    try:
        up = _lab_cli(
            tmp_path, "up", "--sites", "2x2", "--wan-rate", "20mbit", "--wan-delay", "50ms"
        )
        up_json = json.loads((tmp_path / "ftmwant.json").read_text())
        pid = up_json["lan"]["wan_pid"]
        assert is_forwarder(pid, "ftmwant")
        assert "site 1" in up.stdout and "delay 50 ms" in up.stdout
        _lab_cli(tmp_path, "wan", "--delay", "3ms", "--loss", "1")
        _lab_cli(tmp_path, "run", "0", "--", *_argv("ping", "10.78.0.130", 9, 1, 0))
        status = json.loads(_lab_cli(tmp_path, "status", "--json").stdout)
        assert [h["site"] for h in status["hosts"]] == [0, 0, 1, 1]
        assert status["wan_stats"]["link"] == {
            "rate": "20mbit", "delay_ms": 3.0, "loss_percent": 1.0, "queue_ms": 100.0
        }  # fmt: skip
        assert (
            status["wan_stats"]["a_to_b"]["packets"] + status["wan_stats"]["a_to_b"]["dropped_loss"]
            >= 1
        )
        down = _lab_cli(tmp_path, "down")
        assert "removed 8 namespaces" in down.stdout, down.stdout
        deadline = time.monotonic() + 5
        while is_forwarder(pid, "ftmwant") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_forwarder(pid, "ftmwant")
    finally:
        subprocess.run(
            [sys.executable, "-m", "ftmesh.cli.lab_cmd", "lab", "--name", "ftmwant", "down"],
            env={**os.environ, "FTMESH_LAB_DIR": str(tmp_path)},
            capture_output=True,
            timeout=60,
        )


KILLED_BASE = "ftmkill"
"""The base of the killed creator's lab: no other test's."""

_KILLED_CREATOR = """
import json, os, sys, time
from ftmesh.lab import VirtualLan
from ftmesh.lab.wan import WanLink
lan = VirtualLan(sites=(1, 1), wan=WanLink(delay_ms=1), prefix=sys.argv[1])
print(json.dumps(lan.to_state()), flush=True)
time.sleep(60)
"""


@pytest.mark.netns
@needs_root
def test_stale_cleanup_removes_the_forwarder_of_a_killed_lab() -> None:
    """A lab whose creator was SIGKILLed is removed by ``cleanup_stale``, its WAN forwarder
    with it. The lab gets a base of its own (``KILLED_BASE``): every lab's constructor sweeps
    its base's stale labs, so under the default base a lab built meanwhile elsewhere (another
    xdist worker, another run on the host) could sweep this one first, and another test's
    leak check would see it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CREATOR, KILLED_BASE],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        state: dict[str, Any] = json.loads(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)  # no atexit, no teardown
        proc.communicate()
    pid = state["wan_pid"]
    assert is_forwarder(pid, state["prefix"])
    removed = cleanup_stale(KILLED_BASE)
    assert set(state["namespaces"]) <= set(removed)
    deadline = time.monotonic() + 5
    while is_forwarder(pid, state["prefix"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_forwarder(pid, state["prefix"])
    assert pid not in _tun_holders()
