"""A ring neighbour that has not *started* a collective and declares itself busy between
steps (``DataPlane.busy``; a mesh reads it from the member's published progress) is waited
for up to ``start_wait`` (``ftmesh.collective.engine``). One that does not declare it (a link
that drops its packets, a frozen process) is stalled after ``io_timeout`` as before; past
``start_wait`` a busy one is stalled too; membership's verdict (``abort_view``) ends the wait
at once."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from tests_support import local_mesh_config

from ftmesh.collective import (
    CollectiveConfig,
    Peer,
    PeerStalledError,
    RingPeerLostError,
    RingView,
    ViewMismatchError,
    open_data_plane,
)
from ftmesh.collective.dataplane import DataPlane
from ftmesh.mesh.core import open_mesh
from ftmesh.mesh.meta import Progress
from ftmesh.torch.between import between_text

IO = 0.5
"""The tests' ``io_timeout``; a late member starts ``LATE`` (4x) after the others."""
LATE = 2.0
NO_HANG = 20.0
"""A no-hang bound on a loaded 2-core machine, far below the long ``start_wait``."""


def config(start_wait: float) -> CollectiveConfig:
    return CollectiveConfig(
        chunk_bytes=1 << 16,
        io_timeout=IO,
        start_wait=start_wait,
        connect_timeout=5.0,
        view_timeout=5.0,
        poll_interval=0.05,
    )


@asynccontextmanager
async def ring_of(
    n: int, cfg: CollectiveConfig, busy: frozenset[str] = frozenset({"m2"})
) -> AsyncIterator[tuple[list[DataPlane], RingView]]:
    """``n`` data planes; ``busy``: the members that declare themselves busy between steps."""
    async with AsyncExitStack() as stack:
        dps = [
            await stack.enter_async_context(open_data_plane(f"m{i}", config=cfg)) for i in range(n)
        ]
        for d in dps:
            d.busy = lambda peer: peer if peer in busy else None
        yield dps, RingView.of(Peer(d.node_id, *d.address) for d in dps)


async def _round(dps: list[DataPlane], view: RingView, late: float) -> dict[int, Any]:
    """An allreduce of ``[i + 1] * 1000`` where m2 starts ``late`` seconds after the others."""
    out: dict[int, Any] = {}

    async def member(i: int) -> None:
        if i == 2:
            await trio.sleep(late)
        try:
            out[i] = (await dps[i].allreduce(view, np.full(1000, i + 1.0))).output
        except Exception as exc:
            out[i] = exc

    with trio.fail_after(NO_HANG):
        async with trio.open_nursery() as nursery:
            for i in range(len(dps)):
                nursery.start_soon(member, i)
    return out


async def test_a_member_that_starts_late_is_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    async with ring_of(3, config(start_wait=30.0)) as (dps, view):
        out = await _round(dps, view, 0.0)  # the ring connects
        assert all(isinstance(v, np.ndarray) for v in out.values()), out
        with caplog.at_level(logging.INFO, logger="ftmesh.collective.engine"):
            out = await _round(dps, view, LATE)
        for i, v in out.items():
            assert isinstance(v, np.ndarray) and (v == 6.0).all(), (i, v)
        waits = [r.getMessage() for r in caplog.records if "waiting for m2" in r.getMessage()]
        assert waits, [r.getMessage() for r in caplog.records]
        assert any("m2 started collective" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("start_wait", [0.0, 30.0])
async def test_a_late_member_that_is_not_busy_is_stalled_after_io_timeout(
    start_wait: float,
) -> None:
    """Not declared busy (or no ``start_wait``): ``io_timeout``, as before."""
    busy = frozenset({"m2"}) if start_wait == 0.0 else frozenset()
    async with ring_of(3, config(start_wait=start_wait), busy) as (dps, view):
        await _round(dps, view, 0.0)
        out = await _round(dps, view, LATE)
        stalled = [v for v in out.values() if isinstance(v, PeerStalledError)]
        assert stalled and all(e.peer == "m2" for e in stalled), out


async def test_past_start_wait_a_late_member_is_stalled() -> None:
    async with ring_of(3, config(start_wait=1.0)) as (dps, view):
        await _round(dps, view, 0.0)
        out = await _round(dps, view, LATE + 1.0)
        stalled = [v for v in out.values() if isinstance(v, PeerStalledError)]
        assert stalled and all(e.peer == "m2" for e in stalled), out
        assert all("did not start the collective within 1s" in str(e) for e in stalled), out


async def test_membership_ends_the_wait_at_once() -> None:
    """m2 never starts; 'membership' suspects it after 0.5 s: the others fail now, not after
    ``start_wait`` (60 s)."""
    async with ring_of(3, config(start_wait=60.0)) as (dps, view):
        await _round(dps, view, 0.0)
        out: dict[int, Any] = {}

        async def member(i: int) -> None:
            try:
                out[i] = await dps[i].allreduce(view, np.ones(1000))
            except Exception as exc:
                out[i] = exc

        with trio.fail_after(NO_HANG):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member, 0)
                nursery.start_soon(member, 1)
                await trio.sleep(IO + 0.5)  # past io_timeout: they wait for m2
                for i in (0, 1):
                    dps[i].abort_view(view.epoch, "m2", "membership: m2 is suspect")
        for i in (0, 1):
            assert isinstance(out[i], RingPeerLostError) and out[i].peer == "m2", out


async def test_both_neighbours_busy_each_is_asked_once() -> None:
    """m0 waits for both its neighbours, each busy between steps: m1 (its right) says its
    pause ended 0.5 s before its first frame reaches m0 (the published progress can arrive
    first), m2 (its left) starts later still. Each neighbour's answer holds for the
    collective: asked again while waiting for the other, m1 looked silent and was stalled
    (seen at a 15 s evaluation beside a 27 s one, with the default ``io_timeout``)."""
    late = {"m1": LATE, "m2": LATE + 1.0}
    t0 = 0.0

    def busy(peer: str) -> str | None:
        if peer == "m1" and time.monotonic() - t0 >= late["m1"] - 0.5:
            return None  # m1's "pause over" is already here
        return peer if peer in late else None

    async with ring_of(3, config(start_wait=30.0)) as (dps, view):
        await _round(dps, view, 0.0)
        for d in dps:
            d.busy = busy
        out: dict[int, Any] = {}

        async def member(i: int) -> None:
            await trio.sleep(late.get(f"m{i}", 0.0))
            try:
                out[i] = (await dps[i].allreduce(view, np.full(1000, i + 1.0))).output
            except Exception as exc:
                out[i] = exc

        t0 = time.monotonic()
        with trio.fail_after(NO_HANG):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(member, i)
        for i, v in out.items():
            assert isinstance(v, np.ndarray) and (v == 6.0).all(), (i, v)


@pytest.mark.parametrize("declared", [True, False])
async def test_a_busy_member_is_waited_for_to_open_a_new_views_ring(declared: bool) -> None:
    """A new view's ring opens as each member starts its first collective on it: m2, busy
    between steps, opens its halves after ``view_timeout``. Declared busy, the others wait
    for it (a failure while someone evaluates no longer fails every retry until the
    evaluation ends); silent, the opening fails after ``view_timeout`` as before."""
    cfg = replace(config(start_wait=30.0), view_timeout=1.0)
    busy = frozenset({"m2"}) if declared else frozenset()
    async with ring_of(3, cfg, busy) as (dps, view):
        out = await _round(dps, view, LATE)  # no round before: the ring opens now
        if declared:
            for i, v in out.items():
                assert isinstance(v, np.ndarray) and (v == 6.0).all(), (i, v)
        else:
            # m0 and m1 give up on m2; m2 then finds them gone
            assert all(isinstance(v, ViewMismatchError) for v in out.values()), out
            assert all(out[i].peer == "m2" for i in (0, 1)), out


async def test_a_pause_that_just_ended_still_counts_for_io_timeout(tmp_path: Path) -> None:
    """Real meshes: a member publishes a pause between steps, then its end (as its next
    step begins). Its neighbour, which may have waited ``io_timeout`` since before the end,
    learns of the end before the member's first frame: the member still counts as busy for
    ``io_timeout`` after the end (so it gets that long to send), not as silent at once."""
    cfg = local_mesh_config(tmp_path, "resumed", io_timeout=2.0)
    async with open_mesh(cfg) as a, open_mesh(cfg) as b:
        with trio.fail_after(NO_HANG):
            await a.wait_view(min_members=2, timeout=NO_HANG)
        assert a.busy_between_steps(b.node_id) is None  # never paused

        async def seen(busy: bool) -> None:
            with trio.fail_after(NO_HANG):
                while (b.node_id in a._between) != busy:
                    await trio.sleep(0.01)

        b.report_progress(Progress(step=3, fault=between_text(1.0, 3)))
        await seen(True)
        assert b.node_id in str(a.busy_between_steps(b.node_id))
        b.report_progress(Progress(step=3))
        await seen(False)
        ended = time.monotonic()
        assert b.node_id in str(a.busy_between_steps(b.node_id))  # just ended: still waited for
        with trio.fail_after(NO_HANG):
            while a.busy_between_steps(b.node_id) is not None:
                await trio.sleep(0.05)
        assert time.monotonic() - ended >= 2.0 - 0.1  # io_timeout after the end
