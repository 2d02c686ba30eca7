"""The Prometheus view of one member: a custom collector over the snapshots its parts keep.

Theory of operation: nothing here is called on a hot path. The node, the data plane and the
trainer keep their own counters and histograms (``ftmesh.stats``); at scrape time, in the
node's trio thread, ``MeshCollector.collect`` reads the node's members and counters and the
snapshots registered in ``Node.statistics_sources`` and turns them into metric families.
Names follow Prometheus conventions: base units, ``_total`` counters, ``_seconds``
histograms. ``METRICS`` lists every family with its labels; it is the contract dashboards
and alerts rely on (tests compare a scrape against it, so renaming one is a visible change).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .. import __version__
from ..membership.messages import MemberState
from ..stats import CollectiveStatistics, HistogramSnapshot, TrainerStatistics

if TYPE_CHECKING:
    from ..net.node import Node

METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ftmesh_info": ("gauge", ("mesh", "node", "name", "version")),
    "ftmesh_members": ("gauge", ("state",)),
    "ftmesh_suspicions_total": ("counter", ()),
    "ftmesh_gossip_packets_total": ("counter", ("direction",)),
    "ftmesh_gossip_bytes_total": ("counter", ("direction",)),
    "ftmesh_dropped_total": ("counter", ("reason",)),
    "ftmesh_collective_seconds": ("histogram", ("op", "backend")),
    "ftmesh_collective_bytes_total": ("counter", ("op", "backend")),
    "ftmesh_collective_aborts_total": ("counter", ("kind",)),
    "ftmesh_link_sent_bytes_total": ("counter", ("peer",)),
    "ftmesh_link_min_rtt_seconds": ("gauge", ("peer",)),
    "ftmesh_link_delivery_rate_bytes": ("gauge", ("peer",)),
    "ftmesh_link_retransmits_total": ("counter", ("peer",)),
    "ftmesh_train_committed_step": ("gauge", ()),
    "ftmesh_train_step_seconds": ("histogram", ()),
    "ftmesh_train_samples_total": ("counter", ()),
    "ftmesh_train_steps_total": ("counter", ()),
    "ftmesh_train_world_size": ("gauge", ()),
    "ftmesh_train_share": ("gauge", ()),
    "ftmesh_train_attempts_total": ("counter", ()),
    "ftmesh_recovery_seconds": ("histogram", ()),
    "ftmesh_state_transfer_bytes_total": ("counter", ()),
    "ftmesh_checkpoint_step": ("gauge", ()),
    "ftmesh_train_straggler_steps_total": ("counter", ()),
    "ftmesh_train_failslow_pauses_total": ("counter", ()),
    "ftmesh_train_nonfinite_steps_total": ("counter", ()),
    "ftmesh_train_skipped_samples_total": ("counter", ()),
    "ftmesh_train_loss": ("gauge", ()),
    # prometheus_client's ProcessCollector (Linux: read from /proc) and PlatformCollector
    "process_virtual_memory_bytes": ("gauge", ()),
    "process_resident_memory_bytes": ("gauge", ()),
    "process_start_time_seconds": ("gauge", ()),
    "process_cpu_seconds_total": ("counter", ()),
    "process_open_fds": ("gauge", ()),
    "process_max_fds": ("gauge", ()),
    "python_info": ("gauge", ("implementation", "major", "minor", "patchlevel", "version")),
}
"""Every metric family: its type and label names. The training families appear once a
trainer runs on the member, the collective ones once a data plane does; the ``process_*``
ones on Linux only (they read ``/proc``)."""

_STATES = {
    MemberState.ALIVE: "alive",
    MemberState.SUSPECT: "suspect",
    MemberState.DEAD: "dead",
    MemberState.LEFT: "left",
}
_TRAFFIC = (
    ("tx_packets", "tx_bytes", "tx"),
    ("rx_packets", "rx_bytes", "rx"),
)


def drop_reasons(counters: dict[str, int]) -> dict[str, int]:
    """The drop and refusal counters among a node's counters, by reason: every counter whose
    name says that input was dropped or refused (``rx_dropped_bad_mac`` -> ``bad_mac``,
    ``tcp_refused_busy`` -> ``tcp_refused_busy``)."""
    out: dict[str, int] = {}
    for key, n in counters.items():
        if key.startswith("rx_dropped_"):
            out[key.removeprefix("rx_dropped_")] = out.get(key.removeprefix("rx_dropped_"), 0) + n
        elif "dropped" in key or "refused" in key:
            out[key] = out.get(key, 0) + n
    return out


class MeshCollector:
    """Collects one member's metrics; see the module docstring."""

    def __init__(self, node: Node) -> None:
        self._node = node

    def describe(self) -> list[Metric]:
        return []  # families vary with what runs: no registration-time checks

    def collect(self) -> Iterator[Metric]:
        node = self._node
        yield from self._membership(node)
        for source in list(node.statistics_sources.values()):
            snap = source()
            if isinstance(snap, CollectiveStatistics):
                yield from _collective(snap)
            elif isinstance(snap, TrainerStatistics):
                yield from _training(snap)

    def _membership(self, node: Node) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "ftmesh_info", "This member's identity.", labels=METRICS["ftmesh_info"][1]
        )
        info.add_metric([node.config.mesh, node.node_id, node.name, __version__], 1)
        yield info
        members = GaugeMetricFamily(
            "ftmesh_members", "Members by state, as this member sees the mesh.", labels=["state"]
        )
        counts = dict.fromkeys(_STATES.values(), 0)
        for m in node.members():
            counts[_STATES[m.state]] += 1
        for state, n in counts.items():
            members.add_metric([state], n)
        yield members
        counters = node.statistics()
        yield CounterMetricFamily(
            "ftmesh_suspicions",
            "Members this member saw become suspect.",
            value=counters.get("event_suspect", 0),
        )
        packets = CounterMetricFamily(
            "ftmesh_gossip_packets", "Gossip datagrams.", labels=["direction"]
        )
        nbytes = CounterMetricFamily(
            "ftmesh_gossip_bytes", "Gossip datagram bytes.", labels=["direction"]
        )
        for pkey, bkey, direction in _TRAFFIC:
            packets.add_metric([direction], counters.get(pkey, 0))
            nbytes.add_metric([direction], counters.get(bkey, 0))
        yield packets
        yield nbytes
        dropped = CounterMetricFamily(
            "ftmesh_dropped",
            "Input dropped or refused (malformed, unauthenticated, rate limited, busy...).",
            labels=["reason"],
        )
        for reason, n in sorted(drop_reasons(counters).items()):
            dropped.add_metric([reason], n)
        yield dropped


def _histogram(
    name: str, doc: str, labels: Iterable[str], rows: Iterable[tuple[list[str], HistogramSnapshot]]
) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=list(labels))
    for values, snap in rows:
        bounds = [*(_le(b) for b in snap.bounds), "+Inf"]
        fam.add_metric(values, list(zip(bounds, snap.cumulative(), strict=True)), snap.total)
    return fam


def _le(bound: float) -> str:
    return repr(float(bound))


def _collective(snap: CollectiveStatistics) -> Iterator[Metric]:
    yield _histogram(
        "ftmesh_collective_seconds",
        "Duration of completed collectives.",
        ("op", "backend"),
        [([op, backend], h) for (op, backend), h in sorted(snap.seconds.items())],
    )
    nbytes = CounterMetricFamily(
        "ftmesh_collective_bytes", "Input bytes of completed collectives.", labels=["op", "backend"]
    )
    for (op, backend), n in sorted(snap.bytes_total.items()):
        nbytes.add_metric([op, backend], n)
    yield nbytes
    aborts = CounterMetricFamily(
        "ftmesh_collective_aborts", "Collectives that failed, by kind.", labels=["kind"]
    )
    for kind, n in sorted(snap.aborts_total.items()):
        aborts.add_metric([kind], n)
    yield aborts
    yield from _links(snap)


def _links(snap: CollectiveStatistics) -> Iterator[Metric]:
    """Per data-plane neighbour (``peer``: its node id): bytes sent and the kernel's figures
    of the connection (``ftmesh.collective.links``)."""
    sent = CounterMetricFamily(
        "ftmesh_link_sent_bytes", "Collective payload bytes sent to a neighbour.", labels=["peer"]
    )
    rtt = GaugeMetricFamily(
        "ftmesh_link_min_rtt_seconds",
        "Smallest round trip the kernel saw on the connection to a neighbour.",
        labels=["peer"],
    )
    rate = GaugeMetricFamily(
        "ftmesh_link_delivery_rate_bytes",
        "Bytes per second the kernel last measured delivered to a neighbour (not app-limited).",
        labels=["peer"],
    )
    retrans = CounterMetricFamily(
        "ftmesh_link_retransmits", "Segments sent again to a neighbour.", labels=["peer"]
    )
    for peer, link in sorted(snap.links.items()):
        sent.add_metric([peer], link.sent_bytes)
        if link.min_rtt_s > 0:
            rtt.add_metric([peer], link.min_rtt_s)
        if link.delivery_rate > 0:
            rate.add_metric([peer], link.delivery_rate)
        retrans.add_metric([peer], link.retransmits)
    yield from (sent, rtt, rate, retrans)


def _training(s: TrainerStatistics) -> Iterator[Metric]:
    yield GaugeMetricFamily("ftmesh_train_committed_step", "Committed steps.", s.committed_step)
    yield _histogram(
        "ftmesh_train_step_seconds",
        "Wall time of committed steps, retries included.",
        (),
        [([], s.step_seconds)],
    )
    yield CounterMetricFamily(
        "ftmesh_train_samples", "Samples this member computed.", value=s.samples_total
    )
    yield CounterMetricFamily(
        "ftmesh_train_steps", "Steps this member committed.", value=s.steps_total
    )
    yield GaugeMetricFamily(
        "ftmesh_train_world_size", "Members computing the last step.", value=s.world_size
    )
    yield GaugeMetricFamily(
        "ftmesh_train_share", "Samples this member computed in the last step.", value=s.share
    )
    yield CounterMetricFamily(
        "ftmesh_train_attempts", "Step attempts, retries included.", value=s.attempts_total
    )
    yield _histogram(
        "ftmesh_recovery_seconds",
        "From a failed attempt to the next committed step.",
        (),
        [([], s.recovery_seconds)],
    )
    yield CounterMetricFamily(
        "ftmesh_state_transfer_bytes",
        "State bytes fetched from other members.",
        value=s.state_transfer_bytes_total,
    )
    yield GaugeMetricFamily(
        "ftmesh_checkpoint_step", "Step of the newest checkpoint written.", s.checkpoint_step
    )
    yield CounterMetricFamily(
        "ftmesh_train_straggler_steps",
        "Steps this member sat out of the compute set as a straggler.",
        value=s.straggler_steps_total,
    )
    yield GaugeMetricFamily(
        "ftmesh_train_loss",
        "Mean loss of the last committed step over its global batch (NaN: not known, as "
        "before the first step or after a step adopted from a peer).",
        value=s.loss,
    )
    yield CounterMetricFamily(
        "ftmesh_train_failslow_pauses",
        "Times this member stepped out of the ring as fail-slow (it kept freezing).",
        value=s.failslow_pauses_total,
    )
    yield CounterMetricFamily(
        "ftmesh_train_nonfinite_steps",
        "Committed steps whose update every member skipped (non-finite gradients).",
        value=s.nonfinite_steps_total,
    )
    yield CounterMetricFamily(
        "ftmesh_train_skipped_samples",
        "Samples of committed steps not trained: the shares of members lost during a step "
        "(recovery='keep').",
        value=s.samples_skipped_total,
    )
