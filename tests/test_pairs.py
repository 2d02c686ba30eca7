"""Packet pairs (``ftmesh.net.pairs``): the receiving side's matching, the kernel's stamps,
and two real members on loopback addresses timing the path from each other."""

from __future__ import annotations

import socket
import struct

import pytest
import trio

from ftmesh.collective.topology import MAX_CROSS_RATE_BUCKET, rate_bucket
from ftmesh.net.node import NodeConfig, open_node
from ftmesh.net.pairs import HEADERS, SO_TIMESTAMPNS, PairTimer, kernel_time_ns
from ftmesh.security import MeshAuth


def test_the_second_half_gives_bytes_on_the_wire_over_the_spacing() -> None:
    timer = PairTimer()
    assert timer.arrived("a", 1, 0, 1_000_000, 1172) is None
    rate = timer.arrived("a", 1, 1, 1_480_000, 1172)  # 480 us apart
    assert rate is not None and abs(rate / ((1172 + HEADERS) / 480e-6) - 1) < 1e-9
    # a second half alone (the first lost), or stamped first (reordered): no sample
    assert timer.arrived("a", 2, 1, 2_000_000, 1172) is None
    assert timer.arrived("b", 3, 0, 3_000_000, 1172) is None
    assert timer.arrived("b", 3, 1, 2_999_999, 1172) is None
    assert timer.unmatched == 2
    # halves from another source, or another pair, do not match
    timer.arrived("a", 4, 0, 4_000_000, 1172)
    assert timer.arrived("c", 4, 1, 4_000_100, 1172) is None
    assert timer.arrived("a", 5, 1, 4_000_100, 1172) is None


def test_first_halves_waiting_are_bounded() -> None:
    timer = PairTimer(max_pending=8)
    for seq in range(100):  # a peer sending first halves only
        timer.arrived("x", seq, 0, seq, 1000)
    assert len(timer._first) == 8
    assert timer.arrived("x", 99, 1, 1000, 1000) is not None  # the newest kept
    assert timer.arrived("x", 0, 1, 1000, 1000) is None


def test_the_kernel_stamp_is_read_from_its_control_message() -> None:
    raw = struct.pack("=qq", 1_700_000_000, 123)
    assert kernel_time_ns([(socket.SOL_SOCKET, SO_TIMESTAMPNS, raw)]) == 1_700_000_000_000_000_123
    assert kernel_time_ns([(socket.IPPROTO_IP, 11, raw)]) is None
    assert kernel_time_ns([(socket.SOL_SOCKET, SO_TIMESTAMPNS, raw[:8])]) is None
    assert kernel_time_ns([]) is None


@pytest.mark.parametrize("auth", ["none", "secret", "encrypted"])
async def test_two_members_time_the_path_from_each_other(auth: str) -> None:
    """On two loopback addresses (no narrow link between them): every pair arrives and is
    timed (sealed as the mesh seals its gossip: plain, with a tag, encrypted), and loopback
    reads far above the cross-site ceiling (about 125 Mbit/s)."""
    sealing = {
        "none": MeshAuth.none(),
        "secret": MeshAuth.from_secrets([b"pairs secret of 32 bytes or more!!"]),
        "encrypted": MeshAuth.from_secrets([b"pairs secret of 32 bytes or more!!"], encrypt=True),
    }[auth]
    base = dict(mesh="pairs", discovery="none", pair_interval=0.02, auth=sealing)
    async with open_node(NodeConfig(bind="127.0.0.1", **base)) as a:  # type: ignore[arg-type]
        join = (f"127.0.0.1:{a.address[1]}",)
        async with open_node(NodeConfig(bind="127.0.0.2", join=join, **base)) as b:  # type: ignore[arg-type]
            with trio.fail_after(20):
                while len(a.members()) < 2 or len(b.members()) < 2:
                    await trio.sleep(0.01)
                rates: dict[str, list[float]] = {a.node_id: [], b.node_id: []}
                while min(len(r) for r in rates.values()) < 20:
                    await trio.sleep(0.05)
                    for node, who in ((a, b), (b, a)):
                        for source, rate in node.take_rates():
                            assert source == who.node_id
                            rates[node.node_id].append(rate)
    for node in (a, b):
        got = sorted(rates[node.node_id])
        assert rate_bucket(got[len(got) // 2]) > MAX_CROSS_RATE_BUCKET, got  # the median
        assert node.counters.get("rx_pair_untimed", 0) == 0
        assert node.counters["rx_pair_samples"] >= 20


async def test_members_on_one_address_send_no_pairs() -> None:
    base = dict(mesh="pairs1", discovery="none", bind="127.0.0.1", pair_interval=0.02)
    async with open_node(NodeConfig(**base)) as a:  # type: ignore[arg-type]
        join = (f"127.0.0.1:{a.address[1]}",)
        async with open_node(NodeConfig(join=join, **base)) as b:  # type: ignore[arg-type]
            with trio.fail_after(20):
                while len(a.members()) < 2 or len(b.members()) < 2:
                    await trio.sleep(0.01)
            await trio.sleep(0.3)
            assert "tx_pairs" not in a.counters and "tx_pairs" not in b.counters
            assert a.take_rates() == [] == b.take_rates()
