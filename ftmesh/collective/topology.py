"""The ring plan: which members share a site, the ring order, flat or hierarchical. Pure.

Theory of operation. A flat ring ordered by node id crosses a slow link between two sites as
many times as the order happens to alternate between them, and every crossing carries the
whole reduction. Every member derives, from gossiped inputs alone and without a coordinator,
the same :class:`RingPlan`:

1. *Sites.* If any member of the view publishes an explicit site label (``--site NAME``, the
   analogue of Kubernetes' ``topology.kubernetes.io/zone``), labels decide: members with the
   same label form a site, and the unlabeled ones (if any) one more site. Otherwise the sites
   come from measurement: each member publishes the round-trip time it measured to its peers,
   quantized to half-octave buckets (:func:`rtt_bucket`); the planner symmetrises the matrix
   (the larger bucket of both directions, or the one that is known), and clusters it by single
   linkage: for each threshold ``t`` among the buckets present, in increasing order, the
   members joined by links of bucket ``<= t`` form components; the first ``t`` whose
   components (at least two) are separated by links of bucket ``>= t + SITE_GAP`` (about 4x
   slower than the slowest link inside a site) and ``>= MIN_CROSS_BUCKET`` (about 5 ms), with
   at least one measured link between every two components, gives the sites. No such
   threshold, or a member with no measurement: one site (missing measurements never split).
   When the round trips find one site, the same clustering runs on measured *throughput*
   (:func:`rate_bucket`, half-octave buckets of bits per second; packet-pair capacity,
   ``ftmesh.net.pairs``), fastest links first: the sites are the components joined by fast
   links whose links between them are all at least ``RATE_GAP`` buckets (4x) slower and at
   most ``MAX_CROSS_RATE_BUCKET`` (about 125 Mbit/s). That finds the sites a round trip cannot
   see: two offices a few milliseconds apart over a 50 Mbit/s line, a shaped VPN link, an
   edge fleet on a slow uplink. The symmetrised rate of a pair is its *faster* direction
   (the one known, if one): both must read slow before a pair counts as a slow link, since
   a packet pair can read a fast link slow (cross traffic, a sender descheduled between its
   two datagrams) and a token bucket with tokens left lets a pair through at line rate.
2. *Order.* Sites sorted by label (measured sites: by their smallest node id, labelled
   ``~1``, ``~2``...), members by node id inside a site; the ring is the sites one after the
   other, so it crosses between two sites once per direction.
3. *Hierarchical or flat.* Hierarchical when there are at least two sites and one of them
   has two members or more: an allreduce then runs as a reduce-scatter inside each site into
   ``K`` blocks (``K`` the smallest site's size, :attr:`RingPlan.blocks`; the members at places
   ``K`` and beyond in a larger site hold none), an allreduce of each block across the sites
   among the members at its place in every site, and an allgather inside each site
   (``DataPlane``). Sites of one member each run the flat, site-ordered ring
   (``RingPlan.why_flat`` says so): the hierarchy would change nothing.

The plan is a function of its inputs only (no clock, no randomness, no dict order): members
that hold the same inputs derive the same plan, bit for bit, and its hash (:attr:`RingPlan.hash`)
goes into the view's epoch when it has more than one site (``view``). Inputs are buckets, not
raw times, so noise inside a bucket changes nothing; the measuring side holds a bucket until
the estimate leaves it by half a bucket (:class:`LinkEstimator`), so a time near a boundary
does not flap.

The metadata format of the measurements (:func:`format_links`, :func:`parse_summary`): one
string of fixed-width entries, the first ``LINK_ID_CHARS`` hex characters of a peer's node id
and the round-trip bucket as one base-36 digit (version ``1``), or that and the rate bucket
(version ``2``, published once a rate is measured; ``-`` for a figure not measured), at most
``MAX_LINKS`` entries (the nearest peers first), so a member's summary takes at most 481 bytes
of the 2 KiB of metadata it may publish. A member of an older release reads a version-2
summary as malformed and plans as if that member measured nothing. A view of more than
``MAX_LINKS + 1`` members is planned from partial measurements (label such meshes).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

RTT_BASE_S = 50e-6
"""Lower edge of bucket 1, in seconds; bucket 0 holds everything faster."""
BUCKETS_PER_OCTAVE = 2
"""Half-octave buckets: bucket ``b >= 1`` holds round trips in ``[base * 2**((b-1)/2), base *
2**(b/2))``; a factor of 4 is 4 buckets."""
MAX_BUCKET = 35
"""Highest bucket (one base-36 digit; about 6.5 s and beyond)."""
SITE_GAP = 4
"""Buckets between the slowest link inside a site and the fastest between sites (about 4x)."""
MIN_CROSS_BUCKET = 14
"""Least bucket of a link between sites: 14 holds 4.5-6.4 ms (about 5 ms), so a LAN's jitter
never splits it into sites."""
LINK_ID_CHARS = 8
"""Hex characters of a peer's node id in a published link (32 bits: among 49 peers, two
share a prefix with a chance of about 3e-7; a shared prefix is ignored, see ``links_of``)."""
MAX_LINKS = 48
"""Links one member publishes at most: 48 * 9 = 432 characters, inside a metadata value's 512."""
LINKS_VERSION = "1"
"""First character of a published summary of round trips only: the format's version."""
RATES_VERSION = "2"
"""First character of a summary with rates: each entry has a round-trip and a rate digit."""
UNKNOWN = "-"
"""A figure not measured, in a version-2 entry."""
RATE_BASE_BPS = 1e6
"""Lower edge of rate bucket 1, in bits per second; bucket 0 holds everything slower."""
RATE_GAP = 4
"""Rate buckets between the slowest link inside a throughput site and the fastest between
sites (about 4x)."""
MAX_CROSS_RATE_BUCKET = 14
"""Highest rate bucket of a link between throughput sites: 14 holds 91-128 Mbit/s. Packet
pairs sent by a Python process cannot time a gigabit link (the sender's own gap between the
two datagrams is of that order): veths between lab hosts read about 1 Gbit/s on a quiet
host and 256-512 Mbit/s (buckets 17-18) beside 8 busy processes on 2 cores, so a LAN keeps
a margin of 3 buckets and more and does not split."""
MAX_LABEL = 63
LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
"""A site label: a Kubernetes-label-like name (``eu-west-1a``, ``lab``, ``rack.7``)."""
_LINK_RE = re.compile(rf"([0-9a-f]{{{LINK_ID_CHARS}}}[0-9a-z])*")
_RATED_RE = re.compile(rf"([0-9a-f]{{{LINK_ID_CHARS}}}[0-9a-z-][0-9a-z-])*")
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _position(x: float, base: float) -> float:
    """Where ``x`` falls on a half-octave scale from ``base``, continuously (bucket = its
    floor): bucket ``b >= 1`` holds ``[base * 2**((b-1)/2), base * 2**(b/2))``, 0 below."""
    if not x > base:
        return 0.0
    return min(BUCKETS_PER_OCTAVE * math.log2(x / base) + 1.0, MAX_BUCKET + 0.999)


def _bounds(bucket: int, base: float) -> tuple[float, float]:
    """``[low, high)`` of ``bucket`` on the scale of :func:`_position`."""
    if bucket <= 0:
        return 0.0, base
    low = base * 2 ** ((bucket - 1) / BUCKETS_PER_OCTAVE)
    high = math.inf if bucket >= MAX_BUCKET else base * 2 ** (bucket / BUCKETS_PER_OCTAVE)
    return low, high


def rtt_position(seconds: float) -> float:
    """Where ``seconds`` falls on the bucket scale, continuously (bucket = its floor)."""
    return _position(seconds, RTT_BASE_S)


def rtt_bucket(seconds: float) -> int:
    """The bucket of a round trip of ``seconds``: 0 below 50 us, then one per half octave."""
    return int(rtt_position(seconds))


def bucket_bounds(bucket: int) -> tuple[float, float]:
    """``[low, high)`` seconds of ``bucket`` (for display)."""
    return _bounds(bucket, RTT_BASE_S)


def rate_position(bytes_per_s: float) -> float:
    """Where a rate of ``bytes_per_s`` falls on the rate scale (bucket = its floor): bucket
    ``b >= 1`` holds ``[1 Mbit/s * 2**((b-1)/2), 1 Mbit/s * 2**(b/2))``."""
    return _position(8.0 * bytes_per_s, RATE_BASE_BPS)


def rate_bucket(bytes_per_s: float) -> int:
    """The bucket of a rate of ``bytes_per_s``: 0 below 1 Mbit/s, then one per half octave."""
    return int(rate_position(bytes_per_s))


def rate_bounds(bucket: int) -> tuple[float, float]:
    """``[low, high)`` bits per second of rate ``bucket`` (for display)."""
    return _bounds(bucket, RATE_BASE_BPS)


@dataclass(frozen=True, slots=True)
class MemberLinks:
    """One member's inputs to the plan, as gossiped: its site label (``""``: none) and the
    bucket of its measured round trip to each peer (by full node id)."""

    node: str
    site: str = ""
    rtt: tuple[tuple[str, int], ...] = ()
    """``(peer, bucket)`` pairs; order does not matter (the planner sorts)."""
    rate: tuple[tuple[str, int], ...] = ()
    """``(peer, rate bucket)`` pairs: the throughput measured from the peer to this member."""

    @classmethod
    def of(
        cls,
        node: str,
        site: str = "",
        rtt: Mapping[str, int] | None = None,
        rate: Mapping[str, int] | None = None,
    ) -> MemberLinks:
        return cls(
            node, site, tuple(sorted((rtt or {}).items())), tuple(sorted((rate or {}).items()))
        )


@dataclass(frozen=True, slots=True)
class Site:
    """A site: its label (an explicit one, ``~k`` for a measured one, ``""`` for the unlabeled
    members of a mesh where others have labels) and its members, by node id."""

    label: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class RingPlan:
    """The plan every member derives (see the module doc). Build it with :func:`plan_ring`."""

    sites: tuple[Site, ...]
    hierarchical: bool
    source: str
    """``labels``, ``measured`` (round trips), ``throughput`` or ``none`` (one site: no labels,
    no usable measurement)."""
    why_flat: str = ""
    """Why a plan of several sites runs the flat ring (``""`` when hierarchical or one site)."""
    hash: str = field(init=False)
    """16 hex characters (64 bits) over the sites, their labels and the mode."""
    _site_of: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = hashlib.blake2b(digest_size=8, person=b"ftmesh-plan-v1")
        for site in self.sites:
            _put(h, site.label)
            h.update(len(site.members).to_bytes(4, "little"))
            for node in site.members:
                _put(h, node)
        h.update(b"H" if self.hierarchical else b"F")
        object.__setattr__(self, "hash", h.hexdigest())
        where = {n: i for i, s in enumerate(self.sites) for n in s.members}
        object.__setattr__(self, "_site_of", where)

    @property
    def order(self) -> tuple[str, ...]:
        """The ring order: each site's members in turn."""
        return tuple(n for s in self.sites for n in s.members)

    @property
    def flat(self) -> bool:
        """One site: the ring (and the view's epoch) is exactly the unplanned one."""
        return len(self.sites) <= 1

    @property
    def blocks(self) -> int:
        """Blocks of a hierarchical allreduce: the smallest site's size (each block crosses
        between the sites in a ring of the members at its place in every site)."""
        return min(len(s.members) for s in self.sites)

    def site_of(self, node: str) -> int:
        """Index of ``node``'s site in ``sites``."""
        return self._site_of[node]

    def describe(self) -> str:
        """One line: ``2 sites (labels) a[2] b[2], hierarchical, plan 1a2b3c4d``."""
        if self.flat:
            return f"1 site ({self.source}), flat ring, plan {self.hash[:8]}"
        sites = " ".join(f"{s.label or '(unlabeled)'}[{len(s.members)}]" for s in self.sites)
        mode = "hierarchical" if self.hierarchical else f"flat ring ({self.why_flat})"
        return f"{len(self.sites)} sites ({self.source}) {sites}, {mode}, plan {self.hash[:8]}"


def _put(h: hashlib.blake2b, text: str) -> None:
    raw = text.encode()
    h.update(len(raw).to_bytes(4, "little"))
    h.update(raw)


def plan_ring(members: Iterable[MemberLinks]) -> RingPlan:
    """The plan of a view whose members published ``members`` (see the module doc). Links to
    nodes that are not in ``members`` are ignored; so is a member's link to itself."""
    by_node = {m.node: m for m in members}
    nodes = sorted(by_node)
    if any(by_node[n].site for n in nodes):
        groups: dict[str, list[str]] = {}
        for n in nodes:
            groups.setdefault(by_node[n].site, []).append(n)
        sites = tuple(Site(label, tuple(groups[label])) for label in sorted(groups))
        return _finish(sites, "labels")
    source = "measured"
    measured = _cluster(nodes, _symmetric(by_node, "rtt"), SITE_GAP, MIN_CROSS_BUCKET)
    if measured is None:
        source = "throughput"  # distance: how much slower than the fastest bucket
        cross = MAX_BUCKET - MAX_CROSS_RATE_BUCKET
        measured = _cluster(nodes, _symmetric(by_node, "rate"), RATE_GAP, cross)
    if measured is None:
        source = "measured" if any(m.rtt or m.rate for m in by_node.values()) else "none"
        return RingPlan((Site("", tuple(nodes)),), False, source)
    measured.sort(key=lambda c: c[0])
    return _finish(tuple(Site(f"~{i + 1}", tuple(c)) for i, c in enumerate(measured)), source)


def _finish(sites: tuple[Site, ...], source: str) -> RingPlan:
    if len(sites) < 2:
        return RingPlan(sites, False, source)
    if max(len(s.members) for s in sites) < 2:
        return RingPlan(sites, False, source, "one member per site")
    return RingPlan(sites, True, source)


def _symmetric(by_node: Mapping[str, MemberLinks], what: str) -> dict[tuple[str, str], int]:
    """``(a, b)`` with ``a < b`` -> the distance of the pair, or the one direction known. A
    round trip's distance is its bucket, the larger of both directions; a rate's is
    ``MAX_BUCKET`` minus its bucket (slower is farther), the smaller of both (module doc)."""
    out: dict[tuple[str, str], int] = {}
    for a, m in by_node.items():
        for b, bucket in m.rtt if what == "rtt" else m.rate:
            if b == a or b not in by_node or not 0 <= bucket <= MAX_BUCKET:
                continue
            d = bucket if what == "rtt" else MAX_BUCKET - bucket
            key = (a, b) if a < b else (b, a)
            other = out.get(key, d)
            out[key] = max(other, d) if what == "rtt" else min(other, d)
    return out


def _cluster(
    nodes: list[str], links: dict[tuple[str, str], int], gap: int, least_cross: int
) -> list[list[str]] | None:
    """Single-linkage sites of ``nodes`` (each sorted) over the distances ``links``, or None
    for one site: components joined by links up to a threshold ``t`` whose links between
    them are all ``>= max(t + gap, least_cross)``."""
    if len(nodes) < 2 or not links:
        return None
    index = {n: i for i, n in enumerate(nodes)}
    edges = sorted((b, index[x], index[y]) for (x, y), b in links.items())
    parent = list(range(len(nodes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    k = 0
    for t in sorted({b for b, _, _ in edges}):
        while k < len(edges) and edges[k][0] <= t:  # Kruskal: merge every link up to t
            _, x, y = edges[k]
            rx, ry = root(x), root(y)
            if rx != ry:
                parent[max(rx, ry)] = min(rx, ry)
            k += 1
        comps = {root(i) for i in range(len(nodes))}
        if len(comps) < 2:
            return None  # (higher thresholds only merge more)
        crossing: set[tuple[int, int]] = set()
        ok = True
        for b, x, y in edges[k:]:
            rx, ry = root(x), root(y)
            if rx != ry:
                if b < max(t + gap, least_cross):
                    ok = False
                    break
                crossing.add((min(rx, ry), max(rx, ry)))
        if ok and len(crossing) == len(comps) * (len(comps) - 1) // 2:
            groups: dict[int, list[str]] = {}
            for i, n in enumerate(nodes):
                groups.setdefault(root(i), []).append(n)
            return list(groups.values())
    return None


# -- the published summary --------------------------------------------------------------------


def format_links(rtt: Mapping[str, int], rates: Mapping[str, int] | None = None) -> str:
    """Our measured buckets (peer node id -> round-trip bucket, and -> rate bucket) as a
    metadata value: the version digit, then at most ``MAX_LINKS`` entries, the nearest first
    (ties by id), sorted by id. Without rates, version 1 (round trips only)."""
    rates = rates or {}
    peers = set(rtt) | set(rates)
    nearest = sorted(peers, key=lambda p: (rtt.get(p, MAX_BUCKET + 1), p))[:MAX_LINKS]
    parts = []
    for node in sorted(nearest):
        prefix = node[:LINK_ID_CHARS].lower()
        if len(prefix) != LINK_ID_CHARS or not all(c in _DIGITS[:16] for c in prefix):
            continue
        digits = _digit(rtt.get(node))
        if rates:
            digits += _digit(rates.get(node))
        parts.append(prefix + digits)
    return (RATES_VERSION if rates else LINKS_VERSION) + "".join(parts)


def _digit(bucket: int | None) -> str:
    return UNKNOWN if bucket is None else _DIGITS[min(max(bucket, 0), MAX_BUCKET)]


def parse_summary(value: object) -> tuple[dict[str, int], dict[str, int]]:
    """``format_links``'s output back: (id prefix -> round-trip bucket, id prefix -> rate
    bucket); ``ValueError`` if malformed (a value from the network: bounded, checked
    character by character)."""
    rated = isinstance(value, str) and value.startswith(RATES_VERSION)
    width = LINK_ID_CHARS + (2 if rated else 1)
    if not isinstance(value, str) or len(value) > 1 + MAX_LINKS * width:
        raise ValueError("links: expected a short string")
    pattern = _RATED_RE if rated else _LINK_RE
    if not value.startswith((LINKS_VERSION, RATES_VERSION)) or not pattern.fullmatch(value, 1):
        raise ValueError(f"links: malformed {value[:40]!r}")
    rtt: dict[str, int] = {}
    rate: dict[str, int] = {}
    seen: set[str] = set()
    for i in range(1, len(value), width):
        prefix = value[i : i + LINK_ID_CHARS]
        if prefix in seen:
            raise ValueError(f"links: {prefix} twice")
        seen.add(prefix)
        for out, c in zip((rtt, rate), value[i + LINK_ID_CHARS : i + width], strict=False):
            if c != UNKNOWN:
                out[prefix] = _DIGITS.index(c)
    return rtt, rate


def parse_links(value: object) -> dict[str, int]:
    """The round-trip buckets of a published summary (``parse_summary``)."""
    return parse_summary(value)[0]


def links_of(published: Mapping[str, int], nodes: Iterable[str]) -> dict[str, int]:
    """Published ``prefix -> bucket`` resolved against the view's ``nodes``: a prefix that
    matches no node, or two, is ignored (the same for every member that holds the view)."""
    owners: dict[str, list[str]] = {}
    for n in nodes:
        owners.setdefault(n[:LINK_ID_CHARS].lower(), []).append(n)
    return {owners[p][0]: b for p, b in published.items() if p in owners and len(owners[p]) == 1}


def check_label(label: str) -> str:
    """``label`` if it is a valid site label, else ``ValueError``."""
    if not isinstance(label, str) or not LABEL_RE.fullmatch(label):
        raise ValueError(
            f"site label must be 1-{MAX_LABEL} letters, digits, '.', '_' or '-', starting with "
            f"a letter or digit; got {str(label)[:80]!r}"
        )
    return label


# -- measuring ---------------------------------------------------------------------------------

HYSTERESIS = 0.5
"""Buckets an estimate must move past the published bucket's edge before the bucket changes."""
WINDOW = 8
"""Round-trip samples per peer the estimate is the minimum of: queueing and scheduling only
ever add to a round trip, so the minimum of the last few is the steadiest estimate of the
link's own delay (as TCP's min-RTT filters do)."""
MIN_SAMPLES = 4
"""Samples a peer's link needs before it is published: one or two round trips measured while
a process starts (imports, a loaded host) can all be slow, and a link published from them
could split a site off for one links interval (a plan, and a view, that flip and flip back);
an unpublished link never splits."""


class LinkEstimator:
    """Round trips measured to each peer -> the buckets to publish, with hysteresis: a peer's
    published bucket changes only when the estimate (the minimum of its last ``WINDOW``
    samples) leaves the bucket by ``HYSTERESIS`` of a bucket, so a link whose time sits on a
    boundary does not flap (a published change is a metadata change, which every member
    gossips and which may change the plan and the view); a peer is published once it has
    ``min_samples`` samples. Pure: the caller feeds samples.

    :meth:`for_rates` makes the same estimator of throughputs (bytes per second, rate buckets):
    its estimate is the median of the window, since a packet pair errs both ways (cross
    traffic between the two datagrams spreads them: too slow; a queue after the narrow link
    bunches them: too fast)."""

    def __init__(
        self,
        window: int = WINDOW,
        hysteresis: float = HYSTERESIS,
        min_samples: int = MIN_SAMPLES,
        *,
        position: Callable[[float], float] = rtt_position,
        pick: Callable[[list[float]], float] = min,
    ) -> None:
        self.window = window
        self.hysteresis = hysteresis
        self.min_samples = min(min_samples, window)
        self._position = position
        self._pick = pick
        self._samples: dict[str, list[float]] = {}
        self._published: dict[str, int] = {}

    @classmethod
    def for_rates(cls, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> LinkEstimator:
        """An estimator of throughputs (see the class doc)."""
        return cls(window, HYSTERESIS, min_samples, position=rate_position, pick=_median)

    def add(self, peer: str, seconds: float) -> None:
        """One sample measured to ``peer`` (a round trip in seconds, or a rate in bytes per
        second; non-finite or negative ignored)."""
        if not 0 <= seconds < math.inf:
            return
        s = self._samples.setdefault(peer, [])
        s.append(seconds)
        if len(s) > self.window:
            del s[0]

    def forget(self, keep: Iterable[str]) -> None:
        """Drop every peer not in ``keep`` (members that left)."""
        keep = set(keep)
        for d in (self._samples, self._published):
            for peer in [p for p in d if p not in keep]:
                del d[peer]

    def estimate(self, peer: str) -> float | None:
        s = self._samples.get(peer)
        return self._pick(s) if s else None

    def buckets(self) -> dict[str, int]:
        """The buckets to publish now (updating the held ones where the estimate moved far
        enough)."""
        for peer, s in self._samples.items():
            held = self._published.get(peer)
            if held is None and len(s) < self.min_samples:
                continue  # too few samples to trust (MIN_SAMPLES)
            pos = self._position(self._pick(s))
            if held is None or not held - self.hysteresis <= pos < held + 1 + self.hysteresis:
                self._published[peer] = int(pos)
        return dict(self._published)


def _median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]
