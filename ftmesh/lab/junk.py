"""A hostile LAN peer: floods ftmesh gossip ports with junk datagrams, or holds many idle TCP
connections open to a member's ports (lab use only).

Run inside a lab host (``python -m ftmesh.lab.junk --target IP:PORT ... --pps N --duration S``).
Every datagram is something a member must drop and count without changing its view: random
bytes, a bad magic, an unknown protocol version, a garbage body, a well-formed packet of another
mesh, a packet signed with a key the mesh does not hold, an oversized datagram, and (with
``--forge``, against a mesh with a secret) well-formed *unsigned* ``Dead`` rumours about real
members. Against a mesh without a secret the forged rumours would be legitimate protocol input,
which is why they are opt-in.

Bounded: at most ``pps * duration`` datagrams (``MAX_PPS``, ``MAX_DURATION``), sent from one
socket, paced in 10 ms slices; the sender never reads. Prints one JSON line with what it sent.

With ``--connect IP:PORT ... --connections N`` it opens ``N`` TCP connections to each address
(at most ``MAX_CONNECTIONS`` in all), sends nothing on them and closes them after
``--duration`` seconds: what a port scanner, a stuck client or an attacker without the mesh
secret does to a member's data-plane and gossip TCP ports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import socket
import sys
import time

from ..membership.messages import Alive, Dead, Message
from ..membership.wire import MAX_DATAGRAM, PacketCodec
from ..security import MeshAuth

MAX_PPS = 20_000
"""Highest total send rate (datagrams per second) accepted."""

MAX_DURATION = 600.0
"""Longest flood in seconds."""

SLICE = 0.01
"""Pacing granularity in seconds."""

MAX_CONNECTIONS = 4096
"""Idle TCP connections held at once by one flood, all targets together."""

CONNECT_TIMEOUT = 2.0
"""Seconds one idle connection may take to open before it is given up."""

KINDS = (
    "random",
    "bad_magic",
    "bad_version",
    "garbage_body",
    "other_mesh",
    "wrong_key",
    "oversized",
)


def _parse_target(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


class JunkFactory:
    """Builds junk datagrams from a seeded RNG (see the module docstring)."""

    def __init__(self, mesh: str, victims: list[str], seed: int, forge: bool) -> None:
        self.rng = random.Random(seed)
        self.mesh = mesh
        self.victims = victims or ["0" * 32]
        self.kinds = (*KINDS, "forged_dead") if forge else KINDS
        self.other = PacketCodec(f"{mesh}-other"[:63], MeshAuth.none())
        self.wrong_key = PacketCodec(mesh, MeshAuth.from_secrets([b"not the mesh secret at all"]))
        self.unsigned = PacketCodec(mesh, MeshAuth.none())

    def _msgs(self) -> tuple[Message, ...]:
        victim = self.rng.choice(self.victims)
        return (
            Dead(node=victim, incarnation=self.rng.randrange(1 << 20), accuser="f" * 32),
            Alive(node="e" * 32, name="intruder", addr=("10.0.0.1", 1), incarnation=1),
        )

    def make(self) -> tuple[str, bytes]:
        kind = self.rng.choice(self.kinds)
        rb = self.rng.randbytes
        now = time.time()
        if kind == "random":
            return kind, rb(self.rng.randrange(1, 1400))
        if kind == "bad_magic":
            return kind, b"XX\x01\x00" + rb(self.rng.randrange(0, 200))
        if kind == "bad_version":
            return kind, b"FM" + bytes((self.rng.randrange(2, 256), 0)) + rb(64)
        if kind == "garbage_body":
            return kind, b"FM\x01" + bytes((self.rng.randrange(2),)) + rb(self.rng.randrange(300))
        if kind == "other_mesh":
            return kind, self.other.seal(self._msgs(), now, rb(8))
        if kind == "wrong_key":
            return kind, self.wrong_key.seal(self._msgs(), now, rb(8))
        if kind == "oversized":
            return kind, b"FM\x01\x00" + bytes(MAX_DATAGRAM - 3)
        return kind, self.unsigned.seal(self._msgs(), now, rb(8))


def flood(
    targets: list[tuple[str, int]],
    factory: JunkFactory,
    pps: int,
    duration: float,
) -> dict[str, int]:
    """Send about ``pps`` datagrams per second, round-robin over ``targets``, for ``duration``
    seconds. Returns datagrams sent by kind (plus ``send_errors``)."""
    pps = max(1, min(pps, MAX_PPS))
    duration = max(0.0, min(duration, MAX_DURATION))
    total = int(pps * duration)
    sent: dict[str, int] = {}
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    start = time.monotonic()
    try:
        for i in range(total):
            due = start + i / pps
            lag = due - time.monotonic()
            if lag > SLICE:
                time.sleep(lag)
            if time.monotonic() - start > duration + 1.0:
                break
            kind, data = factory.make()
            try:
                sock.sendto(data, targets[i % len(targets)])
                sent[kind] = sent.get(kind, 0) + 1
            except OSError:
                sent["send_errors"] = sent.get("send_errors", 0) + 1
    finally:
        sock.close()
    return sent


def hold_connections(
    targets: list[tuple[str, int]], per_target: int, duration: float
) -> dict[str, int]:
    """Open ``per_target`` idle TCP connections to each target, keep them for ``duration``
    seconds, close them. Returns how many opened and failed."""
    with contextlib.suppress(ValueError, OSError):
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    per_target = max(0, min(per_target, MAX_CONNECTIONS // max(1, len(targets))))
    duration = max(0.0, min(duration, MAX_DURATION))
    held: list[socket.socket] = []
    counts = {"connected": 0, "connect_errors": 0}
    end = time.monotonic() + duration
    try:
        for target in targets:
            for _ in range(per_target):
                if time.monotonic() >= end:
                    break
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.settimeout(CONNECT_TIMEOUT)
                try:
                    sock.connect(target)
                except OSError:
                    sock.close()
                    counts["connect_errors"] += 1
                    continue
                held.append(sock)
                counts["connected"] += 1
        time.sleep(max(0.0, end - time.monotonic()))
    finally:
        for sock in held:
            sock.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftmesh.lab.junk", description=__doc__)
    p.add_argument("--target", action="append", default=[], metavar="IP:PORT")
    p.add_argument("--connect", action="append", default=[], metavar="IP:PORT",
                   help="hold idle TCP connections to this address instead")  # fmt: skip
    p.add_argument("--connections", type=int, default=100, help="per --connect address")
    p.add_argument("--mesh", default="lab", help="mesh name to imitate")
    p.add_argument("--victim", action="append", default=[], help="node id for forged rumours")
    p.add_argument("--pps", type=int, default=1000)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--forge", action="store_true", help="also send unsigned forged rumours")
    args = p.parse_args(argv)
    if args.connect:
        targets = [_parse_target(t) for t in args.connect]
        held = hold_connections(targets, args.connections, args.duration)
        print(json.dumps({"event": "connect_flood_done", **held}), flush=True)
        return 0
    if not args.target:
        p.error("give --target (datagrams) or --connect (idle connections)")
    factory = JunkFactory(args.mesh, args.victim, args.seed, args.forge)
    sent = flood([_parse_target(t) for t in args.target], factory, args.pps, args.duration)
    print(json.dumps({"event": "junk_done", "sent": sent}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
