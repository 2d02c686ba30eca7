"""Reachability for the data plane: which training members the ring leaves out, and why.

Theory of operation. SWIM says whether a member is alive, over UDP and through indirect
probes; it cannot say whether its ring neighbours can open and keep a TCP connection to its
data-plane address. A member that SWIM holds alive but that its left neighbour cannot reach
(a wrong ``--advertise``, a firewalled port, a one-way link) or that keeps sending bytes that
fail verification (malformed frames, state chunks that do not hash to their leaves) would
stall every collective of the ring for as long as it stays. This module decides, without any
coordinator, who the ring leaves out.

Two halves, both pure (no sockets, no clocks, no threads):

* :class:`ReachTracker`, one per member: the data plane reports what happened on its
  connections (``Connecting``/``ConnectFailed``/``Connected``/``ConnectEnded`` around each
  connect to a ring neighbour, ``RingFailed``/``RingWorked`` for collectives, ``BadBytes``
  for state chunks that failed their hash, ``ProbeDone`` for re-admission probes), each event
  stamped with ``time.monotonic()``. From these and the set of members membership holds alive,
  :meth:`ReachTracker.tick` decides this member's *accusations* (:class:`Accuse`,
  :class:`Withdraw`) and the probes to run (:class:`Probe`). The accusations are what the
  member publishes in its metadata (:meth:`ReachTracker.published`, :func:`format_reports`).
* :func:`exclusions`: from every training member's published accusations (gossiped, so every
  member eventually holds the same ones) the set of members the ring leaves out. A pure
  function of gossiped state: every member computes the same ring, with no one deciding it.

When a member is accused (:class:`ReachConfig`'s thresholds), who is left out (an accuser
alone against two is left out itself; an accused member's accusations do not count), the bound
on insiders, one-way links and re-admission: ``docs/DESIGN-NOTES.md``, "Reachability: who the
ring leaves out".
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from ..errors import ConfigError

UNREACHABLE = "unreachable"
STALLED = "stalled"
BAD_FRAMES = "frames"
BAD_STATE = "state"
REASONS = (UNREACHABLE, STALLED, BAD_FRAMES, BAD_STATE)
"""Accusation reasons, as published."""
ACCUSES_MANY = "accuses"
"""Exclusion reason of a reporter that accuses two or more members."""
CYCLE = "cycle"
"""Exclusion reason of members that accuse each other in a cycle."""

MAX_ACCUSATIONS = 4
"""Accusations one member publishes (and that are read from one member) at most: bounds the
metadata they take (about 45 bytes each) and what colluding insiders can do (module doc)."""
MAX_NODE_ID = 64
"""Longest node id accepted in an accusation (ours are 32 hex characters)."""
_ID_RE = re.compile(r"[0-9a-zA-Z_-]{1,64}")


@dataclass(frozen=True, slots=True)
class ReachConfig:
    """Thresholds and holds of reachability; see the module doc for how they combine."""

    unreachable_after: float = 3.0
    """Seconds our connection attempts to a live member must have failed without a break
    before we accuse it. The data plane listens before a member joins, so a live member's
    address answers in milliseconds; longer means it cannot be reached. Lower reacts faster;
    too low accuses a member whose host is briefly overloaded (then costs ``min_hold``)."""
    stall_strikes: int = 2
    """Rings in a row, with a live member as neighbour, that stalled before completing any
    collective: a connection that opens but does not carry data (an MTU black hole)."""
    bad_bytes_strikes: int = 3
    """Verification failures (malformed or unauthenticated frames, state chunks failing their
    hash) from one member within ``bad_bytes_window`` that make us accuse it. An honest member
    sends none; three leave room for one stream broken by a crash mid-frame."""
    bad_bytes_window: float = 120.0
    """Seconds over which ``bad_bytes_strikes`` are counted."""
    min_hold: float = 2.0
    """Seconds of successful probes before an unreachable member is re-admitted (first time)."""
    max_hold: float = 16.0
    """Longest such hold, however often the member flapped (keeps a member that became
    reachable out for at most this long)."""
    backoff_memory: float = 60.0
    """Seconds after which earlier accusations of a member no longer lengthen its hold."""
    bad_bytes_hold: float = 60.0
    """Seconds a ``frames``/``state`` accusation stands (first time); doubles like ``hold``."""
    max_bad_bytes_hold: float = 960.0
    """Longest ``frames``/``state`` hold."""
    probe_interval: float = 1.0
    """Seconds between re-admission probes of one accused member."""
    forget_after: float = 30.0
    """Seconds a member may be absent from the live members before what we hold about it
    (accusations included) is dropped."""

    def __post_init__(self) -> None:
        for name in (
            "unreachable_after",
            "bad_bytes_window",
            "min_hold",
            "max_hold",
            "backoff_memory",
            "bad_bytes_hold",
            "max_bad_bytes_hold",
            "probe_interval",
            "forget_after",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"reach: {name} must be > 0 seconds")
        if self.stall_strikes < 1 or self.bad_bytes_strikes < 1:
            raise ConfigError("reach: strikes must be >= 1")
        if self.max_hold < self.min_hold or self.max_bad_bytes_hold < self.bad_bytes_hold:
            raise ConfigError("reach: a maximum hold is below its minimum")


# -- events: what the data plane saw ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connecting:
    """We began connecting to ring neighbour ``peer`` at its data address ``addr``."""

    at: float
    peer: str
    addr: str


@dataclass(frozen=True, slots=True)
class ConnectFailed:
    """One connection attempt to ``peer`` failed (refused, reset, another member answered)."""

    at: float
    peer: str
    addr: str
    error: str


@dataclass(frozen=True, slots=True)
class Connected:
    """A connection to ``peer`` is open and authenticated."""

    at: float
    peer: str


@dataclass(frozen=True, slots=True)
class ConnectEnded:
    """The connect to ``peer`` ended without a connection (timed out or cancelled)."""

    at: float
    peer: str


@dataclass(frozen=True, slots=True)
class RingFailed:
    """A collective failed with an abort of ``kind`` (``lost``, ``stalled``, ``protocol``...)
    that names neighbour ``peer``; ``worked``: this ring completed a collective before."""

    at: float
    peer: str
    kind: str
    worked: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RingWorked:
    """A new ring completed its first collective: both neighbours carry data."""

    at: float
    peers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BadBytes:
    """Bytes from ``peer`` failed verification (``what``: ``frames`` or ``state``)."""

    at: float
    peer: str
    what: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ProbeDone:
    """A re-admission probe of ``peer`` succeeded (``ok``) or not."""

    at: float
    peer: str
    ok: bool


ReachEvent = (
    Connecting
    | ConnectFailed
    | Connected
    | ConnectEnded
    | RingFailed
    | RingWorked
    | BadBytes
    | ProbeDone
)


# -- effects: what the member does ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Accuse:
    """Publish that we accuse ``peer`` (``reason``; ``addr``: the data address tried);
    ``hold``: seconds of successful probes before we take it back (``unreachable``,
    ``stalled``), or seconds the accusation stands (``frames``, ``state``)."""

    peer: str
    reason: str
    addr: str
    detail: str
    hold: float = 0.0


@dataclass(frozen=True, slots=True)
class Withdraw:
    """Stop accusing ``peer`` (``why``: probes succeeded, the hold ran out, it is gone)."""

    peer: str
    reason: str
    why: str


@dataclass(frozen=True, slots=True)
class Probe:
    """Check whether ``peer``'s data address ``addr`` answers; report a ``ProbeDone``."""

    peer: str
    addr: str


ReachEffect = Accuse | Withdraw | Probe


@dataclass(slots=True)
class _Accusation:
    reason: str
    since: float
    hold: float
    addr: str
    ok_since: float | None = None
    next_probe: float = 0.0
    probing: bool = False


@dataclass(slots=True)
class _PeerState:
    addr: str = ""
    attempt_open: bool = False
    failing_since: float | None = None
    last_attempt: float = 0.0
    last_error: str = ""
    stalls: int = 0
    bad: deque[float] = field(default_factory=deque)
    bad_detail: str = ""
    bad_what: str = ""
    accusation: _Accusation | None = None
    history: deque[float] = field(default_factory=deque)
    absent_since: float | None = None


class ReachTracker:
    """One member's reachability judgements; see the module doc. Sans-IO: feed it events
    (:meth:`receive`), then :meth:`tick` with the live members and apply the effects."""

    def __init__(self, me: str, config: ReachConfig | None = None) -> None:
        self.me = me
        self.config = config or ReachConfig()
        self._peers: dict[str, _PeerState] = {}

    def _peer(self, peer: str) -> _PeerState:
        st = self._peers.get(peer)
        if st is None:
            st = self._peers[peer] = _PeerState()
        return st

    # -- inputs -------------------------------------------------------------------------------

    def receive(self, ev: ReachEvent) -> None:
        """Take one event from the data plane (any order; times need not be increasing)."""
        if not isinstance(ev, RingWorked) and ev.peer == self.me:
            return
        if isinstance(ev, Connecting):
            st = self._peer(ev.peer)
            st.addr, st.attempt_open, st.last_attempt = ev.addr, True, ev.at
            if st.failing_since is None:
                st.failing_since = ev.at
        elif isinstance(ev, ConnectFailed):
            st = self._peer(ev.peer)
            st.addr, st.last_error, st.last_attempt = ev.addr, ev.error, ev.at
            if st.failing_since is None:
                st.failing_since = ev.at
        elif isinstance(ev, Connected):
            st = self._peer(ev.peer)
            st.attempt_open, st.failing_since, st.last_error = False, None, ""
        elif isinstance(ev, ConnectEnded):
            st = self._peer(ev.peer)
            st.attempt_open, st.last_attempt = False, ev.at
        elif isinstance(ev, RingFailed):
            if ev.kind == "protocol":
                self._bad(ev.peer, ev.at, BAD_FRAMES, ev.detail or "a malformed frame")
            elif ev.kind == "stalled" and not ev.worked:
                self._peer(ev.peer).stalls += 1
        elif isinstance(ev, RingWorked):
            for p in ev.peers:
                if p in self._peers:
                    self._peers[p].stalls = 0
        elif isinstance(ev, BadBytes):
            self._bad(ev.peer, ev.at, ev.what, ev.detail)
        elif isinstance(ev, ProbeDone):
            acc = self._peer(ev.peer).accusation
            if acc is not None and acc.probing:
                acc.probing = False
                acc.next_probe = ev.at + self.config.probe_interval
                if ev.ok:
                    acc.ok_since = ev.at if acc.ok_since is None else acc.ok_since
                else:
                    acc.ok_since = None

    def _bad(self, peer: str, at: float, what: str, detail: str) -> None:
        st = self._peer(peer)
        st.bad.append(at)
        st.bad_what, st.bad_detail = what, detail

    # -- decisions ------------------------------------------------------------------------------

    def tick(self, now: float, alive: Mapping[str, str]) -> list[ReachEffect]:
        """Decide at ``now``; ``alive``: node id -> data address of the members membership
        holds alive (other than us). Returns what to publish, withdraw and probe."""
        cfg = self.config
        out: list[ReachEffect] = []
        for peer in list(self._peers):
            st = self._peers[peer]
            if peer not in alive:
                # A suspect's failures say nothing about its address; one gone for long is
                # forgotten, accusations included.
                st.failing_since, st.stalls = None, 0
                st.absent_since = now if st.absent_since is None else st.absent_since
                if now - st.absent_since >= cfg.forget_after:
                    if st.accusation is not None:
                        out.append(Withdraw(peer, st.accusation.reason, "it left the mesh"))
                    del self._peers[peer]
                continue
            st.absent_since = None
            st.addr = alive[peer] or st.addr
            while st.bad and now - st.bad[0] > cfg.bad_bytes_window:
                st.bad.popleft()
            while st.history and now - st.history[0] > cfg.backoff_memory:
                st.history.popleft()
            if st.accusation is None:
                found = self._judge(now, peer, st)
                if found is not None:
                    out.append(found)
            else:
                out.extend(self._recheck(now, peer, st))
        return out

    def _judge(self, now: float, peer: str, st: _PeerState) -> Accuse | None:
        cfg = self.config
        reason = detail = ""
        if len(st.bad) >= cfg.bad_bytes_strikes:
            reason = st.bad_what or BAD_FRAMES
            detail = (
                f"{len(st.bad)} verification failures within {cfg.bad_bytes_window:.0f}s "
                f"(last: {st.bad_detail})"
            )
        elif st.failing_since is not None:
            recent = st.attempt_open or now - st.last_attempt < cfg.unreachable_after
            if not recent:
                st.failing_since = None  # no attempt lately: start over next time
            elif now - st.failing_since >= cfg.unreachable_after:
                reason = UNREACHABLE
                detail = (
                    f"no connection for {now - st.failing_since:.1f}s "
                    f"(last error: {st.last_error or 'no answer'})"
                )
        if not reason and st.stalls >= cfg.stall_strikes:
            reason = STALLED
            detail = f"{st.stalls} rings in a row stalled before carrying any data"
        if not reason:
            return None
        st.history.append(now)
        k = len(st.history)
        if reason in (BAD_FRAMES, BAD_STATE):
            hold = min(cfg.bad_bytes_hold * 2 ** (k - 1), cfg.max_bad_bytes_hold)
        else:
            hold = min(cfg.min_hold * 2 ** (k - 1), cfg.max_hold)
        st.accusation = _Accusation(reason, now, hold, st.addr, next_probe=now)
        st.failing_since, st.stalls = None, 0
        st.bad.clear()
        return Accuse(peer, reason, st.addr, detail, hold)

    def _recheck(self, now: float, peer: str, st: _PeerState) -> list[ReachEffect]:
        acc = st.accusation
        assert acc is not None
        if acc.reason in (BAD_FRAMES, BAD_STATE):
            if now - acc.since >= acc.hold:
                st.accusation = None
                return [Withdraw(peer, acc.reason, f"its {acc.hold:.0f}s hold ran out")]
            return []
        if acc.ok_since is not None and now - acc.ok_since >= acc.hold:
            st.accusation = None
            why = f"its data address answered for {now - acc.ok_since:.1f}s"
            return [Withdraw(peer, acc.reason, why)]
        if not acc.probing and now >= acc.next_probe:
            acc.probing = True
            return [Probe(peer, st.addr or acc.addr)]
        return []

    # -- outputs --------------------------------------------------------------------------------

    def published(self) -> dict[str, str]:
        """Our accusations (accused id -> reason), oldest first, at most ``MAX_ACCUSATIONS``."""
        held = [(st.accusation.since, p, st.accusation.reason)
                for p, st in self._peers.items() if st.accusation is not None]  # fmt: skip
        held.sort()
        return {p: r for _, p, r in held[:MAX_ACCUSATIONS]}

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to decide by time alone (None: only events
        or a change of the live members can make it act)."""
        cfg = self.config
        times: list[float] = []
        for st in self._peers.values():
            acc = st.accusation
            if acc is not None:
                if acc.reason in (BAD_FRAMES, BAD_STATE):
                    times.append(acc.since + acc.hold)
                elif acc.ok_since is not None:
                    times.append(acc.ok_since + acc.hold)
                if not acc.probing:
                    times.append(acc.next_probe)
            elif st.failing_since is not None:
                times.append(st.failing_since + cfg.unreachable_after)
            if st.absent_since is not None:
                times.append(st.absent_since + cfg.forget_after)
        return min(times, default=None)


# -- the shared decision ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Exclusion:
    """A member the ring leaves out: ``reason`` (an accusation reason, ``accuses`` or
    ``cycle``) and the reporters whose accusations decided it (itself for ``accuses``). The
    mesh adds ``bad_meta`` (no reporters) and ``release`` (``by``: the release it runs,
    ``ftmesh.mesh.meta.ring_exclusions``)."""

    node: str
    reason: str
    by: tuple[str, ...]


def exclusions(
    reports: Mapping[str, Mapping[str, str]], candidates: Collection[str]
) -> dict[str, Exclusion]:
    """The members of ``candidates`` the ring leaves out, given each reporter's accusations
    (``reports``: reporter -> accused -> reason). Only candidates' accusations of other
    candidates count (at most ``MAX_ACCUSATIONS`` each, in id order). Deterministic: a
    function of its arguments only. See the module doc for the rule and its bound."""
    cands = set(candidates)
    accused: dict[str, dict[str, str]] = {}
    for r in sorted(reports):
        if r not in cands:
            continue
        mine = sorted((a, why) for a, why in reports[r].items() if a in cands and a != r)
        if mine:
            accused[r] = dict(mine[:MAX_ACCUSATIONS])
    times: dict[str, int] = {}
    for acc in accused.values():
        for a in acc:
            times[a] = times.get(a, 0) + 1
    out: dict[str, Exclusion] = {}
    targets: dict[str, dict[str, str]] = {}
    for r, acc in accused.items():
        if sum(times[a] == 1 for a in acc) >= 2:
            out[r] = Exclusion(r, ACCUSES_MANY, (r,))
        else:
            targets[r] = acc
    # Accusers of each node, among reporters whose accusations still count.
    accusers: dict[str, set[str]] = {}
    for r, acc in targets.items():
        for a in acc:
            accusers.setdefault(a, set()).add(r)
    nodes = sorted(set(targets) | set(accusers))
    stays: set[str] = set()
    queue = [n for n in nodes if not accusers.get(n)]
    while queue:
        n = queue.pop()
        if n in stays or n in out:
            continue
        stays.add(n)
        for a, why in sorted(targets.get(n, {}).items()):
            if a in out:
                continue
            out[a] = Exclusion(a, why, tuple(sorted(r for r in accusers[a] if r in stays)))
            for t in targets.get(a, {}):  # the accusations of a member left out do not count
                accusers[t].discard(a)
                if not accusers[t] and t not in out:
                    queue.append(t)
    # Every node left is accused by another one left: they accuse each other round cycles
    # (two members that cannot reach each other, or an insider answering an accusation with
    # one). All of them are left out.
    for n in nodes:
        if n not in stays and n not in out:
            out[n] = Exclusion(n, CYCLE, tuple(sorted(accusers.get(n, ()))))
    return out


# -- the metadata form --------------------------------------------------------------------


def format_reports(accusations: Mapping[str, str]) -> str:
    """``{accused: reason}`` as the metadata value: ``"ID:reason,ID:reason"`` (id order)."""
    return ",".join(f"{p}:{r}" for p, r in sorted(accusations.items())[:MAX_ACCUSATIONS])


def parse_reports(value: object) -> dict[str, str] | None:
    """The accusations of a metadata value (None: absent); ``ValueError`` if malformed."""
    if value is None or value == "":
        return None if value is None else {}
    if not isinstance(value, str) or len(value) > MAX_ACCUSATIONS * (MAX_NODE_ID + 16):
        raise ValueError("reach: expected a short string")
    out: dict[str, str] = {}
    for item in value.split(","):
        node, sep, reason = item.partition(":")
        if not sep or not _ID_RE.fullmatch(node) or reason not in REASONS:
            raise ValueError(f"reach: bad accusation {item[:80]!r}")
        out[node] = reason
    if len(out) > MAX_ACCUSATIONS:
        raise ValueError("reach: too many accusations")
    return out
