"""SWIM membership with Lifeguard, as a sans-IO state machine.

Theory of operation (SWIM: Das, Gupta, Motivala 2002; Lifeguard: Dadgar et al. 2018;
behaviour follows hashicorp/memberlist where the papers are silent):

* Every probe interval this member probes the next member of a shuffled round-robin list with
  a ``Ping``. No ``Ack`` within the probe timeout: it asks ``k`` random members to probe the
  target for it (``IndirectPing``); they relay the target's ack, or a ``Nack`` when the target
  stays silent, which tells us our own link works. No ack by the end of the interval: the target
  becomes *suspect*, and a ``Suspect`` rumour spreads.
* A suspect that hears of its suspicion refutes it by raising its incarnation and spreading
  ``Alive``, and also sends that ``Alive`` straight to the accuser named in the rumour; a
  member probing a suspect adds its ``Suspect`` to the ping. (Beyond memberlist: at small n a
  rumour is sent only a few times and can miss a member, and a missed refutation is a false
  death.) An accusation older than our incarnation only re-queues our current ``Alive``.
  Otherwise, when the suspicion timeout (shrinking with up to k confirmations, see
  ``suspicion``) expires, the suspect is declared *dead*.
* Rumours (``Alive``/``Suspect``/``Dead``) are piggybacked on every packet through a
  transmit-limited queue (``broadcast``) and pushed by gossip rounds to a few random members;
  dead members keep receiving gossip for a while so a paused process learns of its death.
* Periodic TCP push-pull of the full member list with one random member heals what gossip
  missed. To merge partitions, the partner is, with probability dead / (dead + live), a
  member we declared dead (serf's reconnect; memberlist alone never talks to the dead).
  Joining is a push-pull with a known address.

Precedence of rumours about one member, for incarnation i (memberlist's rules): Alive(j) wins
over anything with i < j; Suspect(i) overrides Alive(i); Dead(i) overrides Alive(i) and
Suspect(i); Left (a Dead whose accuser is the member itself) overrides Dead(i). Incarnations
only grow; the member itself is the only one that raises its own incarnation.

Members are kept as immutable ``MemberSnapshot`` records, replaced on every change: an event,
``members()`` and a push-pull hand out the records themselves, so a state change costs one new
record and reading the view costs no copy. A machine can also start from a member list handed
to it (``adopt``: a batched join, the state a join storm settles into); one handed the same
list as others keeps it by reference and tracks how its own table departs from it
(``shared_table``), which lets a simulator of thousands of members exchange push-pulls in
O(departures) (``push_pull_subset``). No timer wakes the driver for nothing: gossip rounds
run only while there is something to spread (the timer sleeps while the queue is empty and
resumes on its grid), the 1 s reap round is armed only for the grid point at which a departed
member is due to be forgotten, and the timeout of a probe that was acked is dropped from the
head of the timers instead of firing. (At thousands of simulated members these were half of
all timer events; what the machine does and when is unchanged.)

The machine owns no socket, clock or random source: the driver passes ``now`` (monotonic
seconds) and a seeded ``random.Random``, feeds received messages to :meth:`Swim.receive`, calls
:meth:`Swim.tick` at :meth:`Swim.next_deadline`, and carries out the returned effects.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, countOf, is_not
from typing import Any, Literal, TypeAlias

from ..errors import LocalUsageError, RemoteProtocolError
from .broadcast import BroadcastQueue
from .config import MembershipConfig
from .messages import (
    Ack,
    Address,
    Alive,
    Dead,
    Gossip,
    IndirectPing,
    MemberSnapshot,
    MemberState,
    Message,
    Meta,
    Nack,
    Ping,
    PushPull,
    Suspect,
)
from .suspicion import Awareness, Suspicion
from .wire import MAX_COUNTER, MAX_MEMBERS, check_meta, encoded_size

EventKind: TypeAlias = Literal["joined", "alive", "suspect", "dead", "left", "updated"]


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msgs`` in one datagram to ``dest``."""

    dest: Address
    msgs: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class StartPushPull:
    """Open a TCP exchange with ``dest``: send :meth:`Swim.push_pull_state`, feed the reply to
    :meth:`Swim.merge_push_pull`, and report failure of a join with :meth:`Swim.join_failed`."""

    dest: Address
    join: bool


@dataclass(frozen=True, slots=True)
class MemberEvent:
    kind: EventKind
    member: MemberSnapshot
    at: float


Effect: TypeAlias = Send | StartPushPull | MemberEvent


@dataclass(slots=True)
class _Member:
    """This member itself (the others are immutable ``MemberSnapshot`` records)."""

    node: str
    name: str
    addr: Address
    incarnation: int
    state: MemberState
    meta: Meta

    def snapshot(self) -> MemberSnapshot:
        return MemberSnapshot(
            node=self.node,
            name=self.name,
            addr=self.addr,
            incarnation=self.incarnation,
            state=self.state,
            meta=dict(self.meta),
        )


@dataclass(slots=True)
class _Probe:
    target: str
    indirect_sent: int = 0
    nacks: int = 0
    acked: bool = False
    closed: bool = False
    """Started because the target's connection closed (``Swim.connection_closed``): no ack
    within the probe timeout confirms its suspicion."""
    settled: bool = False
    """A closed probe whose outcome was taken before its timeout (``Swim.port_unreachable``)."""
    sent: float = -1.0
    """When the direct ping went out, for the round trip its ack measures (-1: not timed)."""


@dataclass(slots=True)
class _Relay:
    origin: Address
    origin_seq: int
    target: str
    want_nack: bool


class _ProbeRound:
    """The order of one probe round: a Fisher-Yates shuffle of ``ids`` drawn one step per
    probe, with the members added during the round after them. ``ids`` is not copied: its
    first ``len(ids)`` entries must not change during the round (entries appended later are
    not part of it). Only the positions the shuffle swapped are stored, so a round costs
    O(probes drawn so far), not an n-entry copy per round: at thousands of simulated members
    the copies were a fifth of the simulator's memory. Draws exactly as a shuffle of a copy
    would, given the same random source."""

    __slots__ = ("_added", "_count", "_ids", "_swapped", "pos")

    def __init__(self, ids: list[str]) -> None:
        self._ids = ids
        self._count = len(ids)
        self._added: list[str] = []
        self._swapped: dict[int, str] = {}  # position -> member moved there by a swap
        self.pos = 0  # positions before it have been drawn

    def __len__(self) -> int:
        return self._count + len(self._added)

    def _at(self, i: int) -> str:
        moved = self._swapped.get(i)
        if moved is not None:
            return moved
        return self._ids[i] if i < self._count else self._added[i - self._count]

    def draw(self, rng: random.Random) -> str | None:
        """The next member of the round (``None``: the round is over)."""
        pos = self.pos
        left = len(self) - pos
        if left <= 0:
            return None
        pick = pos + rng.randrange(left)
        here = self._at(pos)
        drawn = self._at(pick)
        # Swap positions pos and pick; pos is behind us from now on and is never read again.
        self._swapped[pick] = here
        self._swapped.pop(pos, None)
        self.pos = pos + 1
        return drawn

    def add(self, node: str) -> None:
        self._added.append(node)

    def pending(self, node: str) -> bool:
        """Whether ``node`` is still to be drawn in this round (a search: for the rare member
        forgotten and back)."""
        return any(self._at(i) == node for i in range(self.pos, len(self)))


_LIVE = (MemberState.ALIVE, MemberState.SUSPECT)
_GONE = (MemberState.DEAD, MemberState.LEFT)
_GOSSIP = (Alive, Suspect, Dead)
_STATE = attrgetter("state")
_NODE = attrgetter("node")
_ALL_STATES = tuple(MemberState)
_LAST_ADOPTED: list[tuple[Mapping[str, MemberSnapshot], int, int, int]] = []
"""The last table adopted wholesale: its size, ALIVE and SUSPECT counts (``Swim.adopt``)."""
MAX_RELAYS = 4096
"""Indirect probes relayed at once: bounds what a flood of ping-reqs can make us hold."""
MAX_DIRECT = 64
"""Members a leave, or a suspicion after a closed connection, is also sent to directly."""


class Swim:
    """One member's view of the mesh. See the module docstring."""

    def __init__(
        self,
        *,
        node_id: str,
        name: str,
        addr: Address,
        config: MembershipConfig,
        rng: random.Random,
        now: float,
        meta: Meta | None = None,
        size_of: Callable[[Gossip], int] = encoded_size,
        round_trips: int = 0,
    ) -> None:
        self.config = config
        self._round_trips: deque[tuple[str, float]] | None = (
            deque(maxlen=round_trips) if round_trips > 0 else None
        )
        """The last ``round_trips`` direct round trips measured (``take_round_trips``); None
        (the default, and the simulator's) keeps none: measuring then costs nothing."""
        self.node_id = node_id
        self._rng = rng
        self._me = _Member(node_id, name, addr, 1, MemberState.ALIVE, check_meta(meta or {}))
        # Other members as immutable records, replaced (never mutated) on every change: events,
        # ``members()`` and push-pulls hand them out without copying, and a driver may share
        # one record between many machines (the simulator does).
        self._members: dict[str, MemberSnapshot] = {}
        # Every known member but us, for O(1) random picks. A forgotten member's id stays
        # behind (in _stale) until a compaction or its return, so forgetting costs no search
        # and no per-member index (which would double the memory of a large table).
        self._peer_ids: list[str] = []
        self._stale: set[str] = set()
        # The table adopted wholesale (shared with other machines, never changed) and how
        # ours departs from it: members whose record is not the shared one, and shared
        # members we no longer hold (us included); dicts, for a deterministic order. A
        # simulator exchanges and sizes push-pulls between machines of one shared table from
        # these, in O(departures) rather than O(members) (see push_pull_subset).
        self._base: Mapping[str, MemberSnapshot] | None = None
        self._own: dict[str, None] = {}
        self._dropped: dict[str, None] = {}
        self._live = 0  # members (not us) ALIVE or SUSPECT
        self._departed: dict[str, float] = {}  # DEAD or LEFT members -> since when
        self._probe_round = _ProbeRound([])
        self._probes: dict[int, _Probe] = {}
        self._relays: dict[int, _Relay] = {}
        self._suspicions: dict[str, Suspicion] = {}
        self._seq = 0
        self._timers: list[tuple[float, int, str, object]] = []  # (when, order, kind, key)
        self._timer_order = 0
        self._queue = BroadcastQueue(size_of)
        self._rumours = self._queue.by_key  # (read-only: "anything to spread?" without a call)
        self._size_of = size_of
        self._awareness = Awareness(config.awareness_max_multiplier)
        self._out: list[Effect] = []
        self.leaving = False
        self.counters: dict[str, int] = {}
        self._fire: dict[str, Callable[[float, object], None]] = {
            "probe": self._fire_probe,
            "probe_timeout": self._fire_probe_timeout,
            "probe_end": self._fire_probe_end,
            "closed_timeout": self._fire_closed_timeout,
            "relay_timeout": self._fire_relay_timeout,
            "suspicion": self._fire_suspicion,
            "last_chance": self._fire_last_chance,
            "gossip": self._fire_gossip,
            "push_pull": self._fire_push_pull,
            "reap": self._fire_reap,
        }
        self._handlers: dict[type, tuple[str, Callable[[float, Address, Any], None]]] = {
            Ping: ("rx_ping", self._on_ping),
            IndirectPing: ("rx_indirectping", self._on_indirect_ping),
            Ack: ("rx_ack", lambda now, _src, msg: self._on_ack(now, msg)),
            Nack: ("rx_nack", lambda _now, _src, msg: self._on_nack(msg)),
            Alive: ("rx_alive", lambda now, _src, msg: self._on_alive(now, msg)),
            Suspect: ("rx_suspect", lambda now, _src, msg: self._on_suspect(now, msg)),
            Dead: ("rx_dead", lambda now, _src, msg: self._on_dead(now, msg)),
        }
        self._limit_cache = (-1, 0)  # (live members, retransmit limit) of the last lookup
        jitter = rng.random()
        self._arm(now + config.probe_interval * jitter, "probe", None)
        self._arm(now + config.gossip_interval * jitter, "gossip", None)
        # While nothing waits to be spread the gossip timer is not armed (at thousands of
        # simulated members, empty gossip rounds were a third of all events): the round
        # that found the queue empty leaves the time of the next one here, and the next
        # rumour queued re-arms the timer on the same grid.
        self._gossip_next: float | None = None
        self._now = now  # time of the call being handled (for _broadcast)
        # Reaping runs on a 1 s grid, but its timer is armed only for the grid point at which
        # the oldest departed member is due to be forgotten (none: not armed): the rounds in
        # between would find nothing to do (see _schedule_reap).
        self._reap_grid = now + 1.0  # the next point of the grid
        self._reap_armed = False
        if config.push_pull_interval > 0:
            self._arm(now + config.push_pull_interval * (1 + jitter), "push_pull", None)
        self._broadcast(self._alive_self())

    # ------------------------------------------------------------------ public API

    @property
    def incarnation(self) -> int:
        return self._me.incarnation

    @property
    def awareness(self) -> int:
        return self._awareness.score

    def num_live(self) -> int:
        """Members ALIVE or SUSPECT, us included."""
        return self._live + 1

    def members(self) -> list[MemberSnapshot]:
        """Every known member including us (dead ones until they are forgotten). The records
        are shared, not copies: read-only."""
        return [self._me.snapshot(), *self._members.values()]

    def member(self, node_id: str) -> MemberSnapshot | None:
        if node_id == self.node_id:
            return self._me.snapshot()
        return self._members.get(node_id)

    def alive_among(self, node_ids: Iterable[str]) -> int:
        """How many of ``node_ids`` other than us we see ALIVE. Loops in C: simulators ask
        this of thousands of members about thousands of members."""
        return list(map(_STATE, filter(None, map(self._members.get, node_ids)))).count(
            MemberState.ALIVE
        )

    def state_of(self, node_id: str) -> MemberState | None:
        """The state of one member (``None`` if unknown), without copying anything: for
        drivers and simulators that poll the view of many members."""
        if node_id == self.node_id:
            return self._me.state
        m = self._members.get(node_id)
        return m.state if m is not None else None

    def next_deadline(self) -> float:
        # A probe acked before its timeout leaves a timer that would fire to do nothing: it
        # is dropped here when it reaches the head, so a driver does not wake up for it
        # (most probes are acked: one wake-up less per probe).
        timers = self._timers
        while timers:
            head = timers[0]
            if head[2] == "probe_timeout":
                probe = self._probes.get(head[3])  # type: ignore[call-overload]
                if probe is None or probe.acked:
                    heapq.heappop(timers)
                    continue
            return head[0]
        return float("inf")

    def adopt(self, now: float, members: Mapping[str, MemberSnapshot]) -> None:
        """Know ``members`` (keyed by node id) from the start, without spreading them and
        without events: for a mesh started from one member list that every member is handed
        (a batched join: the state a join storm settles into once its rumours have drained).
        Members already known, and we ourselves, are left as they are; the new ones (ALIVE,
        DEAD or LEFT: a suspicion is the protocol's to start) are probed from the next probe
        round on. The records are kept as given, so a driver of many machines can hand them
        all the same ones. A fresh machine keeps a reference to ``members`` (its shared
        table), which must not change afterwards."""
        known = self._members
        me = members.get(self.node_id)
        wholesale = not known and not self._stale  # a fresh machine, the common case
        if wholesale:
            fresh: list[str] = []
            count = len(members) - (me is not None)
        else:
            fresh = [n for n in members if n not in known and n != self.node_id]
            count = len(fresh)
        if len(known) + count > MAX_MEMBERS:
            raise LocalUsageError(f"more than {MAX_MEMBERS} members")
        # States counted in C, suspects only when not all are alive; a table adopted
        # wholesale by one machine after another (a simulator's thousands) is counted once.
        last = _LAST_ADOPTED[0] if wholesale and _LAST_ADOPTED else None
        if last is not None and last[0] is members and last[1] == len(members):
            alive, suspects = last[2], last[3]
        else:
            pool = list(members.values()) if wholesale else [members[n] for n in fresh]
            alive = countOf(map(_STATE, pool), MemberState.ALIVE)
            suspects = 0
            if alive < len(pool):
                suspects = countOf(map(_STATE, pool), MemberState.SUSPECT)
            if wholesale:
                _LAST_ADOPTED[:] = [(members, len(members), alive, suspects)]
        if wholesale and me is not None:  # (our own record is not adopted)
            alive -= me.state == MemberState.ALIVE
            suspects -= me.state == MemberState.SUSPECT
        if suspects:
            raise LocalUsageError("adopt takes no suspects: a suspicion is the protocol's")
        if wholesale:
            # Copy the table wholesale: no Python loop per member, which matters for
            # thousands of machines of thousands of members.
            known.update(members)
            known.pop(self.node_id, None)
            fresh = self._peer_ids = list(known)
            self._base = members
            if me is not None:
                self._dropped[self.node_id] = None
        else:
            for node in fresh:
                known[node] = members[node]
                self._track(node, members[node])
                if node in self._stale:
                    self._stale.discard(node)
                else:
                    self._peer_ids.append(node)
        self._live += alive
        if count > alive:
            for node in fresh:
                if known[node].state not in _LIVE:
                    self._departed[node] = now
            self._now = now
            self._schedule_reap()

    def join(self, now: float, addrs: Iterable[Address]) -> list[Effect]:
        """Contact ``addrs`` (seeds or discovered peers) with a joining push-pull."""
        for addr in addrs:
            if addr != self._me.addr:
                self._out.append(StartPushPull(addr, join=True))
        return self._flush()

    def receive(self, now: float, src: Address, msgs: Sequence[Message]) -> list[Effect]:
        """Handle the messages of one datagram from ``src``."""
        self._now = now
        handlers = self._handlers
        counters = self.counters
        known = self._members
        old_alive = old_suspect = old_dead = 0
        for msg in msgs:
            # Fast paths for the bulk of gossip traffic, rumours we already have: what the
            # handlers would decide (return without effect), without calling them.
            if type(msg) is Alive:
                m = known.get(msg.node)
                if (
                    m is not None
                    and msg.incarnation <= m.incarnation
                    and (m.state is not MemberState.LEFT or msg.meta == m.meta)
                ):
                    old_alive += 1
                    continue
            elif type(msg) is Suspect:
                m = known.get(msg.node)
                if m is not None:
                    if msg.incarnation < m.incarnation or m.state in _GONE:
                        old_suspect += 1
                        continue
                    if m.state is MemberState.SUSPECT and msg.incarnation == m.incarnation:
                        susp = self._suspicions.get(msg.node)
                        if (
                            susp is None
                            or len(susp.accusers) > susp.k
                            or msg.accuser in susp.accusers
                        ):
                            old_suspect += 1  # (Suspicion.confirm would refuse it)
                            continue
            elif type(msg) is Dead:
                m = known.get(msg.node)
                if m is not None and (
                    msg.incarnation < m.incarnation
                    or m.state is MemberState.LEFT
                    or (m.state is MemberState.DEAD and msg.accuser != msg.node)
                ):
                    old_dead += 1
                    continue
            entry = handlers.get(type(msg))
            if entry is None:
                self._count("rx_" + type(msg).__name__.lower())
                self._count("dropped_unexpected")
                continue
            key, handle = entry
            counters[key] = counters.get(key, 0) + 1
            handle(now, src, msg)
        if old_alive:
            counters["rx_alive"] = counters.get("rx_alive", 0) + old_alive
        if old_suspect:
            counters["rx_suspect"] = counters.get("rx_suspect", 0) + old_suspect
        if old_dead:
            counters["rx_dead"] = counters.get("rx_dead", 0) + old_dead
        return self._flush()

    def tick(self, now: float) -> list[Effect]:
        """Fire every timer due at ``now``."""
        while self._timers and self._timers[0][0] <= now:
            when, _, kind, key = heapq.heappop(self._timers)
            self._now = when  # a late tick: rumours queued by this timer go out as if on time
            self._fire[kind](now, key)
        self._now = now
        return self._flush()

    def push_pull_state(self, *, join: bool = False, observer: bool = False) -> PushPull:
        """Our full state, to send in a push-pull exchange."""
        return PushPull(
            source=self.node_id,
            members=(self._me.snapshot(), *self._members.values()),
            join=join,
            observer=observer,
        )

    def shared_table(self) -> tuple[Mapping[str, MemberSnapshot] | None, list[str], list[str]]:
        """For simulators: the table this machine adopted wholesale (``None`` if none), the
        members whose record is not that table's, and that table's members it no longer
        holds (itself included)."""
        return self._base, list(self._own), list(self._dropped)

    def push_pull_subset(self, nodes: Iterable[str], *, join: bool = False) -> PushPull:
        """Our push-pull state reduced to ``nodes`` (those we hold), us first. A simulator
        whose machines share one adopted table hands a peer this in place of the full state,
        naming our own records and the shared members the peer no longer holds: every
        record left out is then the very record the peer holds, or a shared one the peer
        replaced by a newer one (a protocol change only moves forward), and merging either
        changes nothing."""
        get = self._members.get
        records = [m for node in nodes if (m := get(node)) is not None]
        return PushPull(source=self.node_id, members=(self._me.snapshot(), *records), join=join)

    def merge_push_pull(self, now: float, remote: PushPull) -> list[Effect]:
        """Merge a peer's full state (their request to us, or their reply to ours)."""
        self._now = now
        if remote.observer:
            return self._flush()
        known = self._members
        members = remote.members
        # A record we hold already (the very object: tables share records where a driver
        # shares them, as the simulator does) changes nothing, save a suspect's, which counts
        # the peer as one more accuser (below). Filtered out in C, so merging two agreeing
        # tables of 10,000 members costs no Python loop.
        if self._suspicions:
            remote_ids = set(map(id, members))
            shared = [
                m
                for node in self._suspicions
                if (m := known.get(node)) is not None and id(m) in remote_ids
            ]
        else:
            shared = []
        for m in compress(members, map(is_not, members, map(known.get, map(_NODE, members)))):
            if m.state == MemberState.ALIVE:
                cur = known.get(m.node)
                if cur is not None and m.incarnation <= cur.incarnation:
                    continue  # what _on_alive would decide, without building an Alive
                self._on_alive(
                    now,
                    Alive(
                        node=m.node,
                        name=m.name,
                        addr=m.addr,
                        incarnation=m.incarnation,
                        meta=m.meta,
                    ),
                )
            elif m.state == MemberState.LEFT:
                self._on_dead(now, Dead(node=m.node, incarnation=m.incarnation, accuser=m.node))
            else:
                # A remote "dead" is only a suspicion here: it lets the member refute it.
                self._on_suspect(
                    now, Suspect(node=m.node, incarnation=m.incarnation, accuser=remote.source)
                )
        for m in shared:
            self._on_suspect(
                now, Suspect(node=m.node, incarnation=m.incarnation, accuser=remote.source)
            )
        return self._flush()

    def join_failed(self, now: float, dest: Address) -> list[Effect]:
        self._count("join_failed")
        return self._flush()

    def update_meta(self, now: float, meta: Meta) -> list[Effect]:
        """Replace our metadata; spreads as an Alive with a higher incarnation."""
        self._now = now
        try:
            self._me.meta = check_meta(meta)
        except RemoteProtocolError as exc:
            raise LocalUsageError(f"invalid member metadata: {exc}") from None
        self._me.incarnation = min(self._me.incarnation + 1, MAX_COUNTER)
        self._broadcast(self._alive_self())
        return self._flush()

    def leave(self, now: float) -> list[Effect]:
        """Announce a graceful leave. The driver should keep running for about two gossip
        intervals so the news spreads, then stop.

        The leave goes straight to every live member in one datagram behind our current
        ``Alive``: the leave has the same incarnation, so a member that heard of it before our
        latest metadata (a last role or progress, changed just before leaving and perhaps not
        gossiped yet) would keep the older one; read in order from one datagram, the metadata
        always comes first, and the leaver need not wait for it to spread."""
        self._now = now
        self.leaving = True
        msg = Dead(node=self.node_id, incarnation=self._me.incarnation, accuser=self.node_id)
        self._broadcast(msg)
        self._send_direct(self._alive_self(), msg)
        return self._flush()

    def report_unreachable(self, now: float, node_id: str) -> list[Effect]:
        """Hard evidence (a data-plane connection to ``node_id`` broke): probe it right away,
        directly and indirectly at once, instead of waiting for its turn, and suspect it if
        no answer came within ``probe_timeout`` (not the whole ``probe_interval``)."""
        m = self._members.get(node_id)
        if (
            m is not None
            and m.state == MemberState.ALIVE
            and not any(p.target == node_id for p in self._probes.values())
        ):
            self._count("fast_probes")
            self._start_probe(now, m, indirect_now=True)
        return self._flush()

    def connection_closed(self, now: float, node_id: str) -> list[Effect]:
        """Evidence from the data plane: ``node_id`` closed or reset an established
        connection with nothing left unsaid (EOF or ``ECONNRESET`` on a ring connection we
        still held, no abort notice before it: what the kernel does to a killed process's
        sockets), or refused one (``ECONNREFUSED``: its listener is gone).

        Not a death by itself, nor even a suspicion: a live member closes connections too,
        without a word, when it believes *us* lost (a false suspicion of us, a stall) or gives
        a broken ring up, and a live member whose data port is misconfigured refuses. (Taken
        as a suspicion at once, each such close suspected a live member, who then refuted:
        view changes in cascade, seen under load in ``ftmesh bench recovery``.) So it starts
        a probe, direct and indirect at once, and if no ack comes within the probe timeout
        (not the whole probe interval) the member is suspected then, the suspicion is sent
        straight to the live members (it included: a live one refutes at once) besides
        being gossiped, and it counts as fully confirmed (its timeout drops to the minimum,
        ``suspicion_min_timeout``), after which the final direct probe decides the death as
        for any suspicion. A member that answers is left alone. So a member starved of CPU
        for less than the probe timeout is not even suspected, and one starved for less
        than the minimum suspicion timeout is never declared dead.

        A member that is not ALIVE or SUSPECT (dead, left: a graceful leave stays ``left``)
        is not probed, nor one whose closed connection is being probed already."""
        self._now = now
        m = self._members.get(node_id)
        if m is None or m.state not in _LIVE or self.leaving:
            self._count("closed_ignored")
            return self._flush()
        if any(p.closed and p.target == node_id for p in self._probes.values()):
            return self._flush()
        self._count("closed_probes")
        seq = self._start_probe(now, m, indirect_now=True, closed=True)
        self._arm(now + self._awareness.scale(self.config.probe_timeout), "closed_timeout", seq)
        return self._flush()

    def port_unreachable(self, now: float, addr: Address) -> list[Effect]:
        """A datagram we sent to ``addr`` was answered with ICMP *port unreachable*: the host
        is up and nothing listens on the member's gossip port any more, so its process is
        gone (a live member always holds that port). Taken as the answer to a pending probe
        of a member whose connection closed (``connection_closed``): two independent facts,
        its connection closed and its port, so the probe fails now instead of at its
        timeout. Without such a probe it is only counted: an ICMP message is not
        authenticated, and alone it is not worth a suspicion."""
        self._now = now
        for seq, probe in list(self._probes.items()):
            m = self._members.get(probe.target)
            if probe.closed and not probe.settled and m is not None and m.addr == addr:
                self._count("closed_port_unreachable")
                self._fire_closed_timeout(now, seq)
                probe.settled = True
                return self._flush()
        self._count("port_unreachable_ignored")
        return self._flush()

    def _fire_closed_timeout(self, now: float, seq: object) -> None:
        """The probe of a member whose connection closed went unanswered for the probe
        timeout (``connection_closed``), or its port is closed (``port_unreachable``). (The
        probe itself stays until its end, which does Lifeguard's accounting of the nacks:
        they come after the relays' own timeout.)"""
        assert isinstance(seq, int)
        probe = self._probes.get(seq)
        m = self._members.get(probe.target) if probe else None
        if probe is None or probe.acked or probe.settled or m is None or m.state not in _LIVE:
            return
        s = Suspect(node=m.node, incarnation=m.incarnation, accuser=self.node_id)
        self._on_suspect(now, s)  # a suspicion, or our confirmation of one
        if m.state == MemberState.ALIVE:
            self._send_direct(s)
        susp = self._suspicions.get(m.node)
        if susp is None or susp.incarnation != self._members[m.node].incarnation:
            return
        self._count("closed_suspects")
        susp.k = 0  # as good as fully confirmed: the minimum timeout
        self._arm(susp.deadline, "suspicion", m.node)

    # ------------------------------------------------------------------ probing

    def take_round_trips(self) -> list[tuple[str, float]]:
        """The round trips measured since the last call, oldest first: ``(member, seconds)``
        from a probe's ``Ping`` to its direct ``Ack``. Probes acked through a helper, and the
        fast probes that go indirect at once, are not timed (the detour is not the link). What
        a ``round_trips`` of 0 keeps: nothing."""
        if not self._round_trips:
            return []
        out = list(self._round_trips)
        self._round_trips.clear()
        return out

    def _fire_probe(self, now: float, _key: object) -> None:
        interval = self._awareness.scale(self.config.probe_interval)
        self._arm(now + interval, "probe", None)
        target = self._next_probe_target()
        if target is not None:
            self._start_probe(now, target, indirect_now=False)

    def _next_probe_target(self) -> MemberSnapshot | None:
        """The next member of this probe round. A round visits every member in random order,
        drawn as the round goes (a Fisher-Yates shuffle done one step per probe): shuffling
        the whole list up front costs n random draws at each round's start, n^2 across a
        simulated mesh (and a copy of the list per round, see ``_ProbeRound``). Members dead
        or forgotten when their turn comes are passed over."""
        if not self._live:
            return None
        get = self._members.get
        rng = self._rng
        for _ in range(2):  # the rest of this round, then a new one (it has a live member)
            draw = self._probe_round.draw
            while (node := draw(rng)) is not None:
                m = get(node)
                if m is not None and m.state in _LIVE:
                    return m
            # (_peer_ids is only appended to in place, or replaced: see _remove.)
            self._probe_round = _ProbeRound(self._peer_ids)
        return None

    def _start_probe(
        self, now: float, target: MemberSnapshot, *, indirect_now: bool, closed: bool = False
    ) -> int:
        seq = self._next_seq()
        self._probes[seq] = _Probe(target.node, sent=-1.0 if indirect_now else now)
        self._probes[seq].closed = closed
        ping = Ping(seq=seq, target=target.node, source=self.node_id, source_addr=self._me.addr)
        if target.state == MemberState.SUSPECT:
            # Tell a suspect directly that we suspect it, so it refutes to us even if the
            # rumour missed it.
            self._send(
                target.addr,
                ping,
                Suspect(node=target.node, incarnation=target.incarnation, accuser=self.node_id),
            )
        else:
            self._send(target.addr, ping)
        self._count("probes")
        if indirect_now:
            self._send_indirect(seq, target)
        else:
            self._arm(now + self._awareness.scale(self.config.probe_timeout), "probe_timeout", seq)
        # A fast probe (hard evidence: a connection broke) ends after the probe timeout, not
        # the whole period: the period is the tolerance for a member that merely stood still
        # (``MembershipConfig.preset``), and a broken connection is more than that. A probe of
        # a closed connection suspects at its own ``closed_timeout`` and stays to its end
        # for Lifeguard's accounting (``connection_closed``).
        fast = indirect_now and not closed
        end = self.config.probe_timeout if fast else self.config.probe_interval
        self._arm(now + self._awareness.scale(end), "probe_end", seq)
        return seq

    def _fire_probe_timeout(self, now: float, seq: object) -> None:
        assert isinstance(seq, int)
        probe = self._probes.get(seq)
        target = self._members.get(probe.target) if probe else None
        if probe is None or probe.acked or target is None:
            return
        self._send_indirect(seq, target)

    def _send_indirect(self, seq: int, target: MemberSnapshot) -> None:
        probe = self._probes[seq]
        helpers = self._random_members(
            self.config.indirect_checks, exclude=target.node, states=(MemberState.ALIVE,)
        )
        for helper in helpers:
            self._send(
                helper.addr,
                IndirectPing(
                    seq=seq,
                    target=target.node,
                    target_addr=target.addr,
                    source=self.node_id,
                    source_addr=self._me.addr,
                ),
            )
        probe.indirect_sent = len(helpers)

    def _fire_probe_end(self, now: float, seq: object) -> None:
        assert isinstance(seq, int)
        probe = self._probes.pop(seq, None)
        if probe is None or probe.acked:
            return
        # Lifeguard: missing nacks mean our own links or process are the slow part.
        if probe.indirect_sent:
            self._awareness.apply(max(probe.indirect_sent - probe.nacks, 0))
        else:
            self._awareness.apply(1)
        target = self._members.get(probe.target)
        if target is None or target.state not in _LIVE:
            return
        self._count("probe_failures")
        self._on_suspect(
            now, Suspect(node=target.node, incarnation=target.incarnation, accuser=self.node_id)
        )

    def _on_ping(self, now: float, src: Address, ping: Ping) -> None:
        if ping.target != self.node_id:
            self._count("dropped_ping_not_for_us")  # stale address of a previous process
            return
        extra: tuple[Message, ...] = ()
        sender = self._members.get(ping.source)
        if sender is not None and sender.state in (MemberState.DEAD, MemberState.LEFT):
            # Tell a paused or partitioned member straight away that it was declared dead.
            extra = (Dead(node=sender.node, incarnation=sender.incarnation, accuser=self.node_id),)
        self._send(src, Ack(seq=ping.seq, source=self.node_id), *extra)

    def _on_indirect_ping(self, now: float, src: Address, req: IndirectPing) -> None:
        if len(self._relays) >= MAX_RELAYS:
            self._count("dropped_relay_cap")
            return
        seq = self._next_seq()
        self._relays[seq] = _Relay(src, req.seq, req.target, req.want_nack)
        self._send(
            req.target_addr,
            Ping(seq=seq, target=req.target, source=self.node_id, source_addr=self._me.addr),
        )
        self._arm(now + self.config.probe_timeout, "relay_timeout", seq)

    def _fire_relay_timeout(self, now: float, seq: object) -> None:
        assert isinstance(seq, int)
        relay = self._relays.pop(seq, None)
        if relay is not None and relay.want_nack:
            self._send(relay.origin, Nack(seq=relay.origin_seq, source=self.node_id))

    def _on_ack(self, now: float, ack: Ack) -> None:
        relay = self._relays.pop(ack.seq, None)
        if relay is not None:
            if ack.source == relay.target:
                self._send(relay.origin, Ack(seq=relay.origin_seq, source=ack.source))
            return
        probe = self._probes.get(ack.seq)
        if probe is None or probe.acked or ack.source != probe.target:
            self._count("dropped_stale_ack")
            return
        probe.acked = True
        self._awareness.apply(-1)
        if self._round_trips is not None and probe.sent >= 0 and not probe.indirect_sent:
            self._round_trips.append((ack.source, now - probe.sent))

    def _on_nack(self, nack: Nack) -> None:
        probe = self._probes.get(nack.seq)
        if probe is not None:
            probe.nacks += 1

    # ------------------------------------------------------------------ rumours

    def _on_alive(self, now: float, a: Alive) -> None:
        m = self._members.get(a.node)
        if m is not None and a.incarnation <= m.incarnation:
            if m.state == MemberState.LEFT and a.incarnation == m.incarnation and a.meta != m.meta:
                self._last_words(now, m, a)
            return  # the common case under gossip: old news
        if a.node == self.node_id:
            if a.incarnation > self._me.incarnation or (
                a.incarnation == self._me.incarnation
                and (a.addr != self._me.addr or a.meta != self._me.meta)
            ):
                self._refute(a.incarnation)
            return
        if m is None:
            if len(self._members) >= MAX_MEMBERS:
                self._count("dropped_member_cap")
                return
            m = _alive_record(a)
            self._add(m, now)
            self._emit("joined", m, now)
            self._broadcast(a)
            return
        before = m.state
        changed = (m.addr, m.meta, m.name) != (a.addr, a.meta, a.name)
        m = _alive_record(a)
        self._put(m, before, now)
        if before != MemberState.ALIVE:
            self._suspicions.pop(m.node, None)
            self._emit("alive" if before == MemberState.SUSPECT else "joined", m, now)
        elif changed:
            self._emit("updated", m, now)
        self._broadcast(a)

    def _last_words(self, now: float, m: MemberSnapshot, a: Alive) -> None:
        """The metadata a member published just before its leave (its last role, progress),
        heard after the leave, which has the same incarnation: a leaver's metadata changes no
        more after its leave, so it is the newest; kept (the member stays ``left``, no
        event) and passed on. The leave itself carries it first to every member
        (``leave``); this covers the gossip that passes both on in either order."""
        self._put(dataclasses.replace(m, meta=a.meta), m.state, now)
        self._broadcast(a)

    def _on_suspect(self, now: float, s: Suspect) -> None:
        if s.node == self.node_id:
            if not self.leaving:
                self._refute(s.incarnation, s.accuser)
            return
        m = self._members.get(s.node)
        if m is None or s.incarnation < m.incarnation:
            return
        if m.state == MemberState.SUSPECT and s.incarnation == m.incarnation:
            susp = self._suspicions.get(m.node)
            if susp is not None and susp.confirm(s.accuser):
                self._arm(susp.deadline, "suspicion", m.node)
                self._broadcast(s)
            return
        if m.state not in _LIVE:
            return
        # A fresh suspicion: of an alive member, or of a suspect at a newer incarnation (it
        # refuted the old suspicion in a rumour we missed and was suspected again).
        before = m.state
        m = self._replace(m, s.incarnation, MemberState.SUSPECT, now)
        if before == MemberState.ALIVE:
            self._emit("suspect", m, now)
        self._broadcast(s)
        n = self.num_live()
        k = self.config.suspicion_mult - 2
        if n - 2 < k:
            k = 0  # too few members to expect independent confirmations
        lo = self.config.suspicion_min_timeout(n)
        susp = Suspicion(
            s.incarnation, now, lo, lo * self.config.suspicion_max_timeout_mult, k, {s.accuser}
        )
        self._suspicions[m.node] = susp
        self._arm(susp.deadline, "suspicion", m.node)

    def _fire_suspicion(self, now: float, node: object) -> None:
        assert isinstance(node, str)
        susp = self._suspicions.get(node)
        m = self._members.get(node)
        if susp is None or m is None or m.state != MemberState.SUSPECT:
            return
        if susp.incarnation != m.incarnation or now < susp.deadline:
            return  # refuted in between, or a confirmation moved the deadline
        if susp.last_chance:
            return  # the final probe is out; _fire_last_chance decides
        # Last chance: one direct probe carrying the accusation. A member that answers is
        # alive and gets to refute; only silence turns the suspicion into a death. This
        # catches the rare refutation that gossip lost, at the cost of one probe timeout.
        seq = self._next_seq()
        susp.last_chance = seq
        self._probes[seq] = _Probe(node)
        self._send(
            m.addr,
            Ping(seq=seq, target=node, source=self.node_id, source_addr=self._me.addr),
            Suspect(node=node, incarnation=m.incarnation, accuser=self.node_id),
        )
        self._arm(now + self._awareness.scale(self.config.probe_timeout), "last_chance", node)

    def _fire_last_chance(self, now: float, node: object) -> None:
        assert isinstance(node, str)
        susp = self._suspicions.get(node)
        m = self._members.get(node)
        if susp is None or m is None or m.state != MemberState.SUSPECT or not susp.last_chance:
            return
        probe = self._probes.pop(susp.last_chance, None)
        susp.last_chance = 0
        if susp.incarnation != m.incarnation:
            return
        if probe is not None and probe.acked:
            self._count("last_chance_acked")
            susp.start = now  # it lives: give its refutation another suspicion period
            self._arm(susp.deadline, "suspicion", node)
            return
        self._count("suspicion_expired")
        self._on_dead(now, Dead(node=node, incarnation=m.incarnation, accuser=self.node_id))

    def _on_dead(self, now: float, d: Dead) -> None:
        left = d.accuser == d.node
        if d.node == self.node_id:
            if not self.leaving:
                self._refute(d.incarnation, d.accuser)
            return
        m = self._members.get(d.node)
        if m is None or d.incarnation < m.incarnation:
            return
        if m.state == MemberState.LEFT or (m.state == MemberState.DEAD and not left):
            return
        m = self._replace(m, d.incarnation, MemberState.LEFT if left else MemberState.DEAD, now)
        self._suspicions.pop(m.node, None)
        self._emit("left" if left else "dead", m, now)
        self._broadcast(d)

    def _refute(self, accused_incarnation: int, accuser: str | None = None) -> None:
        # Besides gossip, answer the accuser directly: it holds a suspicion timer for us, and
        # at small n a rumour can miss a member (each is sent only a few times), which would
        # turn into a false death. One datagram per accusation, only to known members.
        target = self._members.get(accuser) if accuser is not None else None
        if target is not None and target.state in _LIVE:
            self._send(target.addr, self._alive_self_after(accused_incarnation))
        if accused_incarnation < self._me.incarnation:
            # Old news (we refuted it already) still circulating, or a member that missed our
            # refutation: repeat our current Alive rather than raising the incarnation again.
            if not self._queue.has(self.node_id):
                self._count("refutes_repeated")
                self._broadcast(self._alive_self())
            return
        # Capped so our Alive stays decodable (wire.MAX_COUNTER); unreachable in practice.
        self._me.incarnation = min(accused_incarnation + 1, MAX_COUNTER)
        self._awareness.apply(1)  # being suspected suggests we are the slow one
        self._count("refutes")
        self._broadcast(self._alive_self())

    def _alive_self_after(self, accused_incarnation: int) -> Alive:
        """Our Alive as it will be once ``_refute`` has run (incarnation above the accused)."""
        me = self._me
        inc = me.incarnation
        if accused_incarnation >= inc:
            inc = min(accused_incarnation + 1, MAX_COUNTER)
        return Alive(node=me.node, name=me.name, addr=me.addr, incarnation=inc, meta=dict(me.meta))

    def _alive_self(self) -> Alive:
        me = self._me
        return Alive(
            node=me.node, name=me.name, addr=me.addr, incarnation=me.incarnation, meta=dict(me.meta)
        )

    # ------------------------------------------------------------------ gossip rounds

    def _fire_gossip(self, now: float, _key: object) -> None:
        if not self._rumours:
            self._gossip_next = now + self.config.gossip_interval  # idle: see __init__
            return
        self._arm(now + self.config.gossip_interval, "gossip", None)
        for m in self._random_members(
            self.config.gossip_nodes, exclude=None, states=_ALL_STATES, now=now
        ):
            rumours = self._take_rumours(self.config.packet_budget)
            if not rumours:
                break
            self._out.append(Send(m.addr, tuple(rumours)))

    def _fire_push_pull(self, now: float, _key: object) -> None:
        period = self.config.push_pull_period(self.num_live())
        self._arm(now + period * (0.5 + self._rng.random()), "push_pull", None)
        # Reconnect (as serf does): with probability dead / (dead + live), sync with a member
        # we declared dead instead. If it is alive on the far side of a healed partition, the
        # exchange tells each side the other's state and the two views merge; if it is really
        # gone, the driver's exchange fails and costs one connection attempt.
        dead = sum(
            1
            for m in (self._members.get(n) for n in self._departed)
            if m is not None and m.state == MemberState.DEAD
        )
        if dead and self._rng.random() * (dead + self._live) < dead:
            peers = self._random_members(1, exclude=None, states=(MemberState.DEAD,))
            if peers:
                self._count("reconnects")
                self._out.append(StartPushPull(peers[0].addr, join=False))
                return
        peers = self._random_members(1, exclude=None, states=(MemberState.ALIVE,))
        if peers:
            self._out.append(StartPushPull(peers[0].addr, join=False))

    def _fire_reap(self, now: float, _key: object) -> None:
        self._reap_armed = False
        self._reap_grid = now + 1.0
        gone = [n for n, since in self._departed.items() if now - since > self.config.dead_reclaim]
        for node in gone:
            self._remove(node)
        stale = [s for s, p in self._probes.items() if p.target not in self._members]
        for s in stale:
            del self._probes[s]
        self._schedule_reap()

    def _schedule_reap(self) -> None:
        """Arm the reap timer, unless armed, at the first point of its 1 s grid at which a
        departed member is due to be forgotten: the grid point where a reap run every second
        would first forget one. (Those runs would forget nothing before it, and a probe of a
        forgotten member, which they also drop, exists only after a member is forgotten.)
        Departures only ever get later (``since`` is the time of the call that departed the
        member), so a timer armed stays the earliest due."""
        if self._reap_armed or not self._departed:
            return
        oldest = min(self._departed.values())
        reclaim = self.config.dead_reclaim
        when = self._reap_grid
        while when < self._now or when - oldest <= reclaim:
            when += 1.0
        self._reap_grid = when
        self._reap_armed = True
        self._arm(when, "reap", None)

    # ------------------------------------------------------------------ helpers

    def _send(self, dest: Address, *msgs: Message) -> None:
        budget = self.config.packet_budget - 48 * len(msgs)
        for m in msgs:
            if isinstance(m, _GOSSIP):
                budget -= self._size_of(m)
        rumours = self._take_rumours(budget) if budget > 32 else []
        self._out.append(Send(dest, (*msgs, *rumours)))

    def _send_direct(self, *msgs: Gossip) -> None:
        """Send ``msgs`` alone, in one datagram, to every live member (at most ``MAX_DIRECT``,
        drawn at random), besides gossiping them: news every member must act on at once."""
        targets = [m for m in self._members.values() if m.state in _LIVE]
        if len(targets) > MAX_DIRECT:
            targets = self._rng.sample(targets, MAX_DIRECT)
        for m in targets:
            self._out.append(Send(m.addr, msgs))

    def _take_rumours(self, budget: int) -> list[Gossip]:
        if not self._rumours:
            return []
        n = self._live + 1
        cached_n, limit = self._limit_cache
        if cached_n != n:
            limit = self.config.retransmit_limit(n)
            self._limit_cache = (n, limit)
        return self._queue.take(budget, limit)

    def _broadcast(self, msg: Gossip) -> None:
        self._queue.push(msg)
        when = self._gossip_next
        if when is not None:  # gossip rounds were idle: resume them on their grid
            self._gossip_next = None
            interval = self.config.gossip_interval
            while when < self._now:
                when += interval
            self._arm(when, "gossip", None)

    def _random_members(
        self,
        k: int,
        *,
        exclude: str | None,
        states: tuple[MemberState, ...],
        now: float | None = None,
    ) -> list[MemberSnapshot]:
        """Up to ``k`` distinct random members in ``states`` (dead ones only within
        ``gossip_to_dead`` of their death when ``now`` is given). Rejection sampling keeps
        this O(k) for large meshes."""
        picked: dict[str, MemberSnapshot] = {}
        ids = self._peer_ids
        n = len(ids)
        if not n:
            return []
        # rng.randrange(n), inlined (the same draws: Random._randbelow_with_getrandbits).
        getrandbits = self._rng.getrandbits
        bits = n.bit_length()
        get = self._members.get
        # 4k + 8 draws whatever n: with n draws a member with two peers found no helper for a
        # failed probe a quarter of the time (both draws hit the target), and skipped the
        # indirect probes that tell a slow member from a dead one.
        for _ in range(4 * k + 8):
            if len(picked) >= k:
                break
            i = getrandbits(bits)
            while i >= n:
                i = getrandbits(bits)
            m = get(ids[i])
            if m is None or m.node == exclude or m.node in picked or m.state not in states:
                continue
            if (
                now is not None
                and m.state not in _LIVE
                and now - self._departed[m.node] > self.config.gossip_to_dead
            ):
                continue
            picked[m.node] = m
        return list(picked.values())

    def _add(self, m: MemberSnapshot, now: float) -> None:
        self._members[m.node] = m
        if self._base is not None:
            self._track(m.node, m)
        if m.state not in _LIVE:
            self._departed[m.node] = now
            self._schedule_reap()
        returning = m.node in self._stale
        if returning:
            self._stale.discard(m.node)  # back in the slot it left
        else:
            self._peer_ids.append(m.node)
        if m.state in _LIVE:
            self._live += 1
            # Into the rest of the current probe round (drawn at random from it), so a new
            # member is probed soon, not after a whole round; a returning one may still be
            # there (a search, but only for members forgotten and back).
            if not returning or not self._probe_round.pending(m.node):
                self._probe_round.add(m.node)

    def _remove(self, node: str) -> None:
        m = self._members.pop(node)
        if self._base is not None:
            self._track(node, None)
        if m.state in _LIVE:
            self._live -= 1
        self._stale.add(node)
        if len(self._stale) > 16 + len(self._peer_ids) // 2:
            stale = self._stale
            self._peer_ids = [n for n in self._peer_ids if n not in stale]
            stale.clear()
        self._suspicions.pop(node, None)
        self._departed.pop(node, None)

    def _replace(
        self, m: MemberSnapshot, incarnation: int, state: MemberState, now: float
    ) -> MemberSnapshot:
        """Store a copy of ``m`` at ``incarnation`` in ``state``; return it."""
        new = MemberSnapshot(
            node=m.node,
            name=m.name,
            addr=m.addr,
            incarnation=incarnation,
            state=state,
            meta=m.meta,
        )
        self._put(new, m.state, now)
        return new

    def _put(self, m: MemberSnapshot, before: MemberState, now: float) -> None:
        """Store ``m`` in place of the member's record that was in state ``before``."""
        self._members[m.node] = m
        if self._base is not None:
            self._track(m.node, m)
        state = m.state
        if state == before:
            return
        self._live += (state in _LIVE) - (before in _LIVE)
        if state in _LIVE:
            self._departed.pop(m.node, None)
        else:
            self._departed[m.node] = now  # since when: for gossip_to_dead and dead_reclaim
            self._schedule_reap()

    def _track(self, node: str, m: MemberSnapshot | None) -> None:
        """Note how the member's record (``None``: forgotten) departs from the shared table."""
        base = self._base
        if base is None:
            return
        shared = base.get(node)
        if m is None:
            self._own.pop(node, None)
            if shared is not None:
                self._dropped[node] = None
        else:
            self._dropped.pop(node, None)
            if shared is m:
                self._own.pop(node, None)
            else:
                self._own[node] = None

    def _emit(self, kind: EventKind, m: MemberSnapshot, now: float) -> None:
        self._count(f"event_{kind}")
        self._out.append(MemberEvent(kind, m, now))

    def _arm(self, when: float, kind: str, key: object) -> None:
        self._timer_order += 1
        heapq.heappush(self._timers, (when, self._timer_order, kind, key))

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) % (1 << 32)
        return self._seq

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def _flush(self) -> list[Effect]:
        out, self._out = self._out, []
        return out


def _alive_record(a: Alive) -> MemberSnapshot:
    """The member record an ``Alive`` rumour states (a new, shared, immutable record)."""
    return MemberSnapshot(
        node=a.node,
        name=a.name,
        addr=a.addr,
        incarnation=a.incarnation,
        state=MemberState.ALIVE,
        meta=a.meta,
    )
