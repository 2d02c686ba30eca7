"""Gossip datagrams are marked as network control (``ftmesh.net.node``): DSCP CS6 in the IP
header, for routers and links that classify by it, and the socket priority that puts them in
the host's own interactive band ahead of bulk data (the ``pfifo_fast`` qdisc's band 0).
Loopback only: a receiving socket reads the TOS byte each datagram carried (``IP_RECVTOS``)."""

from __future__ import annotations

import socket

import pytest

from ftmesh.net.node import LIVENESS_PRIORITY, LIVENESS_TOS, _bind_udp_tcp

IP_RECVTOS = getattr(socket, "IP_RECVTOS", 13)


@pytest.mark.skipif(not hasattr(socket, "SO_PRIORITY"), reason="Linux socket options")
def test_gossip_datagrams_carry_the_network_control_class() -> None:
    udp, tcp = _bind_udp_tcp("127.0.0.1", 0)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind(("127.0.0.1", 0))
        rx.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
        rx.settimeout(5)
        udp.sendto(b"ping", rx.getsockname())
        data, anc, _flags, _addr = rx.recvmsg(64, socket.CMSG_SPACE(1))
        assert data == b"ping"
        tos = [c[2][0] for c in anc if c[0] == socket.IPPROTO_IP and c[1] == socket.IP_TOS]
        assert tos == [LIVENESS_TOS] and LIVENESS_TOS >> 2 == 48  # DSCP CS6
        assert udp.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY) == LIVENESS_PRIORITY == 6
        # (an unmarked socket's datagrams carry 0: the check above can fail)
        plain = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with plain:
            plain.sendto(b"data", rx.getsockname())
            data, anc, _flags, _addr = rx.recvmsg(64, socket.CMSG_SPACE(1))
        assert data == b"data" and [c[2][0] for c in anc if c[1] == socket.IP_TOS] == [0]
    finally:
        for s in (udp, tcp, rx):
            s.close()
