"""Elastic, fault-tolerant data-parallel training of a PyTorch model on the mesh.

``ElasticTrainer.step(loss_fn)`` runs one committed training step following
``ftmesh.training.protocol``: it picks the current view, syncs state when the view changed
(joiners and members left behind fetch the newest committed state from the members that hold
it, striped over all of them and hash-verified), computes
this member's share of the step's global batch, adds all members' gradients with one
allreduce and applies the optimizer. A failure during the step (a peer died or stalled, the
ring disagreed about the view or the inputs) retries the step on the next view, with the
step's batch re-split among the survivors, so the step's samples are all trained exactly once.

Starting together (``ftmesh.training.start``, driven by ``ftmesh.starting``): before it
enters the ring, a member of a mesh that has not started waits until ``start_peers`` members
are ready, at most ``start_timeout``; then more than half of them go ahead and fewer give up
with ``MeshNotFormedError`` (no silent split into separate meshes). Without it, the member
that starts first (workers importing torch on a busy host are seconds apart) would train
alone until the others catch up. Not given, ``start_peers`` and ``start_timeout`` come from
the mesh (``ftmesh.connect(start_peers=...)``, ``ftmesh worker --start-peers``, ``ftmesh
launch -n N`` for its first N workers); members that join a mesh that has started never wait.

Spares (``max_peers=N``): with ``spares="hot"`` (default) every member is in the ring, but
only the first ``N`` of the view (node-id order) compute gradients; the others contribute
nothing, receive the reduced gradients and apply them like everyone, so their state stays
bitwise up to date and a death promotes one at the very next step with nothing to fetch (at
the cost of ring traffic for the spares). With ``spares="cold"`` members beyond ``N`` wait
outside the ring and fetch the state when they step in.

Planned departures (``ftmesh.training.protocol``, 4): once ``mesh.leave_requested()`` (SIGTERM
or SIGINT to a worker started with ``ftmesh.connect``), the member announces in the gradient
allreduce of the step it is computing that it leaves after it, everyone passes one barrier,
it leaves the mesh, and ``step`` raises ``ftmesh.Departed`` (a ``SystemExit`` with code 0);
the others go on with the next step on the view without it, no sync, no retry. A member
that is outside the ring, waiting, or whose announcing step failed leaves at once. A hot
spare computes the leaver's share from the next step; a cold spare takes its slot.

With ``compression="int8"`` the gradient buckets travel as blockwise int8 with error
feedback (``ftmesh.collective.compressed``; one residual per bucket, kept across steps); the
header slots of the last bucket (counters, leave bits) are its exact tail (added in float32,
unquantized). Every member must use the same setting (another one fails the step's allreduce with
``InputMismatchError``).

Gradients are averaged over samples, not members: each member contributes
``sum over its samples of grad(loss)``, and the sum is divided by the step's global batch size,
which equals single-process training on the whole global batch.

With ``shard_optimizer=True`` the optimizer state is sharded over the ring, ZeRO-1 style, each
shard also held by the next ``replicas - 1`` members (``ftmesh.torch.zero``,
``ftmesh.training.shards``): a step ends with an allgather of the updated parameters, and the
sync re-shards after a view change, fetching the shards it lacks from members that hold them.
When more adjacent members died than there are replicas, every survivor reports the loss
(``StateLostError``, logged) and falls back to the newest valid checkpoint in
``checkpoint_dir``, which in this mode holds the whole optimizer state (gathered with the
parameters on checkpoint steps); without one, ``step`` raises the ``StateLostError``.
The optimizer's update must be element-wise (``ftmesh.torch.zero``): others are refused
with ``LocalUsageError`` when the trainer is built. Every member must be started with the
same ``shard_optimizer``, ``replicas`` and (when sharded) ``checkpoint_every``: the sync
compares them, and on a difference ``step`` raises ``ConfigError`` naming the setting and
who has which value: on the members that differ from those holding the mesh's newest state
(the others retry once those have left), or on everyone before anybody trained or when
those members disagree.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from ..collective import InputMismatchError, RingView, ViewMismatchError
from ..compression import per_stream
from ..errors import (
    CollectiveError,
    ConfigError,
    DeadlineExceeded,
    Departed,
    FtmeshError,
    LocalUsageError,
    PeerLostError,
    TrainingFinishedError,
)
from ..membership.messages import MemberState
from ..mesh_meta import role_of
from ..starting import wait_to_start
from ..state import CheckpointWriter, Snapshot, State, StateLostError, latest_valid_checkpoint
from ..state.memory import prepared_zeros
from ..state.sharding import DEFAULT_REPLICAS
from ..sync import SyncMesh
from ..training.protocol import (
    FRESH,
    QUORUM_POLICIES,
    has_quorum,
    leave_slots,
    leavers,
    own_slots_intact,
    plan_sync,
    round_tag,
    sync_vector,
)
from ..training.shards import (
    SETTINGS_SLOTS,
    SettingsMismatchError,
    ShardSettings,
    check_settings,
    read_settings,
    round_id,
    settings_slots,
)
from ..training.start import StartConfig
from .buckets import HEADER_SLOTS, GradBuckets
from .sampler import ElasticSampler
from .zero import ShardedOptimizer

log = logging.getLogger("ftmesh.torch")

REANNOUNCE_EVERY = 20
"""Failed attempts after which a member that never trained re-enters the ring."""
RECEIVE_BUFFER_SLACK = 1 << 20
"""Bytes a joiner's receive buffer has beyond the advertised state size: room for a
snapshot prefix that grew since (the step, a scheduler's state)."""

LEAVE_POLL_S = 1.0
"""Longest a member waits for a view, a quorum or a slot before it looks whether it was asked
to leave."""
DEPARTURE_WAIT_S = 2.0
"""How long the members that stay wait for membership to show the view without the members
that announced their departure (their graceful leave reaches everyone in milliseconds; after
this the next step runs on whatever view there is, with a sync)."""

DEPARTURE_CLOSE_S = 5.0
"""Most seconds a departing member spends leaving the mesh after its last step (its graceful
leave lingers two gossip intervals, at most 1 s, so the news spreads)."""

RECOVERABLE = (PeerLostError, ViewMismatchError, InputMismatchError, CollectiveError)


@dataclass(frozen=True, slots=True)
class StepReport:
    step: int
    """The committed step count after this step (1 after the first step)."""
    loss: float
    """Mean loss over the step's global batch, all members together."""
    samples: int
    members: tuple[str, ...]
    """The members that contributed (ring order)."""
    epoch: str
    """The view epoch the step ran on."""
    attempts: int
    """1 when the step ran without a failure."""
    synced: bool
    """Whether this step began with a state sync (view changed)."""
    sync_bytes: int = 0
    """State bytes this member received in the sync (0: it was not behind)."""
    sync_seconds: float = 0.0
    """Seconds the last sync took (agreement plus state transfer)."""
    share: int = 0
    """Samples this member computed (0: a hot spare, or an adopted step)."""
    adopted: bool = False
    """Others committed this step and we took their state in a sync (a joiner's first step,
    or a step whose end we missed); ``loss`` is then unknown (nan)."""
    leaving: tuple[str, ...] = ()
    """Members that announced in this step that they leave after it (planned departures)."""


class ElasticTrainer:
    """See the module docstring. One per member process; not thread-safe."""

    def __init__(
        self,
        mesh: SyncMesh,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        *,
        min_peers: int = 1,
        max_peers: int = 0,
        spares: str = "hot",
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        step_timeout: float = 300.0,
        join_settle: float = 2.0,
        start_peers: int | None = None,
        start_timeout: float | None = None,
        quorum: str = "majority",
        quorum_grace: float = 5.0,
        bucket_mb: float = 25.0,
        on_world_change: Callable[[int, int], None] | None = None,
        shard_optimizer: bool = False,
        replicas: int = DEFAULT_REPLICAS,
        compression: Any = None,
    ) -> None:
        self.mesh = mesh
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.min_peers = min_peers
        if spares not in ("hot", "cold"):
            raise LocalUsageError(f"spares must be 'hot' or 'cold', got {spares!r}")
        if spares == "cold" and max_peers and max_peers < min_peers:
            # (hot spares count towards min_peers: they are in the ring)
            raise LocalUsageError(f"max_peers ({max_peers}) is below min_peers ({min_peers})")
        self.max_peers = max_peers
        self.spares = spares
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.step_timeout = step_timeout
        self.join_settle = join_settle
        given = mesh.start_config
        self._start = StartConfig(
            given.start_peers if start_peers is None else start_peers,
            given.timeout if start_timeout is None else start_timeout,
            given.join_running,
        )
        self.start_peers = self._start.start_peers
        self.start_timeout = self._start.timeout
        if quorum not in QUORUM_POLICIES:
            raise LocalUsageError(f"quorum must be one of {QUORUM_POLICIES}, got {quorum!r}")
        self.quorum = quorum
        self.quorum_grace = quorum_grace
        self._dead_since: dict[str, float] = {}
        self._last_view: tuple[str, ...] = ()
        self.on_world_change = on_world_change
        self.committed = FRESH
        self._synced_epoch = ""
        self._world = 0
        # Members run the same seeded code, but their global RNGs need not agree: leave them
        # out so that digests compare model and optimizer only.
        self.state = State(model=model, optimizer=optimizer, rng=False)
        params = [p for p in model.parameters() if p.requires_grad]
        self._buckets = GradBuckets(params, int(bucket_mb * 2**20))
        # compression="int8": gradients travel as int8, one error-feedback residual per bucket
        tails = [0] * (len(self._buckets.buffers) - 1) + [HEADER_SLOTS]  # counters: exact
        comps = per_stream(compression, tails)
        self._compression = {id(b): c for b, c in zip(self._buckets.buffers, comps, strict=True)}
        # Sharded mode: ``optimizer`` only keeps the hyper-parameters; the state lives here.
        self._zero = ShardedOptimizer(params, optimizer, replicas) if shard_optimizer else None
        self._checkpoint_state: dict[str, torch.Tensor] = {}
        self.recoveries = 0
        self.fallbacks = 0
        """Times the sharded state was lost and training resumed from a checkpoint."""
        self._rng = random.Random()
        self.last_sync_bytes = 0
        self.last_sync_seconds = 0.0
        self._receive_buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._advertised = -1
        # Stay out of the ring until our first step: members in the ring would otherwise wait
        # for us while we are still starting up.
        mesh.set_role("joining")
        self._in_ring = False
        # Members behind fetch committed state from those that hold it (see ``_sync``).
        mesh.serve_state(self._lookup_state)
        self.checkpoints = CheckpointWriter(self.checkpoint_dir) if self.checkpoint_dir else None
        """Writes the checkpoints; a failed save is logged and counted, training goes on."""
        if self.checkpoint_dir is not None:
            found = latest_valid_checkpoint(self.checkpoint_dir)
            if found is not None:
                self._load_checkpoint(found.snapshot)
                log.info("resumed from checkpoint at step %d", self.committed)
        if self.checkpoints is not None and self.checkpoint_every > 0:
            self.checkpoints.check(self.state.nbytes())

    # ------------------------------------------------------------------ state

    def snapshot(self) -> Snapshot:
        """The live model and optimizer state (and committed step) as a snapshot."""
        return self.state.commit(step=max(self.committed, 0))

    def load_snapshot(self, snap: Snapshot) -> None:
        self.state.load_snapshot(snap)
        self.committed = snap.step

    def digest(self) -> str:
        """Content hash of the model and optimizer state and the committed step (bitwise
        comparison across members). Sharded: of the model and the optimizer's
        hyper-parameters (see ``shard_digests`` for the shards)."""
        self.state.step = max(self.committed, 0)
        return self.state.live_digest()

    def shard_digests(self) -> dict[str, str]:
        """Sharded mode: ``{"start:stop": digest}`` of the optimizer state of each held shard
        (holders of one shard compare equal). Empty in replicated mode."""
        if self._zero is None:
            return {}
        return self._zero.shard_digests()

    def _lookup_state(self, step: int, digest: str) -> Snapshot | None:
        """What our state server serves: a piece of sharded state offered in the current
        sync, else the committed snapshot. Runs in the mesh's thread."""
        piece = self._zero.served.get(digest) if self._zero is not None else None
        if piece is not None and piece.step == step:
            return piece
        return self.state.committed

    def _load_checkpoint(self, snap: Snapshot) -> None:
        self.load_snapshot(snap)
        zero = self.state.scalars.pop("zero", None)
        if (zero is None) != (self._zero is None):
            mode = "without" if zero is None else "with"
            raise LocalUsageError(
                f"the checkpoint of step {snap.step} was written {mode} shard_optimizer"
            )
        if self._zero is not None and zero is not None:
            self._zero.load_full(snap.step, round_id(f"checkpoint {snap.digest}"), zero)

    def _fall_back(self, exc: StateLostError) -> None:
        """The sharded state is lost (see the module docstring): resume from the newest valid
        checkpoint, or raise."""
        found = latest_valid_checkpoint(self.checkpoint_dir) if self.checkpoint_dir else None
        if found is None:
            where = f"in {self.checkpoint_dir}" if self.checkpoint_dir else "(no checkpoint_dir)"
            raise StateLostError(exc.lost, f"{exc.what}; no valid checkpoint {where}") from exc
        log.error("%s: resuming from the checkpoint of step %d", exc, found.snapshot.step)
        self._load_checkpoint(found.snapshot)
        self.fallbacks += 1

    # ------------------------------------------------------------------ the step

    def step(self, loss_fn: Callable[[np.ndarray], torch.Tensor]) -> StepReport:
        """Run one committed step. ``loss_fn(indices)`` returns the *mean* loss of this
        member's samples ``indices`` (it is not called when the share is empty)."""
        deadline = time.monotonic() + self.step_timeout
        attempts = 0
        synced = False
        entered_at = max(self.committed, 0)
        while True:
            attempts += 1
            if self.mesh.leave_requested() and (attempts > 1 or not self._in_ring):
                self._depart()  # nothing to announce, or the announcing attempt failed
            if not self._in_ring:
                # Join: let discovery and gossip settle (so we join the mesh that is there
                # instead of starting a lonely one), then enter the ring at a step boundary.
                self.mesh.wait_quiet(
                    self.join_settle, timeout=max(deadline - time.monotonic(), 0.1)
                )
                self._wait_for_start_peers(deadline)
                if self.max_peers and self.spares == "cold":
                    self._wait_for_slot()
                    deadline = time.monotonic() + self.step_timeout
                self._prepare_receive_buffer()
                self.mesh.set_role("train")
                self._in_ring = True
                # Members that started together flip to "train" within moments of each other:
                # let the view settle so the first step does not run on a partial ring.
                settle = self.join_settle / 4
            else:
                settle = 0.0
            view = self._wait_view(settle, deadline)
            if self._over_max_peers(view):
                log.info(
                    "%d members train (max_peers %d): back to spare", view.size, self.max_peers
                )
                self._in_ring = False
                continue
            if not self._quorate(view):
                log.info(
                    "view of %d lacks a quorum of the last view of %d; waiting",
                    view.size,
                    len(self._last_view),
                )
                self.mesh.wait_view_change(view.epoch, timeout=LEAVE_POLL_S)
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"no quorum within {self.step_timeout}s")
                continue
            try:
                if view.epoch != self._synced_epoch:
                    self._sync(view)
                    synced = True
                    if self.committed > entered_at:
                        # Others committed the step we were computing (we failed at its
                        # end, or joined): adopting it was this step.
                        return self._adopted(view, attempts)
                report = self._attempt(view, loss_fn, attempts, synced)
                if synced:  # the first step on a view made whatever state it makes
                    self._advertise_state()
            except StateLostError as exc:
                self._fall_back(exc)
                self._synced_epoch = ""
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"step {self.committed + 1} did not commit within {self.step_timeout}s"
                    ) from exc
                continue
            except RECOVERABLE as exc:
                self.recoveries += 1
                self._synced_epoch = ""  # whatever happened, agree on state again first
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"step {self.committed + 1} did not commit within {self.step_timeout}s"
                    ) from exc
                log.info(
                    "step %d attempt %d failed (%s); retrying on the next view",
                    self.committed + 1,
                    attempts,
                    exc,
                )
                if self.committed == FRESH and attempts % REANNOUNCE_EVERY == 0:
                    # A joiner that cannot get in: step out of the ring and back in, which
                    # every member sees as a view change (and a fresh sync).
                    self._step_out_of_ring()
                    continue
                if isinstance(exc, PeerLostError):
                    self._pause_after_loss(view, getattr(exc, "peer", ""))
                elif isinstance(exc, SettingsMismatchError):  # until the odd ones have left
                    self.mesh.wait_view_change(view.epoch, timeout=1.0)
                continue
            self._maybe_checkpoint()
            if report.leaving:
                self._see_off(view, report.leaving)  # raises Departed if we are one of them
            return report

    def _wait_view(self, settle: float, deadline: float) -> RingView:
        """``wait_view`` in pieces of about ``LEAVE_POLL_S``, so that a member waiting for
        ``min_peers`` still leaves when asked."""
        piece = max(LEAVE_POLL_S, 2 * settle)
        while True:
            left = deadline - time.monotonic()
            try:
                return self.mesh.wait_view(
                    min_members=self.min_peers, settle=settle, timeout=max(min(left, piece), 0.1)
                )
            except DeadlineExceeded:
                if self.mesh.leave_requested():
                    self._depart()
                if left <= piece:
                    raise DeadlineExceeded(
                        f"no view of {self.min_peers} members within {self.step_timeout:.0f}s"
                    ) from None

    def _see_off(self, view: RingView, gone: tuple[str, ...]) -> None:
        """After a step in which members announced that they leave: one barrier on its view,
        so that no leaver goes before every member has committed the step (its leaving would
        abort collectives still running on the view); then the leavers leave, and the others
        wait for membership to show the view without them and take it without a sync (they
        hold the same state), or else sync as after any change."""
        with contextlib.suppress(*RECOVERABLE):  # committed already; a leaver may have gone
            self.mesh.barrier_on(view)
        if self.mesh.node_id in gone:
            self._depart()
        deadline = time.monotonic() + DEPARTURE_WAIT_S
        current = self.mesh.view()
        while current is not None and any(n in current for n in gone):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            current = self.mesh.wait_view_change(current.epoch, timeout=left)
        rest = tuple(n for n in view.node_ids if n not in gone)
        if current is not None and current.node_ids == rest and self._zero is None:
            # (Sharded: the leavers' shards must be re-spread, which the sync does.)
            self._settle_on(current)

    def _depart(self) -> NoReturn:
        """Leave the mesh gracefully (membership sees ``left``) and end the training call."""
        step = max(self.committed, 0)
        log.warning("planned departure: leaving the mesh after step %d", step)
        self.mesh.close(join_timeout=DEPARTURE_CLOSE_S)
        raise Departed(step)

    def _adopted(self, view: RingView, attempts: int) -> StepReport:
        return StepReport(
            step=self.committed,
            loss=float("nan"),
            samples=self.sampler.global_batch,
            members=view.node_ids,
            epoch=view.epoch,
            attempts=attempts,
            synced=True,
            sync_bytes=self.last_sync_bytes,
            sync_seconds=self.last_sync_seconds,
            adopted=True,
        )

    def finish(self, timeout: float = 60.0) -> None:
        """A last sync on the current view before leaving, so that a member whose final step
        failed after others committed it catches up instead of redoing it alone."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            view = self.mesh.wait_view(timeout=max(deadline - time.monotonic(), 0.1))
            try:
                try:
                    self._sync(view)  # members whose last step failed fetch from us
                except StateLostError:
                    # Members that finished first took their shards with them; the optimizer
                    # state is of no further use: agree on the model only.
                    self._sync(view, shards=False)
                self.mesh.set_role("done")  # spares waiting for a slot stop waiting
                return
            except RECOVERABLE as exc:
                log.info("final sync failed (%s); retrying", exc)
                self.mesh.wait_view_change(view.epoch, timeout=1.0)
        raise DeadlineExceeded(f"final sync did not complete within {timeout}s")

    def _sync(self, view: RingView, *, shards: bool = True) -> None:
        started = time.monotonic()
        self.last_sync_bytes = 0
        me = self.mesh.node_id
        rank = view.rank_of(me)
        mine = self.snapshot()
        settings = self._shard_settings()
        # The settings ride in the same allreduce (``ftmesh.training.shards``).
        vec = np.concatenate(
            [
                sync_vector(rank, view.size, self.committed, mine.nbytes, mine.digest),
                settings_slots(settings, rank, view.size),
            ]
        )
        own = vec.copy()
        self.mesh.allreduce_on(view, vec, "max")
        cut = len(vec) - SETTINGS_SLOTS * view.size
        theirs = read_settings(vec[cut:], view.size)
        if not own_slots_intact(vec[:cut], own[:cut], rank, view.size) or (
            theirs[rank] != settings
        ):
            # Every other member writes FRESH into our slots, so max() must give ours back.
            self._desync(view, f"sync vector {vec.tolist()} lost our slots {own.tolist()}")
        plan = plan_sync(vec[:cut])
        trained = int(vec[: view.size].max()) != FRESH  # (else rank 0's state is adopted)
        established = plan.holders if trained else ()
        try:
            check_settings(theirs, view.node_ids, rank, established)
        except ConfigError:
            # Step out of the ring first: the members that go on see a view without us at
            # once, even if the script catches the error and stays alive.
            self._step_out_of_ring()
            raise
        log.info(
            "sync on view %s rank %d/%d at step %d: steps %s -> target %d root %d behind %s",
            view.epoch,
            rank,
            view.size,
            self.committed,
            vec[: view.size].tolist(),
            plan.target_step,
            plan.root,
            plan.behind,
        )
        buffer, self._receive_buffer = self._receive_buffer, None  # used once, if at all
        if rank in plan.behind:
            holders = [view.members[r].node_id for r in plan.holders]
            fits = buffer is not None and buffer.nbytes >= plan.nbytes
            snap = self.mesh.fetch_state(
                holders, plan.target_step, plan.digest, None, buffer if fits else None
            )
            self.load_snapshot(snap)
            self.last_sync_bytes = plan.nbytes
        if plan.behind:
            # Nobody moves on (and, at the end, leaves) while others still fetch from it. A
            # large state takes longer than io_timeout to fetch: the fetchers' liveness is
            # membership's to judge meanwhile (a dead or frozen one aborts the barrier).
            self.mesh.barrier_on(view, io_timeout=self.step_timeout)
        self.committed = plan.target_step
        if self._zero is not None and shards:
            everyone = tuple(range(view.size))
            candidates = plan.holders if plan.behind else everyone
            self.last_sync_bytes += self._zero.sync(
                self.mesh, view, plan.target_step, candidates, wait=self.step_timeout
            )
        self._settle_on(view)
        self.last_sync_seconds = time.monotonic() - started

    def _settle_on(self, view: RingView) -> None:
        """Every member of ``view`` holds our state: steps run on it without a sync."""
        self._synced_epoch = view.epoch
        self._last_view = view.node_ids
        world = min(view.size, self.max_peers) if self.max_peers else view.size  # computing
        if self._world != world:
            if self._world and self.on_world_change is not None:
                self.on_world_change(self._world, world)
            self._world = world

    def _advertise_state(self) -> None:
        """Tell joiners the size of the state they will fetch (``_prepare_receive_buffer``)."""
        nbytes = self.state.nbytes()
        if nbytes != self._advertised:
            self.mesh.advertise_state(nbytes)
            self._advertised = nbytes

    def _prepare_receive_buffer(self) -> None:
        """Before a member that has not trained enters the ring: start mapping the memory its
        state will be fetched into, while the ring forms, off the fetch's critical path
        (``ftmesh.state.memory``); sized by what the members advertise. A spare keeps it
        while it waits for a slot."""
        if self.committed != FRESH or self._receive_buffer is not None:
            return
        nbytes = self.mesh.advertised_state_bytes()
        if nbytes:
            self._receive_buffer = prepared_zeros(nbytes + RECEIVE_BUFFER_SLACK)

    def _wait_for_start_peers(self, deadline: float) -> None:
        """Before entering the ring of a mesh that has not started: see ``ftmesh.starting``
        (which stops waiting when a departure is requested: the member leaves then)."""
        wait_to_start(self.mesh, self._start, deadline)
        if self.mesh.leave_requested():
            self._depart()

    def _step_out_of_ring(self) -> None:
        """Leave the ring (role ``joining``) until the next step enters it again."""
        self.mesh.set_role("joining")
        self._in_ring = False

    def _shard_settings(self) -> ShardSettings:
        """What every member must agree on (read at each sync: the attributes may change)."""
        every = self.checkpoint_every if self.checkpoint_dir is not None else 0
        replicas = self._zero.replicas if self._zero is not None else 0
        return ShardSettings.of(self._zero is not None, replicas, every)

    def _wait_for_slot(self) -> None:
        """With ``max_peers``: wait as a ``spare`` until the ring has room for us. Free slots
        (``max_peers`` less the members training) go to the candidates (spares and members
        still joining) in node-id order, so every member that sees the same membership picks
        the same ones; the choice is re-made on every membership change, so a member that
        looked at a stale membership catches up (too many that step in at once are sorted out
        by ``_over_max_peers``). Once a training member has finished (role ``done``) no slot
        is taken: that is how training ends, and this raises ``TrainingFinishedError`` when
        none is training any more (also when the last ones left: nobody holds the state). A
        member that left while others train (a planned departure) frees its slot."""
        me = self.mesh.node_id
        self.mesh.set_role("spare")
        announced = False
        for _ in itertools.count():  # waits on membership events; ends on a slot or the end
            if self.mesh.leave_requested():
                self._depart()
            members = self.mesh.members()
            roles = {m.node: role_of(m) for m in members}
            training = [
                m.node for m in members if m.state == MemberState.ALIVE and roles[m.node] == "train"
            ]
            finished = any(roles[m.node] == "done" for m in members)
            left = any(m.state == MemberState.LEFT and roles[m.node] == "train" for m in members)
            if not training and (finished or left):
                raise TrainingFinishedError("the training finished while we waited as a spare")
            if not finished:
                candidates = sorted(
                    m.node
                    for m in members
                    if m.state == MemberState.ALIVE and roles[m.node] in ("spare", "joining")
                )
                free = self.max_peers - len(training)
                if free > 0 and me in candidates[:free]:
                    return
            if not announced:
                log.info(
                    "%d members train (max_peers %d): waiting as a spare",
                    len(training),
                    self.max_peers,
                )
                announced = True
            view = self.mesh.view()
            self.mesh.wait_view_change(view.epoch if view else "", timeout=LEAVE_POLL_S)

    def _over_max_peers(self, view: RingView) -> bool:
        """Cold spares: whether we, not having trained yet, are one too many: members that
        started together can all see a free slot before their roles have spread. The first
        ``max_peers`` of the view (node-id order) stay, as every member computes alike."""
        return bool(
            self.max_peers
            and self.spares == "cold"
            and self.committed == FRESH
            and view.size > self.max_peers
            and self.mesh.node_id not in view.node_ids[: self.max_peers]
        )

    def _pause_after_loss(self, view: RingView, peer: str) -> None:
        """After a collective lost a peer: if membership still holds it alive (typically a
        neighbour that gave up a ring and is forming the next one), retry at once, after a
        random few milliseconds so that members that failed together do not retry in
        lockstep. Otherwise give membership a moment to drop the peer; short, so that we are
        back before neighbours that wait for us give up."""
        states = {m.node: m.state for m in self.mesh.members()}
        if states.get(peer) == MemberState.ALIVE:
            time.sleep(self._rng.uniform(0.0, 0.2))
        else:
            self.mesh.wait_view_change(view.epoch, timeout=0.5)

    def _desync(self, view: RingView, what: str) -> NoReturn:
        """A collective returned data of another round: never use it. Reconnect the ring (its
        streams cannot be trusted) and retry the step from a sync."""
        log.warning("collective data from another round on view %s: %s", view.epoch, what)
        self.mesh.drop_view(view)
        raise CollectiveError(f"collective data from another round on view {view.epoch}: {what}")

    def _quorate(self, view: RingView) -> bool:
        if self.quorum == "any" or not self._last_view:
            return True
        if set(self._last_view) <= set(view.node_ids):  # all that last trained are here
            self._dead_since.clear()
            return True
        now = time.monotonic()
        states = {m.node: m.state for m in self.mesh.members()}
        gone = (MemberState.DEAD, MemberState.LEFT)
        for node in self._last_view:
            # Forgotten members (dead for long) count as dead.
            if states.get(node, MemberState.DEAD) in gone:
                self._dead_since.setdefault(node, now)
            else:
                self._dead_since.pop(node, None)
        # Members that left, and members the ring leaves out (unreachable, or sending bytes
        # that fail verification: every member, they included, computes them out of its view
        # from the same gossip, as it sees a departure), do not count, at once.
        excluded = self.mesh.exclusions()
        left = [n for n in self._last_view if states.get(n) == MemberState.LEFT or n in excluded]
        dead = [n for n, t in self._dead_since.items() if now - t >= self.quorum_grace]
        return has_quorum(self.quorum, view.node_ids, self._last_view, [*left, *dead])

    def _attempt(
        self,
        view: RingView,
        loss_fn: Callable[[np.ndarray], torch.Tensor],
        attempts: int,
        synced: bool,
    ) -> StepReport:
        me = self.mesh.node_id
        step = self.committed  # the step being computed (0-based)
        workers = view.node_ids[: self.max_peers] if self.max_peers else view.node_ids
        if me in workers:
            indices = self.sampler.indices(step, workers, me)
        else:  # a hot spare: contributes nothing, applies the reduced gradients
            indices = np.empty(0, dtype=np.int64)
        buckets = self._buckets  # start() zeroes the gradients

        def launch(buf: np.ndarray) -> Future[Any]:
            return self.mesh.submit_on_view(
                view, "allreduce", buf, "sum", self._compression[id(buf)]
            )

        def run(buf: np.ndarray) -> object:
            return self.mesh.allreduce_on(view, buf, "sum", self._compression[id(buf)])

        buckets.start(launch, run)
        tag = round_tag(step)
        header = buckets.header
        header[2] = tag
        if len(indices):
            loss = loss_fn(indices)
            header[:2] = (len(indices), float(loss.detach()) * len(indices))
            # Gradients of the summed (not mean) loss: the allreduce adds every member's.
            (loss * len(indices)).backward()  # type: ignore[no-untyped-call]
        rank = view.rank_of(me)
        if self.mesh.leave_requested():  # read last: the last bucket carries it (protocol, 4)
            header[3:] = leave_slots(rank)
        announced = bool(header[3:].any())
        buckets.finish(timeout=self.step_timeout)
        total, loss_sum, tags = (float(v) for v in header[:3])
        if tags != tag * view.size:
            self._desync(view, f"step {step + 1}: round check {tags}, expected {tag * view.size}")
        gone = leavers(header[3:], view.size)
        if gone is None or (rank in gone) != announced:
            self._desync(view, f"step {step + 1}: leave slots {header[3:].tolist()}")
        if total <= 0:
            raise FtmeshError("a step reduced zero samples")
        buckets.write_grads(1.0 / total)
        if self._zero is None:
            self.optimizer.step()
        else:
            self._sharded_update(view, step)
        self.committed = step + 1
        return StepReport(
            step=self.committed,
            loss=loss_sum / total,
            samples=int(total),
            members=view.node_ids,
            epoch=view.epoch,
            attempts=attempts,
            synced=synced,
            sync_bytes=self.last_sync_bytes if synced else 0,
            sync_seconds=self.last_sync_seconds if synced else 0.0,
            share=len(indices),
            leaving=tuple(view.node_ids[r] for r in gone),
        )

    def _sharded_update(self, view: RingView, step: int) -> None:
        """Step the held shards, then allgather every owner's updated parameters (and, on a
        checkpoint step, its optimizer state)."""
        zero = self._zero
        assert zero is not None
        flat_grad = torch.cat([p.grad.reshape(-1) for p in zero.params])  # type: ignore[union-attr]
        zero.update(flat_grad, (step + 1, round_id(view.epoch)))
        with_state = self._checkpoint_due(step + 1)
        gathered = self.mesh.allgather_on(view, zero.gather_input(with_state)).output
        self._checkpoint_state = zero.apply_gathered(gathered, with_state)
        zero.commit()

    def _checkpoint_due(self, step: int) -> bool:
        return bool(
            self.checkpoint_dir is not None
            and self.checkpoint_every > 0
            and step % self.checkpoint_every == 0
        )

    def _maybe_checkpoint(self) -> None:
        if self.checkpoints is None or not self._checkpoint_due(self.committed):
            return
        if self._zero is None:
            snap = self.snapshot()
        else:
            full = State(
                model=self.model,
                optimizer=self.optimizer,
                scalars={"zero": self._checkpoint_state},
                rng=False,
            )
            snap = full.commit(step=self.committed)
            self._checkpoint_state = {}
        self.checkpoints.save(snap)
