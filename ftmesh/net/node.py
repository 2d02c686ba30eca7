"""The trio runtime of one mesh member: drives the SWIM machine over UDP and TCP.

Theory of operation: the ``Swim`` machine decides; this module only moves bytes and time.
Five long-lived tasks run in the node's nursery:

* the UDP loop opens each datagram with the ``PacketCodec`` (bad input is counted and dropped
  here, never raised further) and feeds the messages to the machine; on Linux it also reads
  the errors our own datagrams caused (``IP_RECVERR``: the socket's error queue, which must
  be drained or the socket stays readable) and hands each ICMP *port unreachable*, with the
  address the datagram went to, to the machine (``Swim.port_unreachable``); the kernel also
  reports such an error on the socket's next send, dropping that datagram, which is then sent
  again (``Node._send``);
* the timer loop sleeps until the machine's next deadline (the sleep is shortened whenever a
  call makes an earlier deadline) and then ticks it;
* the TCP listener answers push-pull exchanges (joins, anti-entropy, ``ftmesh status``);
  connections that have not sent a valid push-pull yet are pending, under the caps and the
  deadline of ``ftmesh.net.admission``, so idle connections cannot block joins;
* the pair loop sends, every ``pair_interval``, two full-sized datagrams back to back to one
  peer at a time, and the UDP loop times the pairs that arrive (kernel receive stamps) into
  capacity samples of the path from their sender (``ftmesh.net.pairs``);
* discovery (``ftmesh.discovery``) announces us and reports peers, which become joins; the
  ``join`` addresses are offered again every ``JOIN_POLL`` seconds with every discovery (``seeds``
  does it itself). A
  join that fails is retried with exponential backoff (``JOIN_RETRY``) until the address is a
  live member.

Gossip datagrams are marked as network control (``LIVENESS_TOS``, ``LIVENESS_PRIORITY``): a
member's collectives can fill a slow link with bulk data, and a probe or ack queued behind it,
or dropped by a full queue, makes a healthy member suspect. The socket priority puts them in
the host's own interactive band (ahead of bulk data in its ``pfifo_fast`` queue) and the DSCP
class lets links that classify by it (a site's WAN edge with a QoS policy) send them first; a
path that ignores DSCP (a plain drop-tail queue, as most of the internet, and the lab's WAN
forwarder) still drops them, and Lifeguard's refutation then has to undo the suspicion.

Effects come back from every machine call and are applied at once: datagrams are sent without
blocking (a full socket buffer drops the datagram, as the network might, and counts it);
push-pulls run as short tasks with a deadline; member events go to every subscriber's bounded
channel (a subscriber that does not keep up loses events and the loss is counted).

Bind and advertise are separate: every listener of a member (gossip here, the data plane and
the state server in ``ftmesh.mesh``) binds ``NodeConfig.bind``, a local address or
``0.0.0.0``, and every address the member publishes names ``NodeConfig.advertised_host``. The
advertised host need not be an address of this machine: behind NAT or a port forward it is
the public address whose ports lead here (fixed ports make that forwarding possible).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import socket
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from functools import partial

import trio

from ..discovery import Advert, make_discovery
from ..errors import ConfigError, RemoteProtocolError
from ..membership.config import MembershipConfig
from ..membership.messages import (
    Address,
    MemberSnapshot,
    MemberState,
    Message,
    Meta,
    PacketPair,
)
from ..membership.swim import Effect, MemberEvent, Send, StartPushPull, Swim
from ..membership.wire import (
    MAX_DATAGRAM,
    MAX_MESH_NAME,
    PROTOCOL_VERSION,
    PacketCodec,
    StaleError,
)
from ..security import MeshAuth
from .admission import Admission, accept_loop, peer_host
from .clocks import PeerClocks
from .frames import (
    Exchanged,
    Wall,
    exchange_push_pull,
    read_challenge,
    read_push_pull,
    send_challenge,
    write_push_pull,
)
from .pairs import ANCILLARY_BYTES, PAIR_BYTES, PairTimer, enable_timestamps, kernel_time_ns
from .ports import bind_error
from .ratelimit import RateLimiter

log = logging.getLogger("ftmesh.node")

IP_RECVERR = getattr(socket, "IP_RECVERR", 11 if sys.platform == "linux" else None)
"""Linux: queue the ICMP errors our datagrams cause, with the address each was sent to
(``Node._read_errors``)."""
SO_EE_ORIGIN_ICMP = 2
_EXTENDED_ERR = struct.Struct("=IBBBBII")  # struct sock_extended_err
MAX_ERRORS_READ = 64
"""Queued datagram errors read at one wake-up of the UDP loop."""
REPORTED_LATER = frozenset(
    {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN}
)
"""Errors a send may report on behalf of an earlier datagram's ICMP answer (``Node._send``)."""
SEND_TRIES = 3
"""Sends of one datagram while they fail with ``REPORTED_LATER``: the socket holds one pending
error, which the failing send clears; a third try covers one more arriving in between."""
ROUND_TRIPS_KEPT = 256
"""Probe round trips kept until the mesh takes them (it does every few seconds; one probe
per probe interval comes in, so none is lost unless nobody takes them)."""

MAX_CONCURRENT_PUSH_PULLS = 16
"""Outgoing TCP exchanges at once; more are refused (and retried later), bounding our sockets
and tasks. Incoming ones are bounded by ``ftmesh.net.admission``."""
JOIN_RETRY = (1.0, 5.0)
"""Seconds before an address that is not yet a live member is contacted again: the first
retry, and the longest wait, doubling in between (with ``JOIN_JITTER`` so members started
together do not retry in step). Reset once the address is a live member. The longest wait
bounds how long a healed partition can wait for a join; one exchange per address per 5 s is
a negligible load."""
JOIN_JITTER = 0.2
JOIN_RETRY_BOUND = JOIN_RETRY[1] * (1 + JOIN_JITTER)
"""Longest wait between two join attempts at one address."""
JOIN_POLL = 0.5
"""Seconds between offers of the ``join`` addresses to the retry logic."""
MAX_JOIN_ADDRESSES = 4096
"""Addresses whose join backoff is remembered: bounds what discovery floods can grow."""
RATE_PER_SOURCE = 200.0
"""Datagrams per second accepted from one source (burst: twice that). A member sends a peer
a few probes, acks and gossip rounds per second; this leaves a wide margin for that and stops
one host from spending all our CPU on MAC checks."""
GLOBAL_RATE = 20_000.0
"""Datagrams per second accepted from all sources together."""
ALONE_WARN_AFTER = 30.0
"""Seconds a member given seeds (``join``) may be alone before it says so."""
ALONE_WARN_EVERY = 60.0
"""Seconds between those warnings while it stays alone."""
MAX_GONE_ADDRESSES = 4096
"""Addresses of members that died or left, remembered after their records are reaped (their
push-pull failures are expected: ``Node._only_dead_at``)."""
MAX_TRACKED_ADDRESSES = 4096
"""Discovered addresses remembered with their last join outcome (bounds what a flood of
adverts can make us hold; beyond it the record starts over)."""


@dataclass(frozen=True, slots=True)
class DiscoveryStatus:
    """Where a member looks for the others and what it found: what a member that waits for
    peers tells the user (``Node.discovery_status``)."""

    kind: str
    """``local``, ``seeds``, ``mdns`` or ``none``."""
    where: str
    """What it searches: the seeds, the mDNS interface, the registry directory."""
    answered: tuple[str, ...]
    """``host:port`` of discovered addresses that answered a join."""
    unanswered: tuple[str, ...]
    """``host:port (why)`` of discovered addresses whose last join failed."""

    def describe(self) -> str:
        """One line, e.g. ``seeds discovery (seeds a:7946): no answer from 10.0.0.2:7946 (...)``."""
        parts = []
        if self.answered:
            parts.append(f"answered: {', '.join(self.answered[:8])}")
        if self.unanswered:
            parts.append(f"no answer from {', '.join(self.unanswered[:8])}")
        found = "; ".join(parts) or "found nobody"
        return f"{self.kind} discovery ({self.where}): {found}"

    def hint(self) -> str:
        """What to check, for this kind of discovery."""
        same = "that every member uses the same --mesh and mesh secret"
        if self.kind == "mdns":
            return f"check that the members are on this LAN, multicast reaches them and {same}"
        if self.kind == "local":
            return f"check that the members run on this host, share the registry dir and {same}"
        return (
            "check that the seeds (--join) name members that are running and reachable on "
            f"their gossip --port, and {same}"
        )


def parse_hostport(text: str) -> Address:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    return (host, int(port))


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Identity and network settings of one member; timing lives in ``membership``."""

    mesh: str = "default"
    """Mesh name: members of different meshes never merge, even on one LAN."""
    name: str = ""
    """Human name; default ``hostname-pid``."""
    bind: str = "127.0.0.1"
    """Address the gossip UDP and TCP sockets bind to."""
    port: int = 0
    """Gossip port (UDP and TCP); 0 picks a free one."""
    advertise: str = ""
    """Address peers use to reach us; default ``bind`` (required when binding 0.0.0.0). It may
    be an address this machine does not own (a NAT's, a port forward's): nothing binds it."""
    discovery: str = "local"
    """``local`` (same host, no multicast), ``seeds`` (the ``join`` list), ``mdns`` (LAN
    multicast) or ``none`` (only ``join``)."""
    join: tuple[str, ...] = ()
    """``HOST:PORT`` of members (or DNS names resolving to several) to join through."""
    interface: str = ""
    """For ``mdns``: the IPv4 address of the interface to announce and browse on."""
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    auth: MeshAuth = field(default_factory=MeshAuth.none)
    meta: Meta = field(default_factory=dict)
    registry_dir: str = ""
    """For ``local``: where same-host members register; default per ``ftmesh.discovery``."""
    metrics_port: int | None = None
    """Serve Prometheus metrics (``/metrics``, ``ftmesh.metrics``) on ``bind`` at this TCP
    port (0: any free one); ``None``: off, at no cost."""
    pair_interval: float = 1.0
    """Seconds between two packet pairs we send (to one peer at a time, in turn), which time
    the capacity of the path from us (``ftmesh.net.pairs``): about 2.4 KB per interval.
    0: send none (peers then measure no rate from us)."""

    def __post_init__(self) -> None:
        if not self.mesh or len(self.mesh) > MAX_MESH_NAME:
            raise ConfigError(f"mesh name must be 1..{MAX_MESH_NAME} characters")
        if self.discovery not in ("local", "seeds", "mdns", "none"):
            raise ConfigError(f"unknown discovery {self.discovery!r}: local, seeds, mdns, none")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port out of range: {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics port out of range: {self.metrics_port}")
        if not self.pair_interval >= 0:
            raise ConfigError(f"pair_interval must be >= 0, got {self.pair_interval}")
        for j in self.join:
            parse_hostport(j)

    @property
    def advertised_host(self) -> str:
        """The host every address this member publishes names (gossip, data plane, state):
        ``advertise``, else the bound address, which must then not be all interfaces."""
        if self.advertise:
            return self.advertise
        if self.bind in ("0.0.0.0", ""):
            raise ConfigError("binding to all interfaces needs an explicit advertise address")
        return self.bind


class Node:
    """A running member. Get one from :func:`open_node`."""

    def __init__(
        self, config: NodeConfig, swim: Swim, sock: socket.socket, wall: Wall = time.time
    ) -> None:
        self.config = config
        self._wall = wall
        """The wall clock replay protection reads (tests shift it)."""
        self.clocks = PeerClocks()
        """Peers' clock offsets, learned over push-pull (``ftmesh.net.clocks``)."""
        self._swim = swim
        self._sock = sock
        self._codec = PacketCodec(config.mesh, config.auth, config.membership.replay_window)
        self._nonce_rng = random.Random(os.urandom(16))
        self._subscribers: list[trio.MemorySendChannel[MemberEvent]] = []
        self._timer_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._push_pull_slots = trio.Semaphore(MAX_CONCURRENT_PUSH_PULLS)
        self._join_outcome: dict[Address, str] = {}  # "" answered, else why not
        self._gone: OrderedDict[Address, None] = OrderedDict()  # (``_note_gone``)
        self._admission = Admission(self._drop_tcp, handshake_timeout=config.membership.tcp_timeout)
        self._join_backoff: dict[Address, tuple[float, float]] = {}  # addr -> (next try, wait)
        self._jitter = random.Random(os.urandom(8))
        self._last_log: dict[str, float] = {}
        self.counters: dict[str, int] = {}
        self._traffic = [0, 0, 0, 0]  # gossip datagrams and bytes sent, then received
        self.metrics_address: tuple[str, int] | None = None
        """Where ``/metrics`` is served (``NodeConfig.metrics_port``), once it is."""
        self.statistics_sources: dict[str, Callable[[], object]] = {}
        """Snapshots of the components running beside this node (``"collectives"``,
        ``"trainer"``), read by the metrics exporter (``ftmesh.metrics``) at scrape time."""
        self._last_incarnation = swim.incarnation
        self._started = 0.0
        per_source = max(RATE_PER_SOURCE, 20 / config.membership.gossip_interval)
        self._limiter = RateLimiter(per_source, 2 * per_source, GLOBAL_RATE)
        self._stamped = enable_timestamps(sock)
        """The kernel stamps our datagrams' arrival: packet pairs can be timed."""
        self._pairs = PairTimer()
        self._rates: list[tuple[str, float]] = []

    # ------------------------------------------------------------------ public API

    @property
    def node_id(self) -> str:
        return self._swim.node_id

    @property
    def name(self) -> str:
        me = self._swim.member(self.node_id)
        assert me is not None
        return me.name

    @property
    def address(self) -> Address:
        """The gossip address other members can join through."""
        me = self._swim.member(self.node_id)
        assert me is not None
        return me.addr

    @property
    def incarnation(self) -> int:
        return self._swim.incarnation

    def me(self) -> MemberSnapshot:
        me = self._swim.member(self.node_id)
        assert me is not None
        return me

    def members(self) -> list[MemberSnapshot]:
        """Every known member, us first; dead and left ones until they are forgotten."""
        return self._swim.members()

    def take_round_trips(self) -> list[tuple[str, float]]:
        """The round trips our probes measured since the last call (``Swim.take_round_trips``:
        ``(member, seconds)``, at most ``ROUND_TRIPS_KEPT``, oldest dropped first). The mesh
        turns them into the link summary it publishes (``ftmesh.collective.topology``)."""
        return self._swim.take_round_trips()

    def take_rates(self) -> list[tuple[str, float]]:
        """The capacities our packet pairs measured since the last call: ``(member, bytes per
        second)`` of the path from that member to us, at most ``ROUND_TRIPS_KEPT``
        (``ftmesh.net.pairs``)."""
        out, self._rates = self._rates, []
        return out

    def alive_members(self) -> list[MemberSnapshot]:
        return [m for m in self._swim.members() if m.state == 0]

    def subscribe(
        self, max_buffer: int = 4096, *, replay: bool = False
    ) -> trio.MemoryReceiveChannel[MemberEvent]:
        """A channel of every membership event from now on (bounded; overflow is counted).

        With ``replay`` the channel starts with a ``joined`` event for every member already
        alive or suspect, taken atomically with the subscription, so nothing falls in a gap.
        """
        send, recv = trio.open_memory_channel[MemberEvent](max_buffer)
        if replay:
            now = trio.current_time()
            for m in self._swim.members()[1:]:
                if m.state in (MemberState.ALIVE, MemberState.SUSPECT):
                    with suppress(trio.WouldBlock):
                        send.send_nowait(MemberEvent("joined", m, now))
        self._subscribers.append(send)
        return recv

    async def events(self, *, replay: bool = False) -> AsyncIterator[MemberEvent]:
        """``async for event in node.events()``: membership events from now on (with
        ``replay``, first a ``joined`` event per current member)."""
        recv = self.subscribe(replay=replay)
        async with recv:
            async for ev in recv:
                yield ev

    def update_meta(self, meta: Meta) -> None:
        """Replace our metadata; it spreads to every member with a higher incarnation."""
        self._apply(self._swim.update_meta(trio.current_time(), meta))

    def join(self, addrs: list[Address]) -> None:
        """Contact these addresses to join (or merge with) their mesh."""
        self._apply(self._swim.join(trio.current_time(), addrs))

    def report_unreachable(self, node_id: str) -> None:
        """Hard evidence from the data plane: probe ``node_id`` now."""
        self._apply(self._swim.report_unreachable(trio.current_time(), node_id))

    def connection_closed(self, node_id: str) -> None:
        """The data plane saw ``node_id`` close, reset or refuse a connection: probe it now,
        and suspect it if the probe's short timeout passes unanswered
        (``Swim.connection_closed``)."""
        self._apply(self._swim.connection_closed(trio.current_time(), node_id))

    def discovery_status(self) -> DiscoveryStatus:
        """What discovery found and how the joins went (see ``DiscoveryStatus``)."""
        cfg = self.config
        if cfg.discovery == "mdns":
            where = f"mDNS on {cfg.interface or 'the default interface'}"
        elif cfg.discovery == "local":
            where = f"registry {cfg.registry_dir or 'default'}"
        else:
            where = f"seeds {', '.join(cfg.join) or 'none'}"
        answered = [f"{h}:{p}" for (h, p), why in self._join_outcome.items() if not why]
        failed = [f"{h}:{p} ({why})" for (h, p), why in self._join_outcome.items() if why]
        return DiscoveryStatus(cfg.discovery, where, tuple(answered), tuple(failed))

    def _record_join(self, dest: Address, why: str) -> None:
        if len(self._join_outcome) >= MAX_TRACKED_ADDRESSES and dest not in self._join_outcome:
            self._join_outcome.clear()
        self._join_outcome[dest] = why

    def statistics(self) -> dict[str, int]:
        """Drop counters of this driver and the protocol machine's counters, and gossip
        traffic (``tx_packets``, ``tx_bytes``, ``rx_packets``, ``rx_bytes``: UDP datagrams
        sent, and received before any check)."""
        names = ("tx_packets", "tx_bytes", "rx_packets", "rx_bytes")
        traffic = dict(zip(names, self._traffic, strict=True))
        return {**self._swim.counters, **self.counters, **traffic}

    # ------------------------------------------------------------------ effects

    def _apply(self, effects: list[Effect]) -> None:
        if self._swim.incarnation != self._last_incarnation:
            # We refuted a suspicion or a death (or changed metadata): tell subscribers about
            # ourselves, as an "alive" event whose member is us.
            self._last_incarnation = self._swim.incarnation
            effects = [*effects, MemberEvent("alive", self.me(), trio.current_time())]
        for eff in effects:
            if isinstance(eff, Send):
                data = self._codec.seal(eff.msgs, self._wall(), self._nonce_rng.randbytes(8))
                self._send(data, eff.dest)
            elif isinstance(eff, StartPushPull):
                if self._nursery is not None:
                    self._nursery.start_soon(self._push_pull, eff.dest, eff.join)
            else:
                self._note_gone(eff)
                for ch in self._subscribers:
                    try:
                        ch.send_nowait(eff)
                    except trio.WouldBlock:
                        self._count("events_dropped_slow_subscriber")
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self._subscribers.remove(ch)
        if self._timer_scope is not None:
            self._timer_scope.deadline = min(self._timer_scope.deadline, self._swim.next_deadline())

    def _send(self, data: bytes, dest: Address) -> None:
        """Send one datagram. With ``IP_RECVERR`` the kernel reports an ICMP error that an
        *earlier* datagram caused (say to a member that just died, which gossip still
        reaches for ``gossip_to_dead``) on the next send, to whomever it goes, and drops
        that datagram: so a refused or unreachable send is sent again (``SEND_TRIES``) before
        it counts as failed. Without this, every datagram to a dead member cost the next
        one to a live member: lost pings (false suspicions) and lost rumours (a busy
        member's flag that never arrived)."""
        for attempt in range(SEND_TRIES):
            try:
                self._sock.sendto(data, dest)
            except (BlockingIOError, InterruptedError):
                self._count("tx_dropped_full")
                return
            except OSError as exc:
                if exc.errno in REPORTED_LATER and attempt + 1 < SEND_TRIES:
                    self._count("tx_resent_after_error")
                    continue
                self._count("tx_errors")
                self._log_limited("tx", "send to %s failed: %s", dest, exc)
                return
            self._traffic[0] += 1
            self._traffic[1] += len(data)
            return

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def _log_limited(self, key: str, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log.get(key, -1e9) > 10.0:
            self._last_log[key] = now
            log.warning(fmt, *args)

    def _only_dead_at(self, addr: Address) -> bool:
        """Whether ``addr`` is the address of members we believe dead or gone, and of no
        live one: push-pull retries such addresses on purpose (a healed partition merges),
        so their failures are expected, not worth a WARNING every 10 s for the rest of
        the run. Also once their records are reaped (``_gone``)."""
        at = [m.state for m in self._swim.members() if tuple(m.addr) == tuple(addr)]
        if not at:
            return (str(addr[0]), int(addr[1])) in self._gone
        return MemberState.ALIVE not in at and MemberState.SUSPECT not in at

    def _note_gone(self, ev: MemberEvent) -> None:
        """Remember the addresses of members that died or left (bounded), and forget one
        a member is alive at again."""
        addr = (str(ev.member.addr[0]), int(ev.member.addr[1]))
        if ev.kind in ("dead", "left"):
            self._gone[addr] = None
            self._gone.move_to_end(addr)
            while len(self._gone) > MAX_GONE_ADDRESSES:
                self._gone.popitem(last=False)
        elif ev.kind in ("joined", "alive"):
            self._gone.pop(addr, None)

    def _drop(self, exc: RemoteProtocolError, src: object) -> None:
        self._count(f"rx_dropped_{exc.reason}")
        if exc.reason == "bad_version":  # another release: say so, it is no attack
            self._log_limited(
                "rx_bad_version",
                "dropped input from %s: %s; this member speaks wire protocol %d: members of "
                "different ftmesh releases cannot share a mesh (CHANGELOG.md)",
                src,
                exc,
                PROTOCOL_VERSION,
            )
            return
        self._log_limited(f"rx_{exc.reason}", "dropped input from %s: %s", src, exc)

    # ------------------------------------------------------------------ tasks

    def _read_errors(self) -> int:
        """Read the errors queued on the UDP socket (``IP_RECVERR``); hand each ICMP *port
        unreachable* to the machine with the address the datagram went to
        (``Swim.port_unreachable``: a member whose process is gone). How many were read."""
        if IP_RECVERR is None:
            return 0
        read = 0
        for _ in range(MAX_ERRORS_READ):
            try:
                _data, anc, _flags, dest = self._sock.recvmsg(1, 256, socket.MSG_ERRQUEUE)
            except OSError:  # (BlockingIOError: none left)
                break
            read += 1
            for level, kind, raw in anc:
                if level != socket.IPPROTO_IP or kind != IP_RECVERR:
                    continue
                if len(raw) < _EXTENDED_ERR.size or not isinstance(dest, tuple):
                    continue
                code, origin = _EXTENDED_ERR.unpack_from(raw)[:2]
                if code == errno.ECONNREFUSED and origin == SO_EE_ORIGIN_ICMP:
                    self._count("rx_port_unreachable")
                    addr = (str(dest[0]), int(dest[1]))
                    self._apply(self._swim.port_unreachable(trio.current_time(), addr))
        return read

    async def _udp_loop(self) -> None:
        sock = self._sock  # non-blocking
        idle = 0
        while True:
            await trio.lowlevel.checkpoint()
            try:
                if self._stamped:
                    data, anc, _flags, src = sock.recvmsg(MAX_DATAGRAM + 1, ANCILLARY_BYTES)
                else:
                    data, src = sock.recvfrom(MAX_DATAGRAM + 1)
                    anc = []
            except (BlockingIOError, InterruptedError):
                # Nothing to read; or woken by a queued error only (IP_RECVERR). A wake-up
                # with neither, again and again, would spin: then wait a little first.
                if self._read_errors():
                    continue
                idle += 1
                if idle > 16:
                    await trio.sleep(0.01)
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError as exc:  # an ICMP error surfacing (IP_RECVERR on Linux)
                if not self._read_errors():
                    self._count("rx_errors")
                    self._log_limited("rx_err", "recvfrom failed: %s", exc)
                continue
            idle = 0
            self._traffic[2] += 1
            self._traffic[3] += len(data)
            # Same-host members share 127.0.0.1: tell them apart by port there.
            key = src if src[0].startswith("127.") else src[0]
            if not self._limiter.allow(key, trio.current_time()):
                self._count("rx_dropped_rate_limited")
                continue
            addr = (src[0], src[1])
            try:
                msgs = self._codec.open(data, self._wall(), clock_offset=self.clocks.offset(addr))
            except StaleError as exc:
                # A replay, or a sender whose clock we have not measured or that moved: measure
                # it (rate-limited); a real member is accepted again after that round trip.
                self._drop(exc, src)
                if self._nursery is not None and self.clocks.should_sync(addr, time.monotonic()):
                    self._count("clock_syncs")
                    self._nursery.start_soon(self._push_pull, addr, False)
                continue
            except RemoteProtocolError as exc:
                self._drop(exc, src)
                continue
            if any(type(m) is PacketPair for m in msgs):
                self._time_pair(msgs, kernel_time_ns(anc), len(data))
                msgs = [m for m in msgs if type(m) is not PacketPair]
                if not msgs:
                    continue
            self._apply(self._swim.receive(trio.current_time(), addr, msgs))

    def _time_pair(self, msgs: list[Message], at_ns: int | None, nbytes: int) -> None:
        """A half of a packet pair arrived (``ftmesh.net.pairs``): a pair datagram holds it
        alone; one with other messages, or without a kernel stamp, is not timed."""
        pair = msgs[0]
        if at_ns is None or len(msgs) != 1 or not isinstance(pair, PacketPair):
            self._count("rx_pair_untimed")
            return
        rate = self._pairs.arrived(pair.source, pair.seq, pair.part, at_ns, nbytes)
        if rate is not None:
            self._count("rx_pair_samples")
            self._rates.append((pair.source, rate))
            if len(self._rates) > ROUND_TRIPS_KEPT:
                del self._rates[0]

    async def _pair_loop(self) -> None:
        """Every ``pair_interval``: a packet pair to the next peer in turn (alive, not at our
        own address: nothing lies between two processes of one host)."""
        seq = turn = 0
        while True:
            await trio.sleep(self.config.pair_interval)
            here = self.address[0]
            peers = sorted(
                (m for m in self._swim.members() if m.state == MemberState.ALIVE),
                key=lambda m: m.node,
            )
            peers = [m for m in peers if m.node != self.node_id and m.addr[0] != here]
            if not peers:
                continue
            dest = peers[turn % len(peers)].addr
            turn += 1
            seq += 1
            halves = [self._seal_pair(seq, part) for part in (0, 1)]
            for data in halves:  # sealed first: back to back, nothing between the sends
                self._send(data, dest)
            self._count("tx_pairs")

    def _seal_pair(self, seq: int, part: int) -> bytes:
        def seal(filler: int) -> bytes:
            msg = PacketPair(seq=seq, part=part, source=self.node_id, filler=filler)
            return self._codec.seal([msg], self._wall(), self._nonce_rng.randbytes(8))

        bare = len(seal(0))
        return seal(max(0, PAIR_BYTES - bare - 2))  # (a long array's header: 2 bytes more)

    async def _timer_loop(self) -> None:
        while True:
            with trio.CancelScope(deadline=self._swim.next_deadline()) as scope:
                self._timer_scope = scope
                await trio.sleep_forever()
            self._timer_scope = None
            self._apply(self._swim.tick(trio.current_time()))

    async def _push_pull(self, dest: Address, join: bool) -> None:
        if self._push_pull_slots.value == 0:
            self._count("push_pull_refused_busy")
            return
        async with self._push_pull_slots:
            ours = self._swim.push_pull_state(join=join)
            try:
                exchanged = await exchange_push_pull(
                    dest, self._codec, ours, self.config.membership.tcp_timeout, self._wall
                )
            except RemoteProtocolError as exc:
                self._drop(exc, dest)
                if join:
                    self._record_join(dest, f"refused: {exc}")
                self._apply(self._swim.join_failed(trio.current_time(), dest))
                return
            except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                self._count("push_pull_failed")
                if self._only_dead_at(dest):  # (serf's reconnect: expected to fail)
                    log.debug("push-pull with %s (a member we believe gone) failed: %r", dest, exc)
                else:
                    self._log_limited("pp_fail", "push-pull with %s failed: %r", dest, exc)
                if join:
                    self._record_join(dest, _why(exc))
                self._apply(self._swim.join_failed(trio.current_time(), dest))
                return
            if join:
                self._record_join(dest, "")
            self._learn_clock(exchanged, dest)
            self._apply(self._swim.merge_push_pull(trio.current_time(), exchanged.push_pull))

    def _learn_clock(self, exchanged: Exchanged, fallback: Address | None) -> None:
        """Remember the clock offset an exchange measured, under the peer's gossip address."""
        pp = exchanged.push_pull
        if exchanged.clock_offset is None or pp.observer:
            return
        own = next((m for m in pp.members if m.node == pp.source), None)
        addr = own.addr if own is not None else fallback
        if addr is not None and addr != self.address:
            self.clocks.learn(addr, exchanged.clock_offset, own.name if own else "a peer")

    def _drop_tcp(self, reason: str, detail: str) -> None:
        self._count(f"tcp_{reason}")
        self._log_limited(f"tcp_{reason}", "gossip TCP: %s (%s)", reason, detail)

    async def _serve_tcp(self, listener: trio.SocketListener) -> None:
        async with listener, trio.open_nursery() as nursery:
            await accept_loop(
                listener.accept,
                lambda stream: nursery.start_soon(self._handle_tcp, stream),
                self._admission,
            )

    async def _handle_tcp(self, stream: trio.SocketStream) -> None:
        async with stream:
            theirs = None
            try:
                with self._admission.admit(peer_host(stream.socket)):
                    mine = await send_challenge(stream)
                    challenged = self._wall()
                    their_challenge = await read_challenge(stream)
                    theirs = await read_push_pull(stream, self._codec, mine, challenged, self._wall)
                if theirs is None:
                    return  # shed or timed out (counted by the admission)
                with trio.fail_after(self.config.membership.tcp_timeout):
                    state = self._swim.push_pull_state()
                    await write_push_pull(stream, self._codec, state, their_challenge, self._wall)
            except RemoteProtocolError as exc:
                self._drop(exc, "tcp")
                return
            except (OSError, trio.TooSlowError, trio.BrokenResourceError):
                self._count("tcp_failed")
                return
            self._learn_clock(theirs, None)
            self._apply(self._swim.merge_push_pull(trio.current_time(), theirs.push_pull))

    def _on_found(self, advert: Advert) -> None:
        self._offer_join((advert.host, advert.port), advert.node_id)

    def _offer_join(self, addr: Address, node_id: str = "") -> None:
        """Join through ``addr`` unless it is us, a live member already, or still in its
        backoff (``JOIN_RETRY``)."""
        if addr == self.address or (node_id and node_id == self.node_id):
            return
        if any(m.addr == addr and m.state == 0 for m in self._swim.members()):
            self._join_backoff.pop(addr, None)
            return
        now = trio.current_time()
        due, wait = self._join_backoff.get(addr, (now, JOIN_RETRY[0] / 2))
        if now < due:
            return
        if len(self._join_backoff) >= MAX_JOIN_ADDRESSES:
            self._join_backoff.clear()
        wait = min(2 * wait, JOIN_RETRY[1])
        self._join_backoff[addr] = (
            now + wait * self._jitter.uniform(1 - JOIN_JITTER, 1 + JOIN_JITTER),
            wait,
        )
        self.join([addr])

    async def _retry_joins(self) -> None:
        """Offer the ``join`` addresses again and again (``seeds`` discovery re-reports them
        itself, resolved)."""
        seeds = self.config.discovery == "seeds"
        addrs = [] if seeds else [parse_hostport(j) for j in self.config.join]
        while addrs:
            for addr in addrs:
                self._offer_join(addr)
            await trio.sleep(JOIN_POLL)

    async def _run_discovery(self, *, task_status: trio.TaskStatus[None]) -> None:
        cfg = self.config
        kind = cfg.discovery
        if kind == "none":
            task_status.started()
            return
        discovery = make_discovery(
            kind,
            seeds=cfg.join,
            interface_ip=cfg.interface or None,
            registry_dir=cfg.registry_dir or None,
        )
        host, port = self.address
        advert = Advert(mesh=cfg.mesh, node_id=self.node_id, name=self.name, host=host, port=port)
        await discovery.run(advert, self._on_found, task_status=task_status)

    async def _warn_if_alone(self) -> None:
        """A member given seeds that is still alone says so now and then (see
        ``ALONE_WARN_AFTER``): seeds that never answer are a split in the making, unless this
        member is the first one, which is normal and said as such."""
        await trio.sleep(ALONE_WARN_AFTER)
        while True:
            if not any(m.state == MemberState.ALIVE for m in self._swim.members()[1:]):
                status = self.discovery_status()
                if status.unanswered:
                    log.warning(
                        "still alone after %.0fs: %s; %s",
                        trio.current_time() - self._started,
                        status.describe(),
                        status.hint(),
                    )
                else:
                    log.info("alone: the seeds resolve to no other member; waiting to be joined")
            await trio.sleep(ALONE_WARN_EVERY)

    async def _leave(self) -> None:
        self._apply(self._swim.leave(trio.current_time()))
        # Keep answering for a moment so the leave spreads before we go silent.
        await trio.sleep(min(2 * self.config.membership.gossip_interval, 1.0))


def _why(exc: BaseException) -> str:
    """A short reason for a failed join: ``connection refused``, ``timed out``..."""
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    seen: BaseException | None = exc
    for _ in range(4):  # trio's connect: an OSError caused by a group of per-address errors
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror.rpartition(": ")[2].lower()  # trio: "Error connecting to ...: X"
        if seen is None:
            break
        seen = seen.__cause__
        if isinstance(seen, BaseExceptionGroup):
            seen = seen.exceptions[0]
    return type(exc).__name__


LIVENESS_TOS = 0xC0
"""The IP TOS byte of gossip datagrams: DSCP CS6, network control (RFC 4594's class for
routing and other control traffic), so that links that classify by DSCP forward probes and
acks ahead of bulk data (module doc)."""

LIVENESS_PRIORITY = 6
"""``SO_PRIORITY`` of the gossip socket: ``TC_PRIO_INTERACTIVE``, band 0 of the host's
``pfifo_fast`` queue (the highest a process may set without ``CAP_NET_ADMIN``). Set after the
TOS byte, which would otherwise derive it (CS6 maps to best effort there)."""


def mark_liveness(sock: socket.socket) -> None:
    """Mark ``sock``'s datagrams as network control (``LIVENESS_TOS``, ``LIVENESS_PRIORITY``);
    best effort: a platform without the options sends them unmarked."""
    with suppress(OSError):
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, LIVENESS_TOS)
    priority = getattr(socket, "SO_PRIORITY", None)
    if priority is not None:
        with suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, priority, LIVENESS_PRIORITY)


def _bind_udp_tcp(host: str, port: int) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket bound to the same port (a free one when ``port`` is 0); the UDP
    one marked as network control (``mark_liveness``)."""
    last: OSError | None = None
    for _ in range(50 if port == 0 else 1):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
            if IP_RECVERR is not None:
                with suppress(OSError):
                    udp.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
            mark_liveness(udp)
            udp.bind((host, port))
            udp.setblocking(False)
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind((host, udp.getsockname()[1]))
                tcp.listen(128)
            except OSError:
                tcp.close()
                raise
            return udp, tcp
        except OSError as exc:
            udp.close()
            last = exc
    assert last is not None
    raise bind_error("gossip", host, port, "--port ($FTMESH_PORT)", last)


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@asynccontextmanager
async def open_node(
    config: NodeConfig | None = None, *, node_id: str | None = None, wall_clock: Wall = time.time
) -> AsyncIterator[Node]:
    """Run a mesh member for the duration of the ``async with`` block; leave gracefully on
    exit. ``node_id`` (32 hex digits) defaults to a fresh random one: a restarted process is
    a new member.

    ``async with open_node(NodeConfig(mesh="lab")) as node: ...``
    """
    config = config or NodeConfig()
    host = config.advertised_host
    udp, tcp = _bind_udp_tcp(config.bind, config.port)
    advertise = (host, udp.getsockname()[1])
    node_id = node_id or os.urandom(16).hex()
    swim = Swim(
        node_id=node_id,
        name=config.name or default_name(),
        addr=advertise,
        config=config.membership,
        rng=random.Random(os.urandom(16)),
        now=trio.current_time(),
        meta=config.meta,
        round_trips=ROUND_TRIPS_KEPT,
    )
    node = Node(config, swim, udp, wall_clock)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(tcp))
    render = None
    if config.metrics_port is not None:
        from ..metrics import renderer

        try:
            render = renderer(node)  # raises ConfigError without prometheus_client
        except BaseException:
            udp.close()
            tcp.close()
            raise
    try:
        async with trio.open_nursery() as nursery:
            node._nursery = nursery
            nursery.start_soon(node._udp_loop)
            nursery.start_soon(node._timer_loop)
            nursery.start_soon(node._serve_tcp, listener)
            if config.pair_interval > 0:
                nursery.start_soon(node._pair_loop)
            if render is not None and config.metrics_port is not None:
                from ..metrics.probes import readiness
                from ..metrics.server import serve_metrics

                node.metrics_address = await nursery.start(
                    partial(
                        serve_metrics,
                        render,
                        config.bind,
                        config.metrics_port,
                        counters=node.counters,
                        ready=partial(readiness, node),
                    )
                )
            node._started = trio.current_time()
            if config.join:
                nursery.start_soon(node._warn_if_alone)
            nursery.start_soon(node._retry_joins)
            await nursery.start(node._run_discovery)
            try:
                yield node
            finally:
                with trio.CancelScope(shield=True):
                    await node._leave()
                nursery.cancel_scope.cancel()
    finally:
        for ch in node._subscribers:
            ch.close()
        with suppress(OSError):
            udp.close()
        with suppress(OSError):
            tcp.close()
