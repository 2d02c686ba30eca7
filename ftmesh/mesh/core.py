"""The mesh: membership and the data plane of one member, joined into collectives on the
current view.

Theory of operation: a member runs a SWIM node (``ftmesh.net``) and a data plane
(``ftmesh.collective``). It publishes its data-plane address and role in its member metadata.
Its listeners (gossip, data plane, state server) bind ``NodeConfig.bind`` on their ports
(``NodeConfig.port``, ``MeshConfig.data_port``, ``MeshConfig.state_port``; 0: any free one),
and every address it publishes names the advertised host (``NodeConfig.advertised_host``),
which may be a NAT's or a port forward's rather than this machine's (``ftmesh.net.node``).
The *view* is the list of members whose role is ``train`` and that membership holds ALIVE
(see ``MeshConfig.suspects_in_view`` for the trade-off), less those the ring leaves out because
their neighbours cannot reach them or their bytes fail verification
(``ftmesh.collective.reach``: each member publishes its accusations under ``reach`` in its
metadata, and every member computes the same exclusions from them), in the order of the ring
plan their metadata implies (``ftmesh.collective.topology``: site labels and measured round
trips; one site, sorted by node id, unless they say otherwise). Every member derives the
same ring from the same view; before a collective runs on a view the data plane checks with
both ring neighbours that they hold the same view epoch, so if gossip has not converged yet the
call waits and retries on the newer view, up to ``agree_timeout``. A neighbour that dies during a
collective is reported to membership as hard evidence (an immediate probe), and the error is
raised: whether to retry, and with what inputs, is the caller's decision (see
``ftmesh.training``), because an in-place collective may have partly overwritten its input. A
neighbour whose ring connection closes or resets with nothing left unsaid (a killed process's
kernel closes its sockets), during a collective or between two, or that refuses a connection,
is handed to membership as such (``DataPlane.on_closed``, ``Swim.connection_closed``): it is
probed at once and suspected if it does not answer within the probe timeout, so the view drops
it well before the probe round would, and often before the next collective finds the ring
broken.

Progress: ``report_progress`` (the trainer, after each committed step) keeps the latest
``Progress``; a task publishes it in our metadata (key ``progress``) at once if nothing was
published for ``progress_interval`` seconds, else at the end of that interval: each metadata
change is an incarnation gossiped to every member, so at most one a second, and the last
value is never lost (``open_mesh`` publishes a pending one as the member leaves).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import trio

from ..collective import (
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
from ..collective.ops import CollectiveOp, Kind
from ..collective.reach import Exclusion, ReachConfig, ReachEvent
from ..collective.topology import MAX_BUCKET, LinkEstimator, check_label, format_links
from ..collective.transport import Ring
from ..errors import ConfigError, DeadlineExceeded, LocalUsageError
from ..membership.messages import MemberSnapshot, MemberState
from ..membership.swim import MemberEvent
from ..net.node import Node, NodeConfig, open_node
from ..state import (
    Lookup,
    Snapshot,
    StateServer,
    StateTransferError,
    TransferConfig,
    TransferStats,
    fetch_state,
    serve_state,
)
from ..state.transfer import bounded_state_hint
from .meta import (
    BETWEEN_STEPS,
    DATA_KEY,
    LINKS_KEY,
    PROGRESS_KEY,
    RELEASE,
    RELEASE_KEY,
    ROLE_KEY,
    ROLES,
    SITE_KEY,
    STATE_BYTES_KEY,
    STATE_KEY,
    MemberInfo,
    MetadataGate,
    Progress,
    ring_exclusions,
    ring_plan,
)
from .reach import BAD_STATE_REASONS, ReachDriver, describe_exclusion, new_queue

T = TypeVar("T")
log = logging.getLogger("ftmesh.mesh")
_LIVE = (MemberState.ALIVE, MemberState.SUSPECT)

MAX_VIEWS_WATCHED = 4
"""Recent views whose collectives a membership loss aborts."""


MESH_COLLECTIVE = CollectiveConfig(view_timeout=5.0, max_cached_views=1, io_timeout=10.0)
"""The data plane's settings in a mesh (``MeshConfig.collective``'s default), which differ
from a bare ``CollectiveConfig()`` in three fields, on purpose: ``view_timeout`` 5 s (not
10: the mesh retries a view that neighbours do not hold yet, up to
``MeshConfig.agree_timeout``, so each try may be short), ``io_timeout`` 10 s (not 30: a
mesh also learns of a dead neighbour from membership and from a newer view, so the data
plane's own stall limit only has to catch a link that breaks under an open ring) and
``max_cached_views`` 1 (not 2: a mesh's member that moves to a newer view aborts the old
one's collectives, ``ViewSupersededError``, so no straggler finishes a round on it). A
``MeshConfig(collective=CollectiveConfig(...))`` starts from ``CollectiveConfig``'s own
defaults, not these: to change one field and keep the mesh's others, give
``dataclasses.replace(MESH_COLLECTIVE, field=value)``."""


@dataclass(frozen=True)
class MeshConfig:
    node: NodeConfig = field(default_factory=NodeConfig)
    collective: CollectiveConfig = MESH_COLLECTIVE
    """The data plane's settings; default :data:`MESH_COLLECTIVE` (three fields differ from
    ``CollectiveConfig()``'s defaults, which that constant names and explains)."""
    role: str = "train"
    """This member's role: ``train`` members form the ring."""
    data_port: int = 0
    """Data-plane TCP port (0: any free one). It binds the gossip bind address; the published
    address is the advertised host and this port (fix it to forward it, or to write a
    firewall rule for it)."""
    state_port: int = 0
    """State-server TCP port (``serve_state``; 0: any free one), bound and published like
    ``data_port``."""
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
    reach: ReachConfig = field(default_factory=ReachConfig)
    """When a member that membership holds alive is left out of the ring, and re-admitted
    (``ftmesh.collective.reach``)."""
    progress_interval: float = 1.0
    """Least seconds between two publications of our progress (``Mesh.report_progress``):
    each is a metadata change that every member gossips."""
    site: str = ""
    """Our explicit site label (``--site``), published under ``SITE_KEY``: an input of the
    ring plan (``ftmesh.collective.topology``); ``""``: none, the sites are measured."""
    links_interval: float = 5.0
    """Seconds between two looks at the round trips our membership probes measured; a
    quantized summary is published under ``LINKS_KEY`` when a bucket changed (with
    hysteresis: ``topology.LinkEstimator``), so at most one metadata change per interval and
    none while the links hold steady. 0: measure nothing, publish nothing. A peer that
    advertises our own address runs on this machine: its link is published as the fastest
    bucket whatever its probes measure (their time is the processes' scheduling). Our ring
    neighbours' links also take the kernel's smallest round trip on the data-plane connection
    (``DataPlane.links``) as a sample. The capacities our packet pairs measured from each
    peer (``ftmesh.net.pairs``; the median of a window, with the same hysteresis) ride in the
    same summary once one is measured; a peer on this machine then reads as the fastest."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.agree_timeout <= 0:
            raise ConfigError("agree_timeout must be positive")
        if not self.progress_interval > 0:
            raise ConfigError("progress_interval must be positive")
        if not self.links_interval >= 0:
            raise ConfigError("links_interval must be >= 0")
        for name in ("data_port", "state_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name} out of range: {getattr(self, name)}")
        if self.site:
            try:
                check_label(self.site)
            except ValueError as exc:
                raise ConfigError(f"site (--site, $FTMESH_SITE): {exc}") from None


def view_of(
    members: list[MemberSnapshot], suspects: bool = False, gate: MetadataGate | None = None
) -> RingView | None:
    """The ring view membership implies: ``train`` members that are ALIVE (or SUSPECT, with
    ``suspects``) and whose metadata parses (``gate`` counts and logs the others)."""
    return _view((gate or MetadataGate()).usable(members), suspects)


def _view(members: list[MemberInfo], suspects: bool) -> RingView | None:
    live = (MemberState.ALIVE, MemberState.SUSPECT) if suspects else (MemberState.ALIVE,)
    chosen = [m for m in members if m.state in live and m.role == "train" and m.data is not None]
    peers = [Peer(m.node, *m.data) for m in chosen if m.data is not None]
    return RingView.of(peers, ring_plan(chosen)) if peers else None


def ring_members(members: list[MemberSnapshot]) -> list[MemberSnapshot]:
    """``members`` less those the ring leaves out (``ring_exclusions``): what ``view_of`` is
    computed from."""
    out = ring_exclusions(members)
    return [m for m in members if m.node not in out] if out else members


class Mesh:
    """One member of a training mesh. Get one from :func:`open_mesh`."""

    def __init__(
        self,
        config: MeshConfig,
        node: Node,
        dp: DataPlane,
        nursery: trio.Nursery,
        reach_events: deque[ReachEvent] | None = None,
    ) -> None:
        self.config = config
        self.node = node
        self.data_plane = dp
        self._nursery = nursery
        self.reach = ReachDriver(node, dp, config.reach, ring_exclusions, DATA_KEY, reach_events)
        """Our reachability judgements and their log (``ftmesh.mesh.reach``)."""
        self._state_server: StateServer | None = None
        self._view_changed = trio.Event()
        self._seen: dict[str, tuple[str, MemberState, dict[str, Any]]] = {}  # see _material
        self._links_seen: dict[str, object] = {}  # (see _material)
        self._views: dict[str, RingView] = {}
        self._between: dict[str, str] = {}
        """Members whose published progress says they are busy between steps -> their names
        (replaced whole on change: read from any thread)."""
        self._resumed: dict[str, tuple[str, float]] = {}
        """Members whose pause between steps ended -> their names and when (monotonic; as
        ``_between``): see :meth:`busy_between_steps`."""
        self._latest_view: RingView | None = None  # as of the last event _watch handled
        self.metadata = MetadataGate()
        """Counts (``bad_meta``) and logs members whose metadata does not parse."""
        self._progress: Progress | None = None  # the latest reported, maybe not published
        self._progress_due = trio.Event()  # set: a report waits to be published
        self.progress_published = 0
        """Metadata updates ``report_progress`` made (at most one per interval)."""
        self.progress_refused = 0
        """Progress reports the metadata had no room for (logged once)."""
        self.links = LinkEstimator()
        """Our measured round trips to each member, as published (``LINKS_KEY``)."""
        self.rates = LinkEstimator.for_rates()
        """The capacities our packet pairs measured from each member, as published."""
        self.links_published = 0
        """Metadata updates that changed our published links."""

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def view(self) -> RingView | None:
        """The current view (``None`` while we are not a training member)."""
        return view_of(
            ring_members(self.node.members()), self.config.suspects_in_view, self.metadata
        )

    def exclusions(self) -> dict[str, Exclusion]:
        """The training members the ring leaves out now, and why (``ring_exclusions``)."""
        return ring_exclusions(self.node.members())

    def usable_members(self) -> list[MemberInfo]:
        """Every known member whose metadata parses (see ``ftmesh.mesh.meta``)."""
        return self.metadata.usable(self.node.members())

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
        why = ""
        out = self.exclusions().get(self.node_id)
        if out is not None:
            names = {m.node: m.name for m in self.node.members()}
            why = f": the ring leaves this member out ({describe_exclusion(out, names)})"
        raise DeadlineExceeded(f"no view of {min_members} members within {timeout:.0f}s{why}")

    def set_role(self, role: str) -> None:
        """Change our role (``train`` members form the ring); spreads by gossip."""
        if role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {role!r}")
        if self.node.me().meta.get(ROLE_KEY) != role:
            self._update_meta({ROLE_KEY: role})

    @property
    def role(self) -> str:
        return str(self.node.me().meta.get(ROLE_KEY, ""))

    def report_progress(self, progress: Progress) -> None:
        """Publish ``progress`` in our metadata (``PROGRESS_KEY``), now or, if we published
        less than ``progress_interval`` seconds ago, at the end of that interval: the latest
        value reported by then is the one published. Never blocks."""
        self._progress = progress
        self._progress_due.set()

    def keep_progress(self, progress: Progress) -> bool:
        """``report_progress`` from another thread, in two halves: keep ``progress`` as the
        latest (any thread) and say whether the publisher must be woken (``True``: run
        :meth:`wake_progress` in the mesh's thread). While a publication is pending it will
        carry the latest value anyway, so a trainer that reports every step wakes the mesh's
        thread about once per ``progress_interval``, not once per step (each wake-up costs
        the reporting thread a GIL hand-over on the critical path of its step)."""
        self._progress = progress
        # read after the store: the publisher replaces the event before it reads _progress,
        # so either it reads ours or we see its new, unset event and wake it
        return not self._progress_due.is_set()

    def wake_progress(self) -> None:
        """Mesh thread: publish the progress :meth:`keep_progress` kept (rate limited)."""
        self._progress_due.set()

    async def _publish_links(self) -> None:
        """Every ``links_interval``: feed the probes' round trips to ``links`` and publish its
        buckets if one changed (see ``MeshConfig.links_interval``)."""
        refused = False
        while True:
            await trio.sleep(self.config.links_interval)
            here = self.node.me().addr[0]
            hosts = {m.node: m.addr[0] for m in self.node.members()}
            for node, seconds in self.node.take_round_trips():
                # A peer at our own address runs on this machine: a probe's round trip to it
                # measures the two processes' scheduling, not a link, and a loaded host would
                # look like a distant site (a plan, and a view, that flip): it is 0.
                self.links.add(node, 0.0 if hosts.get(node) == here else seconds)
            for node, link in self.data_plane.links().items():
                # The kernel's smallest round trip on our ring connection to a neighbour:
                # the path's own delay, free of the scheduling a probe's includes.
                if link.min_rtt_s > 0 and node in hosts:
                    self.links.add(node, 0.0 if hosts[node] == here else link.min_rtt_s)
            for node, rate in self.node.take_rates():
                if node in hosts:
                    self.rates.add(node, rate)
            live = [m.node for m in self.node.members() if m.state in _LIVE]
            self.links.forget(live)
            self.rates.forget(live)
            rates = self.rates.buckets()
            if rates:  # peers on this machine are never timed: nothing lies between us
                me = self.node_id
                rates.update({n: MAX_BUCKET for n, h in hosts.items() if h == here and n != me})
            value = format_links(self.links.buckets(), rates)
            before = self.node.me().meta.get(LINKS_KEY)
            if value == before or (before is None and value == format_links({})):
                continue
            try:
                self._update_meta({LINKS_KEY: value})
                self.links_published += 1
            except LocalUsageError as exc:  # no room next to the other keys
                if not refused:
                    refused = True
                    log.warning("measured links not published: %s", exc)

    async def _publish_progress(self) -> None:
        while True:
            await self._progress_due.wait()
            self.flush_progress()
            await trio.sleep(self.config.progress_interval)

    def flush_progress(self) -> None:
        """Publish the latest reported progress now, if it is not published yet."""
        if self._progress_due.is_set():
            try:
                self._update_meta({})
            except LocalUsageError as exc:  # over the metadata size limit with the other keys
                self.progress_refused += 1
                if self.progress_refused == 1:  # (then counted, not logged every second)
                    log.warning("progress not published: %s", exc)

    def _update_meta(self, changes: dict[str, Any]) -> None:
        """Publish our metadata with ``changes``, and the pending progress report if there is
        one (one metadata change, one incarnation, for both)."""
        me = self.node.me()
        meta = {**me.meta, **changes}
        if self._progress_due.is_set() and self._progress is not None:
            self._progress_due = trio.Event()
            meta[PROGRESS_KEY] = self._progress.encode()
        if meta != me.meta:
            self.node.update_meta(meta)
            if meta.get(PROGRESS_KEY) != me.meta.get(PROGRESS_KEY):
                self.progress_published += 1

    async def wait_quiet(
        self,
        settle: float,
        timeout: float = 60.0,
        until: Callable[[list[MemberSnapshot]], bool] | None = None,
    ) -> None:
        """Wait until membership has had no event for ``settle`` seconds (at most
        ``timeout``): discovery and gossip have settled. ``until``: also return as soon as
        it holds for the members (looked at first and after every membership event)."""
        with trio.move_on_after(timeout):
            while until is None or not until(self.node.members()):
                with trio.move_on_after(settle) as quiet:
                    await self.view_changed()
                if quiet.cancelled_caught:
                    return

    async def view_changed(self) -> None:
        """Return after the next membership event (the view may or may not have changed)."""
        await self._view_changed.wait()

    # -- the async face of the collectives (the blocking one is ``ViewSession``) -------------------
    async def run(
        self, op: CollectiveOp, x: T, *, view: RingView | None = None
    ) -> CollectiveResult[T]:
        """Run collective ``op`` on ``x`` (``DataPlane.plan`` says what each kind does).

        ``view=None``: on the current view, retried on a view its neighbours do not share yet
        until ``agree_timeout`` (gossip converging). A ``view``: on exactly that view, never
        retried -- for protocols that must know which view a round ran on. A lost peer is
        reported to membership (the fast path to its suspicion) before the error is raised."""
        deadline = trio.current_time() + self.config.agree_timeout
        while True:
            on = view if view is not None else self.view()
            if on is None or self.node_id not in on:
                raise ConfigError(f"{self.node_id} is not a training member of the mesh")
            self._in_use(on)
            try:
                return await self.data_plane.run(on, op, x)
            except ViewMismatchError:
                if view is not None or trio.current_time() >= deadline:
                    raise
            except RingPeerLostError as exc:
                self.node.report_unreachable(exc.peer)
                raise

    async def allreduce(
        self, x: T, op: str = "sum", compression: Any = None
    ) -> CollectiveResult[T]:
        """Reduce ``x`` in place over the view; ``avg`` divides by the members that ran.
        ``compression``: ``"int8"`` or an ``Int8Compression`` (see ``DataPlane.plan``)."""
        return await self.run(CollectiveOp.allreduce(op, compression), x)

    async def reduce_scatter(self, x: T, op: str = "sum") -> CollectiveResult[T]:
        return await self.run(CollectiveOp(kind=Kind.REDUCE_SCATTER, op=op), x)

    async def allgather(self, x: T) -> CollectiveResult[T]:
        return await self.run(CollectiveOp(kind=Kind.ALLGATHER), x)

    async def broadcast(self, x: T, root: str) -> CollectiveResult[T]:
        return await self.run(CollectiveOp(kind=Kind.BROADCAST, root=root), x)

    async def barrier(self) -> CollectiveResult[None]:
        return await self.run(CollectiveOp(kind=Kind.BARRIER), None)

    async def open_ring(self, view: RingView) -> Ring:
        """Open ``view``'s ring for a ``ViewSession`` (``ring_in_use`` finds it from then on):
        remembered as in use, so a loss from it or our moving on aborts its collectives."""
        self._in_use(view)
        return await self.data_plane.open_ring(view)

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
        if (view.parent or view.epoch) not in self._views:  # (a sub-view: its view's)
            return None
        return self.data_plane.whole_ring(view.epoch)

    async def serve_state(self, source: Lookup) -> tuple[str, int]:
        """Serve ``source(step, digest)`` (the snapshot asked for, or None) to members that
        fetch state (``fetch_state``), for as long as the mesh is open, and publish the
        server's address (the advertised host, the bound port) in our metadata; it is
        returned. One server per member; a second call replaces it."""
        if self._state_server is not None:
            self._state_server.close()
        nc = self.config.node
        server: StateServer = await self._nursery.start(
            functools.partial(
                serve_state,
                source,
                auth=nc.auth,
                mesh=nc.mesh,
                host=nc.bind,
                port=self.config.state_port,
                config=self.config.transfer,
            )
        )
        self._state_server = server
        host, port = nc.advertised_host, server.port
        self._update_meta({STATE_KEY: f"{host}:{port}"})
        return host, port

    def advertise_state(self, nbytes: int) -> None:
        """Publish the size of the state we would serve (``advertised_state_bytes``)."""
        if self.node.me().meta.get(STATE_BYTES_KEY) != nbytes:
            self._update_meta({STATE_BYTES_KEY: nbytes})

    def advertised_state_bytes(self) -> int:
        """The committed-state size the training members agree on, 0 if none: see
        ``ftmesh.state.transfer.bounded_state_hint`` (the median of what the holders of the
        newest step advertise, bounded by ``TransferConfig.max_state_bytes`` and half the
        available memory; the joiner also bounds it by its own state's size, see
        ``own_size_limit``). A hint from the network, used to prepare a receive buffer: too
        small only costs an allocation."""
        out = self.exclusions()
        holders = [
            (0 if m.progress is None else m.progress.step, n)
            for m in self.usable_members()
            if m.node != self.node_id
            and m.node not in out
            and m.state == MemberState.ALIVE
            and m.role == "train"
            and (n := m.state_bytes)
        ]
        cap = min(self.config.transfer.max_state_bytes, _free_memory() // 2)
        return bounded_state_hint(holders, cap=cap)

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
        by_id = {m.node: m for m in self.usable_members()}
        peers = [a for node in holders if node in by_id and (a := by_id[node].state_addr)]
        node_at = {
            f"{a[0]}:{a[1]}": n for n in holders if n in by_id and (a := by_id[n].state_addr)
        }
        if not peers:
            raise StateTransferError(f"none of {len(holders)} holders serves its state", {})
        nc = self.config.node
        stats = stats if stats is not None else TransferStats()
        try:
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
        finally:
            # A holder whose chunks or manifest failed their hash lied or is broken: counted
            # towards leaving it out (``reach``), whether or not others made up for it.
            for key, why in stats.failures.items():
                if why in BAD_STATE_REASONS and key in node_at:
                    self.reach.bad_state(node_at[key], f"state {digest[:12]} of step {step}: {why}")

    def _in_use(self, view: RingView) -> None:
        """Remember ``view`` as one collectives run on, so a member lost from it, or our moving
        on to a newer view, aborts them. A view that is the current one again (a suspect
        refuted) loses any earlier abort; one that is not current fails at once. A sub-view
        (a phase of a hierarchical allreduce) needs its view in use already, and clears no
        abort: the view's abort is its sub-views' (``DataPlane``)."""
        if view.parent:
            current = self.view()
            if view.parent not in self._views or current is None or current.epoch != view.parent:
                raise ViewSupersededError(
                    f"{self.node_id}: view {view.parent} is no longer current", epoch=view.parent
                )
            return
        current = self.view()
        if current is None or current.epoch != view.epoch:
            raise ViewSupersededError(
                f"{self.node_id}: view {view.epoch} is no longer current", epoch=view.epoch
            )
        self.data_plane.clear_abort(view.epoch)
        self._views[view.epoch] = view
        while len(self._views) > MAX_VIEWS_WATCHED:
            del self._views[next(iter(self._views))]

    def _closed_reporter(self) -> Callable[[str, bool], None]:
        """``DataPlane.on_closed`` for this mesh (call in its trio thread): hands each report
        to membership in this thread, from whichever thread saw the connection close."""
        token = trio.lowlevel.current_trio_token()

        def closed(peer: str, refused: bool) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._connection_closed, peer, refused)

        return closed

    def _connection_closed(self, peer: str, refused: bool) -> None:
        log.debug("data plane: %s %s a connection", peer, "refused" if refused else "closed")
        try:
            self.node.connection_closed(peer)
        except Exception:  # (a callback of trio's: an exception would end the run)
            log.exception("membership could not take %s's closed connection", peer)

    def busy_between_steps(self, node_id: str) -> str | None:
        """If ``node_id`` declares itself busy between steps (its progress, as gossiped), how
        to name it in a log line (its name and id), else None: the data plane then waits for
        its next collective up to ``start_wait``. Any thread.

        A member whose pause ended less than ``io_timeout`` ago counts as busy too: it
        publishes the end as its next step begins, and that news may overtake its first
        frame; a neighbour that has waited ``io_timeout`` since before the pause ended must
        give it ``io_timeout`` from there, not fail it as silent."""
        named = self._between.get(node_id)
        if named is not None:
            return named
        resumed = self._resumed.get(node_id)
        if resumed is None:
            return None
        if time.monotonic() - resumed[1] < self.config.collective.io_timeout:
            return resumed[0]
        return None

    def _note_between(self, m: MemberSnapshot) -> None:
        parts = str(m.meta.get(PROGRESS_KEY, "")).split("|", 6)  # (Progress.encode)
        busy = (
            m.state == MemberState.ALIVE and len(parts) == 7 and parts[6].startswith(BETWEEN_STEPS)
        )
        if busy != (m.node in self._between):
            named = f"{m.name} ({m.node})"
            rest = {n: v for n, v in self._between.items() if n != m.node}
            self._between = {**rest, m.node: named} if busy else rest
            resumed = {n: v for n, v in self._resumed.items() if n != m.node}
            ended = not busy and m.state == MemberState.ALIVE  # (not a death)
            self._resumed = {**resumed, m.node: (named, time.monotonic())} if ended else resumed
        elif m.state != MemberState.ALIVE and m.node in self._resumed:
            self._resumed = {n: v for n, v in self._resumed.items() if n != m.node}

    async def _watch(self) -> None:
        async for ev in self.node.events():
            self._note_between(ev.member)
            if ev.kind in ("suspect", "dead"):
                # Membership no longer counts on this member: collectives waiting for it (a
                # frozen process sends nothing and closes nothing) fail now, not at io_timeout.
                # Not for a graceful leave: the leaver superseded its views as it left and
                # closes its sockets, so a collective it finished completes here and one it
                # never ran fails (``open_mesh``); aborting would fail the first kind too.
                for epoch, view in self._views.items():
                    if ev.member.node in view and ev.member.node != self.node_id:
                        self.data_plane.abort_view(
                            epoch, ev.member.node, f"membership: {ev.member.name} is {ev.kind}"
                        )
            if not self._material(ev):
                continue  # only a member's published progress changed
            self._supersede_old_views(f"{ev.member.name} is {ev.kind}")
            event, self._view_changed = self._view_changed, trio.Event()
            event.set()

    def _material(self, ev: MemberEvent) -> bool:
        """Whether ``ev`` changes anything but the member's published progress (which changes
        about once a second on every training member: it must not keep ``wait_quiet`` and
        the view's waiters awake) or its measured links (which change the view only when
        they change the ring plan: then it is material)."""
        m = ev.member
        skip = (PROGRESS_KEY, LINKS_KEY)
        seen = (ev.kind, m.state, {k: v for k, v in m.meta.items() if k not in skip})
        before = self._seen.get(m.node)
        self._seen[m.node] = seen
        if seen != before:
            return True
        links = m.meta.get(LINKS_KEY)
        if self._links_seen.get(m.node) == links:
            return False
        self._links_seen[m.node] = links
        now, then = self.view(), self._latest_view
        return (now and now.epoch) != (then and then.epoch)

    def _supersede_old_views(self, why: str) -> None:
        """We moved off every watched view but the current one: we will not run collectives on
        them, so the members still running or opening one must not wait ``io_timeout`` for us
        (a joiner's arrival would otherwise stall the ring that far)."""
        before, current = self._latest_view, self.view()
        self._latest_view = current
        plans = [v.plan.hash if v and v.plan and not v.plan.flat else "" for v in (before, current)]
        if before is not None and current is not None and plans[0] != plans[1]:
            # Sites appear or go away with measured links or labels: say so, a view change
            # (and a retried step) that no member's arrival or death explains otherwise.
            plan = current.plan
            log.info("ring plan now %s (%s)", plan.describe() if plan else "one site", why)
        self._supersede([e for e in self._views if current is None or e != current.epoch], why)

    def _supersede(self, epochs: list[str], why: str) -> None:
        for epoch in epochs:
            del self._views[epoch]
            self.data_plane.supersede_view(epoch, why)


@asynccontextmanager
async def open_mesh(config: MeshConfig | None = None) -> AsyncIterator[Mesh]:
    """Join (or start) a training mesh for the duration of the block; leave on exit."""
    config = config or MeshConfig()
    node_id = os.urandom(16).hex()
    nc = config.node
    advertised = nc.advertised_host  # (a ConfigError before anything binds)
    events = new_queue()
    async with open_data_plane(
        node_id,
        host=nc.bind,
        port=config.data_port,
        auth=nc.auth,
        mesh=nc.mesh,
        config=config.collective,
        observe=events.append,
    ) as dp:
        data = f"{advertised}:{dp.address[1]}"
        meta: dict[str, Any] = {
            **nc.meta,
            DATA_KEY: data,
            ROLE_KEY: config.role,
            RELEASE_KEY: RELEASE,
            **({SITE_KEY: config.site} if config.site else {}),
        }
        async with (
            open_node(replace(nc, meta=meta), node_id=node_id) as node,
            trio.open_nursery() as nursery,
        ):
            mesh = Mesh(config, node, dp, nursery, events)
            dp.busy = mesh.busy_between_steps
            dp.on_closed = mesh._closed_reporter()
            node.statistics_sources["collectives"] = dp.statistics
            nursery.start_soon(mesh._watch)
            nursery.start_soon(mesh.reach.run, nursery)
            nursery.start_soon(mesh._publish_progress)
            if config.links_interval > 0:
                nursery.start_soon(mesh._publish_links)
            try:
                yield mesh
            finally:
                mesh._supersede(list(mesh._views), "it left the mesh")  # before the leave
                mesh.flush_progress()  # the last step, reported while throttled
                if mesh._progress is not None:
                    _closed_progress[:] = [mesh._progress]
                nursery.cancel_scope.cancel()


_closed_progress: list[Progress] = []


def last_progress() -> Progress | None:
    """The progress the last mesh closed in this process published last (``ftmesh worker``
    hands it to ``ftmesh launch`` as it exits), or None."""
    return _closed_progress[-1] if _closed_progress else None


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
