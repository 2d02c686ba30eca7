"""Aborting collectives whose peer stopped participating (``DataPlane.abort_view``), and the
``io_timeout`` stall path without an abort.

The stalled member opens the ring (so the view agreement succeeds) and then never runs the
collective: the kernel accepts what its left neighbour sends until the buffers fill and nothing
comes out towards its right, exactly what a SIGSTOPped process looks like from the wire."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio

from ftmesh.collective import (
    CollectiveConfig,
    Peer,
    PeerStalledError,
    RingPeerLostError,
    RingView,
    SyncDataPlane,
    ViewSupersededError,
    open_data_plane,
)
from ftmesh.collective.dataplane import DataPlane
from ftmesh.collective.ops import CollectiveOp, Kind
from ftmesh.security import MeshAuth

SLOW = CollectiveConfig(
    chunk_bytes=1 << 16, io_timeout=60.0, connect_timeout=5.0, view_timeout=5.0, poll_interval=0.05
)
NO_HANG = 20.0
"""Generous bound (seconds) for 'promptly': far below io_timeout, far above any real latency
on a loaded 2-core machine. A no-hang check, not a speed test."""

STALLED = "m2"
ENCRYPTED = MeshAuth.from_secrets([b"a mesh secret for the abort tests"], encrypt=True)
AUTHS = {"plain": MeshAuth.none(), "encrypted": ENCRYPTED}
"""The abort paths write frames from several threads (notices, forwarded aborts, ``READY``):
with encryption each of them is sealed and numbered, so they run both ways."""


@asynccontextmanager
async def ring_of(
    n: int, config: CollectiveConfig, auth: MeshAuth | None = None
) -> AsyncIterator[tuple[list[DataPlane], RingView]]:
    async with AsyncExitStack() as stack:
        dps = [
            await stack.enter_async_context(open_data_plane(f"m{i}", config=config, auth=auth))
            for i in range(n)
        ]
        yield dps, RingView.of(Peer(d.node_id, *d.address) for d in dps)


@pytest.mark.parametrize("mode", list(AUTHS))
@pytest.mark.parametrize("elems", [1000, 1 << 20])  # one-thread (inline) and two-thread rounds
@pytest.mark.parametrize("abort_on", ["all", "m0", "m3"])
async def test_abort_view_fails_every_survivor_promptly(
    elems: int, abort_on: str, mode: str
) -> None:
    async with ring_of(4, SLOW, AUTHS[mode]) as (dps, view):
        survivors = [i for i in range(4) if dps[i].node_id != STALLED]
        out: dict[int, Any] = {}
        entered = 0

        async def member(i: int) -> None:
            nonlocal entered
            entered += 1
            try:
                out[i] = await dps[i].allreduce(view, np.ones(elems, np.float32))
            except Exception as exc:
                out[i] = exc

        with trio.fail_after(NO_HANG):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dps[2].open_ring, view)  # agrees, then never takes part
                for i in survivors:
                    nursery.start_soon(member, i)
                while entered < len(survivors):
                    await trio.sleep(0.01)
                await trio.sleep(0.3)  # let them block on the stalled member
                assert not out, out
                for i in survivors:
                    if abort_on in ("all", dps[i].node_id):
                        dps[i].abort_view(view.epoch, STALLED, "declared dead by the test")
        for i in survivors:
            exc = out[i]
            assert isinstance(exc, RingPeerLostError), (i, exc)
            assert not isinstance(exc, PeerStalledError), (i, exc)
            assert exc.peer == STALLED and exc.epoch == view.epoch, (i, out)
        # an aborted epoch stays aborted on the members that were told
        told = [i for i in survivors if abort_on in ("all", dps[i].node_id)]
        with trio.fail_after(NO_HANG), pytest.raises(RingPeerLostError):
            await dps[told[0]].allreduce(view, np.ones(4, np.float32))


async def test_abort_view_before_the_ring_connects() -> None:
    """A collective still waiting in trio for view agreement is cancelled by the abort."""
    async with ring_of(3, SLOW) as (dps, view):
        with trio.fail_after(NO_HANG):
            async with trio.open_nursery() as nursery:
                result: list[Any] = []

                async def member() -> None:
                    try:
                        await dps[0].allreduce(view, np.ones(8))
                    except Exception as exc:
                        result.append(exc)

                nursery.start_soon(member)
                await trio.sleep(0.2)  # m1 and m2 never connect
                dps[0].abort_view(view.epoch, "m1", "gone")
        assert isinstance(result[0], RingPeerLostError) and result[0].peer == "m1", result


@pytest.mark.parametrize("mode", list(AUTHS))
@pytest.mark.parametrize("elems", [1000, 1 << 20])
async def test_stall_without_abort_raises_peer_stalled_after_io_timeout(
    elems: int, mode: str
) -> None:
    cfg = CollectiveConfig(
        chunk_bytes=1 << 16, io_timeout=1.0, connect_timeout=5.0, view_timeout=5.0
    )
    async with ring_of(4, cfg, AUTHS[mode]) as (dps, view):
        survivors = [i for i in range(4) if i != 2]
        out: dict[int, Any] = {}

        async def member(i: int) -> None:
            try:
                out[i] = await dps[i].allreduce(view, np.ones(elems, np.float32))
            except Exception as exc:
                out[i] = exc

        with trio.fail_after(NO_HANG):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dps[2].open_ring, view)
                for i in survivors:
                    nursery.start_soon(member, i)
        for i in survivors:
            exc = out[i]
            assert isinstance(exc, PeerStalledError), (i, exc)
            assert exc.peer == STALLED and exc.epoch == view.epoch, (i, out)


def test_abort_view_unblocks_the_sync_api() -> None:
    dps = [SyncDataPlane.start(f"m{i}", config=SLOW) for i in range(4)]
    try:
        view = RingView.of(Peer(d.node_id, *d.address) for d in dps)
        results: dict[int, BaseException | None] = {}

        def go(i: int) -> None:
            try:
                dps[i].session(view).allreduce(np.ones(1 << 20, np.float32))
                results[i] = None
            except BaseException as exc:  # reported below
                results[i] = exc

        threads = [threading.Thread(target=go, args=(i,)) for i in (0, 1, 3)]
        opener = threading.Thread(target=dps[2].open_ring, args=(view,))
        opener.start()
        for t in threads:
            t.start()
        opener.join(NO_HANG)
        for t in threads:
            t.join(0.3)
        assert all(t.is_alive() for t in threads), results  # blocked on m2
        dps[0].abort_view(view.epoch, STALLED, "declared dead by the test")  # m0 only
        for t in threads:
            t.join(NO_HANG)
        assert not any(t.is_alive() for t in threads)
        for i in (0, 1, 3):
            exc = results[i]
            assert isinstance(exc, RingPeerLostError) and exc.peer == STALLED, (i, exc)
    finally:
        for d in dps:
            d.close()


@pytest.mark.parametrize("mode", list(AUTHS))
async def test_supersede_view_fails_the_others_without_naming_a_loss(mode: str) -> None:
    """The member that moved on to a newer view never runs the round its neighbours wait in;
    ``supersede_view`` on it alone ends their round at once, as ``ViewSupersededError``."""
    async with ring_of(4, SLOW, AUTHS[mode]) as (dps, view):
        others = [0, 1, 3]
        out: dict[int, Any] = {}

        async def member(i: int) -> None:
            try:
                out[i] = await dps[i].allreduce(view, np.ones(1 << 18, np.float32))
            except Exception as exc:
                out[i] = exc

        with trio.fail_after(NO_HANG):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dps[2].open_ring, view)  # agrees, then sees a newer view
                for i in others:
                    nursery.start_soon(member, i)
                while dps[2].cached_ring(view) is None:  # (superseded while opening, m2
                    await trio.sleep(0.01)  # closes its half-open connections: a loss)
                await trio.sleep(0.3)  # let the others block on m2
                assert not out, out
                dps[2].supersede_view(view.epoch, "a member joined")
        for i in others:
            assert isinstance(out[i], ViewSupersededError), (i, out[i])
            assert out[i].epoch == view.epoch
        with trio.fail_after(NO_HANG), pytest.raises(ViewSupersededError):
            await dps[2].allreduce(view, np.ones(4, np.float32))


async def test_supersede_keeps_an_earlier_loss() -> None:
    async with ring_of(3, SLOW) as (dps, view):
        dps[0].abort_view(view.epoch, "m1", "gone")
        dps[0].supersede_view(view.epoch, "a member joined")
        with trio.fail_after(NO_HANG), pytest.raises(RingPeerLostError) as info:
            await dps[0].allreduce(view, np.ones(4))
        assert info.value.peer == "m1"


async def test_a_barrier_waits_past_io_timeout_when_told() -> None:
    """After a long state fetch the fetcher enters the post-sync barrier late: with a longer
    ``io_timeout`` for that barrier the others wait for it instead of calling it stalled."""
    cfg = CollectiveConfig(
        chunk_bytes=1 << 16, io_timeout=0.5, connect_timeout=5.0, view_timeout=5.0
    )
    async with ring_of(3, cfg) as (dps, view):
        out: dict[int, Any] = {}

        async def member(i: int, delay: float, io_timeout: float | None) -> None:
            await trio.sleep(delay)
            try:
                out[i] = await dps[i].barrier(view, io_timeout)
            except Exception as exc:
                out[i] = exc

        with trio.fail_after(NO_HANG):
            for late in (0.0, 2.0):  # connect the ring; then one member four io_timeouts late
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(member, 0, 0.0, 30.0)
                    nursery.start_soon(member, 1, 0.0, 30.0)
                    nursery.start_soon(member, 2, late, 30.0)
                assert all(not isinstance(r, Exception) for r in out.values()), out
        with trio.fail_after(NO_HANG):  # the default still calls a late member stalled
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member, 0, 0.0, None)
                nursery.start_soon(member, 1, 0.0, None)
                nursery.start_soon(member, 2, 2.0, None)
        assert any(isinstance(r, PeerStalledError) for r in out.values()), out


async def test_a_member_sends_while_its_left_neighbour_streams() -> None:
    """A member whose right neighbour starts a collective late starts sending when that
    neighbour's ``READY`` arrives, not when its left neighbour's stream pauses: ``m0`` starts
    only once ``m2`` is inside its first receive, and ``m1``'s whole stream waits in ``m2``'s
    socket. Reading that backlog without looking at the other socket, ``m2`` held its first
    send until it had received everything: no overlap, and a member held inside its last
    receive (as the test below does) never sent at all."""
    async with ring_of(3, SLOW) as (dps, view):
        with trio.fail_after(NO_HANG):  # connect the ring: the collective below runs on it
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(dps[i].allreduce, view, np.ones(4, np.float32))
        events: list[tuple[str, int]] = []
        paused, m1_sent = threading.Event(), threading.Event()

        async def member(i: int) -> None:
            plan = dps[i].plan(view, CollectiveOp(kind=Kind.ALLGATHER), np.full(1 << 18, i, "f4"))
            if i == 0:
                while not paused.is_set():
                    await trio.sleep(0.01)
            elif i == 1:
                last_send = len(plan.sched.sends) - 1
                plan.bufs.on_send = lambda j: m1_sent.set() if j == last_send else None
            else:

                def on_recv(j: int) -> None:
                    events.append(("recv", j))
                    if j == 0:
                        paused.set()
                        m1_sent.wait(NO_HANG)
                        time.sleep(0.2)  # m1's last frames reach m2's socket

                plan.bufs.on_recv = on_recv
                plan.bufs.on_send = lambda j: events.append(("send", j))
            await dps[i].run_plan(plan)

        with trio.fail_after(NO_HANG):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(member, i)
        last_recv = max(j for kind, j in events if kind == "recv")
        assert events.index(("send", 0)) < events.index(("recv", last_recv)), events


@pytest.mark.parametrize("moved_on", ["the finished member", "everyone"])
async def test_moving_on_after_a_collective_does_not_fail_its_last_reads(moved_on: str) -> None:
    """A member that finished a collective and moved on (a graceful leave, a newer view) must
    not fail the members still reading that collective's last frames: ``m1`` finishes while
    ``m2`` is held inside its last receive (``m0`` then waits for ``m2``'s ``DONE``), and moves
    on. Its notices reach ``m0``, whose sends are all written, and ``m2`` after ``m1``'s
    ``DONE``; with "everyone", ``m0`` and ``m2`` move on too while their collective runs. All
    three complete with the right data; the view then refuses new collectives everywhere."""
    async with ring_of(3, SLOW) as (dps, view):
        out: dict[int, Any] = {}
        held, release = threading.Event(), threading.Event()

        async def member(i: int) -> None:
            plan = dps[i].plan(view, CollectiveOp(kind=Kind.ALLGATHER), np.full(1 << 18, i, "f4"))
            if i == 2:
                last = len(plan.sched.recvs) - 1

                def hold(j: int) -> None:
                    if j == last:
                        held.set()
                        release.wait(NO_HANG)

                plan.bufs.on_recv = hold
            try:
                out[i] = (await dps[i].run_plan(plan)).output
            except Exception as exc:
                out[i] = exc

        with trio.fail_after(NO_HANG):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(member, i)
                while not (held.is_set() and 1 in out):
                    await trio.sleep(0.01)
                assert 0 not in out and 2 not in out, out  # both wait on m2
                for i in (1,) if moved_on == "the finished member" else (1, 0, 2):
                    dps[i].supersede_view(view.epoch, "a newer view")
                await trio.sleep(0.3)  # the notices arrive
                release.set()
        for i in range(3):
            assert isinstance(out[i], np.ndarray), (i, out[i])
            assert [float(r[0]) for r in out[i]] == [0.0, 1.0, 2.0] and out[i].shape == (3, 1 << 18)
        with trio.fail_after(NO_HANG), pytest.raises(ViewSupersededError):
            await dps[1].allreduce(view, np.ones(4, np.float32))


def record_closed(dps: list[DataPlane]) -> dict[str, list[tuple[str, bool]]]:
    """What each data plane reports closed (``DataPlane.on_closed``), by member."""
    seen: dict[str, list[tuple[str, bool]]] = {d.node_id: [] for d in dps}
    for d in dps:
        d.on_closed = lambda peer, refused, me=d.node_id: seen[me].append((peer, refused))
    return seen


@pytest.mark.parametrize("mode", list(AUTHS))
async def test_a_neighbour_whose_connections_close_mid_collective_is_reported(mode: str) -> None:
    """Issue #30 item 1: a ring member whose connections close under a collective (what the
    kernel does to a killed process's sockets) is reported closed by a neighbour (by both,
    unless one hears of the loss round the ring before it sees its own connection close: an
    abort known first means nothing first-hand is reported), the survivors fail naming it,
    and nobody else is reported."""
    async with ring_of(4, SLOW, AUTHS[mode]) as (dps, view):
        seen = record_closed(dps)
        out: dict[int, Any] = {}

        async def member(i: int) -> None:
            try:
                out[i] = await dps[i].allreduce(view, np.ones(1 << 18, np.float32))
            except Exception as exc:
                out[i] = exc

        with trio.fail_after(NO_HANG):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dps[2].open_ring, view)  # agrees, never takes part...
                for i in (0, 1, 3):
                    nursery.start_soon(member, i)
                while (ring := dps[2].cached_ring(view)) is None:
                    await trio.sleep(0.01)
                await trio.sleep(0.2)
                ring.close()  # ...and dies
        for i in (0, 1, 3):
            assert isinstance(out[i], RingPeerLostError) and out[i].peer == STALLED, out
        assert (STALLED, False) in seen["m1"] + seen["m3"], seen
        assert all(r == (STALLED, False) for reports in seen.values() for r in reports), seen


async def test_a_refused_connection_is_reported_once_as_refused() -> None:
    cfg = CollectiveConfig(connect_timeout=0.5, view_timeout=5.0, io_timeout=5.0)
    gone = trio.socket.socket()
    await gone.bind(("127.0.0.1", 0))
    port = gone.getsockname()[1]
    gone.close()  # nothing listens there any more: connections are refused
    async with open_data_plane("m0", config=cfg) as dp:
        seen = record_closed([dp])
        view = RingView.of([Peer("m0", *dp.address), Peer("gone", "127.0.0.1", port)])
        with trio.fail_after(NO_HANG), pytest.raises(RingPeerLostError):
            await dp.allreduce(view, np.ones(8, np.float32))
        assert seen["m0"] == [("gone", True)]
