"""Numbers a component keeps about itself, cheap enough for hot paths, read by the metrics
exporter (``ftmesh.metrics``) and by ``statistics()`` snapshots.

Theory of operation: a component owns plain counters (ints in a dict or attributes) and, for
durations and sizes, a :class:`Histogram` with fixed bucket bounds. ``observe`` is a bisect
and two additions, with no lock: the GIL makes each list item increment atomic enough for
monitoring (a scrape racing an observation may see the count and the sum one observation
apart, which Prometheus tolerates). Readers take a :class:`HistogramSnapshot`, a frozen
copy. Nothing here formats or serves anything.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import LocalUsageError

SECONDS_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Upper bounds (seconds) for latencies from a sub-millisecond allreduce to a minute-long
recovery; an implicit ``+Inf`` bucket follows."""


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    """Upper bounds of the buckets, ascending; the ``+Inf`` bucket is implicit."""
    counts: tuple[int, ...]
    """Observations per bucket (not cumulative), ``len(bounds) + 1`` entries."""
    total: float
    """Sum of all observed values."""
    count: int
    """Number of observations."""

    def cumulative(self) -> list[int]:
        """Counts of observations ``<= bound`` for each bound, then the total (``+Inf``)."""
        out, running = [], 0
        for c in self.counts:
            running += c
            out.append(running)
        return out


class Histogram:
    """Fixed-bucket histogram; see the module docstring."""

    __slots__ = ("_bounds", "_counts", "_total")

    def __init__(self, bounds: Sequence[float] = SECONDS_BUCKETS) -> None:
        b = tuple(float(x) for x in bounds)
        if list(b) != sorted(set(b)):
            raise LocalUsageError("histogram bounds must be strictly ascending")
        self._bounds = b
        self._counts = [0] * (len(b) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._total += value

    def snapshot(self) -> HistogramSnapshot:
        counts = tuple(self._counts)
        return HistogramSnapshot(self._bounds, counts, self._total, sum(counts))


@dataclass(frozen=True, slots=True)
class LinkStatistics:
    """What a member knows of its data-plane connection to one neighbour
    (``DataPlane.links``; the kernel's figures: ``ftmesh.collective.links``)."""

    sent_bytes: int = 0
    """Payload bytes sent to the neighbour in collectives that completed, over every ring."""
    min_rtt_s: float = 0.0
    """The smallest round trip the kernel saw on the connection (seconds; 0: not known)."""
    delivery_rate: float = 0.0
    """Bytes per second the kernel last measured delivered while the sender was not
    application limited (0: not yet): what the path carried when it had to."""
    retransmits: int = 0
    """Segments the kernel sent again on the connection."""


@dataclass(frozen=True, slots=True)
class CollectiveStatistics:
    """What a data plane did since it started (``DataPlane.statistics()``)."""

    seconds: dict[tuple[str, str], HistogramSnapshot]
    """Duration of completed collectives per ``(op, backend)``: op is ``allreduce``,
    ``reduce_scatter``, ``allgather``, ``broadcast`` or ``barrier``; backend ``tcp``,
    ``nccl`` or ``staging``."""
    bytes_total: dict[tuple[str, str], int]
    """Payload bytes of completed collectives per ``(op, backend)`` (the input's size)."""
    aborts_total: dict[str, int]
    """Collectives that ended with an abort, per abort kind (``lost``, ``superseded``, ...)."""
    links: dict[str, LinkStatistics] = field(default_factory=dict)
    """Per neighbour (node id) this member sent collectives to (``DataPlane.links``)."""


@dataclass(frozen=True, slots=True)
class TrainerStatistics:
    """What a trainer did since it started (``ElasticTrainer.statistics()``)."""

    committed_step: int
    """Steps committed (0 before the first)."""
    world_size: int
    """Members that computed the last committed step."""
    share: int
    """Samples this member computed in the last committed step."""
    samples_total: int
    """Samples this member computed over all committed steps."""
    steps_total: int
    """Steps this member committed (trained or adopted)."""
    attempts_total: int
    """Attempts of those steps: ``steps_total`` plus every retry."""
    step_seconds: HistogramSnapshot
    """Wall time of each committed step, retries included."""
    recovery_seconds: HistogramSnapshot
    """From a failed attempt (a fault) to the next committed step."""
    state_transfer_bytes_total: int
    """State bytes this member fetched from others (joins, syncs)."""
    checkpoint_step: int
    """Step of the newest checkpoint this member wrote; -1 if none."""
    straggler_steps_total: int = 0
    """Steps this member sat out of the compute set as a straggler (a hot spare)."""
    failslow_pauses_total: int = 0
    """Times this member stepped out of the ring as fail-slow (``ftmesh.torch.freezes``)."""
    nonfinite_steps_total: int = 0
    """Committed steps whose update every member skipped: some member's gradients were
    non-finite (``ftmesh.training.step.StepVerdict``)."""
    loss: float = float("nan")
    """Mean loss of the last committed step over its global batch (``StepReport.loss``);
    ``nan`` before the first step and after an adopted one."""
    recoveries_total: int = 0
    """Failed attempts (each cost a retry of its step; ``ElasticTrainer.recoveries``)."""
    fallbacks_total: int = 0
    """Times the sharded state was lost and training resumed from a checkpoint
    (``ElasticTrainer.fallbacks``)."""
    last_sync_bytes: int = 0
    """State bytes fetched in the last sync (0: it was not behind)."""
    last_sync_seconds: float = 0.0
    """Seconds the last sync took (agreement plus state transfer)."""
    samples_skipped_total: int = 0
    """Samples of committed steps that were not trained: the shares of members lost during
    a step under ``TrainerConfig.recovery="keep"`` (``StepReport.skipped``)."""
