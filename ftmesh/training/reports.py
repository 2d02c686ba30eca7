"""What a member reports of its steps: the :class:`StepReport` of each run, and its counters.

Theory of operation. The step machine (``ftmesh.training.step``) ends every run that
commits a step with a :class:`StepReport`: the step count, the loss, the view it ran on, how
many attempts it took, whether it synced first and what the sync transferred, this
member's share, who computed and who announced leaving. A step is either *computed* (we ran
its compute and committed it) or *adopted* (others committed it and a sync gave us their
state: a joiner's first step, or a step whose end we missed; its loss is unknown, nan).
:class:`Counters` builds both reports and keeps the member's running counters alongside
(steps, samples, attempts, step and recovery times, bytes transferred, the smoothed
samples/s, the last fault), from which it makes the member's published ``Progress``
(``ftmesh.mesh.meta``, a pure record) and its ``TrainerStatistics`` (the metrics). Pure: no
clock, no I/O; the times come in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..mesh.meta import Progress
from ..stats import Histogram, TrainerStatistics
from .actions import Computed

if TYPE_CHECKING:
    from ..collective.view import RingView

SPS_SMOOTHING = 0.2
"""Weight of the newest step in the published samples/s (an exponential moving average)."""


@dataclass(frozen=True, slots=True)
class StepReport:
    step: int
    """The committed step count after this step (1 after the first step)."""
    loss: float
    """Mean loss over the step's global batch, all members together (``nan``: not recorded,
    or an adopted step)."""
    samples: int
    members: tuple[str, ...]
    """The members of the view the step ran on (ring order)."""
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
    computing: tuple[str, ...] = ()
    """The members that computed the step (the others of ``members`` were hot spares: over
    ``max_peers``, or sitting out as stragglers); ``()`` for an adopted step."""
    skipped: int = 0
    """Samples of the global batch the step did not train (``TrainerConfig.recovery="keep"``:
    the shares of the members lost during the step; ``loss`` and the update are then the
    mean over the ``samples - skipped`` trained). 0 for an adopted step, whatever it skipped:
    the member took that step's state in a sync, and nothing it holds then says what the
    committing attempt trained. A joiner knows nothing of the step; a member that failed at the
    step's end cannot tell whether the others committed the attempt it was in, or a later,
    kept attempt without it, which skipped its share as well; and the sync carries each
    member's committed step, state size and digest (``ftmesh.training.protocol``), not this.
    Reporting it would take one more slot per member in the sync vector, a protocol change.
    (``loss`` is ``nan`` for the same reason; ``samples_skipped_total`` counts the skipped
    samples of the steps this member computed only.)"""


@dataclass(frozen=True, slots=True)
class Ending:
    """What every report of a run says alike: the committed ``step`` count, the step's
    global batch (``samples``), the ``view`` it ended on, the ``attempts`` it took, and the
    last sync's bytes and seconds."""

    step: int
    samples: int
    view: RingView
    attempts: int
    sync_bytes: int
    sync_seconds: float


@dataclass(slots=True)
class Counters:
    """One member's step counters (``StepMachine.statistics``, ``StepMachine.progress``)."""

    step_seconds: Histogram = field(default_factory=Histogram)
    recovery_seconds: Histogram = field(default_factory=Histogram)
    samples_total: int = 0
    samples_skipped_total: int = 0
    """Samples of committed steps not trained (``StepReport.skipped``)."""
    steps_total: int = 0
    share: int = 0
    world_size: int = 0
    attempts_total: int = 0
    state_transfer_bytes: int = 0
    checkpoint_step: int = -1
    last_step_s: float = 0.0
    sps: float = 0.0
    """Samples per second this member computed, smoothed (``SPS_SMOOTHING``)."""
    last_fault: str = ""
    loss: float = math.nan
    """Loss of the last committed step (``StepReport.loss``)."""

    def ended(self, started: float, now: float, failed_at: float | None) -> None:
        """A run that began at ``started`` committed a step at ``now`` (``failed_at``: its
        first failed attempt)."""
        self.steps_total += 1
        self.last_step_s = now - started
        self.step_seconds.observe(self.last_step_s)
        if failed_at is not None:
            self.recovery_seconds.observe(now - failed_at)

    def adopted(self, ending: Ending, world: int) -> StepReport:
        """The report of a step others committed and we took in a sync (``world``: the
        members computing on its view)."""
        self.world_size = world
        self.share = 0
        self.loss = math.nan
        return StepReport(
            step=ending.step,
            loss=float("nan"),
            samples=ending.samples,
            members=ending.view.node_ids,
            epoch=ending.view.epoch,
            attempts=ending.attempts,
            synced=True,
            sync_bytes=ending.sync_bytes,
            sync_seconds=ending.sync_seconds,
            adopted=True,
        )

    def computed(
        self,
        ending: Ending,
        out: Computed,
        workers: tuple[str, ...],
        synced: bool,
        trained: int | None = None,
    ) -> StepReport:
        """The report of a step we computed (``out``) with ``workers``; ``synced``: the run
        synced first; ``trained``: the samples the step trained (``None``: all of them)."""
        self.world_size = len(workers)
        self.share = out.share
        self.samples_total += out.share
        trained = ending.samples if trained is None else trained
        skipped = ending.samples - trained
        self.samples_skipped_total += skipped
        self.loss = out.loss_sum / trained if trained else math.nan
        rate = out.share / max(self.last_step_s, 1e-6)
        self.sps = rate if self.steps_total == 1 else self.sps + SPS_SMOOTHING * (rate - self.sps)
        return StepReport(
            step=ending.step,
            loss=self.loss,
            samples=ending.samples,
            members=ending.view.node_ids,
            epoch=ending.view.epoch,
            attempts=ending.attempts,
            synced=synced,
            sync_bytes=ending.sync_bytes if synced else 0,
            sync_seconds=ending.sync_seconds if synced else 0.0,
            share=out.share,
            leaving=out.leaving,
            computing=workers,
            skipped=skipped,
        )

    def progress(self, committed: int, backend: str) -> Progress:
        """What the member publishes after a committed step (``committed``: its committed
        step count; ``SyncMesh.report_progress``)."""
        return Progress(
            step=max(committed, 0),
            step_s=self.last_step_s,
            share=self.share,
            sps=self.sps,
            world=self.world_size,
            backend=backend,
            fault=self.last_fault,
        )

    def statistics(
        self,
        committed: int,
        straggler_steps: int,
        failslow_pauses: int,
        nonfinite_steps: int,
        *,
        recoveries: int,
        fallbacks: int,
        sync: tuple[int, float],
    ) -> TrainerStatistics:
        """A frozen snapshot (``committed``: the committed step count; the others: the
        pace's, the header judge's and the machine's counters; ``sync``: the last sync's
        bytes and seconds)."""
        return TrainerStatistics(
            committed_step=max(committed, 0),
            world_size=self.world_size,
            share=self.share,
            samples_total=self.samples_total,
            steps_total=self.steps_total,
            attempts_total=self.attempts_total,
            step_seconds=self.step_seconds.snapshot(),
            recovery_seconds=self.recovery_seconds.snapshot(),
            state_transfer_bytes_total=self.state_transfer_bytes,
            checkpoint_step=self.checkpoint_step,
            straggler_steps_total=straggler_steps,
            failslow_pauses_total=failslow_pauses,
            nonfinite_steps_total=nonfinite_steps,
            loss=self.loss,
            recoveries_total=recoveries,
            fallbacks_total=fallbacks,
            last_sync_bytes=sync[0],
            last_sync_seconds=sync[1],
            samples_skipped_total=self.samples_skipped_total,
        )
