"""Measure a lab path with real traffic: UDP round trips and one TCP transfer (the lab has no
ping or iperf). Run inside lab hosts by tests/test_lab_wan.py.

- ``echo PORT``: echo UDP datagrams back; prints ``ready`` once bound; exits after 30 s idle.
- ``ping HOST PORT COUNT INTERVAL_S``: one datagram at a time, each awaited (1 s timeout);
  prints ``{"rtt_ms": [...], "lost": n}``.
- ``sink PORT SKIP``: accept one TCP connection and read it to the end; prints ``ready`` once
  listening, then ``{"bytes": n, "bps": b}`` where ``b`` is the rate after the first ``SKIP``
  bytes (so TCP's slow start is not measured).
- ``send HOST PORT BYTES``: connect and send ``BYTES`` bytes.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def echo(port: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    s.settimeout(30.0)
    print("ready", flush=True)
    try:
        while True:
            data, addr = s.recvfrom(2048)
            s.sendto(data, addr)
    except TimeoutError:
        pass


def ping(host: str, port: int, count: int, interval: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1.0)
    rtts, lost = [], 0
    for seq in range(count):
        tag = f"{seq}".encode()
        t = time.monotonic()
        s.sendto(tag, (host, port))
        try:
            while s.recv(2048) != tag:  # (a late reply to an earlier probe)
                pass
            rtts.append((time.monotonic() - t) * 1000)
        except TimeoutError:
            lost += 1
        time.sleep(interval)
    print(json.dumps({"rtt_ms": rtts, "lost": lost}))


def sink(port: int, skip: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    srv.settimeout(30.0)
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(30.0)
    n, t_skip = 0, None
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        n += len(chunk)
        if t_skip is None and n >= skip:
            t_skip, n_skip = time.monotonic(), n
    t_end = time.monotonic()
    assert t_skip is not None, n
    print(json.dumps({"bytes": n, "bps": (n - n_skip) * 8 / max(t_end - t_skip, 1e-6)}))


def send(host: str, port: int, total: int) -> None:
    s = socket.create_connection((host, port), timeout=30.0)
    block = b"\0" * (1 << 16)
    left = total
    while left > 0:
        left -= s.send(block[: min(left, len(block))])
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # the sink closes once it has read everything
    s.close()


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "echo":
        echo(int(args[0]))
    elif cmd == "ping":
        ping(args[0], int(args[1]), int(args[2]), float(args[3]))
    elif cmd == "sink":
        sink(int(args[0]), int(args[1]))
    elif cmd == "send":
        send(args[0], int(args[1]), int(args[2]))
    else:
        sys.exit(f"unknown command {cmd!r}")
