"""The ring plan on real members (``ftmesh.collective.topology`` through ``ftmesh.mesh``):
measured links published from SWIM's probes, sites from labels, the view and its epoch, and the
hierarchical allreduce, with its bytes and its failures.

Real meshes in one process: SWIM over loopback UDP with the ``local`` preset, same-host
discovery in a per-test registry, real data-plane sockets."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import trio
from tests_support import local_mesh_config

from ftmesh.collective.topology import links_of, parse_links
from ftmesh.collective.view import view_epoch
from ftmesh.mesh.core import Mesh, MeshConfig, open_mesh
from ftmesh.mesh.meta import LINKS_KEY

NO_HANG = 30.0


def config(registry: Path, site: str = "", links_interval: float = 0.0) -> MeshConfig:
    base = local_mesh_config(registry, "plan", max_cached_views=1)
    return dataclasses.replace(base, site=site, links_interval=links_interval)


@asynccontextmanager
async def meshes(
    registry: Path, sites: list[str], links_interval: float = 0.0
) -> AsyncIterator[list[Mesh]]:
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(open_mesh(config(registry, s, links_interval)))
            for s in sites
        ]


async def one_view(ms: list[Mesh], size: int) -> str:
    """Wait until every member holds the same view of ``size`` members; its epoch."""
    with trio.fail_after(NO_HANG):
        while True:
            views = [v for m in ms if (v := m.view()) is not None and v.size == size]
            if len(views) == len(ms) and len({v.epoch for v in views}) == 1:
                return views[0].epoch
            await trio.sleep(0.05)


async def test_members_measure_and_publish_their_links(tmp_path: Path) -> None:
    """Every member times its probes' acks and publishes a bucket per peer; on one host the
    links are all fast, so the plan is one site, measured, and the epoch is the unplanned one."""
    async with meshes(tmp_path, ["", "", ""], links_interval=0.2) as ms:
        await one_view(ms, 3)
        ids = sorted(m.node_id for m in ms)
        with trio.fail_after(NO_HANG):
            while True:
                published = [
                    links_of(parse_links(m.node.me().meta.get(LINKS_KEY, "1")), ids) for m in ms
                ]
                if all(len(p) == 2 for p in published):
                    break
                await trio.sleep(0.1)
        for m, p in zip(ms, published, strict=True):
            assert set(p) == set(ids) - {m.node_id}
            assert all(b <= 13 for b in p.values()), p  # loopback: well under 5 ms
            assert m.links_published >= 1
        epoch = await one_view(ms, 3)
        view = ms[0].view()
        assert view is not None and view.plan is not None
        # every member's links are in every member's view (gossip converged): measured
        with trio.fail_after(NO_HANG):
            while ms[0].view().plan.source != "measured":  # type: ignore[union-attr]
                await trio.sleep(0.1)
        assert view.plan.flat and epoch == view_epoch(ids)
