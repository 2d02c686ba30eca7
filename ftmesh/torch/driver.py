"""Carrying out the step machine's actions on the mesh, the state and the disk.

Theory of operation. ``ElasticTrainer`` asks :class:`MeshDriver` to carry out every action of
``ftmesh.training.step`` but ``Compute`` and its header's ``Reduce``, ``Gather`` and ``Apply``
(which run in the user's loop, ``ElasticTrainer._reduce``): waits on membership
and views, the sync allreduce (a snapshot of the committed state and the machine's sync
vector), fetching the newest state into the receive buffer a joiner mapped while the ring
formed, barriers, re-sharding, reconnecting a ring, checkpoint fall-backs and writes
(``CheckpointWriter``: a failed save is logged and counted, training goes on), the start gate
(``ftmesh.torch.starting``) and a planned departure (:meth:`MeshDriver.depart`). Every exception of
the mesh that stands for a failed step becomes a ``Failed`` outcome here, in one place
(:func:`failure_of`); anything else propagates.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from ..collective import InputMismatchError, RingView
from ..errors import (
    CollectiveError,
    DeadlineExceeded,
    Departed,
    FtmeshError,
    LocalUsageError,
    PeerLostError,
)
from ..membership.messages import MemberSnapshot
from ..mesh.blocking import SyncMesh
from ..mesh.meta import advertises_state, role_of
from ..state import Snapshot, StateLostError
from ..state.memory import prepared_zeros
from ..state.transfer import SIZE_HINT_FACTOR, own_size_limit
from ..training.actions import (
    Action,
    Advertise,
    Barrier,
    Checkpoint,
    Done,
    DropRing,
    Failed,
    Failure,
    FallBack,
    Fetch,
    Fetched,
    Loaded,
    MemberInfo,
    Members,
    Outcome,
    PrepareJoin,
    ReadMembers,
    ReadView,
    Reduced,
    Reshard,
    Saved,
    SetRole,
    Settle,
    Sleep,
    Sync,
    ViewSeen,
    WaitToStart,
    WaitView,
    WaitViewChange,
    WorldChanged,
)
from ..training.config import TrainerConfig
from ..training.entry import training_mesh
from ..training.protocol import FRESH
from ..training.shards import round_id
from ..training.step import StepMachine
from .starting import wait_to_start
from .state import TrainingState

if TYPE_CHECKING:  # built only with checkpoint_dir / shard_optimizer (issue #30: start-up)
    from ..state import CheckpointWriter
    from .zero import ShardedOptimizer

log = logging.getLogger("ftmesh.torch")

RECEIVE_BUFFER_SLACK = 1 << 20
"""Bytes a joiner's receive buffer has beyond the advertised state size: room for a
snapshot prefix that grew since (the step, a scheduler's state)."""
LEAVE_POLL_S = 1.0
"""Longest a member waits for a view before it looks whether it was asked to leave."""
DEPARTURE_CLOSE_S = 5.0
"""Most seconds a departing member spends leaving the mesh after its last step (its graceful
leave lingers two gossip intervals, at most 1 s, so the news spreads)."""
_DONE = Done()


def failure_of(exc: BaseException) -> Failed | None:
    """The step failure an exception of the mesh stands for (``None``: not a failure of the
    step, it propagates)."""
    if isinstance(exc, StateLostError):
        return Failed(Failure.STATE_LOST, str(exc), error=exc)
    if isinstance(exc, PeerLostError):
        return Failed(Failure.PEER_LOST, str(exc), peer=str(getattr(exc, "peer", "")), error=exc)
    if isinstance(exc, InputMismatchError):
        return Failed(Failure.INPUT_MISMATCH, str(exc), error=exc)
    if isinstance(exc, CollectiveError):  # view mismatch, superseded, aborted
        return Failed(Failure.VIEW, str(exc), error=exc)
    return None


def member_info(m: MemberSnapshot, excluded: bool = False) -> MemberInfo:
    return MemberInfo(m.node, m.state, role_of(m), advertises_state(m), excluded)


def joinable(members: list[MemberSnapshot]) -> bool:
    """Whether ``members`` hold a training mesh to join (``Settle`` ends then)."""
    return training_mesh([member_info(m) for m in members])


class MeshDriver:
    """Carries out the step machine's actions but ``Compute`` and its header's; see the module
    docstring."""

    def __init__(
        self,
        mesh: SyncMesh,
        config: TrainerConfig,
        machine: StepMachine,
        state: TrainingState,
        zero: ShardedOptimizer | None,
        on_world_change: Callable[[int, int], None] | None,
    ) -> None:
        self.mesh = mesh
        self.config = config
        self.machine = machine
        self.state = state
        self.zero = zero
        self.on_world_change = on_world_change
        self.checkpoint_state: dict[str, torch.Tensor] = {}
        """Sharded mode: the gathered optimizer state of a checkpoint step."""
        self._receive_buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._fetch_buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._advertised = -1
        directory = config.checkpoint_dir
        self.checkpoints: CheckpointWriter | None = None
        """Writes the checkpoints; a failed save is logged and counted, training goes on."""
        if directory is not None:
            from ..state import CheckpointWriter

            self.checkpoints = CheckpointWriter(directory)

    def _collective(self, run: Callable[[], Outcome]) -> Outcome:
        try:
            return run()
        except FtmeshError as exc:
            failure = failure_of(exc)
            if failure is None:
                raise
            return failure

    def perform(self, action: Action) -> Outcome:
        mesh, cfg = self.mesh, self.config
        match action:
            case Settle(seconds, timeout):
                mesh.wait_quiet(seconds, timeout=timeout, until=joinable)
            case SetRole(role):
                mesh.set_role(role)
            case WaitToStart(timeout, rejoin):
                start = self.machine.start
                if rejoin:
                    start = dataclasses.replace(start, join_running=True)
                wait_to_start(mesh, start, time.monotonic() + timeout, cfg.max_peers)
            case ReadMembers():
                excluded = mesh.exclusions()
                return Members(tuple(member_info(m, m.node in excluded) for m in mesh.members()))
            case ReadView():
                return ViewSeen(mesh.view())
            case Sleep(seconds):
                time.sleep(seconds)
            case WaitViewChange(epoch, timeout):
                if epoch is None:
                    current = mesh.view()
                    epoch = current.epoch if current is not None else ""
                return ViewSeen(mesh.wait_view_change(epoch, timeout=timeout))
            case WaitView(min_members, settle, timeout):
                return ViewSeen(self._wait_view(min_members, settle, timeout))
            case PrepareJoin():
                self._prepare_receive_buffer()
            case Sync(view):
                return self._collective(lambda: self._sync_allreduce(view))
            case Fetch():
                return self._collective(lambda: self._fetch(action))
            case Barrier(view):
                return self._collective(lambda: self._barrier(view))
            case Reshard(view, step, candidates):
                zero = self.zero
                assert zero is not None
                wait = cfg.step_timeout
                return self._collective(
                    lambda: Fetched(zero.sync(mesh, view, step, candidates, wait=wait))
                )
            case DropRing(view):
                mesh.drop_view(view)
            case FallBack(failure):
                return self._fall_back(failure)
            case WorldChanged(old, new):
                if self.on_world_change is not None:
                    self.on_world_change(old, new)
            case Advertise():
                self._advertise_state()
            case Checkpoint(step):
                return Saved(self._write_checkpoint(step))
            case _:
                raise LocalUsageError(f"the trainer cannot carry out {action!r}")
        return _DONE

    def _wait_view(self, min_members: int, settle: float, timeout: float) -> RingView | None:
        """``wait_view`` in pieces of about ``LEAVE_POLL_S``, so that a member waiting for
        ``min_peers`` still leaves when asked (``None``)."""
        end = time.monotonic() + timeout
        piece = max(LEAVE_POLL_S, 2 * settle)
        while True:
            left = end - time.monotonic()
            try:
                return self.mesh.wait_view(
                    min_members=min_members, settle=settle, timeout=max(min(left, piece), 0.1)
                )
            except DeadlineExceeded:
                if self.mesh.leave_requested():
                    return None
                if left <= piece:
                    raise DeadlineExceeded(
                        f"no view of {min_members} members within {timeout:.0f}s"
                    ) from None

    def depart(self, step: int) -> NoReturn:
        """Leave the mesh gracefully (membership sees ``left``) and end the training call."""
        log.warning("planned departure: leaving the mesh after step %d", step)
        # the others' next view leaves us out once the role or the leave reaches them (the
        # leave goes straight to each, behind the role: Swim.leave)
        self.mesh.set_role("leaving")
        self.mesh.close(join_timeout=DEPARTURE_CLOSE_S)
        raise Departed(step)

    # -- the sync's I/O

    def _sync_allreduce(self, view: RingView) -> Reduced:
        snap = self.state.commit(max(self.machine.committed, 0))
        vec = self.machine.sync_vector(view, snap.nbytes, snap.digest)
        self.mesh.session(view).allreduce(vec, "max")
        # The buffer prepared while joining serves the fetch of this sync, if any: used once.
        self._fetch_buffer, self._receive_buffer = self._receive_buffer, None
        return Reduced(vec)

    def _fetch(self, action: Fetch) -> Fetched:
        view, plan = action.view, action.plan
        holders = [view.members[r].node_id for r in plan.holders]
        buffer, self._fetch_buffer = self._fetch_buffer, None
        fits = buffer is not None and buffer.nbytes >= plan.nbytes
        snap = self.mesh.fetch_state(
            holders, plan.target_step, plan.digest, None, buffer if fits else None
        )
        self.state.load(snap)
        return Fetched(plan.nbytes)

    def _barrier(self, view: RingView) -> Done:
        # A large state takes longer than io_timeout to fetch: the fetchers' liveness is
        # membership's to judge meanwhile (a dead or frozen one aborts the barrier).
        self.mesh.session(view).barrier(io_timeout=self.config.step_timeout)
        return _DONE

    def lookup_state(self, step: int, digest: str) -> Snapshot | None:
        """What our state server serves: a piece of sharded state offered in the current
        sync, else the committed snapshot. Runs in the mesh's thread."""
        piece = self.zero.served.get(digest) if self.zero is not None else None
        if piece is not None and piece.step == step:
            return piece
        return self.state.state.committed

    def _advertise_state(self) -> None:
        """Tell joiners the size of the state they will fetch (``_prepare_receive_buffer``)."""
        nbytes = self.state.state.nbytes()
        if nbytes != self._advertised:
            self.mesh.advertise_state(nbytes)
            self._advertised = nbytes

    def _prepare_receive_buffer(self) -> None:
        """Before a member that has not trained enters the ring: start mapping the memory its
        state will be fetched into, while the ring forms, off the fetch's critical path
        (``ftmesh.state.memory``); sized by what the members advertise. A spare keeps it
        while it waits for a slot."""
        if self.machine.committed != FRESH or self._receive_buffer is not None:
            return
        nbytes = self.mesh.advertised_state_bytes()
        if nbytes > own_size_limit(self.state.state.nbytes()):
            log.warning(
                "the members advertise a state of %d bytes, over %dx our own: no buffer"
                " prepared (a member's claim, or a different program)",
                nbytes,
                SIZE_HINT_FACTOR,
            )
            nbytes = 0
        if nbytes:
            self._receive_buffer = prepared_zeros(nbytes + RECEIVE_BUFFER_SLACK)

    # -- checkpoints

    def load_checkpoint(self, snap: Snapshot) -> None:
        zero = self.state.load(snap, extra=("zero",)).get("zero")
        self.machine.adopt_snapshot(snap.step)
        if (zero is None) != (self.zero is None):
            mode = "without" if zero is None else "with"
            raise LocalUsageError(
                f"the checkpoint of step {snap.step} was written {mode} shard_optimizer"
            )
        if self.zero is not None and zero is not None:
            self.zero.load_full(snap.step, round_id(f"checkpoint {snap.digest}"), zero)

    def _fall_back(self, failure: Failed) -> Loaded:
        """The sharded state is lost: resume from the newest valid checkpoint, or raise."""
        exc = failure.error
        assert isinstance(exc, StateLostError)
        where_dir = self.config.checkpoint_dir
        from ..state import latest_valid_checkpoint

        found = latest_valid_checkpoint(where_dir) if where_dir else None
        if found is None:
            where = f"in {where_dir}" if where_dir else "(no checkpoint_dir)"
            raise StateLostError(exc.lost, f"{exc.what}; no valid checkpoint {where}") from exc
        log.error("%s: resuming from the checkpoint of step %d", exc, found.snapshot.step)
        self.load_checkpoint(found.snapshot)
        return Loaded(found.snapshot.step)

    def _write_checkpoint(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` was written (``CheckpointWriter``)."""
        assert self.checkpoints is not None
        if self.zero is None:
            snap = self.state.commit(step)
        else:
            snap = self.state.with_extra(step, zero=self.checkpoint_state)
            self.checkpoint_state = {}
        return self.checkpoints.save(snap) is not None
