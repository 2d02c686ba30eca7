"""What the step machine (``ftmesh.training.step``) and its driver say to each other.

*Actions* are what the machine asks the driver to do; *outcomes* are what the driver feeds
back, each action's docstring says which (``EXPECTS`` is the same as a table; the machine
refuses any other). All are frozen dataclasses: a test compares them with ``==``. Failures
are values too (:class:`Failed` with a :class:`Failure` kind): the driver turns the
exceptions of the mesh into them in one place, and the machine decides on the kind.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from ..collective.view import RingView
from ..membership.messages import MemberState
from .protocol import SyncPlan

if TYPE_CHECKING:
    from .step import StepReport
    from .verdicts import StepVerdict


# -- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What the machine needs to know of a member of the mesh."""

    node: str
    state: MemberState
    role: str
    started: bool = False
    """It advertises a committed state: it has taken a step (the mesh has started)."""
    excluded: bool = False
    """The ring leaves it out (unreachable, or sending bytes that fail verification:
    ``Mesh.exclusions``); every member computes that from the same gossip."""


class Failure(enum.Enum):
    """Why an action that needs other members did not complete."""

    PEER_LOST = "peer_lost"
    """A member died or stalled (or no holder could serve the state)."""
    VIEW = "view"
    """The ring did not agree on the view, or moved on to another one."""
    INPUT_MISMATCH = "input_mismatch"
    """Members ran different collectives (another step, another sync)."""
    DESYNC = "desync"
    """A collective returned data of another round: never used; the ring is reconnected."""
    SETTINGS = "settings"
    """Members of the view run with other settings; we wait for them to leave."""
    STATE_LOST = "state_lost"
    """Sharded optimizer state with no surviving copy: fall back to the checkpoint."""
    HEADER = "header"
    """A member's own contribution to the step's header is out of its range, or the reduced
    header is not the sum of what the members say they added (``protocol.RowFault``; the
    detail names the member where it can): never used; the attempt is retried."""


# -- outcomes (what the driver feeds back) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Done:
    """The action completed and returns nothing."""


@dataclass(frozen=True, slots=True)
class Members:
    members: tuple[MemberInfo, ...]


@dataclass(frozen=True, slots=True)
class ViewSeen:
    view: RingView | None


@dataclass(frozen=True, slots=True)
class Reduced:
    """The reduced sync vector."""

    vector: np.ndarray


@dataclass(frozen=True, slots=True)
class Fetched:
    nbytes: int


@dataclass(frozen=True, slots=True)
class Loaded:
    """A checkpoint was loaded: the committed step is now ``step``."""

    step: int


@dataclass(frozen=True, slots=True)
class Measured:
    """The step's micro-batches ended (their gradients are in the buckets, the last
    bucket's allreduce not yet finished): the machine answers with the header slots to fill
    in (:class:`Reduce`)."""

    share: int
    """Samples this member computed."""
    seconds: float
    """Our compute time: the body up to its last backward (``shares="speed"``)."""
    checks: tuple[int, ...] | None = None
    """The state check values we put in the header (``Compute.check``), else ``None``."""


@dataclass(frozen=True, slots=True)
class Contributed:
    """The gradient allreduce finished: ``header`` is our own contribution to it, as we
    added it, ``nonfinite`` whether we sent zeros for non-finite gradients, and ``frozen``
    whether our process stood still since our last committed step (``ftmesh.torch.freezes``;
    the same freeze as ``Computed.frozen``)."""

    header: np.ndarray
    nonfinite: bool
    frozen: bool = False


@dataclass(frozen=True, slots=True)
class Gathered:
    """Every member's row, gathered (``rows``), the reduced ``header``, and whether the
    reduced gradients are all finite."""

    header: tuple[float, ...]
    rows: np.ndarray
    reduced_finite: bool


@dataclass(frozen=True, slots=True)
class Computed:
    """The step's body completed and its update was applied."""

    share: int
    """Samples this member computed."""
    loss_sum: float = float("nan")
    """Summed loss over the global batch, all members together (``nan``: not recorded)."""
    leaving: tuple[str, ...] = ()
    """Members that announced in this step's leave slots that they leave after it
    (``Apply.leaving``); a planned departure, ``ftmesh.training.protocol`` 4."""
    speeds: tuple[float, ...] = ()
    """``shares="speed"``: the reduced speed slots, one smoothed compute speed per view rank
    (``Apply.verdict.speeds``); the split of the next step is made from them."""
    frozen: float = 0.0
    """Seconds this member's process stood still since its last committed step
    (``ftmesh.torch.freezes``)."""
    nonfinite: tuple[str, ...] = ()
    """Members whose own gradients were non-finite in this step (``StepVerdict.nonfinite``)."""
    skipped: bool = False
    """Every member skipped this step's update (non-finite gradients)."""


@dataclass(frozen=True, slots=True)
class Saved:
    """A checkpoint save ended: ``written`` is False when the disk refused it (logged and
    counted by the writer; the next checkpoint step tries again)."""

    written: bool


@dataclass(frozen=True, slots=True)
class Failed:
    kind: Failure
    detail: str
    peer: str = ""
    """The member that was lost (``PEER_LOST``), when known."""
    error: BaseException | None = None
    """The exception the driver saw, kept as the cause of a later ``DeadlineExceeded``."""


Outcome: TypeAlias = (
    Done
    | Members
    | ViewSeen
    | Reduced
    | Fetched
    | Loaded
    | Measured
    | Contributed
    | Gathered
    | Computed
    | Saved
    | Failed
)


# -- actions (what the driver does) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settle:
    """Wait until membership has been quiet for ``seconds`` (at most ``timeout``), or until a
    training mesh shows up (``ftmesh.training.entry.training_mesh``: then there is nothing to
    settle, we join it) -> Done."""

    seconds: float
    timeout: float


@dataclass(frozen=True, slots=True)
class SetRole:
    """Announce our role (``joining``, ``starting``, ``spare``, ``train``, ``done``) -> Done."""

    role: str


@dataclass(frozen=True, slots=True)
class WaitToStart:
    """Wait as the start gate says (``ftmesh.torch.starting.wait_to_start`` with the machine's
    ``StartConfig``), at most ``timeout``. The gate's verdicts that end the run are the
    driver's to raise (``MeshNotFormedError``, ``TrainingFinishedError``); it returns at once
    when a leave is requested -> Done. ``rejoin``: as a member that only joins a running mesh
    (``StartConfig.join_running``: a fail-slow member coming back)."""

    timeout: float
    rejoin: bool = False


@dataclass(frozen=True, slots=True)
class ReadMembers:
    """-> Members."""


@dataclass(frozen=True, slots=True)
class ReadView:
    """-> ViewSeen (``None``: no view yet)."""


@dataclass(frozen=True, slots=True)
class Sleep:
    """-> Done."""

    seconds: float


@dataclass(frozen=True, slots=True)
class WaitViewChange:
    """Wait until the view's epoch differs from ``epoch`` (``None``: the current view's), at
    most ``timeout`` -> ViewSeen."""

    epoch: str | None
    timeout: float


@dataclass(frozen=True, slots=True)
class WaitView:
    """Wait for a view of ``min_members`` holding us that has not changed for ``settle``
    seconds, at most ``timeout`` (then the driver raises ``DeadlineExceeded``) -> ViewSeen;
    ``ViewSeen(None)`` when a leave was requested meanwhile (the driver looks about every
    second)."""

    min_members: int
    settle: float
    timeout: float


@dataclass(frozen=True, slots=True)
class PrepareJoin:
    """About to enter the ring: a member that never trained maps the memory its state will
    be fetched into, off the fetch's critical path -> Done."""


@dataclass(frozen=True, slots=True)
class Sync:
    """Commit a snapshot of our state, build our contribution with
    :meth:`StepMachine.sync_vector` and allreduce(max) it on ``view`` -> Reduced | Failed."""

    view: RingView


@dataclass(frozen=True, slots=True)
class Fetch:
    """Fetch ``plan``'s state (step ``plan.target_step``, digest ``plan.digest``) from the
    ranks ``plan.holders`` of ``view`` and load it -> Fetched | Failed."""

    view: RingView
    plan: SyncPlan


@dataclass(frozen=True, slots=True)
class Barrier:
    """A barrier on ``view`` (members that fetched are done with the holders) -> Done | Failed."""

    view: RingView


@dataclass(frozen=True, slots=True)
class Reshard:
    """Sharded mode: re-shard the optimizer state for ``view`` at ``step``; ``candidates``
    are the ranks holding the agreed model -> Fetched | Failed."""

    view: RingView
    step: int
    candidates: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DropRing:
    """Reconnect ``view``'s ring before its next collective (its streams cannot be trusted)
    -> Done."""

    view: RingView


@dataclass(frozen=True, slots=True)
class FallBack:
    """The sharded state is lost: load the newest valid checkpoint -> Loaded (or raise the
    failure's error when there is none)."""

    failure: Failed


@dataclass(frozen=True, slots=True)
class WorldChanged:
    """The number of members computing changed -> Done."""

    old: int
    new: int


@dataclass(frozen=True, slots=True)
class Compute:
    """Compute step ``index`` (0-based; committing it makes ``index + 1`` steps) on ``view``:
    this member's share of the global batch split over ``workers`` (the compute set) by
    ``weights`` (``None``: equal), then the gradient allreduce and the update. Its header
    goes through the machine: the driver feeds :class:`Measured` when the micro-batches end
    (then :class:`Reduce`, :class:`Gather`, :class:`Apply`, which answers ``Computed``)
    -> Measured | Failed. ``Computed`` is taken only after this attempt's ``Apply``: fed
    before it, the machine refuses it (``LocalUsageError``), as any out-of-order outcome.
    ``check``: this step's allreduce carries the state digests."""

    view: RingView
    index: int
    workers: tuple[str, ...]
    weights: tuple[float, ...] | None
    check: bool
    attempt: int
    kept: bool = False
    """``TrainerConfig.recovery="keep"``: contribute the local gradients kept from this step's
    failed attempt (computed on its split, not computed again), rescaled by the step's global
    batch over ``trained``; ``workers`` are the members of the view, all of which computed
    that attempt."""
    trained: int | None = None
    """The samples the attempt trains, all members together (``None``: the step's whole
    global batch; with ``kept``, the kept shares of the members of the view): what the
    reduced header's sample count must be."""


@dataclass(frozen=True, slots=True)
class Reduce:
    """Fill in our header's tail with ``slots`` (the speed slots; may be empty) and, when
    ``announce``, our leave slots (``protocol.leave_slots``: we leave after the step), then
    finish the gradient allreduce -> Contributed (our header as we added it) | Failed."""

    slots: np.ndarray
    announce: bool


@dataclass(frozen=True, slots=True)
class Gather:
    """Allgather ``row`` (our claims: our contribution and flags,
    :meth:`StepMachine.row`) on ``view`` -> Gathered | Failed. From here on the others can
    commit the step without us."""

    view: RingView
    row: np.ndarray


@dataclass(frozen=True, slots=True)
class Apply:
    """The machine's verdict on the step's header (``ftmesh.training.verdicts``): the driver
    reports its offences, fails the attempt on ``verdict.failed``, raises on
    ``verdict.diverged``, else runs the update (skipped on ``verdict.skip``) and the rest of
    the body -> Computed | Failed. ``leaving``: who announced they leave after the step."""

    verdict: StepVerdict
    leaving: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Advertise:
    """Tell the mesh the size of our state (joiners map their receive buffers by it) -> Done."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Write a checkpoint of committed step ``step`` -> Saved."""

    step: int


@dataclass(frozen=True, slots=True)
class Finished:
    """The run ended: ``report`` for a step (``None`` for a join or the final sync)."""

    report: StepReport | None


@dataclass(frozen=True, slots=True)
class Depart:
    """A planned departure ends the run: the driver leaves the mesh gracefully (membership
    sees ``left``) and raises ``ftmesh.Departed(step)``. ``report``: the step this member
    committed and announced its departure in (``None``: it left without announcing)."""

    step: int
    report: StepReport | None = None


@dataclass(frozen=True, slots=True)
class Raise:
    """The run failed: the driver raises ``error`` (from ``cause``)."""

    error: BaseException
    cause: BaseException | None = None


Action: TypeAlias = (
    Settle
    | SetRole
    | WaitToStart
    | ReadMembers
    | ReadView
    | Sleep
    | WaitViewChange
    | WaitView
    | PrepareJoin
    | Sync
    | Fetch
    | Barrier
    | Reshard
    | DropRing
    | FallBack
    | WorldChanged
    | Compute
    | Reduce
    | Gather
    | Apply
    | Advertise
    | Checkpoint
    | Finished
    | Depart
    | Raise
)

EXPECTS: dict[type, tuple[type, ...]] = {
    Settle: (Done,),
    SetRole: (Done,),
    WaitToStart: (Done,),
    ReadMembers: (Members,),
    ReadView: (ViewSeen,),
    Sleep: (Done,),
    WaitViewChange: (ViewSeen,),
    WaitView: (ViewSeen,),
    PrepareJoin: (Done,),
    Sync: (Reduced, Failed),
    Fetch: (Fetched, Failed),
    Barrier: (Done, Failed),
    Reshard: (Fetched, Failed),
    DropRing: (Done,),
    FallBack: (Loaded,),
    WorldChanged: (Done,),
    Compute: (Measured, Failed),
    Reduce: (Contributed, Failed),
    Gather: (Gathered, Failed),
    Apply: (Computed, Failed),
    Advertise: (Done,),
    Checkpoint: (Saved,),
}
