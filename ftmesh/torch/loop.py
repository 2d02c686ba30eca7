"""The loop API: one step, attempted until it commits, in ordinary PyTorch
(``ElasticTrainer.steps``).

Theory of operation. ``for step in trainer.steps(): with step: ...`` — the iterator hands the
loop one :class:`Step` per *step*; the ``with`` block is the step's body. Inside it the user
iterates ``step.batches()`` (or ``step.indices()``): this member's share of the step's global
batch, in micro-batches, with ``loss.backward()`` for each; when the iteration ends, the
gradients are the mean over the whole global batch, reduced across the mesh and checked, and
the user may clip them, unscale them (``GradScaler``), step the optimizer and the schedulers,
log. Where each hook runs:

* ``with step:`` (entering) — the first attempt starts: gradients are zeroed (the trainer owns
  them: no ``zero_grad()`` needed), a state check's digests are taken;
* each micro-batch's ``backward`` — gradients accumulate in the buckets; during the last one
  the buckets are allreduced as they complete;
* the end of ``step.batches()`` — the last bucket is reduced and the header checked (a state
  divergence raises ``StateDivergedError``);
* ``optimizer.step()`` — the user's, unchanged (a pre-hook refuses it before the gradients
  are reduced); in sharded mode the trainer's sharded update, which ends with an allgather;
* the end of the ``with`` block — the step is committed: registered objects other than
  modules and optimizers are captured (``ftmesh.torch.state``), a checkpoint may be written.
  ``step.report`` is then set.

**Code after the ``with`` block runs once per committed step**, and so does the body's code
after its loop over micro-batches. A failed attempt (a peer lost, the ring broke, data of
another round) is retried *inside* ``step.batches()``: the trainer re-syncs and the loop over
micro-batches goes on with the next attempt's share (``step.attempt``, ``step.share``,
``step.workers``, ``step.rank`` change; the gradients start from zero again), so only the code
inside that loop runs again. The loop may get no micro-batch at all: a member sitting out as
a straggler (``ftmesh.training.stragglers``) takes part in the step with a share of 0, its
body and its ``torch.distributed`` calls included, so the body's code after the loop must
not assume one (``examples/mnist_port.py``). Under ``recovery="keep"`` a retry after a loss
may instead send the gradients this member already computed (a *kept* attempt,
``step.action.kept``): the loop then gets no micro-batch for it (``step.share`` is what was
kept). When the others committed the step meanwhile (this member failed at its very end),
this member adopts it: ``step.batches()`` ends the body (:class:`StepAborted`, swallowed by
``with step``), ``step.report`` is the adopted step's (``report.adopted``), and the code
after the block runs once for it, like the others'.

Three failures cannot be retried inside the body, and hand the loop a new :class:`Step` for the
step after the block, with ``step.report is None``: with ``shard_optimizer=True``, a failure of
``optimizer.step()``'s allgather (after a successful reduction), and a fall-back to a disk
checkpoint (the sharded state was lost); and a failed ``torch.distributed`` collective called
by the body itself (a metric's sync: ``ftmesh.torch.distributed``). A loop that shards its
optimizer or syncs through ``torch.distributed`` in its body guards code after the block with
``if step.report is None: continue``; a loop that does not look at ``step.report`` after
such a hand-back gets a WARNING naming the step and the failure (its code after the block
ran for an attempt that did not commit). Any other exception leaves the ``with`` block as
usual (the step is not committed).

DiLoCo rounds (``sync=DiLoCo(...)``, ``ftmesh.torch.diloco``): a step is a round, and its body
is the round's inner steps. ``step.indices()`` yields this member's inner batches (its share
of the round split into ``H`` of them, each whole: ``micro_batch`` does not split them), and
the body runs one inner step on each, ``optimizer.step()`` included, inside the loop (the
trainer's ``Rounds.inner_steps``: the buckets detached, the member's own inner optimizer
state). When the loop ends, the outer gradient is reduced and the outer step applied, both the
trainer's: an ``optimizer.step()`` after the loop is refused. A retry yields nothing to a
member that holds its outer gradient of the round (its inner steps are not run again) and its
new share's inner batches to one that does not (a joiner). ``record_loss`` counts in the
round's reported loss; ``step.batches()`` (a ``DataLoader``'s plan) is refused. A body that
raises in the middle of its inner steps leaves the model holding the global parameters
(``with step`` closes the loop's generator).

Between steps is the user's time: evaluating, saving or logging on one member, for longer than
the data plane's ``io_timeout``, does not fail the others' next attempt. After a second of it
the member publishes ``between steps Ns (after step K)`` in its progress
(``ftmesh.torch.between``); the others' collective then waits for its first frame, while
membership holds it alive, up to ``CollectiveConfig.start_wait`` (600 s;
``ftmesh.collective.engine``), and says in its log whom it waits for.

The two sides. A :class:`Step` holds what the user reads (the attempt, the share, the rank)
and runs the body's hooks; what they do to the mesh and the gradients belongs to the trainer,
which the step reaches only through :class:`StepDriver` (the trainer's ``LoopSide``): ``arm``
(the ``with`` block begins), ``reduce`` (the micro-batches end), ``retry`` (an attempt failed
inside them: the next attempt, or ``None``), ``start`` (that attempt begins) and ``end`` (the
block ends). The trainer ends an attempt by setting ``step.failure`` and raising
:class:`StepAborted`; it reads and sets the step's public fields, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch

from ..errors import FtmeshError, LocalUsageError
from ..training.actions import (
    Compute,
    Failed,
    Finished,
)
from ..training.step import (
    StepReport,
)

if TYPE_CHECKING:
    from .buckets import GradBuckets
    from .data import BatchSource
    from .diloco import InnerRun
    from .sampler import ElasticSampler
    from .stream import StreamSizes


class NextAttempt(NamedTuple):
    """A retry of the same step (``StepDriver.retry``): the machine's ``Compute`` for it, this
    member's share of sample indices, and that share in micro-batches."""

    action: Compute
    share: np.ndarray
    micro: list[np.ndarray]


class StepDriver(Protocol):
    """The trainer's side of a :class:`Step` (see the module docstring): everything a step
    does to the mesh, the gradients and the data goes through these members."""

    @property
    def node_id(self) -> str:
        """This member's node id (its rank in an attempt's view)."""
        ...

    @property
    def sampler(self) -> ElasticSampler | StreamSizes:
        """The data's sampler (a step's global batch size, its epoch)."""
        ...

    @property
    def buckets(self) -> GradBuckets:
        """The gradient buckets (micro-batch scaling, the header's loss slot)."""
        ...

    @property
    def loader(self) -> BatchSource | None:
        """The trainer's ``DataLoader`` face, or its stream (``None`` with an
        ``ElasticSampler``)."""
        ...

    def arm(self, step: Step) -> None:
        """``with step:`` begins: the step is the current one, its first attempt starts."""
        ...

    def start(self, step: Step) -> None:
        """A retry's attempt (``Step`` already reset by ``retry``'s answer) starts."""
        ...

    def reduce(self, step: Step) -> None:
        """The micro-batches ended: reduce and judge the gradients; a failed attempt sets
        ``step.failure`` and raises ``StepAborted``."""
        ...

    def retry(self, step: Step) -> NextAttempt | None:
        """The attempt failed inside the micro-batches: the next attempt of the same step,
        or ``None`` when the body ends (adopted, or the machine moved elsewhere:
        ``step.next`` is set)."""
        ...

    def end(self, step: Step, error: BaseException | None) -> bool:
        """``with step:`` ends; returns whether to swallow ``error``."""
        ...

    @property
    def inner_steps(self) -> int:
        """DiLoCo rounds (``sync=DiLoCo(...)``): the inner steps of a step; 0: synchronous
        steps."""
        ...

    def round_inner(self, step: Step) -> AbstractContextManager[InnerRun] | None:
        """DiLoCo: the context the attempt's inner steps run in (``Rounds.inner_steps``), or
        ``None`` when this member runs none (it holds its outer gradient, or is a spare)."""
        ...

    def round_fill(self, step: Step) -> None:
        """DiLoCo: write this member's outer gradient into the gradient buckets."""
        ...

    def round_outer(self, step: Step) -> None:
        """DiLoCo: apply the reduced mean outer gradient (the outer optimizer's step)."""
        ...


class StepAborted(FtmeshError):
    """The step's body ends early (``failure``: the attempt that failed): the step was adopted,
    or failed where it cannot be retried inside the body (see the module docstring). ``with
    step:`` swallows it. Seen only by code that catches exceptions inside a step's body."""

    def __init__(self, failure: Failed) -> None:
        super().__init__(f"step attempt failed ({failure.kind.value}): {failure.detail}")
        self.failure = failure


class StateDivergedError(FtmeshError):
    """Members hold different registered state (``parts``: the part names, each with the
    groups of members that agree). Raised on every member, never retried."""

    def __init__(self, msg: str, parts: dict[str, list[list[str]]]) -> None:
        super().__init__(msg)
        self.parts = parts


class Step:
    """One step, attempted until it commits; see the module docstring."""

    def __init__(
        self,
        driver: StepDriver,
        action: Compute,
        share: np.ndarray,
        micro: list[np.ndarray],
    ) -> None:
        self._driver = driver
        self.index = action.index
        """The step's 0-based index (its place in the data: ``ElasticSampler``)."""
        self.number = action.index + 1
        """The committed step count once this step commits (``StepReport.step``)."""
        self.samples = driver.sampler.batch_size(action.index)
        """Samples of the step's global batch."""
        self.epoch = driver.sampler.epoch_of(action.index)
        """The 0-based epoch of the step."""
        self._report: StepReport | None = None
        self.report_read = False
        """The code after the block looked at :attr:`report` (a hand-back it did not look at
        is logged: see the module docstring)."""
        self._entered = False
        self._iterated = False
        self._inner_gen: Generator[np.ndarray, None, None] | None = None
        self.exited = False
        self.frozen = 0.0
        """Seconds this member's process stood still, taken as its rows went out (a freeze
        counts for the step that commits: ``Computed.frozen``)."""
        self.next: Compute | Finished | None = None
        """What the trainer does after this step (set when the step committed, was adopted,
        or, in the cases the module docstring names, when an attempt failed)."""
        self._attempt(action, share, micro)

    def _attempt(self, action: Compute, share: np.ndarray, micro: list[np.ndarray]) -> None:
        """(Re)set what belongs to one attempt: the first, or a retry on a new view."""
        view = action.view
        self.action = action
        self.attempt = action.attempt
        """The attempt (1, 2, ...); a retry happens inside ``step.batches()``."""
        self.rank = view.rank_of(self._driver.node_id)
        """This member's place in the ring (node-id order) for this attempt."""
        self.world_size = view.size
        """Members in the ring, each applying this step (hot spares included)."""
        self.is_leader = self.rank == 0
        """Whether this member is the ring's first (log and save here, once per step)."""
        self.workers = action.workers
        """The members computing this attempt."""
        self.share = len(share)
        """Samples this member computes."""
        self.indices_share = share
        self._micro = micro
        self._size = 0  # samples of the micro-batch being computed
        self._k = 0  # its place in this attempt's micro-batches
        self.reduced = False
        self.failure: Failed | None = None
        self.loss_sum = 0.0
        self._inner: InnerRun | None = None  # DiLoCo: the inner steps being run
        self.checks: list[int] | None = None
        self.announced = False
        """This member set its leave bit in the step's header (a planned departure)."""
        self.leaving: tuple[str, ...] = ()
        """The members that announced in the step that they leave after it."""
        self.started = 0.0
        """``time.perf_counter()`` when the attempt began (the compute time's start)."""
        self.speeds: tuple[float, ...] = ()
        """``shares="speed"``: the agreed speeds of the reduced header."""

    @property
    def report(self) -> StepReport | None:
        """Set when the step committed (at the end of the ``with`` block), or when this
        member adopted it (``report.adopted``); ``None`` after the block when the attempt
        was handed back (see the module docstring)."""
        if self.exited:
            self.report_read = True
        return self._report

    @report.setter
    def report(self, report: StepReport) -> None:
        self._report = report

    @property
    def micro_batches(self) -> int:
        """How many micro-batches this member's share runs in."""
        return len(self._micro)

    def __enter__(self) -> Step:
        if self._entered:
            raise LocalUsageError("a step's `with` block runs once; the trainer retries by itself")
        self._entered = True
        self._driver.arm(self)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: Any) -> bool:
        self.exited = True
        if self._inner_gen is not None:  # DiLoCo: inner steps the body left (it raised) end
            self._inner_gen.close()  # here: the model holds the global parameters again
        return self._driver.end(self, ev)

    def _running(self) -> None:
        if not self._entered or self.exited:
            raise LocalUsageError("use a step's micro-batches inside its `with step:` block")

    def indices(self) -> Iterator[np.ndarray]:
        """This member's share as micro-batches of sample indices (0-based, into the
        dataset); iterate to the end, running backward on each: the gradients are then
        reduced. When the attempt fails, the iteration goes on with the next attempt's
        share (the micro-batches start over); it ends once the gradients are reduced, or
        when this member adopted the step (the body then ends: ``StepAborted``)."""
        self._running()
        if self._iterated:
            raise LocalUsageError("a step's micro-batches are iterated once")
        driver = self._driver
        if driver.inner_steps:
            self._inner_gen = self._inner_batches()
            yield from self._inner_gen
            return
        for _ in range(1 << 40):  # bounded: the trainer's step_timeout ends a step's retries
            self._iterated = True
            buckets = driver.buckets
            micro = self._micro
            for k, idx in enumerate(micro):
                last = k == len(micro) - 1
                self._size, self._k = len(idx), k
                buckets.micro_batch(len(idx) / self.samples, last)
                yield idx
                if not last:
                    buckets.between(len(idx) / len(micro[k + 1]))
            self._size = 0
            if self._reduced_or_retried():
                return

    def _inner_batches(self) -> Generator[np.ndarray, None, None]:
        """DiLoCo rounds: this member's share of the round as its inner batches (one per inner
        step, whole: ``micro_batch`` does not split them), which the body trains with its
        optimizer's steps; when they end, the outer gradient is reduced (the retries as in
        :meth:`contribute`: a member that holds its outer gradient of the round gets no
        batch again) and the outer step applied."""
        from .diloco import inner_batches  # (DiLoCo only: a plain trainer never loads it)

        driver = self._driver
        inner = driver.inner_steps
        for _ in range(1 << 40):  # bounded: the trainer's step_timeout ends a step's retries
            self._iterated = True
            run = driver.round_inner(self)
            if run is not None:
                with run as acc:
                    self._inner = acc
                    try:
                        for k, idx in enumerate(inner_batches(self.indices_share, inner)):
                            if len(idx):
                                self._size, self._k = len(idx), k
                                yield idx
                    finally:
                        self._size = 0
                        self._inner = None
            driver.round_fill(self)
            if self._reduced_or_retried():
                driver.round_outer(self)
                return

    def contribute(self, fill: Callable[[], None]) -> None:
        """Instead of :meth:`indices`: ``fill()`` writes this member's contribution to the
        step's allreduce into the gradient buckets (DiLoCo's outer gradient,
        ``ftmesh.torch.diloco``), once per attempt; then the gradients are reduced. A failed
        attempt is retried here, like in :meth:`indices` (``fill`` runs again, on the new
        attempt's fields); the body ends when this member adopted the step."""
        self._running()
        if self._iterated:
            raise LocalUsageError("a step's contribution is made once")
        for _ in range(1 << 40):  # bounded: the trainer's step_timeout ends a step's retries
            self._iterated = True
            fill()
            if self._reduced_or_retried():
                return

    def _reduced_or_retried(self) -> bool:
        """Reduce this attempt's contribution: True when reduced; False when the attempt
        failed and the next one is set up (run the body's contribution again); raises when
        there is none."""
        driver = self._driver
        try:
            driver.reduce(self)
        except StepAborted:
            nxt = driver.retry(self)
            if nxt is None:
                raise
            self._attempt(*nxt)
            driver.start(self)
            return False
        return True

    def batches(self) -> Iterator[Any]:
        """This member's share as micro-batches from the trainer's ``DataLoader`` (collated as
        the loader does; with ``sync=DiLoCo(...)``, a round's inner batches: one
        ``optimizer.step()`` each); see :meth:`indices`."""
        loader = self._driver.loader
        if loader is None:
            raise LocalUsageError(
                "step.batches() needs a trainer built with a DataLoader or a ShardedStream; "
                "with an ElasticSampler, iterate step.indices()"
            )
        for _ in self.indices():
            yield loader.next_batch((self.index, self.workers, self.action.weights, self._k))

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Count this micro-batch's mean ``loss`` in the step's reported loss
        (``StepReport.loss``: the mean over the global batch, all members). Optional; costs
        a device sync for a tensor."""
        if not self._size:
            raise LocalUsageError(
                "record_loss() belongs inside the loop over a step's micro-batches"
            )
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if self._inner is not None:  # DiLoCo: the round's kept loss (a retry reports it)
            self._inner.loss_sum += value * self._size
            return
        self._driver.buckets.header[1] += value * self._size
