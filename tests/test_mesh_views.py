"""Collectives on a view the mesh has moved off (``Mesh._watch``, ``ViewSupersededError``).

Real meshes in one process: SWIM over loopback UDP with the ``local`` preset, same-host
discovery in a per-test registry, real data-plane sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from tests_support import local_mesh_config

from ftmesh.collective import ViewSupersededError
from ftmesh.collective.ops import CollectiveOp, Kind
from ftmesh.mesh.core import STATE_BYTES_KEY, Mesh, MeshConfig, open_mesh

NO_HANG = 20.0
"""Far below the data plane's io_timeout here (60 s): a round that ends within it was ended by
the view change, not by the stall timeout."""


def config(registry: Path) -> MeshConfig:
    return local_mesh_config(registry, "views", max_cached_views=1)


@asynccontextmanager
async def meshes(n: int, registry: Path) -> AsyncIterator[tuple[AsyncExitStack, list[Mesh]]]:
    async with AsyncExitStack() as stack:
        ms = [await stack.enter_async_context(open_mesh(config(registry))) for _ in range(n)]
        yield stack, ms


async def views_of(ms: list[Mesh], size: int) -> None:
    with trio.fail_after(NO_HANG):
        for m in ms:
            await m.wait_view(min_members=size, timeout=NO_HANG)
        while len({(v.epoch if (v := m.view()) else "") for m in ms}) != 1:
            await trio.sleep(0.05)


async def test_a_joiner_ends_rounds_waiting_on_the_old_view(tmp_path: Path) -> None:
    """Two members wait in a round on the view of three that the third never joins (it
    started its step on a newer view). When a fourth member arrives, the round fails at once
    with ``ViewSupersededError``, nobody is reported lost, and the four train together."""
    async with meshes(3, tmp_path) as (stack, ms):
        await views_of(ms, 3)
        old = ms[0].view()
        assert old is not None
        async with trio.open_nursery() as nursery:  # everyone has used the old view
            for m in ms:
                nursery.start_soon(partial(m.run, CollectiveOp.allreduce(), np.ones(8), view=old))
        out: dict[int, Any] = {}

        async def waiter(i: int) -> None:
            try:
                out[i] = await ms[i].run(
                    CollectiveOp.allreduce(), np.ones(1 << 16, np.float32), view=old
                )
            except Exception as exc:
                out[i] = exc

        waiting = await stack.enter_async_context(trio.open_nursery())
        for i in (1, 2):
            waiting.start_soon(waiter, i)
        await trio.sleep(0.5)
        assert not out, out
        ms.append(await stack.enter_async_context(open_mesh(config(tmp_path))))
        with trio.fail_after(NO_HANG):
            while len(out) < 2:
                await trio.sleep(0.05)
        for i in (1, 2):
            assert isinstance(out[i], ViewSupersededError), (i, out[i])
            assert out[i].epoch == old.epoch
        await views_of(ms, 4)
        new = ms[0].view()
        assert new is not None and new.size == 4
        sums: list[Any] = []

        async def reduce(m: Mesh) -> None:
            sums.append((await m.allreduce(np.ones(1000))).output)

        with trio.fail_after(NO_HANG):
            async with trio.open_nursery() as nursery:
                for m in ms:
                    nursery.start_soon(reduce, m)
        assert all(np.array_equal(s, np.full(1000, 4.0)) for s in sums), sums


async def test_a_view_that_is_no_longer_current_fails_at_once(tmp_path: Path) -> None:
    async with meshes(2, tmp_path) as (stack, ms):
        await views_of(ms, 2)
        old = ms[0].view()
        assert old is not None
        await stack.enter_async_context(open_mesh(config(tmp_path)))
        await views_of(ms, 3)
        with trio.fail_after(1.0), pytest.raises(ViewSupersededError):
            await ms[0].run(CollectiveOp(kind=Kind.BARRIER), None, view=old)


async def test_state_sizes_are_advertised_by_gossip_and_bounded(tmp_path: Path) -> None:
    """What a joiner sizes its receive buffer by: the size the training members agree on (the
    largest that more than half of them advertise at least), so that one member's claim cannot
    make a joiner reserve more than the others hold; never a size beyond the transfer's
    limit."""
    async with meshes(3, tmp_path) as (_, ms):
        await views_of(ms, 3)
        ms[0].advertise_state(5_000_000)
        ms[1].advertise_state(7_000_000)
        with trio.fail_after(NO_HANG):
            while ms[1].advertised_state_bytes() != 5_000_000:  # not its own 7 MB
                await trio.sleep(0.05)
            while ms[2].advertised_state_bytes() != 5_000_000:  # both hold at least 5 MB
                await trio.sleep(0.05)
        ms[0].advertise_state(3 << 30)  # a liar: 3 GB
        with trio.fail_after(NO_HANG):
            while {m.node: m.meta for m in ms[2].node.members()}[ms[0].node_id].get(
                STATE_BYTES_KEY
            ) != 3 << 30:
                await trio.sleep(0.05)
        assert ms[2].advertised_state_bytes() == 7_000_000  # not the liar's 3 GB
        ms[2].advertise_state(7_000_000)
        with trio.fail_after(NO_HANG):
            while ms[1].advertised_state_bytes() != 7_000_000:  # liar and ms[2]: 7 MB agreed
                await trio.sleep(0.05)
        ms[0].set_role("observer")  # only training members count
        ms[2].set_role("observer")
        with trio.fail_after(NO_HANG):
            while ms[1].advertised_state_bytes() != 0:
                await trio.sleep(0.05)
        huge = ms[2].config.transfer.max_state_bytes + 1
        ms[1].advertise_state(huge)
        with trio.fail_after(NO_HANG):
            while {m.node: m.meta for m in ms[2].node.members()}[ms[1].node_id].get(
                STATE_BYTES_KEY
            ) != huge:
                await trio.sleep(0.05)
        assert ms[2].advertised_state_bytes() == 0  # a hint too large to trust
