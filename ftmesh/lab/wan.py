"""The WAN link of a two-site lab: rate, one-way delay, loss and a drop-tail queue, in user space.

Theory of operation: a two-site :class:`~ftmesh.lab.netns.VirtualLan` has one bridge per site
and one router namespace per site (``<prefix>r0``, ``<prefix>r1``). Each router has a leg on
its site's bridge (the site's gateway address) and a TUN device ``wan0``; the route to the
other site's subnet goes through ``wan0``. The kernel hands every IP packet routed there to
whoever holds the TUN's file descriptor, and a packet written to that descriptor enters the
router's stack as if it had arrived on ``wan0``. The *forwarder* (:func:`main` of this
module in a process of its own, one per lab) holds both TUNs: it reads site A's outbound packets
from ``r0``'s TUN and writes them into ``r1``'s, and the reverse, each direction through its
own model of a link::

    host ── bridge A ── r0 [wan0] ══ forwarder ══ [wan0] r1 ── bridge B ── host

Each direction is a serial line followed by a propagation delay. A packet of ``L`` bytes
arriving at ``t`` first passes the loss draw (``loss_percent``, dropped and counted), then
waits for the transmitter: it starts at ``max(t, busy_until)`` and occupies the line for
``8 L / rate`` seconds (``busy_until`` moves on by that much). A packet that would wait more
than ``queue_ms`` for the line is dropped (drop-tail, counted): that wait is the bottleneck
queue TCP fills, so ``queue_ms`` is the link's buffer expressed in time (100 ms by default:
more than a bandwidth-delay product at tens of milliseconds, so one TCP flow fills the
link). It is delivered ``delay_ms`` after its last bit left, so a full link delivers exactly
``rate`` and an idle one adds exactly ``delay_ms``; delivery order is arrival order (a delay
shortened at run time cannot reorder packets). ``MAX_PACKETS`` bounds the packets held per
direction (an unlimited rate has no queue wait to bound it). Bytes are IP bytes (no Ethernet
header), as a routed WAN link would count them.

One thread, one ``select`` over the two TUNs and a control socket; the timeout is the time
until the next delivery is due, so the process sleeps unless a packet arrives or is due (no
busy loop, no timer thread). Each wake-up drains the readable TUNs (non-blocking, at most
``DRAIN_BATCH`` packets each) and then writes every packet that is due.

Control: an abstract Unix socket ``@ftmesh-wan-<lab prefix>`` in the namespace the lab runs
in (the root namespace; the forwarder binds it before entering the routers' namespaces),
one JSON line in, one JSON line out: ``{"op": "stats"}`` returns the counters of each
direction (``packets``/``bytes`` delivered, ``dropped_loss``, ``dropped_queue``,
``write_errors``, ``queued`` now) and the link; ``{"op": "set", "link": {...}}`` changes rate,
delay, loss or queue from the next packet on. Abstract sockets leave no file behind.

Lifetime: the lab starts the forwarder in its own session, waits for its ``ready`` line and
records its pid (in :meth:`~ftmesh.lab.netns.VirtualLan.to_state` too, so ``ftmesh lab down``
from another process stops it). The forwarder ends its life inside ``r0``'s namespace (after
opening ``r1``'s TUN there with ``setns``), so every sweep that deletes a lab's namespaces
(``down``, :func:`~ftmesh.lab.netns.cleanup_stale`, :func:`~ftmesh.lab.netns.cleanup_named`)
kills it with the namespace's other processes, even when the lab's creator died by SIGKILL.
It also exits by itself when a TUN goes away (a read error other than ``EAGAIN``). Deleting
the router namespaces deletes the TUNs (they are persistent devices made by ``ip tuntap``,
so the forwarder can also be restarted on the same devices).

Why not netem: the natural tool, ``tc qdisc ... netem delay 50ms rate 20mbit``, needs
``sch_netem``, which many kernels (CI's included) are built without; ``tbf``, ``htb`` and
``ingress`` shape rate but none of them delays. A TUN device and a user-space process need
only ``CONFIG_TUN``, which container hosts have. The price is CPU and timer jitter: measured
with one TCP flow on a two-core machine at load average 13, the forwarder took 12 % of a core
at 20 Mbit/s (2400 packets/s both ways) and 13 % at 100 Mbit/s (which it carried at 93.5, with
larger batches per wake-up); round trips came back within a millisecond of the model, a few
outliers within 6 ms.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import json
import os
import random
import re
import select
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import LabError
from .procs import terminate

TUN_DEV = "wan0"
"""Name of the TUN device in each router namespace."""

MAX_PACKETS = 20000
"""Packets one direction may hold (queued or in flight); more are dropped and counted."""

DRAIN_BATCH = 256
"""Packets read from one TUN per wake-up at most, so that a flood cannot delay deliveries."""

START_TIMEOUT = 20.0
"""Seconds the forwarder may take to start (import, open both TUNs) and say ``ready``."""

CONTROL_TIMEOUT = 5.0
"""Seconds a control request (stats, set) may take."""

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000
_RATE_RE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)")
_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_DELAY_RE = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s)?")


def rate_bits(rate: str) -> float:
    """Bits per second of a tc-style rate (``"20mbit"``, ``"2.5MBps"``: bytes per second)."""
    m = _RATE_RE.fullmatch(rate.lower())
    if m is None:
        raise LabError(f"rate {rate!r} is not a rate like '20mbit'")
    return float(m.group(1)) * _UNIT[m.group(2)] * (8 if m.group(3) == "bps" else 1)


def parse_delay_ms(text: str) -> float:
    """Milliseconds of a delay written ``50ms``, ``0.05s``, ``500us`` or ``50`` (ms)."""
    m = _DELAY_RE.fullmatch(text.strip().lower())
    if m is None:
        raise LabError(f"delay {text!r} is not a delay like '50ms'")
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0, None: 1.0}[m.group(2)]
    return float(m.group(1)) * scale


@dataclass(frozen=True)
class WanLink:
    """The inter-site link of a two-site lab, each direction alike.

    ``rate``: tc-style rate (``"20mbit"``), ``None`` for no limit. ``delay_ms``: one-way
    propagation delay (a ping across sees twice that). ``loss_percent``: packets dropped at
    random on entry. ``queue_ms``: the most a packet may wait for the line before it is
    dropped (drop-tail; with ``rate``, that is ``rate * queue_ms`` bytes of buffer).
    """

    rate: str | None = None
    delay_ms: float = 0.0
    loss_percent: float = 0.0
    queue_ms: float = 100.0

    def __post_init__(self) -> None:
        if self.rate is not None and rate_bits(self.rate) <= 0:
            raise LabError(f"rate {self.rate!r} must be positive")
        if not 0 <= self.delay_ms <= 60_000:
            raise LabError(f"delay {self.delay_ms} ms must be within 0..60000")
        if not 0 <= self.loss_percent <= 100:
            raise LabError(f"loss {self.loss_percent}% must be within 0..100")
        if not 0 < self.queue_ms <= 60_000:
            raise LabError(f"queue {self.queue_ms} ms must be within 0..60000 (exclusive of 0)")

    @property
    def rate_bps(self) -> float | None:
        """Bits per second, ``None`` when unlimited."""
        return None if self.rate is None else rate_bits(self.rate)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WanLink:
        try:
            rate = data.get("rate")
            return cls(
                rate=None if rate is None else str(rate),
                delay_ms=float(data.get("delay_ms", 0.0)),
                loss_percent=float(data.get("loss_percent", 0.0)),
                queue_ms=float(data.get("queue_ms", 100.0)),
            )
        except (TypeError, ValueError, AttributeError) as e:
            raise LabError(f"WAN link settings are damaged: {e!r}") from e


@dataclass(frozen=True)
class WanCounters:
    """One direction of the WAN link since the forwarder started."""

    packets: int = 0
    """Packets delivered to the other site."""
    bytes: int = 0
    """IP bytes delivered to the other site."""
    dropped_loss: int = 0
    """Packets dropped by the random loss draw."""
    dropped_queue: int = 0
    """Packets dropped because the queue was full (drop-tail)."""
    write_errors: int = 0
    """Packets the other router's TUN refused."""
    queued: int = 0
    """Packets held right now (waiting for the line or in flight)."""


@dataclass(frozen=True)
class WanStats:
    """Both directions of the WAN link: ``a_to_b`` is site 0 to site 1."""

    a_to_b: WanCounters
    b_to_a: WanCounters
    link: WanLink

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WanStats:
        try:
            return cls(
                a_to_b=WanCounters(**{k: int(v) for k, v in data["a_to_b"].items()}),
                b_to_a=WanCounters(**{k: int(v) for k, v in data["b_to_a"].items()}),
                link=WanLink.from_json(data["link"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LabError(f"the WAN forwarder sent damaged stats: {e!r}") from e


# --- the lab's side ----------------------------------------------------------------------------


def control_address(prefix: str) -> str:
    """Abstract Unix socket of the forwarder of lab ``prefix``."""
    return f"\0ftmesh-wan-{prefix}"


_ENTRY = "import sys; from ftmesh.lab.wan import main; sys.exit(main())"
# (not "-m ftmesh.lab.wan": the package imports this module first, and runpy warns about it)


def start_forwarder(prefix: str, ns_a: str, ns_b: str, link: WanLink) -> subprocess.Popen[bytes]:
    """Start the forwarder between the TUNs of router namespaces ``ns_a`` and ``ns_b`` (its own
    session) and return once both TUNs are open and the control socket listens."""
    argv = [sys.executable, "-c", _ENTRY, "--prefix", prefix, "--ns-a", ns_a]
    argv += ["--ns-b", ns_b, "--link", json.dumps(link.to_json())]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            proc.kill()
            proc.wait()
            err = proc.stderr.read().decode(errors="replace").strip()[-500:]
            raise LabError(f"the WAN forwarder did not start ({proc.returncode}): {err}")
    finally:
        proc.stdout.close()
        proc.stderr.close()
    return proc


def is_forwarder(pid: int, prefix: str) -> bool:
    """Whether ``pid`` is lab ``prefix``'s forwarder (a reused pid is spared)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return _ENTRY.encode() in cmdline and prefix.encode() in cmdline


def stop_forwarder(pid: int, prefix: str, timeout: float = 5.0) -> None:
    """SIGTERM lab ``prefix``'s forwarder ``pid``, wait for it (reaped if it is our child),
    SIGKILL after ``timeout``."""
    terminate(pid, lambda: is_forwarder(pid, prefix), timeout)


def control_request(prefix: str, message: dict[str, Any]) -> dict[str, Any]:
    """One control request to lab ``prefix``'s forwarder."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(CONTROL_TIMEOUT)
        try:
            s.connect(control_address(prefix))
            s.sendall(json.dumps(message).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError as e:
            raise LabError(f"the WAN forwarder of lab {prefix!r} does not answer: {e}") from e
    try:
        reply = json.loads(data)
    except ValueError as e:
        raise LabError(f"the WAN forwarder of lab {prefix!r} sent {data[:100]!r}") from e
    if not isinstance(reply, dict) or "error" in reply:
        raise LabError(f"the WAN forwarder of lab {prefix!r} refused: {reply}")
    return reply


# --- the forwarder -----------------------------------------------------------------------------


class _Line:
    """One direction: loss draw, drop-tail wait for the line, serialisation, delay."""

    def __init__(self, link: WanLink, rng: random.Random) -> None:
        self.link = link
        self.rng = rng
        self.held: collections.deque[tuple[float, bytes]] = collections.deque()
        self.busy_until = 0.0  # when the line has sent everything accepted so far
        self.last_due = 0.0
        self.counts = {k: 0 for k in ("packets", "bytes", "dropped_loss", "dropped_queue")}
        self.counts["write_errors"] = 0

    def offer(self, packet: bytes, now: float) -> None:
        link = self.link
        if link.loss_percent and self.rng.random() * 100 < link.loss_percent:
            self.counts["dropped_loss"] += 1
            return
        if len(self.held) >= MAX_PACKETS:
            self.counts["dropped_queue"] += 1
            return
        start = max(now, self.busy_until)
        if start - now > link.queue_ms / 1000:
            self.counts["dropped_queue"] += 1
            return
        bps = link.rate_bps
        self.busy_until = start + (len(packet) * 8 / bps if bps else 0.0)
        due = max(self.busy_until + link.delay_ms / 1000, self.last_due)
        self.last_due = due
        self.held.append((due, packet))

    def next_due(self) -> float | None:
        return self.held[0][0] if self.held else None

    def deliver(self, now: float, fd: int) -> None:
        held = self.held
        while held and held[0][0] <= now:
            _, packet = held.popleft()
            try:
                os.write(fd, packet)
            except OSError:
                self.counts["write_errors"] += 1
                continue
            self.counts["packets"] += 1
            self.counts["bytes"] += len(packet)

    def stats(self) -> dict[str, int]:
        return {**self.counts, "queued": len(self.held)}


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _open_tun(ns: str) -> int:
    """Enter namespace ``ns`` and open its TUN device (non-blocking)."""
    _setns(f"/run/netns/{ns}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH22x", TUN_DEV.encode(), _IFF_TUN | _IFF_NO_PI)
        fcntl.ioctl(fd, _TUNSETIFF, ifr)
    except OSError:
        os.close(fd)
        raise
    return fd


class Forwarder:
    """The forwarder's state and loop (see the module docstring)."""

    def __init__(self, prefix: str, ns_a: str, ns_b: str, link: WanLink) -> None:
        self.ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ctl.bind(control_address(prefix))  # in the namespace we were started in
        self.ctl.listen(8)
        self.ctl.setblocking(False)
        self.fd_b = _open_tun(ns_b)
        self.fd_a = _open_tun(ns_a)  # last: the forwarder stays in ns_a, swept with it
        rng = random.Random()
        self.lines = {self.fd_a: _Line(link, rng), self.fd_b: _Line(link, rng)}
        self.peer = {self.fd_a: self.fd_b, self.fd_b: self.fd_a}

    def run(self) -> int:
        a_to_b, b_to_a = self.lines[self.fd_a], self.lines[self.fd_b]
        watched = [self.fd_a, self.fd_b, self.ctl.fileno()]
        while True:
            dues = [d for d in (a_to_b.next_due(), b_to_a.next_due()) if d is not None]
            timeout = max(0.0, min(dues) - time.monotonic()) if dues else None
            readable, _, _ = select.select(watched, [], [], timeout)
            for fd in readable:
                if fd == self.ctl.fileno():
                    self._control()
                    continue
                line = self.lines[fd]
                for _ in range(DRAIN_BATCH):  # drain, but let deliveries run in a flood
                    try:
                        packet = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    except OSError:  # the TUN is gone (its namespace was deleted)
                        return 0
                    line.offer(packet, time.monotonic())
            now = time.monotonic()
            a_to_b.deliver(now, self.fd_b)
            b_to_a.deliver(now, self.fd_a)

    def _control(self) -> None:
        try:
            conn, _ = self.ctl.accept()
        except BlockingIOError:
            return
        with conn:
            conn.settimeout(1.0)  # our own lab sends its line at once; a stray client waits
            try:
                data = b""
                while not data.endswith(b"\n") and len(data) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                conn.sendall(json.dumps(self._handle(data)).encode() + b"\n")
            except OSError:
                pass

    def _handle(self, data: bytes) -> dict[str, Any]:
        try:
            message = json.loads(data)
            op = message["op"]
            if op == "set":
                link = WanLink.from_json(message["link"])
                for line in self.lines.values():
                    line.link = link
                return {"ok": True}
            if op == "stats":
                return {
                    "a_to_b": self.lines[self.fd_a].stats(),
                    "b_to_a": self.lines[self.fd_b].stats(),
                    "link": self.lines[self.fd_a].link.to_json(),
                }
            return {"error": f"unknown op {op!r}"}
        except (ValueError, KeyError, TypeError, LabError) as e:
            return {"error": repr(e)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ftmesh-wan-forwarder", description=__doc__)
    ap.add_argument("--prefix", required=True, help="the lab's prefix (names the control)")
    ap.add_argument("--ns-a", required=True, help="site A's router namespace")
    ap.add_argument("--ns-b", required=True, help="site B's router namespace")
    ap.add_argument("--link", required=True, help="WanLink as JSON")
    args = ap.parse_args(argv)
    try:
        link = WanLink.from_json(json.loads(args.link))
        fwd = Forwarder(args.prefix, args.ns_a, args.ns_b, link)
    except (OSError, ValueError, LabError) as e:
        print(f"ftmesh.lab.wan: {e}", file=sys.stderr)
        return 1
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)  # the lab stops reading: no EPIPE later
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    return fwd.run()
