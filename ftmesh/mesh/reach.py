"""The driver of one member's reachability judgements (``ftmesh.collective.reach``).

Theory of operation: the data plane reports connection outcomes into a bounded queue from any
thread (``observe``); every ``REACH_TICK`` the driver, in the mesh's trio thread, feeds them to
the member's ``ReachTracker`` with the members membership holds alive, applies its effects
(publishes our accusations in our metadata under ``REACH_KEY``, runs re-admission probes,
logs every accusation at WARNING with the address tried) and logs, at WARNING, every change of
the set the ring leaves out, computed from everyone's accusations exactly as the view is
(``ftmesh.mesh.ring_exclusions``). The mesh's view, which leaves those members out, changes
through the metadata update like through any other membership event.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import trio

from ..collective import Peer, reach
from ..collective.reach import Exclusion, ReachConfig, ReachEvent, ReachTracker
from ..errors import ConfigError
from ..membership.messages import MemberSnapshot, MemberState
from ..net.node import parse_hostport
from .meta import REACH_KEY, RELEASE

if TYPE_CHECKING:
    from ..collective import DataPlane
    from ..net.node import Node

log = logging.getLogger("ftmesh.mesh")

"""Member metadata key: the members this one accuses of being unreachable or of sending bytes
that fail verification (``reach.format_reports``); the ring leaves them out."""
REACH_TICK = 0.25
"""Seconds between reachability decisions (``reach.ReachTracker.tick``): adds at most this to
the time until an unreachable member is accused or re-admitted."""
MAX_REACH_EVENTS = 4096
"""Connection outcomes queued between two ticks; older ones are dropped (bounds the memory a
storm of failing connections can take)."""
PROBE_TIMEOUT = 2.0
"""Seconds a re-admission probe of an accused member's data address may take."""
BAD_STATE_REASONS = ("bad_chunk", "bad_manifest")
"""State transfer failures (``TransferStats.failures``) that mean bytes failed verification."""

_ACCUSED = {
    reach.UNREACHABLE: "cannot be reached",
    reach.STALLED: "connections to it open but carry no data",
    reach.BAD_FRAMES: "it sends frames that fail verification",
    reach.BAD_STATE: "it serves state that fails verification",
}

Exclusions = Callable[[list[MemberSnapshot]], dict[str, Exclusion]]


def new_queue() -> deque[ReachEvent]:
    """The queue the data plane reports into (``open_data_plane(observe=queue.append)``)."""
    return deque(maxlen=MAX_REACH_EVENTS)


def describe_exclusion(ex: Exclusion, names: Mapping[str, str]) -> str:
    """Why a member is left out, with the names of those who said so."""
    by = ", ".join(f"{names.get(r, '?')} ({r[:8]})" for r in ex.by)
    if ex.reason == reach.ACCUSES_MANY:
        return "it alone accuses two or more members (it is likelier the one that cannot connect)"
    if ex.reason == reach.CYCLE:
        return f"it and {by} accuse each other"
    if ex.reason == "bad_meta":
        return f"its {REACH_KEY!r} metadata does not parse"
    if ex.reason == "release":
        theirs = ex.by[0] if ex.by else "?"
        return (
            f"it runs ftmesh {theirs}.x and this member {RELEASE}.x: members of one mesh must "
            "run one minor release (CHANGELOG.md)"
        )
    return f"{_ACCUSED.get(ex.reason, ex.reason)}, says {by}"


class ReachDriver:
    """Drives one member's ``ReachTracker``; see the module doc."""

    def __init__(
        self,
        node: Node,
        data_plane: DataPlane,
        config: ReachConfig,
        exclusions: Exclusions,
        data_key: str,
        events: deque[ReachEvent] | None = None,
    ) -> None:
        self.node = node
        self.data_plane = data_plane
        self.tracker = ReachTracker(node.node_id, config)
        self.events = new_queue() if events is None else events
        self._exclusions = exclusions
        self._data_key = data_key
        self._excluded: dict[str, Exclusion] = {}
        """The exclusions as of the last tick (for the log)."""
        self.counters: dict[str, int] = {}
        """Accusations made and withdrawn by reason, members left out by reason."""

    def bad_state(self, node: str, detail: str) -> None:
        """State bytes from ``node`` failed verification (``Mesh.fetch_state``)."""
        self.events.append(reach.BadBytes(time.monotonic(), node, reach.BAD_STATE, detail))

    def bad_header(self, node: str, detail: str) -> None:
        """``node``'s own contribution to a step's header failed its checks
        (``ftmesh.training.step.StepVerdict.offences``): one strike, like a bad frame."""
        self.events.append(reach.BadBytes(time.monotonic(), node, reach.BAD_FRAMES, detail))

    async def run(self, nursery: trio.Nursery) -> None:
        """Tick for as long as the mesh runs; probes run as tasks of ``nursery``."""
        while True:
            await trio.sleep(REACH_TICK)
            self.step(time.monotonic(), nursery)

    def step(self, now: float, nursery: trio.Nursery) -> None:
        events, tracker, node = self.events, self.tracker, self.node
        while events:
            tracker.receive(events.popleft())
        members = node.members()
        alive = {
            m.node: str(m.meta.get(self._data_key, ""))
            for m in members
            if m.state == MemberState.ALIVE and m.node != node.node_id
        }
        names = {m.node: m.name for m in members}
        for eff in tracker.tick(now, alive):
            if isinstance(eff, reach.Probe):
                nursery.start_soon(self._probe, eff)
            elif isinstance(eff, reach.Accuse):
                self._count(f"accused_{eff.reason}")
                bad_bytes = eff.reason in (reach.BAD_FRAMES, reach.BAD_STATE)
                log.warning(
                    "ring neighbour %s (%s) at data address %s: %s (%s); the ring goes on "
                    "without it %s",
                    names.get(eff.peer, "?"),
                    eff.peer[:8],
                    eff.addr or "?",
                    _ACCUSED.get(eff.reason, eff.reason),
                    eff.detail,
                    f"for {eff.hold:.0f}s" if bad_bytes else "until it is reachable again",
                )
            else:
                self._count(f"withdrawn_{eff.reason}")
                log.info(
                    "no longer accusing %s (%s) of %s: %s",
                    names.get(eff.peer, "?"),
                    eff.peer[:8],
                    eff.reason,
                    eff.why,
                )
        published = reach.format_reports(tracker.published())
        meta = node.me().meta
        if published != meta.get(REACH_KEY, ""):
            new = {k: v for k, v in meta.items() if k != REACH_KEY}
            if published:
                new[REACH_KEY] = published
            node.update_meta(new)
            members = node.members()
        self._log_exclusions(members, names)

    def _log_exclusions(self, members: list[MemberSnapshot], names: Mapping[str, str]) -> None:
        found = self._exclusions(members)
        by_id = {m.node: m for m in members}
        for node, ex in found.items():
            if self._excluded.get(node) == ex:
                continue
            self._count(f"left_out_{ex.reason}")
            m = by_id.get(node)
            addr = m.meta.get(self._data_key, "?") if m is not None else "?"
            who = "this member" if node == self.node.node_id else f"{names.get(node)} ({node[:8]})"
            log.warning(
                "the ring leaves out %s, data address %s: %s",
                who,
                addr,
                describe_exclusion(ex, names),
            )
        for node in self._excluded.keys() - found.keys():
            m = by_id.get(node)
            if m is not None and m.state == MemberState.ALIVE:
                log.warning("the ring takes %s (%s) back", m.name, node[:8])
        self._excluded = found

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    async def _probe(self, eff: reach.Probe) -> None:
        try:
            host, port = parse_hostport(eff.addr)
        except ConfigError:
            ok = False
        else:
            ok = await self.data_plane.probe(Peer(eff.peer, host, port), PROBE_TIMEOUT)
        self.events.append(reach.ProbeDone(time.monotonic(), eff.peer, ok))
