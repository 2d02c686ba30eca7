"""``TrainerConfig``: every setting of the elastic trainer, in one frozen, documented object.

Nothing here reads the environment: ``ftmesh.connect()`` and the CLI turn flags and
``FTMESH_*`` variables into arguments, and the trainer gets its settings from this object
alone (``ElasticTrainer(mesh, model, optimizer, data, config=TrainerConfig(...))``, or the
same names as keyword arguments). Settings that every member must share are marked *mesh-wide*:
the state sync compares them (``ftmesh.training.shards``) and a member started with other
values gets ``ConfigError`` naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from ..compression import COMPRESSIONS
from ..errors import ConfigError
from .protocol import QUORUM_POLICIES, SHARES
from .stragglers import StragglerRule

SPARE_MODES = ("hot", "cold")
RECOVERIES = ("redo", "keep")
"""What a step does after the loss of a member (``TrainerConfig.recovery``)."""
DEFAULT_REPLICAS = 2
"""Copies of each optimizer shard in sharded mode (the owner and the next member)."""


@dataclass(frozen=True, slots=True)
class DiLoCo:
    """Semi-synchronous training in *rounds* (DiLoCo, Douillard et al. 2023):
    ``TrainerConfig.sync``. Each member runs ``inner_steps`` steps of the user's optimizer
    locally (no collective), then the round commits: the outer gradient (the global
    parameters at the round's start minus the member's) is averaged over the members that
    finished the round, and an outer SGD step (``outer_lr``, ``outer_momentum``, Nesterov or
    not) moves the global parameters; every member then holds them. One round is one trainer
    step (``ftmesh.torch.diloco``; ``docs/PORTING.md``, "DiLoCo rounds"). Mesh-wide."""

    inner_steps: int
    """H: local steps of the user's (inner) optimizer per round. The data's global batch is
    the round's: each member splits its share of it into ``inner_steps`` inner batches."""
    outer_lr: float = 0.7
    """The outer SGD's learning rate (the paper's 0.7; 1.0 without momentum is plain
    parameter averaging, "local SGD")."""
    outer_momentum: float = 0.9
    """The outer SGD's momentum (0: none)."""
    nesterov: bool = True
    """Nesterov momentum for the outer step (needs ``outer_momentum > 0``)."""
    fragments: int = 1
    """Streaming DiLoCo (Douillard et al. 2025): the parameters are split into this many
    fragments (contiguous runs of parameter tensors in registration order, of about equal
    size), and a trainer step runs ``inner_steps / fragments`` inner steps, then syncs one
    fragment, fragment ``step % fragments``: each fragment is synced every ``inner_steps``
    inner steps, at staggered offsets, and each sync reduces only its fragment's bytes (the
    outer step applies to that fragment). Each member's local parameters of the other
    fragments carry on from step to step (``ftmesh.torch.diloco``). 1: plain DiLoCo, the
    whole model every step. Must divide ``inner_steps``."""
    overlap: bool = False
    """Overlap each sync with the inner steps after it (streaming DiLoCo's ``τ``): a step
    sends its fragment's outer gradient, taken from this member's local parameters as the
    step begins, and runs its inner steps while it travels; the outer step and the merge
    (``mix``) follow when both are done. So the link and the computation work at the same
    time, and the fragment's update lands one step's inner steps late. With ``fragments=1``
    the whole model's outer gradient travels during the next step's inner steps (one-step
    delayed DiLoCo). ``ftmesh.torch.diloco``."""
    mix: float = 0.5
    """With ``overlap``: after the outer step, each member's local copy of the synced fragment
    becomes ``mix * local + (1 - mix) * global`` (the paper's alpha: 0 drops the inner steps
    the member ran while the fragment travelled, 1 ignores the global update)."""

    def __post_init__(self) -> None:
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int):
            raise ConfigError(f"DiLoCo inner_steps must be an int, got {self.inner_steps!r}")
        if self.inner_steps < 1:
            raise ConfigError(f"DiLoCo inner_steps must be >= 1, got {self.inner_steps}")
        if not self.outer_lr > 0:
            raise ConfigError(f"DiLoCo outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"DiLoCo outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.nesterov and self.outer_momentum == 0:
            raise ConfigError("DiLoCo nesterov=True needs outer_momentum > 0")
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int):
            raise ConfigError(f"DiLoCo fragments must be an int, got {self.fragments!r}")
        if self.fragments < 1 or self.inner_steps % self.fragments:
            raise ConfigError(
                f"DiLoCo fragments must be >= 1 and divide inner_steps ({self.inner_steps}), "
                f"got {self.fragments}"
            )
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"DiLoCo overlap must be a bool, got {self.overlap!r}")
        if isinstance(self.mix, bool) or not 0 <= self.mix < 1:
            raise ConfigError(f"DiLoCo mix must be in [0, 1), got {self.mix!r}")

    @property
    def steps_per_sync(self) -> int:
        """Inner steps per trainer step: ``inner_steps / fragments``."""
        return self.inner_steps // self.fragments

    @property
    def tag(self) -> str:
        """The settings as text (folded into the registered state's layout, so members with
        other DiLoCo settings get a ``ConfigError``)."""
        streaming = f",F={self.fragments}" if self.fragments > 1 else ""
        overlap = f",overlap,mix={self.mix!r}" if self.overlap else ""
        return (
            f"H={self.inner_steps},lr={self.outer_lr!r},m={self.outer_momentum!r},"
            f"nesterov={self.nesterov}{streaming}{overlap}"
        )


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    """The trainer's settings; see the module docstring. Units are seconds, steps, samples."""

    min_peers: int = 1
    """A step runs only on a view of at least this many members (hot spares count)."""
    max_peers: int = 0
    """At most this many members compute gradients (the first of the view in node-id order);
    the others are spares (``spares``). 0: no limit."""
    spares: Literal["hot", "cold"] = "hot"
    """``hot``: spares are in the ring, apply every step and take over at the next step with
    nothing to fetch (costs ring traffic). ``cold``: they wait outside the ring and fetch the
    state when a slot frees up."""
    checkpoint_dir: Path | None = None
    """Where disk checkpoints are written and resumed from (``None``: no checkpoints)."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: none). Mesh-wide in sharded mode."""
    step_timeout: float = 300.0
    """A step that has not committed after this long raises ``DeadlineExceeded``. Also bounds
    how long members wait for each other's state transfers."""
    join_settle: float = 2.0
    """On a cold start (no training mesh in sight: ``ftmesh.training.entry.training_mesh``),
    a member waits before entering the ring for membership to be quiet this long (or until a
    training mesh shows up), so that members started together find each other before step 1
    instead of each starting a lonely mesh; then for a view unchanged for a quarter of it. A
    member that finds a training mesh waits for neither."""
    start_peers: int | None = None
    """A mesh that has not started waits for this many members before its first step (at most
    ``start_timeout``; then more than half of them go ahead, fewer give up with
    ``MeshNotFormedError``: ``ftmesh.training.start``); members that join a running mesh never
    wait. ``None``: what the mesh was started with (``ftmesh.connect(start_peers=...)``,
    ``ftmesh launch -n N``, ``ftmesh worker --start-peers N``: ``SyncMesh.start_config``)."""
    start_timeout: float | None = None
    """The longest a fresh mesh waits for ``start_peers`` (``None``: the mesh's, else 60 s)."""
    quorum: Literal["majority", "any"] = "majority"
    """``majority``: a view trains only if it holds more than half of the last view's members
    (those gone longer than ``quorum_grace`` not counted), so an isolated member waits instead
    of training alone. ``any``: every view trains."""
    quorum_grace: float = 5.0
    """Seconds after which a dead member stops counting towards the quorum."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB: buckets are allreduced while backward still runs. Smaller
    buckets overlap more, larger ones cost fewer collectives. Mesh-wide (the buckets' shapes)."""
    micro_batch: int = 0
    """A member's share of a step runs in micro-batches of at most this many samples, adding
    up the gradients; the allreduce runs after the last one. Bounds per-member activation
    memory whatever the number of members (0: the whole share at once)."""
    check_every: int = 100
    """Every this many steps the members compare a digest of every registered part of the
    state, inside the step's gradient allreduce; a difference raises ``StateDivergedError``
    naming the parts. 0: never. Mesh-wide."""
    shard_optimizer: bool = False
    """Shard the optimizer state over the ring, ZeRO-1 style (``ftmesh.torch.zero``).
    Mesh-wide."""
    replicas: int = DEFAULT_REPLICAS
    """Copies of each optimizer shard in sharded mode. Mesh-wide."""
    compression: str | None = None
    """``"int8"``: the gradient buckets travel as blockwise int8 with error feedback (one
    residual per bucket, kept across steps; ``ftmesh.collective.compressed``, or for buckets
    of 2**18 values and more on 3+ members ``ftmesh.collective.shared_scale``);
    the header slots are sent exact. ``None``: float32. Mesh-wide."""
    gpu_collectives: bool = True
    """CUDA parameters' gradient buckets allreduce on the GPU: through NCCL (torch's
    process group, one per view, built on the mesh's ring store) when every member of the
    view has a GPU and the same NCCL, else staged by the session through the TCP ring.
    ``False``: staged through host memory always (as with ``compression="int8"``).
    Mesh-wide (the buckets' layout differs)."""
    data_seed: int = 0
    """Seed of the data order when the trainer is given a ``DataLoader`` (an
    ``ElasticSampler`` has its own). Mesh-wide."""
    shares: Literal["equal", "speed"] = "equal"
    """How a step's global batch is split among the members computing: ``equal``, or
    ``speed``: in proportion to each member's measured compute speed (samples/s of its own
    forward and backward, smoothed), which rides in the step's gradient allreduce, so a
    member at a quarter of the speed takes about a quarter of a fast member's share (at
    least ``SHARE_FLOOR`` of an equal share; re-split only when the members' compute times
    are uneven by more than ``SHARE_HYSTERESIS``: ``ftmesh.training.protocol``). Every
    sample still trains once per epoch. Mesh-wide."""
    straggler_factor: float = 1.5
    """A member that makes steps take more than this many times as long as they would
    without it, for ``straggler_steps`` consecutive steps, sits out the compute set as a hot
    spare (in the ring, applying every step, computing nothing) and is retried after
    ``readmit_steps`` (``ftmesh.training.stragglers``; FTLib's ``straggler-detection``).
    Predicted from the members' measured speeds under the split ``shares`` makes. 0: never.
    Mesh-wide."""
    straggler_steps: int = 20
    """Consecutive slow steps before a straggler sits out. Mesh-wide."""
    readmit_steps: int = 50
    """Steps a straggler sits out before its trial: a probe step at the small share its last
    speed gives it, then one at the normal split; too slow in either, it sits out again at
    once, for twice as long each time (at most 8x). Mesh-wide."""
    failslow_freezes: int = 3
    """A member whose whole process stood still for more than ``failslow_freeze`` seconds
    (``ftmesh.torch.freezes``) in this many of its last ``straggler_steps`` committed steps is
    fail-slow: it steps out of the ring (role ``spare``; its freezes would stop every
    collective) for ``failslow_pause`` seconds, then joins again and fetches the state. Its
    own decision: the others see it leave as in a departure. Never from a view of fewer than
    three members (it would leave one training alone). 0: never."""
    failslow_freeze: float = 0.2
    """Seconds of standing still that count as a freeze."""
    failslow_pause: float = 30.0
    """Seconds a fail-slow member stays out of the ring before it joins again (as a member
    that only joins a running mesh: it stops with ``TrainingFinishedError`` if the others
    finished meanwhile). Fail-slow again within ``readmit_steps`` steps of its return, it
    stays out twice as long each time (at most 8x)."""
    torch_distributed: bool = True
    """Inside a step, ``torch.distributed`` runs on the step's view (``ftmesh.torch.distributed``:
    ``dist.is_initialized()`` true, rank and world size the view's, ``dist.all_reduce`` &
    co. on its collective session, a failure failing the attempt). Left alone when the
    program initialised ``torch.distributed`` itself, or another trainer of this process
    holds it (one default group per process; a WARNING says so)."""
    sync: DiLoCo | None = None
    """``None``: every step reduces the gradients of the global batch (synchronous data
    parallelism). ``DiLoCo(inner_steps=H, ...)``: a step is a *round* of H local steps per
    member, committed by an outer step on the averaged outer gradient (see ``DiLoCo``; the
    closure API ``trainer.step(loss_fn)`` runs one round, and so does a loop API step whose
    body steps the optimizer once per inner batch of ``step.indices()``). With
    ``compression="int8"`` the outer gradient travels as blockwise int8 with error feedback
    (each member's residual carried from round to round, as for gradients). Not with
    ``shard_optimizer`` or a ``ShardedStream``. Mesh-wide."""

    recovery: Literal["redo", "keep"] = "redo"
    """What a step interrupted by the loss of a member does on its retry. ``redo`` (lossless):
    the survivors compute the step again, forward and backward, on the new view's split of
    the same global batch. ``keep`` (fast): each survivor keeps its local contribution of
    the failed attempt (its unreduced gradients, copied as they went out) and sends it again
    on the new ring with no forward or backward; the step commits without the lost members'
    shares: those samples are *skipped* (not trained, and not returned to the epoch), counted
    in ``StepReport.skipped`` and the ``samples_skipped_total`` statistic, and the update is
    the mean over the samples actually trained. The attempt falls back to ``redo`` whenever
    the new view holds a member that did not compute the failed attempt (a joiner, a spare),
    or the last failure was not a loss. Only with an ``ElasticSampler`` or ``DataLoader`` and
    synchronous steps (a ``DiLoCo`` round keeps its outer gradient this way by itself, its
    inner steps not run again). Mesh-wide."""

    def __post_init__(self) -> None:
        if self.checkpoint_dir is not None and not isinstance(self.checkpoint_dir, Path):
            object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir))
        if self.spares not in SPARE_MODES:
            raise ConfigError(f"spares must be 'hot' or 'cold', got {self.spares!r}")
        if self.recovery not in RECOVERIES:
            raise ConfigError(f"recovery must be one of {RECOVERIES}, got {self.recovery!r}")
        if self.shares not in SHARES:
            raise ConfigError(f"shares must be one of {SHARES}, got {self.shares!r}")
        if self.quorum not in QUORUM_POLICIES:
            raise ConfigError(f"quorum must be one of {QUORUM_POLICIES}, got {self.quorum!r}")
        if self.min_peers < 1:
            raise ConfigError(f"min_peers must be >= 1, got {self.min_peers}")
        if self.start_peers is not None and self.start_peers < 1:
            raise ConfigError(f"start_peers must be >= 1, got {self.start_peers}")
        if self.straggler_factor != 0 and not self.straggler_factor > 1:
            raise ConfigError(
                f"straggler_factor must be 0 (off) or > 1, got {self.straggler_factor}"
            )
        if self.failslow_freezes < 0:
            raise ConfigError(f"failslow_freezes must be >= 0, got {self.failslow_freezes}")
        for name in ("failslow_freeze", "failslow_pause"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("straggler_steps", "readmit_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_peers", "checkpoint_every", "micro_batch", "check_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.compression not in (None, "none", *COMPRESSIONS):
            raise ConfigError(
                f"compression must be None or one of {COMPRESSIONS}, got {self.compression!r}"
            )
        for name in ("step_timeout", "start_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("join_settle", "quorum_grace"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.sync is not None:
            if not isinstance(self.sync, DiLoCo):
                raise ConfigError(
                    f"sync must be None or a DiLoCo(inner_steps=...), got {self.sync!r}"
                )
            if self.shard_optimizer:
                raise ConfigError("sync=DiLoCo(...) does not combine with shard_optimizer")
            if self.recovery != "redo":
                raise ConfigError(
                    "recovery='keep' is for synchronous steps: a DiLoCo round keeps each "
                    "member's outer gradient across its attempts already"
                )
        if self.spares == "cold" and self.max_peers and self.max_peers < self.min_peers:
            # (hot spares count towards min_peers: they are in the ring)
            raise ConfigError(f"max_peers ({self.max_peers}) is below min_peers ({self.min_peers})")

    @classmethod
    def of(cls, config: TrainerConfig | None = None, **overrides: Any) -> TrainerConfig:
        """``config`` (default: all defaults) with ``overrides`` laid over it; an unknown name
        is a ``ConfigError`` that lists the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(
                f"unknown trainer setting(s) {unknown}; known: {', '.join(sorted(known))}"
            )
        return replace(config or cls(), **overrides)

    @property
    def straggler_rule(self) -> StragglerRule:
        return StragglerRule(self.straggler_factor, self.straggler_steps, self.readmit_steps)

    @property
    def measures_speed(self) -> bool:
        """Whether members measure their compute speed and share it in the step's header
        (speed shares or straggler detection)."""
        return self.shares == "speed" or self.straggler_rule.enabled

    @property
    def keeps_contribution(self) -> bool:
        """Whether the retry of a step after a loss may send the local contributions kept
        from the failed attempt (``recovery="keep"``, or a DiLoCo round's outer gradient):
        the step machine's *kept attempt* (``ftmesh.training.step``)."""
        return self.recovery == "keep" or self.sync is not None

    @property
    def checkpointing(self) -> bool:
        """Whether checkpoints are written at all."""
        return self.checkpoint_dir is not None and self.checkpoint_every > 0

    def checkpoint_due(self, step: int) -> bool:
        """Whether committing ``step`` (1-based) writes a checkpoint."""
        return self.checkpointing and step % self.checkpoint_every == 0

    def check_due(self, step: int) -> bool:
        """Whether the step computed after committing ``step`` steps compares state digests
        (every ``check_every`` steps, starting with the first step)."""
        return self.check_every > 0 and step % self.check_every == 0
