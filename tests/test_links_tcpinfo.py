"""The kernel's figures of a data-plane connection (``ftmesh.collective.links``): parsed from a
real loopback connection's ``TCP_INFO``, and kept per neighbour by a real data plane."""

from __future__ import annotations

import socket
import sys
import threading
from contextlib import AsyncExitStack

import numpy as np
import pytest
import trio

from ftmesh.collective import CollectiveConfig, Peer, RingView, open_data_plane
from ftmesh.collective.links import TcpInfo, read_tcp_info, updated
from ftmesh.stats import LinkStatistics

linux = pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO is read on Linux only")


@linux
def test_a_bulk_stream_shows_its_round_trip_and_delivery_rate() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    with srv, socket.create_connection(srv.getsockname()) as tx:
        rx, _ = srv.accept()
        total = 32 << 20

        def drain() -> None:
            got = 0
            while got < total:
                got += len(rx.recv(1 << 20))

        with rx:
            reader = threading.Thread(target=drain)
            reader.start()
            tx.sendall(b"\0" * total)
            reader.join(30)
            info = read_tcp_info(tx)
    assert info is not None
    assert 0 < info.min_rtt_s <= info.rtt_s + 1e-6 < 0.5, info
    assert info.delivery_rate > 1e6, info  # loopback: far above a megabyte per second
    assert info.retransmits >= 0


def test_a_reading_keeps_the_last_rate_measured_when_not_app_limited() -> None:
    full = TcpInfo(min_rtt_s=1e-4, rtt_s=2e-4, delivery_rate=5e8, app_limited=False, retransmits=0)
    idle = TcpInfo(min_rtt_s=1e-4, rtt_s=2e-4, delivery_rate=1e6, app_limited=True, retransmits=2)
    link = updated(LinkStatistics(), 100, full)
    assert link == LinkStatistics(100, 1e-4, 5e8, 0)
    link = updated(link, 50, idle)  # a lower bound: the path's rate stays the last real one
    assert link == LinkStatistics(150, 1e-4, 5e8, 2)
    assert updated(link, 10, None) == LinkStatistics(160, 1e-4, 5e8, 2)  # (no reading)


@linux
async def test_a_data_plane_keeps_each_neighbours_link() -> None:
    cfg = CollectiveConfig(io_timeout=30.0, view_timeout=10.0)
    async with AsyncExitStack() as stack:
        dps = [
            await stack.enter_async_context(open_data_plane(f"m{i}", config=cfg)) for i in range(3)
        ]
        view = RingView.of(Peer(d.node_id, *d.address) for d in dps)
        x = np.ones(1 << 20, np.float32)  # 4 MiB

        async def run(i: int) -> None:
            await dps[i].allreduce(view, x.copy())

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(run, i)
        for i, d in enumerate(dps):
            right = view.members[(view.rank_of(d.node_id) + 1) % 3].node_id
            links = d.links()
            assert set(links) == {right}, (i, links)
            link = links[right]
            # a 3-ring allreduce sends 2 (N-1)/N of the input to the right (shards of
            # 349525 or 349526 elements)
            assert abs(link.sent_bytes - 2 * 2 * x.nbytes / 3) <= 2 * 4, link
            assert 0 < link.min_rtt_s < 0.5, link
            assert d.statistics().links == links
