"""The mesh: membership and the data plane of one member, joined into collectives on the
current view.

Theory of operation: a member runs a SWIM node (``ftmesh.net``) and a data plane
(``ftmesh.collective``). It publishes its data-plane address and role in its member metadata.
The *view* is the sorted list of members whose role is ``train`` and that membership holds
ALIVE (see ``MeshConfig.suspects_in_view`` for the trade-off). Every member derives the same ring
from the same view; before a collective runs on a view the data plane checks with both ring
neighbours that they hold the same view epoch, so if gossip has not converged yet the call
waits and retries on the newer view, up to ``agree_timeout``. A neighbour that dies during a
collective is reported to membership as hard evidence (an immediate probe), and the error is
raised: whether to retry, and with what inputs, is the caller's decision (see
``ftmesh.training``), because an in-place collective may have partly overwritten its input.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import trio

from .collective import (
    CollectiveConfig,
    CollectiveResult,
    DataPlane,
    Peer,
    RingPeerLostError,
    RingView,
    ViewMismatchError,
    ViewSupersededError,
    open_data_plane,
)
from .collective.transport import Ring
from .errors import ConfigError, DeadlineExceeded
from .membership.messages import MemberSnapshot, MemberState
from .net.node import Node, NodeConfig, open_node, parse_hostport
from .state import (
    Lookup,
    Snapshot,
    StateServer,
    StateTransferError,
    TransferConfig,
    TransferStats,
    fetch_state,
    serve_state,
)

T = TypeVar("T")

DATA_KEY = "data"
"""Member metadata key holding the data-plane ``host:port``."""
STATE_KEY = "state"
"""Member metadata key holding the ``host:port`` of the member's state server, if it runs one
(``Mesh.serve_state``): where members that are behind fetch committed state from."""
STATE_BYTES_KEY = "state_bytes"
"""Member metadata key: the size of the member's committed state (``Mesh.advertise_state``),
so that a member about to fetch it can prepare its receive buffer while it waits to join."""
ROLE_KEY = "role"
"""Member metadata key: ``train`` members form the ring; others not (``joining``: about to
train; ``spare``: waits for a free slot, see ``ElasticTrainer(max_peers=...)``; ``observer``;
``done``: finished training, about to leave)."""
ROLES = ("train", "joining", "starting", "spare", "observer", "done")
MAX_VIEWS_WATCHED = 4
"""Recent views whose collectives a membership loss aborts."""


@dataclass(frozen=True)
class MeshConfig:
    node: NodeConfig = field(default_factory=NodeConfig)
    collective: CollectiveConfig = field(
        default_factory=lambda: CollectiveConfig(
            view_timeout=5.0, max_cached_views=1, io_timeout=10.0
        )
    )
    role: str = "train"
    """This member's role: ``train`` members form the ring."""
    data_port: int = 0
    """Data-plane TCP port (0: any free one). It binds the gossip bind address."""
    suspects_in_view: bool = False
    """Whether SUSPECT members stay in the ring. No (default): a member stops being waited for
    as soon as it is suspected, which is what makes recovery from a crash take well under a
    second; a refuted false suspicion costs one extra state sync. Yes: the ring changes only on
    a death, at the price of waiting for the full suspicion timeout after a crash."""
    transfer: TransferConfig = field(default_factory=TransferConfig)
    """State transfer between members (``serve_state`` / ``fetch_state``)."""
    agree_timeout: float = 120.0
    """Seconds a collective keeps retrying while ring neighbours do not hold the same view
    (gossip still converging, or a neighbour still computing its previous step). Each try
    waits ``collective.view_timeout``."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.agree_timeout <= 0:
            raise ConfigError("agree_timeout must be positive")


def view_of(members: list[MemberSnapshot], suspects: bool = False) -> RingView | None:
    """The ring view membership implies: ``train`` members with a data address that are
    ALIVE (or SUSPECT, with ``suspects``)."""
    live = (MemberState.ALIVE, MemberState.SUSPECT) if suspects else (MemberState.ALIVE,)
    peers = []
    for m in members:
        if m.state not in live:
            continue
        if m.meta.get(ROLE_KEY) != "train" or not isinstance(m.meta.get(DATA_KEY), str):
            continue
        host, port = parse_hostport(str(m.meta[DATA_KEY]))
        peers.append(Peer(m.node, host, port))
    return RingView.of(peers) if peers else None


class Mesh:
    """One member of a training mesh. Get one from :func:`open_mesh`."""

    def __init__(
        self, config: MeshConfig, node: Node, dp: DataPlane, nursery: trio.Nursery
    ) -> None:
        self.config = config
        self.node = node
        self.data_plane = dp
        self._nursery = nursery
        self._state_server: StateServer | None = None
        self._view_changed = trio.Event()
        self._views: dict[str, RingView] = {}
        self._latest_view: RingView | None = None  # as of the last event _watch handled

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def view(self) -> RingView | None:
        """The current view (``None`` while we are not a training member)."""
        return view_of(self.node.members(), self.config.suspects_in_view)

    async def wait_view(
        self, *, min_members: int = 1, settle: float = 0.0, timeout: float = 60.0
    ) -> RingView:
        """Wait until the view holds at least ``min_members`` (us included) and has not
        changed for ``settle`` seconds."""
        with trio.move_on_after(timeout):
            while True:
                view = self.view()
                if view is not None and view.size >= min_members and self.node_id in view:
                    with trio.move_on_after(settle) as quiet:
                        await self.view_changed()
                    if quiet.cancelled_caught or settle == 0:
                        return view
                else:
                    await self.view_changed()
        raise DeadlineExceeded(f"no view of {min_members} members within {timeout:.0f}s")

    def set_role(self, role: str) -> None:
        """Change our role (``train`` members form the ring); spreads by gossip."""
        if role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {role!r}")
        me = self.node.me()
        if me.meta.get(ROLE_KEY) != role:
            self.node.update_meta({**me.meta, ROLE_KEY: role})

    @property
    def role(self) -> str:
        return str(self.node.me().meta.get(ROLE_KEY, ""))

    async def wait_quiet(self, settle: float, timeout: float = 60.0) -> None:
        """Wait until membership has had no event for ``settle`` seconds (at most
        ``timeout``): discovery and gossip have settled."""
        with trio.move_on_after(timeout):
            while True:
                with trio.move_on_after(settle) as quiet:
                    await self.view_changed()
                if quiet.cancelled_caught:
                    return

    async def view_changed(self) -> None:
        """Return after the next membership event (the view may or may not have changed)."""
        await self._view_changed.wait()

    async def allreduce(
        self, x: T, op: str = "sum", compression: Any = None
    ) -> CollectiveResult[T]:
        """Reduce ``x`` in place over the view; ``avg`` divides by the members that ran.
        ``compression``: see ``DataPlane.allreduce`` (``"int8"``, an ``Int8Compression``)."""
        return await self._run(lambda v: self.data_plane.allreduce(v, x, op, compression))

    async def reduce_scatter(self, x: T, op: str = "sum") -> CollectiveResult[T]:
        return await self._run(lambda v: self.data_plane.reduce_scatter(v, x, op))

    async def allgather(self, x: T) -> CollectiveResult[T]:
        return await self._run(lambda v: self.data_plane.allgather(v, x))

    async def broadcast(self, x: T, root: str) -> CollectiveResult[T]:
        return await self._run(lambda v: self.data_plane.broadcast(v, x, root))

    async def barrier(self) -> CollectiveResult[None]:
        return await self._run(self.data_plane.barrier)

    async def on_view(
        self,
        view: RingView,
        kind: str,
        x: T,
        op: str = "sum",
        root: str = "",
        io_timeout: float | None = None,
        compression: Any = None,
    ) -> CollectiveResult[T]:
        """Run one collective on exactly ``view`` (no retry on another view): the building block
        of protocols that must know which view a round ran on (``ftmesh.training``).
        ``kind`` is ``allreduce`` (``compression``: see ``DataPlane.allreduce``),
        ``allgather``, ``broadcast`` or ``barrier`` (``x`` unused; ``io_timeout``: see
        ``DataPlane.barrier``). A lost peer is reported to membership."""
        self._in_use(view)
        plan = self.data_plane.plan_on(view, kind, x, op, root, io_timeout, compression)
        try:
            done: CollectiveResult[T] = await self.data_plane.run_plan(plan)
        except RingPeerLostError as exc:
            self.node.report_unreachable(exc.peer)
            raise
        return done

    def view_in_use(self) -> RingView | None:
        """The view as of the last membership event handled, if collectives already run on it
        over an open ring (``ring_in_use``), else None. Safe from any thread: the steady state
        of a training loop (same view, step after step) needs no trip to the trio thread. It
        may lag ``view()`` by events not handled yet; a collective on it then fails or is
        superseded as on any view that changes under it."""
        view = self._latest_view
        if view is None or self.ring_in_use(view) is None:
            return None
        return view

    def ring_in_use(self, view: RingView) -> Ring | None:
        """The open ring of ``view`` if collectives already ran on it and we have not moved
        on from it since (``_in_use``), else None. Safe from any thread: a collective may then
        run on it straight away with ``DataPlane.run_plan_blocking``; a loss or a newer view
        kills the ring, and the collective raises that."""
        if view.epoch not in self._views:
            return None
        return self.data_plane.whole_ring(view.epoch)

    async def run_on_view(
        self, fn: Callable[[RingView], Awaitable[CollectiveResult[T]]]
    ) -> CollectiveResult[T]:
        """Run ``fn(view)`` on the current view, retrying on view disagreement; see the module
        docstring. For collectives the ``Mesh`` methods do not cover."""
        return await self._run(fn)

    async def _run(
        self, fn: Callable[[RingView], Awaitable[CollectiveResult[T]]]
    ) -> CollectiveResult[T]:
        deadline = trio.current_time() + self.config.agree_timeout
        while True:
            view = self.view()
            if view is None or self.node_id not in view:
                raise ConfigError(f"{self.node_id} is not a training member of the mesh")
            self._in_use(view)
            try:
                return await fn(view)
            except ViewMismatchError:
                if trio.current_time() >= deadline:
                    raise
            except RingPeerLostError as exc:
                self.node.report_unreachable(exc.peer)
                raise

    async def serve_state(self, source: Lookup) -> tuple[str, int]:
        """Serve ``source(step, digest)`` (the snapshot asked for, or None) to members that
        fetch state (``fetch_state``), for as long as the mesh is open, and publish the
        server's address in our metadata. One server per member; a second call replaces it."""
        if self._state_server is not None:
            self._state_server.close()
        nc = self.config.node
        server: StateServer = await self._nursery.start(
            functools.partial(
                serve_state,
                source,
                auth=nc.auth,
                mesh=nc.mesh,
                host=self.data_plane.address[0],
                config=self.config.transfer,
            )
        )
        self._state_server = server
        host, port = server.address
        me = self.node.me()
        self.node.update_meta({**me.meta, STATE_KEY: f"{host}:{port}"})
        return host, port

    def advertise_state(self, nbytes: int) -> None:
        """Publish the size of the state we would serve (``advertised_state_bytes``)."""
        me = self.node.me()
        if me.meta.get(STATE_BYTES_KEY) != nbytes:
            self.node.update_meta({**me.meta, STATE_BYTES_KEY: nbytes})

    def advertised_state_bytes(self) -> int:
        """The largest committed-state size that training members advertise, 0 if none; never
        more than ``TransferConfig.max_state_bytes`` or half the available memory (it is
        a hint from the network, used to prepare a receive buffer)."""
        sizes = [
            m.meta.get(STATE_BYTES_KEY)
            for m in self.node.members()
            if m.node != self.node_id
            and m.state == MemberState.ALIVE
            and m.meta.get(ROLE_KEY) == "train"
        ]
        hint = max((n for n in sizes if type(n) is int and n > 0), default=0)
        return 0 if hint > min(self.config.transfer.max_state_bytes, _free_memory() // 2) else hint

    async def fetch_state(
        self,
        holders: Sequence[str],
        step: int,
        digest: str,
        stats: TransferStats | None = None,
        buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None,
    ) -> Snapshot:
        """Fetch the committed state ``(step, digest)`` from the state servers of the members
        ``holders``, striped over all of them and verified chunk by chunk (into ``buffer``
        when it fits, see ``ftmesh.state.fetch_state``)."""
        by_id = {m.node: m for m in self.node.members()}
        peers = []
        for node in holders:
            addr = by_id[node].meta.get(STATE_KEY) if node in by_id else None
            if isinstance(addr, str):
                peers.append(parse_hostport(addr))
        if not peers:
            raise StateTransferError(f"none of {len(holders)} holders serves its state", {})
        nc = self.config.node
        return await fetch_state(
            peers,
            step,
            digest,
            auth=nc.auth,
            mesh=nc.mesh,
            config=self.config.transfer,
            stats=stats,
            buffer=buffer,
        )

    def _in_use(self, view: RingView) -> None:
        """Remember ``view`` as one collectives run on, so a member lost from it, or our moving
        on to a newer view, aborts them. A view that is the current one again (a suspect
        refuted) loses any earlier abort; one that is not current fails at once."""
        current = self.view()
        if current is None or current.epoch != view.epoch:
            raise ViewSupersededError(
                f"{self.node_id}: view {view.epoch} is no longer current", epoch=view.epoch
            )
        self.data_plane.clear_abort(view.epoch)
        self._views[view.epoch] = view
        while len(self._views) > MAX_VIEWS_WATCHED:
            del self._views[next(iter(self._views))]

    async def _watch(self) -> None:
        async for ev in self.node.events():
            if ev.kind in ("suspect", "dead", "left"):
                # Membership no longer counts on this member: collectives waiting for it (a
                # frozen process sends nothing and closes nothing) fail now, not at io_timeout.
                for epoch, view in self._views.items():
                    if ev.member.node in view and ev.member.node != self.node_id:
                        self.data_plane.abort_view(
                            epoch, ev.member.node, f"membership: {ev.member.name} is {ev.kind}"
                        )
            self._supersede_old_views(f"{ev.member.name} is {ev.kind}")
            event, self._view_changed = self._view_changed, trio.Event()
            event.set()

    def _supersede_old_views(self, why: str) -> None:
        """We moved off every watched view but the current one: we will not run collectives on
        them, so the members still running or opening one must not wait ``io_timeout`` for us
        (a joiner's arrival would otherwise stall the ring that far)."""
        current = self._latest_view = self.view()
        for epoch in [e for e in self._views if current is None or e != current.epoch]:
            del self._views[epoch]
            self.data_plane.supersede_view(epoch, why)


@asynccontextmanager
async def open_mesh(config: MeshConfig | None = None) -> AsyncIterator[Mesh]:
    """Join (or start) a training mesh for the duration of the block; leave on exit."""
    config = config or MeshConfig()
    node_id = os.urandom(16).hex()
    nc = config.node
    async with open_data_plane(
        node_id,
        host=nc.advertise or nc.bind,
        port=config.data_port,
        auth=nc.auth,
        mesh=nc.mesh,
        config=config.collective,
    ) as dp:
        host, port = dp.address
        meta: dict[str, Any] = {**nc.meta, DATA_KEY: f"{host}:{port}", ROLE_KEY: config.role}
        async with (
            open_node(replace(nc, meta=meta), node_id=node_id) as node,
            trio.open_nursery() as nursery,
        ):
            mesh = Mesh(config, node, dp, nursery)
            nursery.start_soon(mesh._watch)
            try:
                yield mesh
            finally:
                nursery.cancel_scope.cancel()


def _free_memory() -> int:
    """Memory available to a new allocation, in bytes (MemAvailable: free memory and page
    cache that can be reclaimed); free pages where that is not known; else unbounded."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62
