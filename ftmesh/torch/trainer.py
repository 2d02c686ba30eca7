"""Elastic, fault-tolerant data-parallel training of a PyTorch model on the mesh.

Theory of operation. ``ElasticTrainer`` drives the step machine of ``ftmesh.training.step``
(which decides) with the mesh's calls and torch (which act): it carries out each action the
machine returns — wait for a view, run the sync allreduce, fetch the newest committed state
(striped over the members that hold it, hash-verified), re-shard, compute — and feeds back
what happened as a typed outcome; exceptions of the mesh become ``Failed`` outcomes in one
place (``ftmesh.torch.driver.failure_of``; ``MeshDriver`` carries out every action but
``Compute``, whose header goes through the machine from inside the step's body: ``Measured``
in, ``Reduce`` out, ``Contributed`` in, ``Gather`` out, ``Gathered`` in, ``Apply`` out, and
``Computed`` in; the trainer calls none of the machine's header helpers). Two ways to write
the loop, on the same machine:

* the loop API, ordinary PyTorch (``ftmesh.torch.loop`` says where each hook runs)::

      for step in trainer.steps(total):
          with step:
              for x, y in step.batches():          # this member's micro-batches
                  F.cross_entropy(model(x), y).backward()
              clip_grad_norm_(model.parameters(), 1.0)   # the reduced gradients
              optimizer.step()
              scheduler.step()

* the closure API: ``trainer.step(loss_fn)`` runs one committed step, where
  ``loss_fn(indices)`` returns the mean loss of a micro-batch of sample indices.

With ``sync=DiLoCo(inner_steps=H, ...)`` a step is a *round* (``ftmesh.torch.diloco``): the
closure API's body runs H local steps of the user's optimizer (``Rounds.compute``), or, in the
loop API, the user's body runs them on the inner batches ``step.indices()`` yields, inside
``Rounds.inner_steps`` (``_round_inner``); either way the step's allreduce carries the outer
gradient instead of the micro-batches' (``_round_fill``) and the outer step follows its
reduction (``_round_outer``); the outer optimizer is a registered part.

With ``recovery="keep"`` (``TrainerConfig.recovery``) each bucket's gradients are copied as
they go out (``_outgoing``, ``ftmesh.torch.keep``), and a retry after the loss of a member
may send the copy again instead of computing the step on the new split (``Compute.kept``:
no micro-batches, the header's count and loss the kept ones).

Several models and optimizers (a GAN, an encoder and a decoder, an EMA copy): the models are
one ``model`` (a ``torch.nn.ModuleDict``), since the step's allreduce averages the model's
gradients only; every other optimizer is registered (``register``) and guarded like the
trainer's; an optimizer over a trainable parameter outside the model is refused.

What the trainer guarantees and how each setting behaves (steps committed by all survivors or
none, the registered state, starting together, planned departures, ``compression``, spares,
``shard_optimizer``): ``docs/DESIGN-NOTES.md``, "The trainer's behaviour".

The data: an ``ElasticSampler`` or a ``DataLoader`` over a map-style dataset (the position is
the committed step), or a ``ShardedStream`` (``ftmesh.torch.stream``: the position is each
shard's committed offset, a registered part; what each member took of its shards rides in
its row of the step's header allgather, ``_reduce``, and the position moves in ``_end`` when
the step commits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import numpy as np
import torch
import torch.utils.data as tud

from ..collective import RingView
from ..collective.ops import CollectiveOp
from ..collective.session import ViewSession
from ..compression import Int8Compression, per_stream
from ..errors import FtmeshError, LocalUsageError, MeshClosedError
from ..membership.messages import MemberState
from ..mesh.blocking import SyncMesh
from ..mesh.meta import BadMetadataError, read_member
from ..state import Snapshot, State
from ..stats import TrainerStatistics
from ..training.actions import (
    Action,
    Apply,
    Compute,
    Computed,
    Contributed,
    Depart,
    Failed,
    Failure,
    Finished,
    Gather,
    Gathered,
    Measured,
    Outcome,
    Raise,
    Reduce,
)
from ..training.config import TrainerConfig
from ..training.protocol import (
    COUNTER_SLOTS,
    FRESH,
    HEADER_SLOTS,
    diverged_members,
    header_size,
    leave_slots,
    round_tag,
)
from ..training.shards import round_id
from ..training.step import (
    StepMachine,
    StepReport,
    StepVerdict,
)
from .between import BetweenSteps, between_text
from .buckets import GradBuckets, Wire, all_finite, check_bucketable, micro_batches
from .data import LOOKAHEAD_STEPS, BatchSource, ElasticLoader, Key, sampler_for
from .driver import MeshDriver, failure_of
from .freezes import FreezeWatch
from .loop import NextAttempt, StateDivergedError, Step, StepAborted
from .sampler import ElasticSampler
from .state import TrainingState

if TYPE_CHECKING:
    # What only some trainers use is imported where it is built: a stream
    # (``ShardedStream``), DiLoCo rounds, ``recovery="keep"``, a sharded optimizer,
    # checkpoints. A plain trainer never loads them (a joiner's start-up, issue #30).
    from ..state import CheckpointWriter
    from .diloco import InnerRun, Rounds
    from .keep import KeptContribution
    from .stream import Position, ShardedStream, StreamFeed, StreamSizes
    from .zero import ShardedOptimizer

__all__ = ["ElasticTrainer", "StepReport"]

log = logging.getLogger("ftmesh.torch")

_A = TypeVar("_A", Reduce, Gather, Apply)

ABANDON_WAIT_S = 5.0
"""How long a step whose body raised waits for its allreduces in flight."""


class ElasticTrainer:
    """See the module docstring. One per member process; not thread-safe.

    ``data``: an ``ElasticSampler`` (steps hand out sample indices), the ``DataLoader`` you
    would train with (``ftmesh.torch.data``: its ``batch_size`` is the global batch), or a
    ``ShardedStream`` (``ftmesh.torch.stream``: streaming data, its position committed).
    ``config`` and keyword settings: ``TrainerConfig`` (keywords override it).
    ``state``: objects to ``register`` at once. ``on_world_change(old, new)``: called when the
    number of members computing changes (e.g. to scale the learning rate). With
    ``sync=DiLoCo(...)``, ``optimizer`` is the inner optimizer and each ``step(loss_fn)``
    one round (``ftmesh.torch.diloco``)."""

    def __init__(
        self,
        mesh: SyncMesh,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data: ElasticSampler | tud.DataLoader[Any] | ShardedStream,
        config: TrainerConfig | None = None,
        *,
        state: Mapping[str, Any] | None = None,
        on_world_change: Callable[[int, int], None] | None = None,
        **settings: Any,
    ) -> None:
        self.config = cfg = TrainerConfig.of(config, **settings)
        self.mesh = mesh
        self.model = model
        self.optimizer = optimizer
        self._loader: ElasticLoader | None = None
        self._stream: StreamFeed | None = None
        self.sampler: ElasticSampler | StreamSizes
        if isinstance(data, tud.DataLoader):
            self.sampler = sampler_for(data, cfg.data_seed)
            self._loader = ElasticLoader(data, self._plan)
        elif isinstance(data, ElasticSampler):
            self.sampler = data
        else:
            from .stream import ShardedStream, StreamFeed, StreamSizes

            if not isinstance(data, ShardedStream):
                raise LocalUsageError(
                    "data must be an ElasticSampler, a DataLoader or a ShardedStream, got "
                    f"{type(data).__name__}"
                )
            self._stream = StreamFeed(data)
            self.sampler = StreamSizes(self._stream)
        self._state = TrainingState(model, optimizer)
        self.state: State = self._state.state
        if self._stream is not None:  # the stream's position: committed with every step
            self._state.register("stream", self._stream.state)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        check_bucketable(params)
        self._params = params
        self._check_reduced("optimizer", optimizer)
        # Sharded mode: ``optimizer`` only keeps the hyper-parameters; the state lives here.
        self._zero: ShardedOptimizer | None = None
        if cfg.shard_optimizer:
            from .zero import ShardedOptimizer

            self._zero = ShardedOptimizer(params, optimizer, cfg.replicas, [n for n, _ in named])
        self._rounds: Rounds | None = None
        """``sync=DiLoCo(...)``: the rounds' outer optimizer and kept outer gradient."""
        self._senders_slot = 0
        """DiLoCo's overlap: 1, the header's last slot counts the members that sent an outer
        gradient (``_senders`` after the reduction); else 0."""
        self._senders = 0
        if cfg.sync is not None:
            if self._stream is not None:
                raise LocalUsageError("sync=DiLoCo(...) does not take a ShardedStream")
            from .diloco import OUTER_PART, Rounds

            self._rounds = Rounds(cfg.sync, params, optimizer)
            self._state.register(OUTER_PART, self._rounds.outer, note=f"[{cfg.sync.tag}]")
        self._kept: KeptContribution | None = None
        """``recovery="keep"``: our local contribution to the step, kept across its attempts
        (``ftmesh.torch.keep``)."""
        if cfg.recovery == "keep":
            if self._stream is not None:
                raise LocalUsageError(
                    "recovery='keep' does not take a ShardedStream (its position commits "
                    "what each member drew): use recovery='redo'"
                )
            from .keep import KeptContribution

            self._kept = KeptContribution()
        self._buckets: GradBuckets | None = None
        self._bucket_bytes = int(cfg.bucket_mb * 2**20)
        self._compression: dict[int, Int8Compression | None] = {}
        """id(bucket buffer) -> its compression (``compression="int8"``; else None)."""
        # the mesh's (what ftmesh.connect() was told, or the environment), with the
        # trainer's explicit overrides laid over it (``StartConfig`` owns the order)
        start = mesh.start_config.overlay(cfg.start_peers, cfg.start_timeout)
        self._machine = StepMachine(cfg, mesh.node_id, self.sampler.batch_size, start=start)
        self._current: Step | None = None
        self._loop_side = LoopSide(self)
        """What the steps call (``ftmesh.torch.loop.StepDriver``)."""
        self._driver = MeshDriver(
            mesh, cfg, self._machine, self._state, self._zero, on_world_change
        )
        self._opened = False
        self._between = BetweenSteps(self._publish_between, self._publish_progress)
        """Publishes that the user's code between steps runs long (``ftmesh.torch.between``)."""
        self._own_nonfinite = False
        """Our own gradients of the current attempt held a NaN or an infinity."""
        self._published_steps: dict[str, int] = {}
        """The newest step each member published while we had not trained (``_published_step``)."""
        self._dist = contextlib.ExitStack()
        """``torch.distributed`` bound to the current attempt's session, if it is."""
        self._dist_bound = False
        self._dist_warned = False
        self._verdict: StepVerdict | None = None
        """The current attempt's verdict on its header (the machine's ``Apply``)."""
        self._freezes: FreezeWatch | None = None
        """Notices when this process stood still (fail-slow; started at the first step)."""
        self._epoch: int | None = None
        self._view: RingView | None = None
        self.last_report: StepReport | None = None
        """The report of the last step committed or adopted."""
        self._step_hooks: list[Callable[[ElasticTrainer, StepReport], None]] = []
        self._hooks = [optimizer.register_step_pre_hook(self._before_optimizer_step)]
        self._install_optimizer_methods(optimizer)
        for name, obj in (state or {}).items():
            self.register(name, obj)
        # Stay out of the ring until our first step: members in the ring would otherwise wait
        # for us while we are still starting up. Members behind fetch committed state from
        # those that hold it: our state server.
        mesh.set_role("joining")
        mesh.serve_state(self._driver.lookup_state)
        if isinstance(mesh, SyncMesh):  # the metrics exporter's ftmesh_train_* families
            mesh.register_statistics("trainer", self.statistics)

    # ------------------------------------------------------------------ registering state

    def register(self, name: str, obj: Any) -> None:
        """Make ``obj`` (an LR scheduler, a ``GradScaler``, EMA weights, any object with
        ``state_dict()``/``load_state_dict()``) part of the committed state under ``name``,
        before the first step: it is restored on joiners, spares and checkpoint resume, and
        compared across members. Modules and optimizers are read live; anything else is
        captured at the end of every step (``ftmesh.torch.state``), so it may be changed
        between steps (a scheduler stepped once per epoch).

        A second optimizer (a GAN's discriminator's, a decoder's) is registered like this:
        it must update parameters of the trainer's ``model`` only (put the modules in one
        ``torch.nn.ModuleDict``), whose gradients the step's allreduce averages; it then gets
        the trainer's optimizer's guards (``step()`` only inside a step, after the reduction;
        skipped with it on non-finite gradients; ``zero_grad()`` inside a step keeps the
        buckets' sum). Not with ``shard_optimizer`` or ``sync=DiLoCo(...)``, which update the
        parameters with the trainer's optimizer alone. ``docs/PORTING.md``, "Several models
        and optimizers"."""
        if isinstance(obj, torch.optim.Optimizer):
            self._check_optimizer(name, obj)
        self._state.register(name, obj)
        if isinstance(obj, torch.optim.Optimizer):
            self._hooks.append(obj.register_step_pre_hook(self._before_optimizer_step))
            self._install_optimizer_methods(obj)

    def _check_optimizer(self, name: str, opt: torch.optim.Optimizer) -> None:
        """Refuse a registered optimizer the trainer would not keep right (see ``register``)."""
        if opt is self.optimizer:
            raise LocalUsageError(f"{name!r}: the trainer's optimizer is registered already")
        cfg = self.config
        if cfg.shard_optimizer or cfg.sync is not None:
            setting = "shard_optimizer=True" if cfg.shard_optimizer else "sync=DiLoCo(...)"
            raise LocalUsageError(
                f"{name!r}: a second optimizer does not work with {setting}, which updates "
                "every parameter of the model with the trainer's optimizer; use one optimizer "
                "with a parameter group per model"
            )
        self._check_reduced(name, opt)

    def _check_reduced(self, name: str, opt: torch.optim.Optimizer) -> None:
        """Refuse an optimizer that would update a parameter whose gradients the step's
        allreduce does not average (one outside the model: members would drift apart)."""
        reduced = {id(p) for p in self._params}
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in reduced:
                    raise LocalUsageError(
                        f"{name!r}: it updates a parameter of shape {tuple(p.shape)} that is "
                        "not in the trainer's model, so its gradients would not be averaged "
                        "across members: give the trainer all the models as one "
                        "torch.nn.ModuleDict (docs/PORTING.md, 'Several models and optimizers')"
                    )

    def add_step_hook(self, hook: Callable[[ElasticTrainer, StepReport], None]) -> None:
        """Call ``hook(trainer, report)`` after every step this member commits or adopts
        (logging, metrics, tests); it runs in the training thread, after the commit."""
        self._step_hooks.append(hook)

    @property
    def dataset(self) -> Any:
        """The dataset of the ``DataLoader`` the trainer was given (``None`` with an
        ``ElasticSampler``)."""
        return self._loader.loader.dataset if self._loader is not None else None

    @property
    def stream_position(self) -> Position | None:
        """With a ``ShardedStream``: the committed position in it (epoch, each shard's next
        offset, the shards ended, the samples trained in the epoch); else ``None``."""
        return self._stream.position if self._stream is not None else None

    @property
    def scalars(self) -> dict[str, Any]:
        """Plain values that are part of the committed state (numbers, strings, lists,
        dicts, tensors); captured at the end of every step like registered objects."""
        return self._state.scalars

    # ------------------------------------------------------------------ reading

    @property
    def on_world_change(self) -> Callable[[int, int], None] | None:
        """Called as ``on_world_change(old, new)`` when the number of members computing
        changes (may be set at any time)."""
        return self._driver.on_world_change

    @on_world_change.setter
    def on_world_change(self, callback: Callable[[int, int], None] | None) -> None:
        self._driver.on_world_change = callback

    @property
    def committed(self) -> int:
        """Steps committed (``-1``: never trained in this mesh; else
        ``statistics().committed_step``)."""
        return self._machine.committed

    @property
    def recoveries(self) -> int:
        """Failed attempts so far (each cost a retry of its step): a view of
        ``statistics().recoveries_total``."""
        return self.statistics().recoveries_total

    @property
    def fallbacks(self) -> int:
        """Times the sharded state was lost and training resumed from a checkpoint: a view
        of ``statistics().fallbacks_total``."""
        return self.statistics().fallbacks_total

    @property
    def rank(self) -> int:
        """This member's place in the ring of the current (last) step; -1 before any."""
        return self._view.rank_of(self.mesh.node_id) if self._view is not None else -1

    @property
    def world_size(self) -> int:
        """Members in the ring of the current (last) step, hot spares included; 0 before."""
        return self._view.size if self._view is not None else 0

    @property
    def is_leader(self) -> bool:
        """Whether this member is first in the ring of the current (last) step."""
        return self.rank == 0

    @property
    def checkpoints(self) -> CheckpointWriter | None:
        """Writes the checkpoints (``None`` without ``checkpoint_dir``); its ``statistics()``
        count saves and failed saves."""
        return self._driver.checkpoints

    def statistics(self) -> TrainerStatistics:
        """A frozen snapshot of this trainer's counters (for metrics; the recoveries,
        fall-backs and the last sync's bytes and seconds among them)."""
        return self._machine.statistics()

    def snapshot(self) -> Snapshot:
        """The live state (and committed step) as the committed snapshot."""
        return self._state.commit(max(self.committed, 0))

    def load_snapshot(self, snap: Snapshot) -> None:
        """Adopt ``snap`` (every registered part) as the committed state of its step."""
        self._state.load(snap)
        self._machine.adopt_snapshot(snap.step)

    def digest(self) -> str:
        """Content hash of the registered state and the committed step (bitwise comparison
        across members). Sharded: of the model and the optimizer's hyper-parameters (see
        ``shard_digests`` for the shards)."""
        return self._state.live_digest(max(self.committed, 0))

    def part_digests(self) -> dict[str, str]:
        """A digest of each registered part (what the state check compares)."""
        return self._state.part_digests()

    def shard_digests(self) -> dict[str, str]:
        """Sharded mode: ``{"start:stop": digest}`` of the optimizer state of each held shard
        (holders of one shard compare equal). Empty in replicated mode."""
        if self._zero is None:
            return {}
        return self._zero.shard_digests()

    # ------------------------------------------------------------------ the loops

    def steps(self, total: int | None = None) -> Iterator[Step]:
        """The loop API: one :class:`Step` per step, until ``total`` steps are committed;
        inside :meth:`epochs`, the rest of the current epoch's steps (``total`` ignored);
        neither: forever. Run each one's body inside ``with step:``; a failed attempt is
        retried inside ``step.batches()``, so code after the block runs once per committed
        (or adopted) step (``ftmesh.torch.loop`` names the two sharded-mode exceptions)."""
        if self._stream is not None and self._epoch is not None:
            yield from self._stream_epoch(self._stream, self._epoch)
            return
        while True:
            if self._epoch is not None:
                end = (self._epoch + 1) * self.sampler.steps_per_epoch
            elif total is not None:
                end = total
            else:
                end = None
            if end is not None and max(self.committed, 0) >= end:
                return
            yield from self._attempts()
            if self._epoch is not None and end is not None and self.committed > end:
                raise FtmeshError(
                    f"this member adopted step {self.committed} while its loop was in epoch "
                    f"{self._epoch} (steps up to {end}): it was away for longer than the rest "
                    "of an epoch, and the code between epochs cannot be replayed. Restart it "
                    "to rejoin."
                )

    def _stream_epoch(self, feed: StreamFeed, epoch: int) -> Iterator[Step]:
        """A stream's steps of ``epoch`` (0-based): until the committed position is in the
        next one."""
        from .stream import Position

        while feed.position.epoch <= epoch:
            yield from self._attempts()
            pos = feed.position
            if pos.epoch > epoch and pos != Position.start(len(pos.offsets), epoch + 1):
                raise FtmeshError(
                    f"this member adopted step {self.committed}, in the stream's epoch "
                    f"{pos.epoch}, while its loop was in epoch {epoch}: it was away for longer "
                    "than the rest of an epoch, and the code between epochs cannot be "
                    "replayed. Restart it to rejoin."
                )

    def epochs(self, epochs: int | Iterable[Any]) -> Iterator[Any]:
        """The epochs to train (``n``: 1..n, or any labels), starting at the mesh's: joins
        first, so a joiner or a resumed mesh starts at the epoch the mesh is in (and one whose
        last step is committed but whose end-of-epoch code has not run yet starts there,
        with no steps left). Inside, :meth:`steps` gives that epoch's remaining steps. When
        the last epoch's body is done, :meth:`finish` runs."""
        labels = list(range(1, epochs + 1)) if isinstance(epochs, int) else list(epochs)
        self.join()
        if self._stream is not None:  # (an epoch's start: its end-of-epoch code may not have run)
            from .stream import Position

            pos = self._stream.position
            fresh = pos == Position.start(len(pos.offsets), pos.epoch)
            first = pos.epoch - 1 if fresh and pos.epoch > 0 else pos.epoch
        else:
            spe = self.sampler.steps_per_epoch
            done = max(self.committed, 0)
            first = done // spe if (done % spe or done == 0) else done // spe - 1
        try:
            for i in range(first, len(labels)):
                self._epoch = i
                yield labels[i]
        finally:
            self._epoch = None
        self.finish()

    def step(self, loss_fn: Callable[[np.ndarray], torch.Tensor]) -> StepReport:
        """The closure API: run one committed step. ``loss_fn(indices)`` returns the *mean*
        loss of a micro-batch of this member's samples (not called when the share is
        empty)."""
        if self._stream is not None:
            raise LocalUsageError(
                "with a ShardedStream, use the loop API (trainer.steps(), step.batches()): a "
                "stream's samples are not indices"
            )
        if self._rounds is not None:
            return self._round(self._rounds, loss_fn)
        for attempt in self._attempts():
            with attempt:
                for idx in attempt.indices():
                    loss = loss_fn(idx)
                    attempt.record_loss(loss)
                    loss.backward()  # type: ignore[no-untyped-call]
                self.optimizer.step()
            attempt.report_read = True  # no code after the block: a hand-back is retried here
        assert self.last_report is not None
        return self.last_report

    def _round(self, rounds: Rounds, loss_fn: Callable[[np.ndarray], torch.Tensor]) -> StepReport:
        """``sync=DiLoCo(...)``: one committed round (``ftmesh.torch.diloco``): the inner
        steps, the mean outer gradient through the step's allreduce, the outer step."""
        for attempt in self._attempts():
            with attempt:

                def fill(step: Step = attempt) -> None:
                    if self.mesh.node_id in step.workers and not rounds.ran(step.index):
                        rounds.compute(
                            step.index,
                            step.indices_share,
                            self.config.micro_batch,
                            loss_fn,
                            self.buckets,
                        )
                    self._round_fill(step)

                attempt.contribute(fill)
                self._round_outer(attempt)
            attempt.report_read = True  # no code after the block: a hand-back is retried here
        assert self.last_report is not None
        return self.last_report

    def _round_inner(self, step: Step) -> AbstractContextManager[InnerRun] | None:
        """DiLoCo, the loop API: this attempt's inner steps, run by the body inside the
        returned context (``Rounds.inner_steps``); ``None`` when this member has none to run
        (it holds its outer gradient of the round already, or is a hot spare)."""
        rounds = self._rounds
        assert rounds is not None
        if self.mesh.node_id not in step.workers or rounds.ran(step.index):
            return None
        return rounds.inner_steps(step.index, step.indices_share, self.buckets)

    def _round_fill(self, step: Step) -> None:
        """DiLoCo: this member's contribution to the attempt's allreduce, its kept outer
        gradient over the members computing (zeros from a hot spare)."""
        rounds = self._rounds
        assert rounds is not None
        weight = 1.0 / len(step.workers) if self.mesh.node_id in step.workers else 0.0
        mean_loss = rounds.contribute(step.index, weight, self.buckets)
        # the header's loss: each member's mean inner loss times its share, so the report's
        # is the members' mean weighted by their shares
        self.buckets.header[1] = mean_loss * step.share

    def _round_outer(self, step: Step) -> None:
        """DiLoCo: the reduced mean outer gradient applied (every member alike)."""
        rounds = self._rounds
        assert rounds is not None
        verdict = self._verdict
        skip = verdict is not None and verdict.skip
        rounds.outer_step(step.index, skip, self._senders)

    @property
    def diloco_rounds_computed(self) -> int:
        """``sync=DiLoCo(...)``: the runs of a round's inner steps by this member, one per
        round but for a round run again on a new split (0 otherwise)."""
        return self._rounds.rounds_computed if self._rounds is not None else 0

    def resume(self) -> int:
        """Resume now rather than at the first step: freeze the registered state and load the
        newest valid checkpoint of ``checkpoint_dir``, if there is one. Returns the committed
        step count then (``-1``: nothing to resume), e.g. to tell that a restarted worker's
        checkpoint already holds the whole run."""
        self._open()
        return self.committed

    def join(self) -> None:
        """Enter the ring and sync (adopting the newest state) without computing; a no-op
        when already synced on the current view."""
        self._open()
        action = self._begin("join")
        assert isinstance(action, Finished)

    def finish(self, timeout: float = 60.0) -> None:
        """A last sync on the current view before leaving, so that a member whose final step
        failed after others committed it catches up instead of redoing it alone."""
        self._open()
        action = self._begin("finish", timeout)
        assert isinstance(action, Finished)

    def close(self) -> None:
        """Remove the trainer's hooks from the model's parameters and the optimizer."""
        if self._buckets is not None:
            self._buckets.close()
        if self._freezes is not None:
            self._freezes.stop()
        self._between.stop()
        if self._loader is not None:
            self._loader.close()  # its worker processes
        self._dist.close()
        if self._dist_bound:
            from . import distributed

            distributed.release()
        for h in self._hooks:
            h.remove()

    # ------------------------------------------------------------------ driving the machine

    def _open(self) -> None:
        """First use: the registered state is final; resume from a checkpoint if any."""
        if self._opened:
            return
        self._opened = True
        state = self._state
        state.frozen = True
        state.capture()  # the starting point (a fresh mesh adopts rank 0's)
        # DiLoCo's overlap: one more slot at the end, whether the member sent an outer
        # gradient (reduced: how many did; ``ftmesh.torch.diloco``)
        self._senders_slot = int(self._rounds is not None and self._rounds.overlap)
        slots = header_size(len(state.names), self.config.measures_speed) + self._senders_slot
        fragments = self._rounds.fragment_of if self._rounds is not None else None
        self._buckets = buckets = GradBuckets(
            self._params, self._bucket_bytes, slots, self._device_buckets(), fragments
        )
        layout = (state.layout, buckets.layout, self.sampler.layout)
        self._machine.registered(len(state.names), layout)
        cfg = self.config
        # compression="int8": one error-feedback residual per bucket; the header: exact
        tails = [0] * (len(buckets.buffers) - 1) + [slots]
        comps = per_stream(cfg.compression, tails)
        self._compression = {id(b): c for b, c in zip(buckets.buffers, comps, strict=True)}
        if cfg.failslow_freezes:
            self._freezes = FreezeWatch(cfg.failslow_freeze).start()
        if cfg.checkpoint_dir is not None:
            from ..state import latest_valid_checkpoint

            found = latest_valid_checkpoint(cfg.checkpoint_dir)
            if found is not None:
                self._driver.load_checkpoint(found.snapshot)
                log.info("resumed from checkpoint at step %d", self.committed)
        if self.checkpoints is not None and cfg.checkpoint_every > 0:
            self.checkpoints.check(self.state.nbytes())

    def _device_buckets(self) -> Callable[[torch.device], bool]:
        """Which parameters' buckets allreduce on their device (``GradBuckets``): those the
        mesh's GPU path takes (``SyncMesh.gpu``; enabled here for CUDA parameters unless
        ``gpu_collectives`` is off). int8 compression stages CUDA gradients through host
        memory (its kernels run on the host side of the TCP ring), and says so once."""
        cfg = self.config
        cuda = any(p.is_cuda for p in self._params)
        if cfg.compression not in (None, "none"):
            if cuda:
                log.info(
                    "compression=%r: CUDA gradients stage through host memory", cfg.compression
                )
            return lambda device: False
        gpu = self.mesh.gpu
        if gpu is None and cuda and cfg.gpu_collectives:
            gpu = self.mesh.enable_gpu()
        if gpu is None:
            return lambda device: False
        is_device = gpu.is_device
        return lambda device: bool(is_device(torch.empty(0, device=device)))

    def _attempts(self) -> Iterator[Step]:
        """One step: a ``Step`` whose attempts run inside its ``batches()`` until it
        commits (or is adopted); another ``Step`` only after a failure outside them."""
        self._open()
        action = self._begin("step")
        while isinstance(action, Compute):
            attempt = self._new_step(action)
            yield attempt
            if not attempt.exited:
                raise LocalUsageError(
                    "run each step's body inside `with step:` (the trainer retries a failed "
                    "attempt by handing the step to the loop again)"
                )
            assert attempt.next is not None
            action = attempt.next
            if isinstance(action, Compute) and not attempt.report_read:
                _unguarded_hand_back(attempt)
        if action.report is not None and action.report is not self.last_report:
            self._reported(action.report)  # adopted (a committed one was reported by _end)

    def _begin(self, kind: str, timeout: float | None = None) -> Compute | Finished:
        self._between.leave()
        self._poll_leave()
        if self._machine.committed == FRESH:  # (a run that lost its state must say so)
            self._machine.saw_step(self._published_step())
        return self._drive(self._machine.begin(time.monotonic(), kind, timeout))

    def _feed(self, outcome: Outcome) -> Compute | Finished:
        self._poll_leave()
        return self._drive(self._machine.feed(time.monotonic(), outcome))

    def _published_step(self) -> int:
        """The newest committed step that the members training (not left, not done) have
        published in their progress (``-1``: none), remembered per member so that a holder
        that died still counts. A member the ring leaves out (an accused insider, one nobody
        reaches) does not count, even for what it said before: its claim must not stop the
        others."""
        out = self.mesh.exclusions()
        seen = self._published_steps
        for m in self.mesh.members():
            try:
                info = read_member(m)
            except BadMetadataError:
                continue
            if info.progress is None or info.state == MemberState.LEFT or info.role == "done":
                seen.pop(info.node, None)
            else:
                seen[info.node] = max(seen.get(info.node, FRESH), info.progress.step)
        return max((step for node, step in seen.items() if node not in out), default=FRESH)

    def _poll_leave(self) -> None:
        """Tell the machine of a planned departure (``SyncMesh.request_leave``, a signal)."""
        if not self._machine.leave_requested and self.mesh.leave_requested():
            self._machine.request_leave()

    def _drive(self, action: Action) -> Compute | Finished:
        machine = self._machine
        while True:
            if isinstance(action, Compute | Finished):
                return action
            if isinstance(action, Raise):
                raise action.error from action.cause
            if isinstance(action, Depart):
                if action.report is not None:
                    self._reported(action.report)
                self._driver.depart(action.step)
            outcome = self._driver.perform(action)
            self._poll_leave()
            if machine.committed == FRESH:  # (as of now: an insider left out meanwhile)
                machine.saw_step(self._published_step())
            action = machine.feed(time.monotonic(), outcome)

    # ------------------------------------------------------------------ an attempt

    @property
    def buckets(self) -> GradBuckets:
        """The gradient buckets (made at the first step, once the registered state is
        final)."""
        if self._buckets is None:
            raise LocalUsageError("the trainer has not started a step yet")
        return self._buckets

    def _new_step(self, action: Compute) -> Step:
        self._view = action.view
        return Step(self._loop_side, action, *self._share(action))

    def _share(self, action: Compute) -> tuple[np.ndarray, list[np.ndarray]]:
        """This member's share of an attempt (sample indices; a stream's: positions in what
        it drew) and its micro-batches."""
        me, mb = self.mesh.node_id, self.config.micro_batch
        if self._stream is not None:  # (a hot spare draws nothing)
            drawn = self._stream.draw(
                action.index, action.workers, action.weights, me, mb, micro_batches
            )
            return np.arange(len(drawn.samples)), drawn.micro
        sampler = self.sampler
        assert isinstance(sampler, ElasticSampler)
        if action.kept and self._rounds is not None:  # DiLoCo: the kept round's share
            return self._rounds.kept_share(action.index), []
        if action.kept:  # the samples we computed the kept gradients on: none computed now
            kept = self._kept
            if kept is not None and kept.kept_for(action.index):
                return kept.indices, []
            return np.empty(0, dtype=np.int64), []  # (sends nothing: the attempt fails)
        if me in action.workers:
            share = sampler.indices(action.index, action.workers, me, action.weights)
        else:  # a hot spare: contributes nothing, applies the reduced gradients
            share = np.empty(0, dtype=np.int64)
        return share, micro_batches(share, mb)

    def _plan(self) -> Iterator[tuple[Key, list[int]]]:
        """The batch sampler's plan (``ftmesh.torch.data``): this member's micro-batches (a
        DiLoCo round's: its inner batches) of the current attempt's step and the steps after
        it, on the same compute set."""
        step = self._current
        if step is None:
            return
        action, me, mb = step.action, self.mesh.node_id, self.config.micro_batch
        sampler = self.sampler
        if me not in action.workers or action.kept or not isinstance(sampler, ElasticSampler):
            return
        inner = self._rounds.settings.steps_per_sync if self._rounds is not None else 0
        for index in range(action.index, action.index + LOOKAHEAD_STEPS):
            share = sampler.indices(index, action.workers, me, action.weights)
            if inner:  # DiLoCo: the round's inner batches, as ``Step.indices`` yields them
                from .diloco import inner_batches

                batches = inner_batches(share, inner)
            else:
                batches = micro_batches(share, mb)
            for k, idx in enumerate(batches):
                if len(idx):
                    yield (index, action.workers, action.weights, k), idx.tolist()

    def _arm(self, step: Step) -> None:
        """``with step:`` begins: the first attempt starts."""
        if self._current is not None and not self._current.exited:
            raise LocalUsageError("one step at a time")
        self._current = step
        self._start_attempt(step)

    def _retry(self, step: Step) -> NextAttempt | None:
        """An attempt failed inside ``step.batches()``: hand the failure to the machine and,
        when it wants the same step computed again, return the next attempt (the step resets
        to it and calls ``_start_attempt``: the body's loop over micro-batches goes on with
        the new share, so code after it and after the ``with`` block runs once per committed
        step). ``None``: the step was adopted (``step.report`` set) or the machine moved
        elsewhere (a fall-back to a checkpoint); the body ends and ``with step`` hands
        ``step.next`` to the iterator."""
        assert step.failure is not None
        nxt = self._feed(step.failure)
        if isinstance(nxt, Compute) and nxt.index == step.index:
            self._view = nxt.view
            return NextAttempt(nxt, *self._share(nxt))
        step.next = nxt
        if isinstance(nxt, Finished) and nxt.report is not None:
            step.report = nxt.report
            self._reported(nxt.report)  # adopted
        return None

    def _bind_torch_distributed(self, ring: ViewSession) -> None:
        """For the attempt, ``torch.distributed`` runs on ``ring`` (``ftmesh.torch.distributed``,
        ``TrainerConfig.torch_distributed``); unbound when the step ends."""
        self._dist.close()
        if not self.config.torch_distributed:
            return
        from . import distributed

        why = distributed.available()
        if not why:
            try:
                self._dist.enter_context(distributed.bound(ring))
                self._dist_bound = True
                return
            except LocalUsageError as exc:  # (another trainer took it meanwhile)
                why = str(exc)
        if not self._dist_warned:
            self._dist_warned = True
            log.warning("torch.distributed inside steps is off for this trainer: %s", why)

    def _start_attempt(self, step: Step) -> None:
        """An attempt starts: zero the gradients, fill the header."""
        buckets = self._buckets
        assert buckets is not None
        ring = self.mesh.session(step.action.view)
        self._bind_torch_distributed(ring)
        comps = self._compression
        for comp in comps.values():
            if comp is not None:  # (a retry: back to the residuals the step started with)
                comp.attempt()
        self._own_nonfinite = False
        self._verdict = None
        kept, action = self._kept, step.action
        if kept is not None and not action.kept:
            kept.start(action.index, step.indices_share, len(buckets.buffers))
        if self._rounds is not None and not action.kept:  # (a Δ of another split is dropped)
            self._rounds.attempt(action.index, step.indices_share)

        def launch(buf: Wire) -> Future[Any]:
            self._outgoing(step, buf)
            return ring.submit(CollectiveOp.allreduce("sum", comps[id(buf)]), buf)

        def run(buf: Wire) -> object:
            self._outgoing(step, buf)
            return ring.run(CollectiveOp.allreduce("sum", comps[id(buf)]), buf)

        # streaming DiLoCo: the step's fragment only (the same on every member: its index's)
        fragment = self._rounds.fragment(step.index) if self._rounds is not None else None
        buckets.start(launch, run, fragment)
        header = buckets.header
        header[0] = step.share
        if action.kept and self._rounds is None:  # the kept gradients go out as they are
            assert kept is not None
            buckets.micro_batch(1.0, last=True)
            header[1] = kept.loss_sum
            self._own_nonfinite = kept.nonfinite and kept.kept_for(action.index)
        if self._stream is not None:  # the planned count (a holder of ended shards took less)
            drawn = self._stream.attempt
            assert drawn is not None
            header[0] = drawn.counts.get(self.mesh.node_id, 0)
        header[2] = round_tag(step.index)
        if step.action.check:
            step.checks = self._state.check_values()
            header[HEADER_SLOTS : HEADER_SLOTS + len(step.checks)] = step.checks
        if self._senders_slot:  # DiLoCo's overlap: the outer gradient goes out now
            assert self._rounds is not None
            computing = self.mesh.node_id in step.workers
            header[-1] = float(self._rounds.send(step.index, computing, buckets))
            buckets.send()
        step.started = time.perf_counter()

    def _outgoing(self, step: Step, buf: Wire) -> None:
        """A bucket's allreduce is about to start: check our gradients in it; under
        ``recovery="keep"`` keep a copy of them as they go out, or, in a kept attempt, send
        the copy instead, rescaled to the mean over the samples the step trains."""
        kept, action = self._kept, step.action
        if kept is None:
            self._check_own(buf)
            return
        assert self._buckets is not None
        grads = self._buckets.gradients(buf)
        if action.kept:
            assert action.trained
            factor = step.samples / action.trained
            kept.contribute(action.index, id(buf), grads, factor)
            return
        self._check_own(buf)
        kept.keep(id(buf), grads, self._own_nonfinite)

    def _check_own(self, buf: Wire) -> None:
        """Before a bucket's allreduce: are our own gradients in it finite? If not, we send
        zeros instead (so the reduced gradients and an int8 residual stay finite) and say so
        in our gathered row: every member then skips the update alike."""
        assert self._buckets is not None
        grads = self._buckets.gradients(buf)
        if not all_finite(grads):
            self._own_nonfinite = True
            grads[:] = 0.0

    def _reduce(self, step: Step) -> None:
        """The end of a step's micro-batches: finish the allreduce and gather the rows; the
        machine fills in the header and judges it (``Measured`` -> ``Reduce`` ->
        ``Contributed`` -> ``Gather`` -> ``Gathered`` -> ``Apply``)."""
        buckets = self._buckets
        assert buckets is not None
        self._poll_leave()  # read last: the last bucket's allreduce carries it (protocol, 4)
        # shares="speed": our compute time is the body up to its last backward (the earlier
        # buckets' allreduces run meanwhile; the wait for them is not counted)
        seconds = time.perf_counter() - step.started
        if self._kept is not None and not step.action.kept:
            self._kept.loss_sum = float(buckets.header[1])
        checks = tuple(step.checks) if step.checks is not None else None
        fill = self._in_step(Measured(step.share, seconds, checks), Reduce)
        if fill.announce:
            buckets.header[COUNTER_SLOTS:HEADER_SLOTS] = leave_slots(step.rank)
            step.announced = True
        end = len(buckets.header) - self._senders_slot  # (the machine's header ends here)
        if len(fill.slots):
            buckets.header[end - len(fill.slots) : end] = fill.slots
        view = step.action.view
        mine = buckets.header[:end].copy()  # (reduced in place by the last bucket's allreduce)
        try:
            buckets.finish(timeout=self.config.step_timeout)
            # (after the last bucket's check: our flag covers every bucket)
            self._poll_leave()  # (a leave asked during the allreduce rides in our row)
            if self._freezes is not None:  # (said in our row: protocol.FLAG_FROZE)
                step.frozen += self._freezes.take()
            contributed = Contributed(mine, self._own_nonfinite, step.frozen > 0)
            gather = self._in_step(contributed, Gather)
            # Each member's own contribution, as it says it added it: what it claims about
            # itself is read from its row only (DESIGN-NOTES: the step header).
            row = gather.row
            if self._stream is not None:  # what we took of each shard rides along
                row = np.concatenate([row, self._stream.row()])
            rows = np.asarray(self.mesh.session(view).allgather(row).output)
        except FtmeshError as exc:
            failure = failure_of(exc)
            if failure is None:
                raise
            _abort(step, failure)
        if self._stream is not None and rows.ndim == 2:
            width = len(gather.row)
            problem = self._stream.gathered(rows[:, width:], view.node_ids)
            rows = rows[:, :width]
            if problem:
                _abort(step, Failed(Failure.DESYNC, f"step {step.number}: {problem}"))
        header = tuple(float(v) for v in buckets.header[:end])
        if self._senders_slot:
            self._senders = _sender_count(step, float(buckets.header[end]))
        # (the loss in the header may be NaN: only gradients count)
        finite = all(all_finite(buckets.gradients(b)) for b in buckets.buffers)
        judged = self._in_step(Gathered(header, rows, bool(finite)), Apply)
        verdict = judged.verdict
        self._report(view, verdict)
        if verdict.failed is not None:
            _abort(step, verdict.failed)
        if verdict.diverged:
            self._diverged(step, verdict.diverged, verdict.rows)
        if self._stream is not None:
            verdict = self._short_step(verdict)
        self._verdict = verdict
        step.loss_sum = header[1]
        if self._stream is not None and 0 < self._stream.taken != self._stream.stream.batch_size:
            # a short step's report.loss: the mean over the samples it took
            step.loss_sum *= self._stream.stream.batch_size / self._stream.taken
        step.leaving = judged.leaving
        step.speeds = verdict.speeds
        step.reduced = True

    def _short_step(self, verdict: StepVerdict) -> StepVerdict:
        """A stream's step that took fewer samples than its global batch (shards ended): the
        reduced gradients, scaled by ``1 / batch`` in the micro-batches, become the mean over
        the samples taken; a step that took none skips the update on every member."""
        assert self._stream is not None
        taken, batch = self._stream.taken, self._stream.stream.batch_size
        if taken == 0:
            return dataclasses.replace(verdict, skip=True)
        if taken != batch:
            with torch.no_grad():
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(batch / taken)
        return verdict

    def _in_step(self, outcome: Outcome, expected: type[_A]) -> _A:
        """Feed an outcome of the pending ``Compute``'s header (``_reduce``); the machine
        answers with the next header action, ``expected``."""
        action = self._machine.feed(time.monotonic(), outcome)
        if not isinstance(action, expected):
            raise AssertionError(f"the machine answered {action!r} to {type(outcome).__name__}")
        return action

    def _report(self, view: RingView, verdict: StepVerdict) -> None:
        """Hand the offences of other members to the accusation path (one strike each)."""
        me = self.mesh.node_id
        for o in verdict.offences:
            if 0 <= o.rank < view.size and view.node_ids[o.rank] != me:
                node = view.node_ids[o.rank]
                log.warning("member %s: step header %s (%s)", node, o.fault.value, o.detail)
                self.mesh.report_offence(node, f"step header: {o.fault.value} ({o.detail})")

    def _diverged(
        self, step: Step, parts: tuple[int, ...], rows: tuple[tuple[int, ...], ...]
    ) -> None:
        """Our state differs from that of members we are not a strict majority with (the
        rows are every member's own check values, gathered: a malformed contribution is a
        ``Failure.HEADER``, never this)."""
        names = self._state.names
        differ = [names[i] for i in parts]
        view = step.action.view
        groups = diverged_members(names, view.node_ids, [list(r) for r in rows])
        detail = "; ".join(
            f"{part}: " + " vs ".join("{" + ", ".join(g) + "}" for g in gs)
            for part, gs in groups.items()
        )
        raise StateDivergedError(
            f"members hold different state at step {step.index} in: {', '.join(differ)}. "
            f"{detail}. Something changed registered state on some members only (stepping a "
            "scheduler or changing a module outside the step's body, code that depends on "
            "the member, or a member running another version of the script)",
            groups,
        )

    def _before_optimizer_step(self, *_: Any) -> None:
        if self._rounds is not None:
            if self._rounds.running_inner:
                return  # a DiLoCo inner step (ftmesh.torch.diloco)
            raise LocalUsageError(
                "with sync=DiLoCo(...), optimizer.step() is an inner step: call it inside the "
                "loop over step.indices(), once per inner batch; the outer step is the "
                "trainer's, when that loop ends"
            )
        step = self._current
        if step is None or step.exited or not step.reduced:
            raise LocalUsageError(
                "optimizer.step() ran outside a trainer step, or before the step's gradients "
                "were reduced: call it inside `with step:`, after the loop over the step's "
                "micro-batches"
            )

    def _install_optimizer_methods(self, opt: torch.optim.Optimizer) -> None:
        """``opt.zero_grad()`` inside a step drops ``.grad`` and keeps the buckets' sum (the
        micro-batches' gradients add up whatever ``set_to_none``); ``opt.step()`` is skipped
        with every member's on non-finite gradients; in sharded mode (the trainer's optimizer
        only) ``optimizer.step()`` runs the sharded update."""
        zero_grad = opt.zero_grad

        def zero_grad_in_step(_opt: Any, set_to_none: bool = True) -> None:
            buckets = self._buckets
            if buckets is not None and buckets.armed:
                buckets.release()
            else:
                zero_grad(set_to_none)

        opt.zero_grad = types.MethodType(zero_grad_in_step, opt)  # type: ignore[method-assign]
        if self._zero is None:
            step_fn = opt.step

            def guarded_step(_opt: Any, closure: Any = None) -> Any:
                if self._skipping(opt):
                    return None
                return step_fn(closure)

            opt.step = types.MethodType(guarded_step, opt)  # type: ignore[method-assign]
        if self._zero is not None:

            def sharded_step(_opt: Any, closure: Any = None) -> None:
                self._sharded_step()

            opt.step = types.MethodType(sharded_step, opt)  # type: ignore[method-assign]

    def _skipping(self, opt: torch.optim.Optimizer) -> bool:
        """Whether the current step's update is skipped by every member (non-finite
        gradients: ``StepVerdict.skip``), checked as ``opt.step()`` is called."""
        self._before_optimizer_step()
        verdict = self._verdict
        if verdict is None or not verdict.skip:
            return False
        if self._rounds is not None and self._rounds.running_inner:
            return False
        opt._opt_called = True  # type: ignore[attr-defined]  # (LR schedulers check)
        return True

    def _sharded_step(self) -> None:
        """Step the held shards, then allgather every owner's updated parameters (and, on a
        checkpoint step, its optimizer state)."""
        self._before_optimizer_step()
        step, zero = self._current, self._zero
        assert step is not None and zero is not None
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # (LR schedulers check)
        view = step.action.view
        if self._verdict is not None and self._verdict.skip:  # (every member skips alike)
            zero.hold_still()
        else:
            flat_grad = torch.cat([p.grad.reshape(-1) for p in zero.params])  # type: ignore[union-attr]
            zero.update(flat_grad, (step.number, round_id(view.epoch)))
        with_state = self.config.checkpoint_due(step.number)
        try:
            gathered = self.mesh.session(view).allgather(zero.gather_input(with_state)).output
        except FtmeshError as exc:
            failure = failure_of(exc)
            if failure is None:
                raise
            _abort(step, failure)
        self._driver.checkpoint_state = zero.apply_gathered(gathered, with_state)
        zero.commit()

    def _end(self, step: Step, error: BaseException | None) -> bool:
        """``with step:`` ends; returns whether to swallow ``error``."""
        buckets = self._buckets
        assert buckets is not None
        self._dist.close()
        self._current = None
        failed = failure_of(error) if step.failure is None and error is not None else None
        if failed is not None:
            # A collective of the body itself failed (``torch.distributed`` on the step's view,
            # ``ftmesh.torch.distributed``): the attempt fails like any collective of the step.
            self._abandon(step)
            step.failure = failed
        if step.failure is not None and (
            error is None or isinstance(error, StepAborted) or failed is not None
        ):
            if step.next is None:  # failed outside step.batches() (a sharded optimizer.step,
                step.next = self._feed(step.failure)  # a torch.distributed call of the body)
            return True
        if error is None and not step.reduced:
            error = LocalUsageError(
                "a step's body ended before its gradients were reduced: iterate "
                "step.batches() (or step.indices()) to the end inside `with step:`"
            )
            self._abandon(step)
            raise error
        if error is not None:
            self._abandon(step)
            return False
        if self._stream is not None:  # the step commits: so does the stream's position
            self._stream.commit(self.mesh.node_id)
        self._state.capture()
        for comp in self._compression.values():
            if comp is not None:  # the step commits: its int8 residuals stand
                comp.settle()
        verdict = self._verdict
        step.next = self._feed(
            Computed(
                step.share,
                step.loss_sum,
                step.leaving,
                step.speeds,
                step.frozen,
                nonfinite=verdict.nonfinite if verdict is not None else (),
                skipped=verdict is not None and verdict.skip,
            )
        )
        if isinstance(step.next, Finished) and step.next.report is not None:
            step.report = step.next.report
            self._reported(step.next.report)
        return False

    def _reported(self, report: StepReport) -> None:
        self.last_report = report
        if self._kept is not None:
            self._kept.clear()
        self.mesh.report_progress(self._machine.progress())
        for hook in self._step_hooks:
            hook(self, report)
        self._between.enter(report.step)  # the user's time, until the next step begins

    def _publish_progress(self) -> None:
        self.mesh.report_progress(self._machine.progress())

    def _publish_between(self, seconds: float, step: int) -> None:
        """(``BetweenSteps``' thread) Publish that we are busy between steps."""
        progress = self._machine.progress()
        try:
            fault = between_text(seconds, step)
            self.mesh.report_progress(dataclasses.replace(progress, fault=fault))
        except MeshClosedError:  # the mesh closed before the trainer: no one left to tell
            return

    def _abandon(self, step: Step) -> None:
        """A step's body raised (not a step failure): its allreduces are out of order with
        the others', so the next attempt syncs first."""
        assert self._buckets is not None
        self._buckets.abandon(ABANDON_WAIT_S)
        self._machine.forget_sync()


class LoopSide:
    """The trainer's side of its steps (``ftmesh.torch.loop.StepDriver``): one per trainer,
    handed to every ``Step``, so that the loop reaches the trainer through these members
    only."""

    def __init__(self, trainer: ElasticTrainer) -> None:
        self._trainer = trainer

    @property
    def node_id(self) -> str:
        return self._trainer.mesh.node_id

    @property
    def sampler(self) -> ElasticSampler | StreamSizes:
        return self._trainer.sampler

    @property
    def buckets(self) -> GradBuckets:
        return self._trainer.buckets

    @property
    def loader(self) -> BatchSource | None:
        t = self._trainer
        return t._loader if t._loader is not None else t._stream

    def arm(self, step: Step) -> None:
        self._trainer._arm(step)

    def start(self, step: Step) -> None:
        self._trainer._start_attempt(step)

    def reduce(self, step: Step) -> None:
        self._trainer._reduce(step)

    def retry(self, step: Step) -> NextAttempt | None:
        return self._trainer._retry(step)

    def end(self, step: Step, error: BaseException | None) -> bool:
        return self._trainer._end(step, error)

    @property
    def inner_steps(self) -> int:
        rounds = self._trainer._rounds
        return rounds.settings.steps_per_sync if rounds is not None else 0

    def round_inner(self, step: Step) -> AbstractContextManager[InnerRun] | None:
        return self._trainer._round_inner(step)

    def round_fill(self, step: Step) -> None:
        self._trainer._round_fill(step)

    def round_outer(self, step: Step) -> None:
        self._trainer._round_outer(step)


def _sender_count(step: Step, reduced: float) -> int:
    """DiLoCo's overlap: the reduced senders slot, the count of members that sent an outer
    gradient; anything but a whole number up to the view's size is data of another round."""
    size = step.action.view.size
    if not (reduced.is_integer() and 0 <= reduced <= size):
        _abort(step, Failed(Failure.DESYNC, f"step {step.number}: {reduced} senders of {size}"))
    return int(reduced)


def _abort(step: Step, failure: Failed) -> NoReturn:
    """The attempt failed (``failure``): the step's body ends here (``StepAborted``; retried
    inside ``step.batches()`` or handed back, ``ftmesh.torch.loop``)."""
    step.failure = failure
    raise StepAborted(failure)


def _unguarded_hand_back(step: Step) -> None:
    """The loop came back for the next step after a hand-back (``ftmesh.torch.loop``: an
    attempt that failed where it cannot be retried inside the body) without looking at
    ``step.report``: its code after the block ran for an attempt that did not commit."""
    failure = step.failure
    what = f"{failure.kind.value}: {failure.detail}" if failure is not None else "failed"
    log.warning(
        "step %d: the attempt failed inside the body (%s) and was handed back after the "
        "`with step:` block, whose code after the block then ran for an attempt that did not "
        "commit; guard it with `if step.report is None: continue` (docs/PORTING.md)",
        step.number,
        what,
    )
