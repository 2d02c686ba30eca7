"""Striped state transfer on loopback: peers dying, stalling, lying; authentication."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio

from ftmesh.bench.transfer import measure_transfer
from ftmesh.errors import LocalUsageError
from ftmesh.security import MeshAuth
from ftmesh.state import (
    Snapshot,
    State,
    StateServer,
    StateTransferError,
    TransferConfig,
    TransferStats,
    fetch_state,
)
from ftmesh.state.transfer import _send_all

MESH = "test-mesh"
SECRET = MeshAuth.from_secrets([b"a-secret-of-enough-bytes"])
FAST = TransferConfig(chunks_per_request=1, connect_timeout=5, request_timeout=5)


def make_state(mib: int = 12) -> State:
    n = mib * (1 << 20) // 8
    return State(arrays={"w": np.arange(n, dtype=np.float64)}, scalars={"epoch": 2}, rng=False)


class SlowServer(StateServer):
    delay = 0.005

    async def _send_chunk(self, sock: Any, snap: Snapshot, index: int) -> None:
        await trio.sleep(self.delay)
        await super()._send_chunk(sock, snap, index)


class ClosingServer(SlowServer):
    """Dies (stops listening, drops its sessions) when asked for its second chunk."""

    sent = 0

    async def _send_chunk(self, sock: Any, snap: Snapshot, index: int) -> None:
        if self.sent >= 1:
            self.close()
            await trio.lowlevel.checkpoint()
        self.sent += 1
        await super()._send_chunk(sock, snap, index)


class StallingServer(SlowServer):
    """Sends one chunk, then hangs like a SIGSTOPped process."""

    sent = 0

    async def _send_chunk(self, sock: Any, snap: Snapshot, index: int) -> None:
        if self.sent >= 1:
            await trio.sleep_forever()
        self.sent += 1
        await super()._send_chunk(sock, snap, index)


class LyingServer(SlowServer):
    """Serves the right manifest but flips a bit in every chunk."""

    async def _send_chunk(self, sock: Any, snap: Snapshot, index: int) -> None:
        data = bytearray(b"".join(snap.chunk_views(index)))
        data[len(data) // 2] ^= 1
        await _send_all(sock, data)


@asynccontextmanager
async def servers(
    state: State,
    classes: Sequence[type[StateServer]],
    *,
    auth: MeshAuth = SECRET,
    mesh: str = MESH,
) -> AsyncIterator[list[StateServer]]:
    async with trio.open_nursery() as nursery:
        out = []
        for cls in classes:
            srv = cls(state, auth=auth, mesh=mesh, config=FAST)
            await nursery.start(srv.serve)
            out.append(srv)
        yield out
        nursery.cancel_scope.cancel()


def key(srv: StateServer) -> str:
    return f"{srv.host}:{srv.port}"


async def test_striped_fetch_from_three_peers() -> None:
    state = make_state()
    snap = state.commit(step=10)
    async with servers(state, [SlowServer] * 3) as srvs:
        stats = TransferStats()
        got = await fetch_state(
            [s.address for s in srvs],
            10,
            snap.digest,
            auth=SECRET,
            mesh=MESH,
            config=FAST,
            stats=stats,
        )
    assert got.digest == snap.digest and got.step == 10
    assert all(stats.bytes_from[key(s)] > 0 for s in srvs)  # striped over every peer
    assert sum(stats.bytes_from.values()) == snap.nbytes  # each byte fetched once
    joiner = State(arrays={"w": np.zeros(1)}, rng=False)
    joiner.load_snapshot(got)
    assert joiner.digest() == state.digest() and joiner.scalars == {"epoch": 2}


async def test_peer_closed_mid_transfer() -> None:
    state = make_state()
    snap = state.commit(step=3)
    async with servers(state, [SlowServer, ClosingServer, SlowServer]) as srvs:
        stats = TransferStats()
        got = await fetch_state(
            [s.address for s in srvs],
            3,
            snap.digest,
            auth=SECRET,
            mesh=MESH,
            config=FAST,
            stats=stats,
        )
    assert got.digest == snap.digest
    assert key(srvs[1]) in stats.failures
    assert stats.reassigned >= 1


_SERVER_SCRIPT = textwrap.dedent(
    """
    import sys, trio, numpy as np
    from ftmesh.security import MeshAuth
    from ftmesh.state import State, StateServer

    class Slow(StateServer):
        sent = 0
        async def _send_chunk(self, sock, snap, index):
            await trio.sleep(0.01 if self.sent == 0 else 1.0)
            self.sent += 1
            await super()._send_chunk(sock, snap, index)

    n = 12 * (1 << 20) // 8
    state = State(arrays={"w": np.arange(n, dtype=np.float64)}, scalars={"epoch": 2}, rng=False)
    state.commit(step=4)
    async def main():
        auth = MeshAuth.from_secrets([b"a-secret-of-enough-bytes"])
        srv = Slow(state, auth=auth, mesh="test-mesh")
        async with trio.open_nursery() as n:
            await n.start(srv.serve)
            print(srv.port, flush=True)
    trio.run(main)
    """
)


async def test_peer_killed_mid_transfer() -> None:
    state = make_state()
    snap = state.commit(step=4)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(await trio.to_thread.run_sync(proc.stdout.readline))
        victim = f"127.0.0.1:{port}"

        class Slower(SlowServer):
            delay = 0.05

        async with servers(state, [Slower, Slower]) as srvs:
            stats = TransferStats()
            result: list[Snapshot] = []

            async def fetch() -> None:
                result.append(
                    await fetch_state(
                        [srvs[0].address, ("127.0.0.1", port), srvs[1].address],
                        4,
                        snap.digest,
                        auth=SECRET,
                        mesh=MESH,
                        config=FAST,
                        stats=stats,
                    )
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch)
                for _ in range(2000):  # until the victim has delivered one chunk
                    if stats.bytes_from.get(victim, 0) > 0:
                        break
                    await trio.sleep(0.005)
                os.kill(proc.pid, signal.SIGKILL)  # kill -9 while its next range is in flight
        assert result[0].digest == snap.digest
        assert stats.bytes_from[victim] > 0 and victim in stats.failures
    finally:
        proc.kill()
        proc.wait()


async def test_stalled_peer_is_given_up_and_its_stripe_reassigned() -> None:
    state = make_state()
    snap = state.commit(step=5)
    config = TransferConfig(chunks_per_request=1, request_timeout=0.5)
    async with servers(state, [StallingServer, SlowServer]) as srvs:
        stats = TransferStats()
        got = await fetch_state(
            [s.address for s in srvs],
            5,
            snap.digest,
            auth=SECRET,
            mesh=MESH,
            config=config,
            stats=stats,
        )
    assert got.digest == snap.digest
    assert stats.failures == {key(srvs[0]): "timeout"}


async def test_lying_peer_is_detected() -> None:
    state = make_state()
    snap = state.commit(step=6)
    async with servers(state, [LyingServer, SlowServer]) as srvs:
        stats = TransferStats()
        got = await fetch_state(
            [s.address for s in srvs],
            6,
            snap.digest,
            auth=SECRET,
            mesh=MESH,
            config=FAST,
            stats=stats,
        )
        assert got.digest == snap.digest
        assert stats.failures == {key(srvs[0]): "bad_chunk"} and stats.bad_chunks >= 1
        # With only the liar, no state at all rather than a corrupt one.
        with pytest.raises(StateTransferError, match="bad_chunk"):
            await fetch_state([srvs[0].address], 6, snap.digest, auth=SECRET, mesh=MESH)


async def test_wrong_secret_and_wrong_mesh_refused() -> None:
    state = make_state(1)
    snap = state.commit(step=1)
    other = MeshAuth.from_secrets([b"another-secret-of-enough-bytes"])
    async with servers(state, [StateServer]) as (srv,):
        fetch = functools.partial(fetch_state, [srv.address], 1, snap.digest, config=FAST)
        with pytest.raises(StateTransferError, match="bad_mac"):
            await fetch(auth=other, mesh=MESH)  # the client catches the impostor server
        with pytest.raises(StateTransferError, match="eof"):
            await fetch(auth=MeshAuth.none(), mesh=MESH)  # the server refuses us
        with pytest.raises(StateTransferError, match="wrong_mesh"):
            await fetch(auth=SECRET, mesh="other-mesh")
        assert srv.dropped.get("bad_mac") == 1 and srv.dropped.get("wrong_mesh") == 1
        assert srv.sessions_served == 0
        got = await fetch(auth=SECRET, mesh=MESH)
        assert got.digest == snap.digest


async def test_other_state_unavailable_and_no_peers_left() -> None:
    state = make_state(1)
    snap = state.commit(step=1)
    async with servers(state, [StateServer]) as (srv,):
        with pytest.raises(StateTransferError, match="unavailable"):
            await fetch_state([srv.address], 2, snap.digest, auth=SECRET, mesh=MESH)
        with pytest.raises(StateTransferError, match="unavailable"):
            await fetch_state([srv.address], 1, "00" * 32, auth=SECRET, mesh=MESH)
    dead = [("127.0.0.1", srv.port)]  # closed now
    with pytest.raises(StateTransferError, match="io"):
        await fetch_state(dead, 1, snap.digest, auth=SECRET, mesh=MESH)


async def test_garbage_from_the_network_is_dropped() -> None:
    state = make_state(1)
    snap = state.commit(step=1)
    async with servers(state, [StateServer]) as (srv,):
        for payload in (b"\xff\xff\xff\xff" + b"x" * 10, b"\x00\x00\x00\x03abc", b"\x00"):
            stream = await trio.open_tcp_stream(*srv.address)
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(payload)
                await stream.send_eof()
                with trio.fail_after(5):
                    while await stream.receive_some():
                        pass
            await stream.aclose()
        assert srv.dropped.get("oversized") == 1 and srv.dropped.get("malformed") == 1
        got = await fetch_state([srv.address], 1, snap.digest, auth=SECRET, mesh=MESH)
        assert got.digest == snap.digest


def test_measure_transfer_reports_ratio() -> None:
    r = measure_transfer(4, 2, repeats=1)
    assert r.transfer_mb_per_s > 0 and r.raw_tcp_mb_per_s > 0 and r.ratio > 0


async def test_fetch_into_a_callers_buffer() -> None:
    state = make_state(6)
    snap = state.commit(step=4)
    fetch = functools.partial(
        fetch_state, step=4, digest=snap.digest, auth=SECRET, mesh=MESH, config=FAST
    )
    async with servers(state, [SlowServer] * 2) as srvs:
        peers = [s.address for s in srvs]
        roomy = np.full(snap.nbytes + 4096, 0xEE, dtype=np.uint8)
        got = await fetch(peers, buffer=roomy)
        assert got.digest == snap.digest
        assert np.shares_memory(got.numpy("a/w"), roomy)  # received in place
        assert (roomy[snap.nbytes :] == 0xEE).all()  # nothing written past the state
        small = np.zeros(snap.nbytes - 1, dtype=np.uint8)
        got = await fetch(peers, buffer=small)  # too small: new memory, buffer untouched
        assert got.digest == snap.digest and not np.shares_memory(got.numpy("a/w"), small)
        assert not small.any()
        bad: Any
        for bad in (np.zeros(snap.nbytes, np.float32), np.zeros((2, snap.nbytes), np.uint8)):
            with pytest.raises(LocalUsageError, match="buffer"):
                await fetch(peers, buffer=bad)


@pytest.mark.parametrize(("mib", "peers"), [(1, 3), (16, 3), (17, 3), (100, 2), (300, 4)])
async def test_ranges_are_even_and_cover_the_state_once(mib: int, peers: int) -> None:
    from ftmesh.state.snapshot import chunk_count
    from ftmesh.state.transfer import _Job

    snap = make_state(mib).commit(step=1)
    job = _Job(1, snap.digest, TransferConfig(), peers)
    job.adopt(snap.nbytes, snap.leaves)
    ranges = list(job.pending)
    lengths = {n for _, n in ranges}
    assert max(lengths) - min(lengths) <= 1
    assert max(lengths) <= TransferConfig().chunks_per_request
    ends = [first + n for first, n in ranges]
    assert [first for first, _ in ranges] == [0, *ends[:-1]]  # back to back, in order
    assert ends[-1] == chunk_count(snap.nbytes)
