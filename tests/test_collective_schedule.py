"""Pure tests of the ring schedules: simulate every member in memory, no sockets."""

from __future__ import annotations

import numpy as np
import pytest

from ftmesh.collective import schedule
from ftmesh.collective.view import Peer, RingView, view_epoch


def simulate(n_members: int, data: list[np.ndarray], first: int, last: int, chunk: int) -> None:
    """Run the ring schedules of all members in lock-step, honouring send_after."""
    bounds = schedule.segment_bounds(data[0].size, n_members)
    scheds = [
        schedule.ring(bounds, r, first_step=first, last_step=last, itemsize=8, chunk_bytes=chunk)
        for r in range(n_members)
    ]
    inflight: list[list[np.ndarray]] = [[] for _ in range(n_members)]  # to member r
    sent = [0] * n_members
    recvd = [0] * n_members
    for _ in range(10_000):
        progressed = False
        for r, s in enumerate(scheds):
            while sent[r] < len(s.sends) and s.send_after[sent[r]] <= recvd[r]:
                op = s.sends[sent[r]]
                inflight[(r + 1) % n_members].append(data[r][op.start : op.stop].copy())
                sent[r] += 1
                progressed = True
            while inflight[r] and recvd[r] < len(s.recvs):
                op = s.recvs[recvd[r]]
                got = inflight[r].pop(0)
                assert got.size == op.stop - op.start
                if op.reduce:
                    data[r][op.start : op.stop] += got
                else:
                    data[r][op.start : op.stop] = got
                recvd[r] += 1
                progressed = True
        if not progressed:
            break
    assert all(sent[r] == len(s.sends) and recvd[r] == len(s.recvs) for r, s in enumerate(scheds))


@pytest.mark.parametrize("n_members", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("size", [0, 1, 2, 6, 13, 97, 1000])
@pytest.mark.parametrize("chunk", [8, 24, 1 << 20])
def test_ring_allreduce_schedule(n_members: int, size: int, chunk: int) -> None:
    rng = np.random.default_rng(size * 31 + n_members)
    data = [rng.integers(0, 100, size).astype(np.float64) for _ in range(n_members)]
    want = sum(d.copy() for d in data)
    simulate(n_members, data, 0, 2 * n_members - 3, chunk)
    for d in data:
        np.testing.assert_array_equal(d, want)


@pytest.mark.parametrize("n_members", [2, 3, 5])
def test_reduce_scatter_leaves_own_segment_reduced(n_members: int) -> None:
    data = [np.arange(23, dtype=np.float64) * (r + 1) for r in range(n_members)]
    want = sum(d.copy() for d in data)
    simulate(n_members, data, 0, n_members - 2, 16)
    b = schedule.segment_bounds(23, n_members)
    for r, d in enumerate(data):
        np.testing.assert_array_equal(d[b[r] : b[r + 1]], want[b[r] : b[r + 1]])


def test_segment_bounds_match_array_split() -> None:
    for n in range(0, 30):
        for parts in range(1, 7):
            sizes = [len(a) for a in np.array_split(np.arange(n), parts)]
            b = schedule.segment_bounds(n, parts)
            assert [b[i + 1] - b[i] for i in range(parts)] == sizes


@pytest.mark.parametrize("n_members", [2, 3, 5])
def test_chain_sends_everything_once(n_members: int) -> None:
    for rank in range(n_members):
        s = schedule.chain(10, rank, 1, n_members, itemsize=1, chunk_bytes=3)
        dist = (rank - 1) % n_members
        assert len(s.recvs) == (0 if dist == 0 else 4)
        assert len(s.sends) == (0 if dist == n_members - 1 else 4)


def test_view_is_sorted_and_epoch_is_order_independent() -> None:
    a = RingView.of([Peer("b", "h", 2), Peer("a", "h", 1), Peer("c", "h", 3)])
    b = RingView.of([Peer("c", "h", 3), Peer("a", "h", 1), Peer("b", "h", 2)])
    assert a.node_ids == ("a", "b", "c")
    assert a.epoch == b.epoch == view_epoch(["a", "b", "c"])
    assert a.right_of("c").node_id == "a"
    assert a.left_of("a").node_id == "c"
    assert view_epoch(["a", "b"]) != a.epoch
