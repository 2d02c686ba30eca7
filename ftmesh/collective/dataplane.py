"""The async data-plane API: ring collectives on a ``RingView``, inside trio.

Theory of operation: ``open_data_plane`` binds the data-plane listener and serves inbound ring
connections in a nursery. Each collective (1) stages the input as a flat host array (``ops``),
(2) gets the ring for the view, connecting and agreeing on the epoch with both neighbours the
first time a view is used (``transport``), (3) builds this member's schedule (``schedule``) and
(4) drives it over the two sockets (``engine``). Collectives on one data plane run one at a
time, in call order; every member must call the same collectives in the same order on a view.

A view whose ring plan is hierarchical (``topology``: at least two sites, one of at least two
members) runs an allreduce in three phases on sub-views (``RingView.groups``; an int8-compressed
one compresses only the cross-site phase: ``hierarchical_int8``): the
reduce-scatter half of the ring inside the member's site, an allreduce of the member's block
across the sites among the members at the same place in every site (``avg`` divides there, by
the whole view's size), and the allgather half inside the site. The buffer is cut into ``K``
blocks, ``K`` the smallest site's size (``RingPlan.blocks``); in a site of ``k > K`` members the
ring's segments ``K..k-1`` are empty, so the members at those places hold no block, sit out the
cross-site phase and receive the result in the allgather; a site of one member has no site
phase. They are the steps of the flat ring's schedule, split over three rings, on the same
buffer in place; each sub-view has its own ring (and epoch, derived from the parent's). Every
member ends with the same bits (each block is finalised by one cross-site ring, and copied
from there); the summation order differs from the flat ring's (site partial sums, then across
sites), so the result may differ from a flat ring's in the last bits. Between two sites the
``K`` blocks cross once each (``S / K`` of an ``S``-byte buffer, so ``S`` per direction per site
pair), where the flat ring's edge between the sites carries ``2 (N-1)/N * S``. A
failure in any phase (or of a sub-ring to open) fails the whole collective with the phase's
typed error, and this member kills every ring it has of the view, the sub-rings and the
view's own (``_fail_phases``: their neighbours get the abort as a notice, and every member's
next attempt opens them all afresh); an abort of the view (``abort_view``,
``supersede_view``) reaches its sub-rings.
"""

from __future__ import annotations

import logging
import socket as _stdsocket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import numpy as np
import trio

from ..compression import Int8Compression
from ..errors import LocalUsageError
from ..net.ports import bind_error
from ..security import MeshAuth
from ..stats import CollectiveStatistics, LinkStatistics
from . import compressed, schedule, shared_scale
from .aborts import Abort, AbortKind, error_for
from .config import CollectiveConfig
from .engine import Buffers, Pipeline
from .errors import RingPeerLostError
from .hierarchical_int8 import HierarchicalInt8
from .links import read_tcp_info, updated
from .ops import (
    REDUCE_OPS,
    CollectiveOp,
    Kind,
    Staged,
    empty_like_input,
    reducer,
    scaler,
    stage,
)
from .reach import RingFailed, RingWorked
from .statistics import CollectiveRecorder
from .transport import Observer, Ring, Transport, tune_socket
from .view import Peer, RingView

T = TypeVar("T")

MAX_LINKS_KEPT = 64
"""Neighbours whose ``LinkStatistics`` a data plane keeps (the most recently sent to): a long
run's churn must not grow them without bound."""
log = logging.getLogger(__name__)

MAX_ABORTED_VIEWS = 64
"""Aborted epochs remembered (so later collectives on them fail at once); oldest forgotten."""


@dataclass(frozen=True)
class CollectiveResult(Generic[T]):
    """What a collective returns: the view epoch it ran on, the members that contributed (in
    ring order) and the output (the input object itself for in-place collectives)."""

    epoch: str
    members: tuple[str, ...]
    output: T


class DataPlane:
    """One member's data plane. Create with ``open_data_plane``; see the module doc."""

    def __init__(self, transport: Transport, config: CollectiveConfig) -> None:
        self._transport = transport
        self.config = config
        self.node_id = transport.node_id
        self._lock = trio.Lock()
        self._engine_lock = threading.Lock()
        """Held while a collective drives the ring's sockets, from whichever thread."""
        host, port = transport.listener.getsockname()[:2]
        self.address: tuple[str, int] = (str(host), int(port))
        self._aborted: OrderedDict[str, Abort] = OrderedDict()
        self._opening: dict[str, set[trio.CancelScope]] = {}
        self._recorder = CollectiveRecorder()
        self._warned_sizes: set[int] = set()  # views too big for the compressed allreduce
        self._parents: OrderedDict[str, str] = OrderedDict()
        """Sub-view epoch -> its view's epoch (hierarchical allreduce): an abort of the view
        is one of its sub-views (``_check_aborted``, ``_abort``)."""
        self._links: dict[str, LinkStatistics] = {}  # (replaced whole: read from any thread)

    @property
    def busy(self) -> Callable[[str], str | None] | None:
        """Whether a member declares itself busy between steps (set by the mesh, which reads
        membership; called from engine threads and the trio thread): a neighbour that has not
        started a collective, or not yet opened its half of a view's ring, is then waited for
        up to ``config.start_wait`` (``engine``, ``Transport``)."""
        return self._transport.busy

    @busy.setter
    def busy(self, fn: Callable[[str], str | None] | None) -> None:
        self._transport.busy = fn

    @property
    def on_closed(self) -> Callable[[str, bool], None] | None:
        """Told ``(peer, refused)`` when a ring neighbour closed or reset a connection with
        nothing left unsaid (during a collective, before any abort reason was known, or
        between collectives: ``transport.HangupWatch``), or refused to connect (``True``):
        the mesh hands these to membership (``Swim.connection_closed``). Called from engine
        threads and the trio thread; must not block."""
        return self._transport.on_closed

    @on_closed.setter
    def on_closed(self, fn: Callable[[str, bool], None] | None) -> None:
        self._transport.on_closed = fn

    def sent_bytes(self) -> dict[str, int]:
        """Payload bytes this member sent to each peer (node id) in collectives that
        completed, over every ring and sub-ring (frame heads and control messages not
        counted; the ``MAX_LINKS_KEPT`` peers sent to last); safe from any thread. What a
        hierarchical plan moves between sites is the sum over the members of one site of
        what they sent to the other's."""
        return {peer: r.sent_bytes for peer, r in self._links.items()}

    def links(self) -> dict[str, LinkStatistics]:
        """What this member knows of its connection to each peer it sent collectives to: the
        bytes and the kernel's newest reading (``ftmesh.collective.links``); any thread."""
        return self._links

    def statistics(self) -> CollectiveStatistics:
        """Completed collectives (seconds, bytes) per ``(op, backend)`` and aborts per kind;
        safe from any thread."""
        return replace(self._recorder.snapshot(), links=self._links)

    def abort_view(self, epoch: str, peer: str, reason: str) -> None:
        """Declare that ``peer`` is dead for view ``epoch``: every collective on that epoch on
        this member, running (in the engine threads, or waiting in trio to connect) or future,
        fails promptly with ``RingPeerLostError(peer=peer, epoch=epoch)``, and the abort is sent
        both ways round the ring so the other members' rounds on it fail promptly too rather
        than after ``io_timeout``. The ring's connections are dropped. Sync and non-blocking;
        call it from the trio thread (``SyncDataPlane.abort_view`` from any other thread). Meant
        for the membership layer, when it declares a member of a running view dead (a crash is
        noticed by the sockets already; a stalled peer, e.g. SIGSTOPped, is not)."""
        msg = f"{peer} was declared dead: {reason}"
        self._abort(epoch, Abort(AbortKind.PEER_LOST, peer, self.node_id, msg))

    def supersede_view(self, epoch: str, reason: str) -> None:
        """This member moved on from view ``epoch`` (a member joined or came back): like
        ``abort_view``, but collectives on it fail with ``ViewSupersededError``, which names no
        lost member. The members still on ``epoch`` would otherwise wait ``io_timeout`` for
        this one. A collective running here on ``epoch`` is not aborted but ends on its own
        (its neighbours may have sent all it needs; those that will not run it send notices),
        then the ring is killed. Does nothing to an epoch already aborted (a loss says more)."""
        if epoch not in self._aborted:
            msg = f"{self.node_id} moved on from view {epoch}: {reason}"
            self._abort(epoch, Abort(AbortKind.SUPERSEDED, "", self.node_id, msg), let_finish=True)

    def _abort(self, epoch: str, reason: Abort, *, let_finish: bool = False) -> None:
        self._aborted[epoch] = reason
        self._aborted.move_to_end(epoch)
        while len(self._aborted) > MAX_ABORTED_VIEWS:
            self._aborted.popitem(last=False)
        subs = [sub for sub, parent in self._parents.items() if parent == epoch]
        for e in (epoch, *subs):
            for scope in self._opening.get(e, ()):
                scope.cancel()
            self._transport.kill_ring(e, reason, let_finish=let_finish)

    def clear_abort(self, epoch: str) -> None:
        """Forget an abort of ``epoch``: the same set of members is a live view again (a
        suspected member refuted the suspicion), so collectives on it may run again."""
        self._aborted.pop(epoch, None)

    def drop_view(self, epoch: str) -> None:
        """Close this member's connections of view ``epoch`` (if no collective runs on them):
        the next collective on it connects and agrees afresh, and the neighbours' next one on
        the old connections fails. For callers that find a round's data inconsistent."""
        ring = self._transport.cached_ring_of(epoch)
        if ring is not None and ring.active is None:
            self._transport.drop_ring(ring)

    def _check_aborted(self, epoch: str) -> None:
        reason = self._aborted.get(epoch)
        if reason is None and epoch in self._parents:  # a sub-view: its view's abort
            reason = self._aborted.get(self._parents[epoch])
        if reason is not None:
            raise error_for(reason, epoch, self.node_id)

    async def _open_ring(self, view: RingView) -> Ring:
        """``transport.open_ring``, cancelled by ``abort_view`` of the view's epoch."""
        epoch = view.epoch
        self._check_aborted(epoch)
        scope = trio.CancelScope()
        scopes = self._opening.setdefault(epoch, set())
        scopes.add(scope)
        try:
            with scope:
                return await self._transport.open_ring(view)
        finally:
            scopes.discard(scope)
            if not scopes:
                self._opening.pop(epoch, None)
        self._check_aborted(epoch)
        # The abort was cleared again before we woke up (the view came back): still a loss.
        raise RingPeerLostError(f"opening view {epoch} was aborted", peer="", epoch=epoch)

    @property
    def dropped(self) -> dict[str, int]:
        """Inbound connections refused, by reason (``bad_mac``, ``wrong_mesh``...)."""
        return dict(self._transport.dropped)

    # -- async collectives (inside trio) -------------------------------------------------------
    async def run(self, view: RingView, op: CollectiveOp, x: T) -> CollectiveResult[T]:
        """Run collective ``op`` on ``x`` over ``view`` (see ``plan`` for what each kind does),
        opening the view's ring first if needed; the engine runs in a worker thread. An
        allreduce on a hierarchical view runs its phases (``hierarchical``, module doc)."""
        if self.hierarchical(view, op):
            return await self.run_phases(self.plan_phases(view, op, x))
        return await self.run_plan(self.plan(view, op, x))

    async def allreduce(
        self, view: RingView, x: T, op: str = "sum", compression: Any = None
    ) -> CollectiveResult[T]:
        """``run`` of an allreduce; ``compression``: None, ``"int8"`` or an
        ``Int8Compression`` (see ``plan``)."""
        return await self.run(view, CollectiveOp.allreduce(op, compression), x)

    async def reduce_scatter(self, view: RingView, x: T, op: str = "sum") -> CollectiveResult[T]:
        return await self.run(view, CollectiveOp(kind=Kind.REDUCE_SCATTER, op=op), x)

    async def allgather(self, view: RingView, x: T) -> CollectiveResult[T]:
        return await self.run(view, CollectiveOp(kind=Kind.ALLGATHER), x)

    async def broadcast(self, view: RingView, x: T, root: str) -> CollectiveResult[T]:
        return await self.run(view, CollectiveOp(kind=Kind.BROADCAST, root=root), x)

    async def barrier(
        self, view: RingView, io_timeout: float | None = None
    ) -> CollectiveResult[None]:
        return await self.run(view, CollectiveOp(kind=Kind.BARRIER, io_timeout=io_timeout), None)

    # -- the planner: everything but the I/O (shared by the async and the blocking paths) -------
    def plan(self, view: RingView, op: CollectiveOp, x: Any) -> Plan[Any]:
        """The plan of collective ``op`` on this member's ``x``:

        - ``ALLREDUCE``: reduce ``x`` elementwise over all members, in place (``avg`` divides
          by the view's size). With ``op.compression`` (float16, bfloat16 and float32, ``sum``
          or ``avg``) ``x`` travels as blockwise int8 (``compressed``, ``shared_scale``); every
          member must pass the same setting.
        - ``REDUCE_SCATTER``: this member's block of the reduced, flattened ``x`` (blocks are
          ``np.array_split(x.ravel(), N)`` in ring order); ``x`` is untouched.
        - ``ALLGATHER``: every member's ``x`` (same dtype and shape everywhere) in a new array
          of shape ``(N, *x.shape)``, in ring (sorted node id) order.
        - ``BROADCAST``: overwrite ``x`` with the root member's ``x``, in place.
        - ``BARRIER``: ``x`` unused; done once every member entered it. ``op.io_timeout``
          (never below the config's) bounds the wait for a neighbour to enter; a member that
          dies meanwhile is still noticed at once (closed sockets, or ``abort_view``).
        """
        if op.kind is Kind.ALLREDUCE:
            plan = self._plan_allreduce(view, x, op.op, op.compression)
        elif op.kind is Kind.REDUCE_SCATTER:
            plan = self._plan_reduce_scatter(view, x, op.op)
        elif op.kind is Kind.ALLGATHER:
            plan = self._plan_allgather(view, x)
        elif op.kind is Kind.BROADCAST:
            plan = self._plan_broadcast(view, x, op.root)
        else:
            plan = self._plan_barrier(view)
        plan.io_timeout = op.io_timeout
        return plan

    def _plan_allreduce(
        self, view: RingView, x: T, op: str, comp: Int8Compression | None
    ) -> Plan[T]:
        st = stage(x, writable=True)
        if comp is not None:
            return self._plan_compressed(view, x, op, st, comp)
        red, scale = self._reducers(op, st.dtype, view.size)
        sched = self._ring_schedule(view, st.flat.size, st.flat.itemsize)

        def finish() -> T:
            if view.size == 1 and scale is not None:
                scale(st.flat)
            if st.commit is not None:
                st.commit()
            return x

        return Plan(
            view=view, kind="allreduce", op=op, dtype=st.dtype, shape=st.shape, sched=sched,
            bufs=Buffers(st.flat, st.flat, red, scale), finish=finish,
        )  # fmt: skip

    def _plan_compressed(
        self, view: RingView, x: T, op: str, st: Staged, comp: Int8Compression
    ) -> Plan[T]:
        quantized = int(st.flat.size) - comp.exact_tail
        if shared_scale.use_shared_scale(comp, quantized, view.size):
            return self._plan_shared_scale(view, x, op, st, comp)
        rank = view.rank_of(self.node_id)
        ratio = compressed.wire_ratio(view.size, comp.codec.block_size)
        if ratio < 1 and view.size not in self._warned_sizes:
            self._warned_sizes.add(view.size)
            log.warning(
                "int8 compression on a view of %d members moves %.2fx the bytes of an "
                "uncompressed allreduce (its ring carries every encoded shard hop by hop, "
                "which pays off below 14 members): turn compression off for a mesh this big, "
                "or lower Int8Compression.shared_scale_from",
                view.size,
                1 / ratio,
            )
        sched, bufs, done = compressed.prepare(comp, st, op, view.size, rank)

        def finish() -> T:
            done()
            return x

        return Plan(
            view=view, kind="allreduce", op=op, dtype=st.dtype, shape=st.shape, sched=sched,
            bufs=bufs, finish=finish, codec=compressed.codec_header(comp),
        )  # fmt: skip

    def _plan_shared_scale(
        self, view: RingView, x: T, op: str, st: Staged, comp: Int8Compression
    ) -> Plan[T]:
        """Two rounds (``shared_scale``): the scales (and exact tail), then the integers."""
        compressed.check_compressible(op, st.dtype)
        run = shared_scale.SharedScaleRun(comp, st, op, view.size)

        def ring_plan(wire: Any, phase: str, red: Any, finish: Callable[[], Any]) -> Plan[Any]:
            sched = self._ring_schedule(view, wire.size, wire.itemsize)
            return Plan(
                view=view, kind="allreduce", op=op, dtype=st.dtype, shape=st.shape, sched=sched,
                bufs=Buffers(wire, wire, red), finish=finish,
                codec=shared_scale.codec_header(comp, view.size, phase),
            )  # fmt: skip

        def finish() -> T:
            run.finish()
            return x

        def integers() -> Plan[T]:
            run.quantize()
            return ring_plan(run.ints, "ints", reducer("sum", run.lane.name), finish)

        scales = ring_plan(run.scales_wire, "scales", run.reduce_scales, lambda: None)
        scales.then = integers
        return scales

    def _plan_reduce_scatter(self, view: RingView, x: T, op: str) -> Plan[T]:
        st = stage(x, writable=False)
        red, scale = self._reducers(op, st.dtype, view.size)
        bounds = schedule.segment_bounds(st.flat.size, view.size)
        rank = view.rank_of(self.node_id)
        acc = np.empty_like(st.flat) if view.size > 1 else st.flat.copy()
        sched = self._ring_schedule(view, st.flat.size, st.flat.itemsize, last=view.size - 2)

        def finish() -> T:
            if view.size == 1 and scale is not None:
                scale(acc)
            mine = acc[bounds[rank] : bounds[rank + 1]]
            out, out_st = empty_like_input(x, (int(mine.size),))
            out_st.flat[...] = mine
            if out_st.commit is not None:
                out_st.commit()
            return out  # type: ignore[return-value]

        return Plan(
            view=view, kind="reduce_scatter", op=op, dtype=st.dtype, shape=st.shape, sched=sched,
            bufs=Buffers(acc, st.flat, red, scale), finish=finish,
        )  # fmt: skip

    def _plan_allgather(self, view: RingView, x: T) -> Plan[T]:
        st = stage(x, writable=False)
        nm, n = view.size, st.flat.size
        rank = view.rank_of(self.node_id)
        out, out_st = empty_like_input(x, (nm, *st.shape))
        out_st.flat[rank * n : (rank + 1) * n] = st.flat
        sched = schedule.ring(
            [i * n for i in range(nm + 1)],
            rank,
            first_step=nm - 1,
            last_step=2 * nm - 3,
            itemsize=st.flat.itemsize,
            chunk_bytes=self.config.chunk_bytes,
        )

        def finish() -> T:
            if out_st.commit is not None:
                out_st.commit()
            return out  # type: ignore[return-value]

        return Plan(
            view=view, kind="allgather", dtype=st.dtype, shape=st.shape, sched=sched,
            bufs=Buffers(out_st.flat, out_st.flat), finish=finish,
        )  # fmt: skip

    def _plan_broadcast(self, view: RingView, x: T, root: str) -> Plan[T]:
        st = stage(x, writable=True)
        sched = schedule.chain(
            st.flat.size,
            view.rank_of(self.node_id),
            view.rank_of(root),
            view.size,
            itemsize=st.flat.itemsize,
            chunk_bytes=self.config.chunk_bytes,
        )

        def finish() -> T:
            if st.commit is not None:
                st.commit()
            return x

        return Plan(
            view=view, kind="broadcast", dtype=st.dtype, shape=st.shape, root=root, sched=sched,
            bufs=Buffers(st.flat, st.flat), finish=finish,
        )  # fmt: skip

    def _plan_barrier(self, view: RingView) -> Plan[None]:
        empty = np.empty(0, np.uint8)
        sched = schedule.ring(
            [0] * (view.size + 1),
            view.rank_of(self.node_id),
            first_step=0,
            last_step=view.size - 2,
            itemsize=1,
            chunk_bytes=self.config.chunk_bytes,
        )
        return Plan(
            view=view,
            kind="barrier",
            dtype="uint8",
            shape=(0,),
            sched=sched,
            bufs=Buffers(empty, empty),
            finish=lambda: None,
        )

    # -- the hierarchical allreduce (module doc) -------------------------------------------
    @staticmethod
    def hierarchical(view: RingView, op: CollectiveOp) -> bool:
        """Whether ``op`` on ``view`` runs as a hierarchical allreduce: an allreduce on a view
        whose plan says so (an int8-compressed one compresses only across sites:
        ``hierarchical_int8``)."""
        return op.kind is Kind.ALLREDUCE and view.hierarchical

    def plan_phases(self, view: RingView, op: CollectiveOp, x: T) -> Phases[T]:
        """The three phases of ``op`` (an allreduce) on this member's ``x`` over hierarchical
        ``view``: plans on the member's site and cross-site sub-views, in the order they
        run, on ``x``'s staged buffer in place (compressed: on its float32 contribution,
        with the cross-site phase in int8, ``hierarchical_int8``)."""
        site, cross = view.groups(self.node_id)
        for sub in (site, cross):
            if sub is not None:
                self._parents[sub.epoch] = view.epoch
                self._parents.move_to_end(sub.epoch)
        while len(self._parents) > MAX_ABORTED_VIEWS:
            self._parents.popitem(last=False)
        st = stage(x, writable=True)
        hint8 = None
        if op.compression is None:
            red, scale = self._reducers(op.op, st.dtype, view.size)
            flat = st.flat
        else:
            hint8 = HierarchicalInt8(op.compression, st, op.op, view.size)
            red, scale = self._reducers("sum", "float32", view.size)
            flat = hint8.work
        assert view.plan is not None
        k, rs, blocks, n = site.size, site.rank_of(self.node_id), view.plan.blocks, int(flat.size)
        # K blocks, then empty segments for the places a smaller site lacks (module doc)
        bounds = schedule.segment_bounds(n, blocks) + [n] * (k - blocks)
        block = flat[bounds[rs] : bounds[rs + 1]]
        chunk, item = self.config.chunk_bytes, flat.itemsize

        def phase(
            sub: RingView, kind: str, shape: tuple[int, ...], sched: Any, bufs: Buffers
        ) -> Plan[None]:
            return Plan(
                view=sub, kind=kind, op=op.op, dtype=st.dtype, shape=shape, sched=sched,
                bufs=bufs, finish=lambda: None, io_timeout=op.io_timeout,
            )  # fmt: skip

        def steps(b: list[int], rank: int, first: int, last: int) -> schedule.Schedule:
            return schedule.ring(
                b, rank, first_step=first, last_step=last, itemsize=item, chunk_bytes=chunk
            )

        plans: list[Plan[Any]] = []
        if k > 1:
            rs_steps = steps(bounds, rs, 0, k - 2)
            plans.append(
                phase(site, "allreduce/site", st.shape, rs_steps, Buffers(flat, flat, red))
            )
        if cross is not None and hint8 is not None:
            comp = hint8.block_compression(bounds[rs], bounds[rs + 1])
            plans.append(
                self._plan_compressed(cross, block, "sum", stage(block, writable=True), comp)
            )
        elif cross is not None:
            m, rc = cross.size, cross.rank_of(self.node_id)
            ar_steps = steps(schedule.segment_bounds(int(block.size), m), rc, 0, 2 * m - 3)
            bufs = Buffers(block, block, red, scale)
            plans.append(phase(cross, "allreduce/cross", (int(block.size),), ar_steps, bufs))
        if k > 1:
            ag_steps = steps(bounds, rs, k - 1, 2 * k - 3)
            plans.append(phase(site, "allgather/site", st.shape, ag_steps, Buffers(flat, flat)))

        def finish() -> T:
            if hint8 is not None:
                hint8.finish()
            if st.commit is not None:
                st.commit()
            return x

        return Phases(view, plans, finish, int(st.flat.nbytes))

    async def run_phases(self, phases: Phases[T]) -> CollectiveResult[T]:
        """Run a hierarchical allreduce inside trio: each phase's sub-ring opened if needed,
        driven in a worker thread, under the data plane's lock for all three."""
        view = phases.view
        with self._recorder.timed("allreduce", "tcp", phases.nbytes):
            async with self._lock:
                try:
                    for plan in phases.plans:
                        ring = await self._open_ring(plan.view)
                        (await self._drive(ring, plan)).finish()
                except BaseException as exc:
                    self._fail_phases(phases, exc)
                    raise
        return CollectiveResult(view.epoch, view.node_ids, phases.finish())

    def run_phases_blocking(
        self, phases: Phases[T], ring_of: Callable[[RingView], Ring]
    ) -> CollectiveResult[T]:
        """Run a hierarchical allreduce in the calling (non-trio) thread; ``ring_of`` gives
        each sub-view's open ring (the host opens it in its trio thread if need be)."""
        view = phases.view
        with self._recorder.timed("allreduce", "tcp", phases.nbytes):
            try:
                for plan in phases.plans:
                    self._run_pipeline(ring_of(plan.view), plan).finish()
            except BaseException as exc:
                self._fail_phases(phases, exc)
                raise
        return CollectiveResult(view.epoch, view.node_ids, phases.finish())

    def _fail_phases(self, phases: Phases[Any], exc: BaseException) -> None:
        """This member gave up the attempt (a phase failed, a sub-ring did not open, or it
        moved on from the view): kill every ring it has of the view -- each sub-ring and the
        view's own ring -- so that members waiting in (or about to start) any phase hear of it
        from us at once (a notice both ways, ``Ring.kill``) rather than at ``io_timeout``, and
        so that our next attempt opens them all afresh, as a neighbour whose rings were killed
        does. A view's ring kept open here while a neighbour reopens its own would leave us
        opening the first sub-ring while it waits for us on the view's ring: every retry
        would fail after ``view_timeout`` until the view changes (``ViewSession.run_on_ring``
        opens the view's ring before the phases)."""
        reason = getattr(exc, "abort", None)
        if not isinstance(reason, Abort):
            why = f"{self.node_id} failed a hierarchical allreduce: {type(exc).__name__}: {exc}"
            reason = Abort(AbortKind.COMM_FAILED, "", self.node_id, why[:300])
        for epoch in (phases.view.epoch, *{p.view.epoch for p in phases.plans}):
            self._transport.kill_ring(epoch, reason)

    # -- execution ------------------------------------------------------------------------
    def _reducers(self, op: str, dtype: str, size: int) -> tuple[Any, Any]:
        if op not in REDUCE_OPS:
            raise LocalUsageError(f"unknown reduce op {op!r}; use one of {REDUCE_OPS}")
        return reducer(op, dtype), (scaler(dtype, size) if op == "avg" else None)

    def _ring_schedule(
        self, view: RingView, n: int, itemsize: int, *, first: int = 0, last: int | None = None
    ) -> Any:
        """The ring schedule of ``n`` elements (steps ``first..last``; by default the whole
        allreduce: reduce-scatter and allgather)."""
        return schedule.ring(
            schedule.segment_bounds(n, view.size),
            view.rank_of(self.node_id),
            first_step=first,
            last_step=2 * view.size - 3 if last is None else last,
            itemsize=itemsize,
            chunk_bytes=self.config.chunk_bytes,
        )

    async def open_ring(self, view: RingView) -> Ring:
        """Connect to the view's neighbours and agree on its epoch (cached per view)."""
        view.rank_of(self.node_id)  # raises LocalUsageError if we are not a member
        async with self._lock:
            return await self._open_ring(view)

    def cached_ring(self, view: RingView) -> Ring | None:
        return self._transport.cached_ring(view)

    def whole_ring(self, epoch: str) -> Ring | None:
        """The open ring of ``epoch`` if it is neither broken nor killed, else None. Safe from
        any thread (it only reads); the ring may still be killed right after, which the
        collective then raises."""
        ring = self._transport.cached_ring_of(epoch)
        if ring is None or ring.broken or ring.killed is not None:
            return None
        return ring

    async def run_plan(self, plan: Plan[T]) -> CollectiveResult[T]:
        """Run ``plan``: open its view's ring if needed, drive it in a worker thread."""
        with self._recorder.timed(plan.kind, "tcp", plan.nbytes):
            return await self._run_plan(plan)

    async def _run_plan(self, plan: Plan[T]) -> CollectiveResult[T]:
        async with self._lock:
            ring = await self._open_ring(plan.view)
            plan = await self._drive(ring, plan)
        return CollectiveResult(plan.view.epoch, plan.view.node_ids, plan.finish())

    async def _drive(self, ring: Ring, plan: Plan[T]) -> Plan[T]:
        """Run ``plan`` on ``ring`` in a worker thread (the caller holds the lock)."""
        if plan.view.size <= 1:
            await trio.lowlevel.checkpoint()
            return _last_round(plan)
        try:
            return await trio.to_thread.run_sync(
                self._run_pipeline, ring, plan, abandon_on_cancel=True
            )
        except trio.Cancelled:
            # The engine threads may still run: fail their sockets so they exit promptly.
            ring.broken = True
            ring.shutdown()
            self._transport.drop_ring(ring)
            raise

    def run_plan_blocking(self, ring: Ring, plan: Plan[T]) -> CollectiveResult[T]:
        """Run ``plan`` on an already open ``ring`` (``whole_ring``) in the calling (non-trio)
        thread: no thread hand-off at all. Collectives from several threads take turns (one
        drives the sockets at a time) but their order is the callers' business."""
        with self._recorder.timed(plan.kind, "tcp", plan.nbytes):
            plan = self._run_pipeline(ring, plan) if plan.view.size > 1 else _last_round(plan)
            return CollectiveResult(plan.view.epoch, plan.view.node_ids, plan.finish())

    def _pipeline(self, ring: Ring, plan: Plan[Any]) -> Pipeline:
        ring.seq += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s #%d %s %s on %s (ring %x)",
                plan.kind,
                ring.seq,
                plan.dtype,
                plan.shape,
                plan.view.epoch,
                id(ring),
            )
        header = {
            "seq": ring.seq,
            "kind": plan.kind,
            "op": plan.op,
            "dtype": plan.dtype,
            "shape": list(plan.shape),
            "root": plan.root,
            "frames": len(plan.sched.sends),
        }
        if plan.codec is not None:
            header["codec"] = plan.codec
        return Pipeline(
            self.node_id,
            ring,
            header,
            plan.sched,
            plan.bufs,
            io_timeout=max(plan.io_timeout or 0.0, self.config.io_timeout),
            chunk_bytes=self.config.chunk_bytes,
            poll_interval=self.config.poll_interval,
            start_wait=self.config.start_wait,
            busy=self.busy,
        )

    def _run_pipeline(self, ring: Ring, plan: Plan[T]) -> Plan[T]:
        """Run ``plan``'s rounds on ``ring``, in one turn of the engine (no other collective
        between them); returns the last round's plan."""
        with self._engine_lock:
            # Aborted views refuse a collective's start; its later rounds run unless the ring
            # itself was killed (a loss), which ``run_blocking`` raises: moving on to a newer
            # view lets a running collective end (``Ring.kill``'s ``let_finish``).
            self._check_aborted(ring.view.epoch)
            ring.begin_collective()
            try:
                for _ in range(MAX_ROUNDS):
                    pipe = self._pipeline(ring, plan)
                    try:
                        pipe.run_blocking()
                    except BaseException:
                        if pipe.hangup is not None:
                            self._transport.report_closed(pipe.hangup)
                        self._observe_failure(ring, pipe.abort)
                        raise
                    self._count_sent(ring, plan)
                    if not ring.worked:
                        ring.worked = True
                        peers = (ring.left.node_id, ring.right.node_id)
                        self._transport.observe(RingWorked(time.monotonic(), peers))
                    if plan.then is None:
                        return plan
                    plan = plan.then()
                raise AssertionError(f"a collective of more than {MAX_ROUNDS} rounds")
            finally:
                if ring.broken:
                    self._transport.drop_ring(ring)
                ring.end_collective()  # (a kill left for now: closed at the next open_ring)

    def _count_sent(self, ring: Ring, plan: Plan[Any]) -> None:
        """Engine thread (one at a time: ``_engine_lock``): the bytes a completed round sent
        to the right, and the kernel's reading of that connection."""
        nbytes = sum(x.stop - x.start for x in plan.sched.sends) * plan.bufs.acc.itemsize
        peer = ring.right.node_id
        tcp = read_tcp_info(ring.send_sock) if ring.send_sock is not None else None
        links = {k: v for k, v in self._links.items() if k != peer}
        links[peer] = updated(self._links.get(peer, LinkStatistics()), nbytes, tcp)
        while len(links) > MAX_LINKS_KEPT:  # the least recently used first (dict order)
            del links[next(iter(links))]
        self._links = links

    def _observe_failure(self, ring: Ring, reason: Abort | None) -> None:
        """Report a round that this member aborted because of one of its neighbours (stalled,
        closed, sent bytes that failed verification) to ``reach``. Aborts that other members
        started, or that name no neighbour, say nothing about our connections."""
        if reason is None or reason.origin != self.node_id:
            return
        peer = reason.peer
        if peer in (ring.left.node_id, ring.right.node_id) and peer != self.node_id:
            ev = RingFailed(
                time.monotonic(), peer, reason.kind.value, ring.worked, reason.detail[:300]
            )
            self._transport.observe(ev)

    async def probe(self, peer: Peer, timeout: float) -> bool:
        """Whether ``peer``'s data address answers (connect and authenticated handshake)
        within ``timeout`` seconds; see ``Transport.probe``."""
        return await self._transport.probe(peer, timeout)


@dataclass(kw_only=True)
class Plan(Generic[T]):
    """A collective ready to run: its schedule, buffers and how to produce the output."""

    view: RingView
    kind: str
    dtype: str
    shape: tuple[int, ...]
    sched: schedule.Schedule
    bufs: Buffers
    finish: Callable[[], T]
    op: str | None = None
    root: str | None = None
    io_timeout: float | None = None
    """Raises the config's ``io_timeout`` for this collective (never lowers it)."""
    codec: str | None = None
    """The compression the data travels in (``int8/256``), compared with the neighbours'."""
    then: Callable[[], Plan[T]] | None = None
    """The collective's next round, if it has two (``shared_scale``): called once this one
    completed, on the same ring and under the same engine turn; the last round's ``finish``
    gives the output (earlier rounds' are not called)."""

    @property
    def nbytes(self) -> int:
        """Size of the collective's input in bytes (0 for a barrier)."""
        if self.kind == "barrier":
            return 0
        itemsize = 2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize


MAX_ROUNDS = 2
"""Rounds of one collective (``Plan.then``): the shared-scale allreduce has two."""


@dataclass
class Phases(Generic[T]):
    """A hierarchical allreduce ready to run (``DataPlane.plan_phases``): its phases' plans,
    each on a sub-view of ``view``, in order, and how to produce the output."""

    view: RingView
    plans: list[Plan[Any]]
    """Each phase's plan; its last round's ``finish`` runs before the next phase starts (the
    compressed cross-site phase decodes its result into the block there)."""
    finish: Callable[[], T]
    nbytes: int
    """Size of the collective's input in bytes."""


def _last_round(plan: Plan[T]) -> Plan[T]:
    """On a view of one member nothing travels: run the rounds' steps in turn."""
    for _ in range(MAX_ROUNDS):
        if plan.then is None:
            return plan
        plan = plan.then()
    raise AssertionError(f"a collective of more than {MAX_ROUNDS} rounds")


@asynccontextmanager
async def open_data_plane(
    node_id: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    auth: MeshAuth | None = None,
    mesh: str = "default",
    config: CollectiveConfig | None = None,
    observe: Observer | None = None,
) -> AsyncIterator[DataPlane]:
    """Bind the data-plane listener on ``host:port`` (0: any free port) and serve it until the
    block exits. ``dp.address`` is the bound address: its port is what to publish in member
    metadata, with the host peers reach us on (``NodeConfig.advertised_host``), which need not
    be ``host``. ``observe`` receives the outcomes of connections and rounds (``reach``
    events), from any thread. A port that cannot be bound (in use, or ``host`` not an address
    of this machine) is a ``ConfigError`` naming ``--data-port``."""
    config = config or CollectiveConfig()
    listener = trio.socket.socket(_stdsocket.AF_INET, _stdsocket.SOCK_STREAM)
    try:
        listener.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_REUSEADDR, 1)
        tune_socket(listener, config)
        try:
            await listener.bind((host, port))
        except OSError as exc:
            raise bind_error(
                "data-plane", host, port, "--data-port ($FTMESH_DATA_PORT)", exc
            ) from None
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    transport = Transport(
        node_id, listener, auth=auth or MeshAuth.none(), mesh=mesh, config=config, observe=observe
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(transport.serve)
            dp = DataPlane(transport, config)
            try:
                yield dp
            finally:
                nursery.cancel_scope.cancel()
    finally:
        transport.close()
