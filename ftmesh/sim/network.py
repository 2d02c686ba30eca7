"""Deterministic in-memory network for the sans-IO membership machines.

Theory of operation: one event heap drives everything. Datagrams become ``deliver`` events
after a random latency (or vanish with probability ``loss``, or when a partition separates the
two ends); push-pull exchanges complete after a round trip; each node's timers become ``tick``
events at its ``next_deadline``. A crashed node drops everything; a paused node keeps its
inbox and processes it (late) when resumed, like a SIGSTOPped process. All randomness comes
from one seeded ``random.Random``, so a run is reproducible from its seed.

Scale: members join one by one (``add_node``) or as one batch that starts knowing each other
(``add_settled``), whose tables all hold the same immutable member records. Queries over all
members (``converged``) loop in C where they can. A tick scheduled for a timer that went moot
since (an acked probe's timeout, which ``Swim.next_deadline`` drops) is passed over without
calling the machine.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_
from typing import Any

import msgpack

from ..membership.config import MembershipConfig
from ..membership.messages import (
    Ack,
    Address,
    Alive,
    Dead,
    MemberSnapshot,
    MemberState,
    Message,
    Nack,
    Ping,
    PushPull,
    Suspect,
)
from ..membership.swim import Effect, MemberEvent, Send, StartPushPull, Swim
from ..membership.wire import encoded_size, snapshot_fields

_GOSSIP = (Alive, Suspect, Dead)
_SIZE_CACHE = 200_000
"""Cached rumour sizes in the byte accounting (~40 MB at most)."""


@dataclass(slots=True)
class SimNode:
    swim: Swim
    addr: Address
    crashed: bool = False
    paused: bool = False
    inbox: list[tuple[Address, tuple[Message, ...]]] = field(default_factory=list)
    scheduled: float = float("inf")
    msgs_sent: int = 0
    bytes_sent: int = 0


class _Settled:
    """A table of ALIVE members handed to a batch (add_settled), with its records' encoded
    sizes once asked for."""

    def __init__(self, records: dict[str, MemberSnapshot]) -> None:
        self.records = records
        self._sizes: dict[str, int] | None = None
        self.total = 0

    def sizes(self) -> dict[str, int]:
        if self._sizes is None:
            self._sizes = {
                k: len(msgpack.packb(snapshot_fields(m))) for k, m in self.records.items()
            }
            self.total = sum(self._sizes.values())
        return self._sizes


@dataclass(frozen=True, slots=True)
class SeenEvent:
    time: float
    observer: str
    event: MemberEvent


class SimNetwork:
    def __init__(
        self,
        *,
        seed: int,
        config: MembershipConfig,
        loss: float = 0.0,
        latency: tuple[float, float] = (0.0002, 0.002),
        count_bytes: bool = True,
        record_events: bool = True,
    ) -> None:
        self.rng = random.Random(seed)
        self.config = config
        self.loss = loss
        self.latency = latency
        self.count_bytes = count_bytes
        self.record_events = record_events
        self.now = 0.0
        self.nodes: dict[Address, SimNode] = {}
        self.by_id: dict[str, SimNode] = {}
        self.events: list[SeenEvent] = []
        self.on_event: Callable[[SeenEvent], None] | None = None
        # (time, order, kind, payload): "tick" SimNode, "deliver" (dest, src, msgs),
        # "push_pull" (SimNode, dest, join)
        self._heap: list[tuple[float, int, str, Any]] = []
        self._order = 0
        self._group: dict[Address, int] = {}  # partition group per node; absent = group 0
        self.dropped = 0
        self._sizes: dict[int, tuple[Message, int]] = {}
        # Encoded size of each member record seen in a push-pull, by id(record), and the
        # records themselves (so an id is not reused while cached).
        self._record_sizes: dict[int, int] = {}
        self._records: dict[int, MemberSnapshot] = {}
        self._probe_sizes: dict[tuple[object, ...], int] = {}
        self._settled: dict[int, _Settled] = {}  # by id of the table (kept alive by _Settled)
        self._stopped: set[Address] = set()

    # ------------------------------------------------------------------ topology

    def add_node(self, *, join: Iterable[Address] = ()) -> SimNode:
        node = self._new_node()
        self._apply(node, node.swim.join(self.now, list(join)))
        self._reschedule(node)
        return node

    def add_settled(self, count: int) -> list[SimNode]:
        """Start ``count`` members that know each other from the start: a batched join, the
        state ``count`` members joining one by one settle into once every join rumour has
        drained (each one ALIVE at incarnation 1 in every table; each member still announces
        itself, as a starting member does). A join storm costs O(n^2 log n) rumour
        transmissions, which at 10,000 members is hours of simulation; this costs one table
        copy per member, and every table holds the same ``count`` record objects."""
        nodes = [self._new_node() for _ in range(count)]
        records: dict[str, MemberSnapshot] = {}
        for node in nodes:
            me = node.swim.member(node.swim.node_id)
            assert me is not None
            records[me.node] = me
        for node in nodes:
            node.swim.adopt(self.now, records)
            self._reschedule(node)
        self._settled[id(records)] = _Settled(records)
        return nodes

    def _new_node(self) -> SimNode:
        idx = len(self.nodes) + 1
        addr = (f"10.{idx // 65536}.{idx // 256 % 256}.{idx % 256}", 7946)
        node_id = f"{self.rng.getrandbits(128):032x}"
        swim = Swim(
            node_id=node_id,
            name=f"n{idx}",
            addr=addr,
            config=self.config,
            rng=random.Random(self.rng.getrandbits(64)),
            now=self.now,
        )
        node = SimNode(swim, addr)
        self.nodes[addr] = node
        self.by_id[node_id] = node
        return node

    def crash(self, node: SimNode) -> None:
        node.crashed = True
        node.inbox.clear()

    def pause(self, node: SimNode) -> None:
        node.paused = True

    def resume(self, node: SimNode) -> None:
        node.paused = False
        inbox, node.inbox = node.inbox, []
        for src, msgs in inbox:
            self._apply(node, node.swim.receive(self.now, src, msgs))
        node.scheduled = float("inf")
        self._apply(node, node.swim.tick(self.now))
        self._reschedule(node)

    def leave(self, node: SimNode) -> None:
        """Graceful leave: the member announces it and keeps running (so the news spreads)
        until the caller crashes it, as ``ftmesh node`` does on SIGTERM."""
        self._apply(node, node.swim.leave(self.now))
        self._reschedule(node)

    def update_meta(self, node: SimNode, meta: dict[str, str | int | float | bool | None]) -> None:
        self._apply(node, node.swim.update_meta(self.now, meta))
        self._reschedule(node)

    def connection_closed(self, node: SimNode, about: SimNode) -> None:
        """Tell ``node`` that ``about`` closed, reset or refused a data-plane connection, as a
        mesh's data plane does (``Swim.connection_closed``)."""
        self._apply(node, node.swim.connection_closed(self.now, about.swim.node_id))
        self._reschedule(node)

    def inject(self, node: SimNode, src: Address, msgs: tuple[Message, ...]) -> None:
        """Hand ``msgs`` to ``node`` now as if a datagram from ``src`` had arrived."""
        self._apply(node, node.swim.receive(self.now, src, msgs))
        self._reschedule(node)

    def partition(self, groups: Iterable[Iterable[SimNode]]) -> None:
        """Cut the network between groups; nodes not named form group 0."""
        self._group = {}
        for gi, group in enumerate(groups, start=1):
            for n in group:
                self._group[n.addr] = gi

    def heal(self) -> None:
        self._group = {}

    # ------------------------------------------------------------------ running

    def run_until(self, t_end: float) -> None:
        # The simulator's inner loop (millions of events at thousands of members): locals
        # for the attributes it uses, no call for a member that returns no effects, and
        # _reschedule inlined.
        heap = self._heap
        pop = heapq.heappop
        push = heapq.heappush
        nodes = self.nodes
        apply = self._apply
        inf = float("inf")
        while heap and heap[0][0] <= t_end:
            when, _, kind, payload = pop(heap)
            self.now = when
            if kind == "tick":
                node = payload
                if node.scheduled != when or node.crashed or node.paused:
                    continue
                node.scheduled = inf
                swim = node.swim
                # (Its timer may have gone moot since: an acked probe's timeout.)
                effects = swim.tick(when) if swim.next_deadline() <= when else None
            elif kind == "deliver":
                dest, src, msgs = payload
                node = nodes[dest]
                if node.crashed:
                    continue
                if node.paused:
                    node.inbox.append((src, msgs))
                    continue
                swim = node.swim
                effects = swim.receive(when, src, msgs)
            else:
                self._push_pull(*payload)
                continue
            if effects:
                apply(node, effects)
            deadline = swim.next_deadline()
            if deadline < node.scheduled:
                node.scheduled = deadline
                self._order += 1
                push(heap, (deadline, self._order, "tick", node))
        self.now = t_end

    def _push_pull(self, src: SimNode, dest_addr: Address, join: bool) -> None:
        dest = self.nodes.get(dest_addr)
        if src.crashed or src.paused:
            return
        if dest is None or dest.crashed or dest.paused or not self._connected(src.addr, dest_addr):
            self._apply(src, src.swim.join_failed(self.now, dest_addr) if join else [])
            return
        s_base, s_own, s_dropped = src.swim.shared_table()
        d_base, d_own, d_dropped = dest.swim.shared_table()
        settled = self._settled.get(id(s_base)) if s_base is d_base else None
        if settled is not None and settled.records is s_base:
            # Both adopted one table of ALIVE members (add_settled): each hands the other
            # its own records and the shared ones the other no longer holds, which merges
            # as the full state would (Swim.push_pull_subset); bytes are the full state's.
            request = src.swim.push_pull_subset(dict.fromkeys([*s_own, *d_dropped]), join=join)
            reply = dest.swim.push_pull_subset(dict.fromkeys([*d_own, *s_dropped]))
            for node, pp, own, dropped in (
                (src, request, s_own, s_dropped),
                (dest, reply, d_own, d_dropped),
            ):
                node.msgs_sent += 1
                if self.count_bytes:
                    node.bytes_sent += 28 + self._settled_state_size(
                        node, pp, own, dropped, settled
                    )
        else:
            request = src.swim.push_pull_state(join=join)
            reply = dest.swim.push_pull_state()
            self._account(src, request)
            self._account(dest, reply)
        self._apply(dest, dest.swim.merge_push_pull(self.now, request))
        self._reschedule(dest)
        self._apply(src, src.swim.merge_push_pull(self.now, reply))
        self._reschedule(src)

    # ------------------------------------------------------------------ plumbing

    def _apply(self, node: SimNode, effects: list[Effect]) -> None:
        rand = self.rng.random
        for eff in effects:
            if isinstance(eff, Send):
                if self.count_bytes:
                    self._account(node, *eff.msgs)
                else:
                    node.msgs_sent += 1
                if (self._group and not self._connected(node.addr, eff.dest)) or (
                    rand() < self.loss
                ):
                    self.dropped += 1
                    continue
                lo, hi = self.latency
                # lo + (hi - lo) * random() is what rng.uniform computes, inlined.
                self._order += 1
                heapq.heappush(
                    self._heap,
                    (
                        self.now + lo + (hi - lo) * rand(),
                        self._order,
                        "deliver",
                        (eff.dest, node.addr, eff.msgs),
                    ),
                )
            elif isinstance(eff, StartPushPull):
                lo, hi = self.latency
                self._push(
                    self.now + 2 * self.rng.uniform(lo, hi), "push_pull", (node, eff.dest, eff.join)
                )
            else:
                seen = SeenEvent(self.now, node.swim.node_id, eff)
                if self.record_events:
                    self.events.append(seen)
                if self.on_event is not None:
                    self.on_event(seen)

    def _account(self, node: SimNode, *msgs: Message) -> None:
        node.msgs_sent += 1
        if self.count_bytes:
            size = 28  # IP + UDP headers
            sizes = self._sizes
            for m in msgs:
                if isinstance(m, _GOSSIP):
                    # Rumours are shared objects piggybacked many times: encode each once. The
                    # cache holds the message itself so its id cannot be reused while cached,
                    # and is emptied when full so memory stays bounded on long runs.
                    hit = sizes.get(id(m))
                    if hit is None:
                        if len(sizes) >= _SIZE_CACHE:
                            sizes.clear()
                        hit = sizes[id(m)] = (m, encoded_size(m))
                    size += hit[1]
                elif isinstance(m, PushPull):
                    size += self._push_pull_size(m)
                else:
                    size += self._probe_size(m)
            node.bytes_sent += size

    def _probe_size(self, m: Message) -> int:
        """``encoded_size`` of a probe, ack, nack or indirect probe. Each is made once and
        sent once, but its size depends only on the length of its (ASCII) strings and the
        magnitude of its integers: cached by that shape, instead of encoding millions."""
        if type(m) is Ping:
            host, port = m.source_addr
            shape: tuple[object, ...] = (
                1,
                m.seq.bit_length(),
                len(m.target),
                len(m.source),
                len(host),
                port.bit_length(),
            )
            ascii_only = m.target.isascii() and m.source.isascii() and host.isascii()
        elif type(m) is Ack or type(m) is Nack:
            shape = (type(m) is Ack, m.seq.bit_length(), len(m.source))
            ascii_only = m.source.isascii()
        else:
            return encoded_size(m)
        size = self._probe_sizes.get(shape) if ascii_only else None
        if size is None:
            size = encoded_size(m)
            if ascii_only:
                self._probe_sizes[shape] = size
        return size

    def _settled_state_size(
        self,
        node: SimNode,
        subset: PushPull,
        own: list[str],
        dropped: list[str],
        settled: _Settled,
    ) -> int:
        """``encoded_size(node.swim.push_pull_state(...))`` from the shared table's size and
        the node's departures from it (``subset`` holds the node's own snapshot, first)."""
        sizes = settled.sizes()
        get = node.swim.member
        total = settled.total - sum(map(sizes.__getitem__, dropped))
        count = len(sizes) - len(dropped) + 1
        for key in own:
            m = get(key)
            assert m is not None
            shared = sizes.get(key)
            if shared is None:
                count += 1
            else:
                total -= shared
            total += self._record_size(m)
        total += self._record_size(subset.members[0])
        array_header = 1 if count < 16 else 3 if count < 1 << 16 else 5
        empty = PushPull(source=subset.source, members=(), join=subset.join)
        return encoded_size(empty) - 1 + array_header + total

    def _record_size(self, m: MemberSnapshot) -> int:
        size = self._record_sizes.get(id(m))
        if size is None:
            if len(self._record_sizes) >= _SIZE_CACHE:
                self._record_sizes.clear()
                self._records.clear()
            size = self._record_sizes[id(m)] = len(msgpack.packb(snapshot_fields(m)))
            self._records[id(m)] = m
        return size

    def _push_pull_size(self, pp: PushPull) -> int:
        """``encoded_size(pp)`` without encoding the member list: the list's bytes are the
        sum of its records' (cached: the records are shared between the members' tables, so
        a 10,000-member exchange costs 10,000 dict lookups in C, not 10,000 encodings)."""
        sizes = self._record_sizes
        members = pp.members
        got = list(map(sizes.get, map(id, members)))
        total = sum(filter(None, got))  # (every size is positive: None is a miss)
        if None in got:
            if len(sizes) >= _SIZE_CACHE:
                sizes.clear()
                self._records.clear()
                total = 0
                missing: Iterable[MemberSnapshot] = members
            else:
                missing = compress(members, map(is_, got, repeat(None)))
            for m in missing:
                size = sizes[id(m)] = len(msgpack.packb(snapshot_fields(m)))
                self._records[id(m)] = m
                total += size
        n = len(pp.members)
        array_header = 1 if n < 16 else 3 if n < 1 << 16 else 5  # msgpack fixarray/16/32
        rest = encoded_size(
            PushPull(source=pp.source, join=pp.join, observer=pp.observer, members=())
        )
        return rest - 1 + array_header + total

    def _connected(self, a: Address, b: Address) -> bool:
        return self._group.get(a, 0) == self._group.get(b, 0)

    def _reschedule(self, node: SimNode) -> None:
        nd = node.swim.next_deadline()
        if nd < node.scheduled:
            node.scheduled = nd
            self._push(nd, "tick", node)

    def _push(self, when: float, kind: str, payload: object) -> None:
        self._order += 1
        heapq.heappush(self._heap, (when, self._order, kind, payload))

    # ------------------------------------------------------------------ queries

    def live_nodes(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if not n.crashed]

    def converged(self) -> bool:
        """Every running node sees exactly the running nodes as alive (and none suspect)."""
        nodes = [n for n in self.live_nodes() if not n.paused]
        running = [n.swim.node_id for n in nodes]
        # Cheap reject first, over all members: live (alive or suspect) members must number
        # exactly the running ones. Then every running one must be alive, which leaves no
        # room for another alive or suspect member.
        if any(n.swim.num_live() != len(running) for n in nodes):
            return False
        running_set = set(running)
        in_table: dict[int, int] = {}  # running members in a settled table (all ALIVE there)
        for n in nodes:
            swim = n.swim
            if swim.state_of(swim.node_id) != MemberState.ALIVE:
                return False
            table, own, dropped = swim.shared_table()
            settled = self._settled.get(id(table))
            if settled is None or settled.records is not table:
                # alive_among loops in C (10^8 lookups at 10,000 members, though).
                alive = swim.alive_among(running)
            else:
                # From the shared table's count and this member's departures from it.
                alive = in_table.get(id(table), -1)
                if alive < 0:
                    alive = in_table[id(table)] = len(table.keys() & running_set)
                alive -= sum(1 for k in dropped if k in running_set)
                for k in own:
                    if k in running_set:
                        alive += (swim.state_of(k) == MemberState.ALIVE) - (k in table)
            if alive != len(running) - 1:
                return False
        return True
