"""What a mesh member publishes in its membership metadata, and how it is read back.

Theory of operation: membership (``ftmesh.membership.wire.check_meta``) only guarantees that
metadata is a small map of scalars. What the keys below *mean* is the mesh's business, and
every value is input from the network: any host that reaches the gossip port (and holds the
secret, if the mesh has one) can publish ``data=garbage``. So every reader goes through
:func:`read_member`, which checks every key the mesh interprets and raises
``BadMetadataError`` for a member whose metadata does not parse. Such a member is unusable for
the data plane: it is left out of the view, its state server and size hint are ignored, and its
role counts as none (see ``DESIGN-NOTES.md``, "Member metadata"). Callers count and log it
(``Mesh``: ``bad_meta``); nothing raises out of a loop. Keys the mesh does not interpret
(``--meta`` entries of the user's own) are left alone.

Progress (``PROGRESS_KEY``): a training member publishes how its training goes
(:class:`Progress`: committed step, step time, share, samples/s, world size, backend, last
fault) as one compact string, ``Mesh.report_progress`` at most once per
``MeshConfig.progress_interval``. That is what ``ftmesh status --watch`` and ``ftmesh
launch``'s view show, and what drives ``launch --kill-at/--join-at``: nothing depends on what
the training script prints. Metadata values are scalars (``check_meta``), hence the string.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import math
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral, Real

from .. import __version__
from ..collective import reach as _reach
from ..collective import topology
from ..collective.reach import Exclusion
from ..errors import ConfigError, RemoteProtocolError
from ..membership.messages import Address, MemberSnapshot, MemberState, Meta

log = logging.getLogger("ftmesh.mesh")

DATA_KEY = "data"
"""Member metadata key holding the data-plane ``host:port``."""
STATE_KEY = "state"
"""Member metadata key holding the ``host:port`` of the member's state server, if it runs one
(``Mesh.serve_state``): where members that are behind fetch committed state from."""
STATE_BYTES_KEY = "state_bytes"
"""Member metadata key: the size of the member's committed state (``Mesh.advertise_state``),
so that a member about to fetch it can prepare its receive buffer while it waits to join."""
RELEASE_KEY = "release"
"""Member metadata key: the member's ftmesh release, ``major.minor`` (``RELEASE``). Members of
one mesh must share it (CHANGELOG.md): the ring leaves out a training member of another
release (reason ``release``), loudly, on both sides."""
RELEASE = ".".join(__version__.split(".")[:2])
"""This process's release (``ftmesh.__version__`` without its patch number)."""
ROLE_KEY = "role"
"""Member metadata key: ``train`` members form the ring; others not (``joining``: about to
train; ``spare``: waits for a free slot, see ``ElasticTrainer(max_peers=...)``; ``observer``;
``done``: finished training, about to leave; ``leaving``: a planned departure, after its
last step: the others' next view leaves it out as soon as they hear of it, without waiting
for the leave itself)."""
ROLES = ("train", "joining", "starting", "spare", "observer", "done", "leaving")
PROGRESS_KEY = "progress"
"""Member metadata key: the member's training progress, ``Progress.encode()``."""
SITE_KEY = "site"
"""Member metadata key: the member's explicit site label (``--site``), an input of the ring
plan (``ftmesh.collective.topology``). A label that does not parse makes the member unusable,
like any other key the mesh interprets: a ring silently planned without it would be wrong."""
LINKS_KEY = "links"
"""Member metadata key: the member's measured round trips to its peers, and the capacities
it measured from them, quantized (``topology.format_links``), an input of the ring plan. A
value that does not parse is dropped (the member stays, as one that measured nothing) and
counted as ``bad_meta``."""
BETWEEN_STEPS = "between steps"
"""Prefix of ``Progress.fault`` while a member's training thread is busy between steps
(``ftmesh.torch.between``): its ring neighbours wait for its next collective past
``io_timeout``, up to ``CollectiveConfig.start_wait`` (``Mesh.busy_between_steps``)."""
MAX_FAULT = 80
"""Characters of a fault's text kept in ``Progress.fault``: the whole record must stay well
inside the metadata limits (``MAX_META_BYTES``) next to the other keys."""
MAX_STEP = 1 << 53
"""Largest step (or share, world size) a progress record may hold: exact as a float, far above
any real run; bounds what a peer can make a reader parse."""
_BACKEND = re.compile(r"[a-z0-9][a-z0-9_+-]{0,15}")
_UINT = re.compile(r"[0-9]{1,16}")
_UFLOAT = re.compile(r"[0-9]{1,16}(\.[0-9]{1,16})?(e[+-]?[0-9]{1,3})?")

MAX_HOSTNAME = 253
"""Longest DNS name (RFC 1035). An advertised host is an IPv4 literal or a DNS name; anything
else (spaces, a scheme, an IPv6 literal this IPv4 data plane cannot dial) is refused."""
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")
MAX_TRACKED = 4096
"""Members whose bad metadata is remembered (to count each version once): bounds the table a
flood of bad members can build; past it, the table starts over."""
LOG_EVERY = 60.0
"""Seconds between two log lines about the same member's bad metadata."""


class BadMetadataError(RemoteProtocolError):
    """A member's metadata does not parse (reason ``bad_meta``); the detail names the key."""

    def __init__(self, detail: str) -> None:
        super().__init__("bad_meta", detail)


@dataclass(frozen=True, slots=True)
class Progress:
    """How a training member's training goes, as of its last committed step (published by
    ``Mesh.report_progress``, read back as ``MemberInfo.progress``)."""

    step: int
    """Committed steps."""
    step_s: float = 0.0
    """Seconds the last committed step took."""
    share: int = 0
    """Samples this member computed in the last committed step (0: a hot spare)."""
    sps: float = 0.0
    """Samples per second this member computes (smoothed)."""
    world: int = 0
    """Members of the view the last committed step ran on."""
    backend: str = "tcp"
    """Collective backend of that step (``tcp``, ``nccl``, ...)."""
    fault: str = ""
    """Short text of the last fault (say ``peer lost 3f2a..``); longer text is cut to
    ``MAX_FAULT`` characters, line breaks become spaces."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fault", " ".join(str(self.fault).split())[:MAX_FAULT])
        for name in ("step", "share", "world"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, Integral) or not 0 <= int(v) <= MAX_STEP:
                raise ConfigError(f"Progress.{name} must be an int in [0, 2**53], got {v!r}")
            object.__setattr__(self, name, int(v))  # (numpy ints become ints)
        for name in ("step_s", "sps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, Real) or not 0 <= float(v) < math.inf:
                raise ConfigError(f"Progress.{name} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        if not isinstance(self.backend, str) or not _BACKEND.fullmatch(self.backend):
            raise ConfigError(f"Progress.backend must be a short name, got {self.backend!r}")

    def encode(self) -> str:
        """The metadata value: ``step|step_s|share|sps|world|backend|fault``."""
        return (
            f"{self.step}|{self.step_s:.4g}|{self.share}|{self.sps:.4g}|{self.world}|"
            f"{self.backend}|{self.fault}"
        )

    @classmethod
    def parse(cls, text: object) -> Progress:
        """``encode``'s output back, or ``BadMetadataError`` (a value from the network)."""
        what = f"{PROGRESS_KEY}: expected STEP|STEP_S|SHARE|SPS|WORLD|BACKEND|FAULT"
        if not isinstance(text, str):
            raise BadMetadataError(f"{what}, got {type(text).__name__}")
        parts = text.split("|", 6)
        if len(parts) != 7:
            raise BadMetadataError(f"{what}, got {text[:80]!r}")
        step, step_s, share, sps, world, backend, fault = parts
        ints = (step, share, world)
        floats = (step_s, sps)
        if not all(_UINT.fullmatch(v) for v in ints) or not all(
            _UFLOAT.fullmatch(v) for v in floats
        ):
            raise BadMetadataError(f"{what}, got {text[:80]!r}")
        if len(fault) > MAX_FAULT or not fault.isprintable():
            raise BadMetadataError(f"{PROGRESS_KEY}: bad fault text {fault[:MAX_FAULT]!r}")
        try:
            return cls(int(step), float(step_s), int(share), float(sps), int(world), backend, fault)
        except ConfigError as exc:
            raise BadMetadataError(f"{PROGRESS_KEY}: {exc}") from None


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """One member as the mesh sees it: membership's snapshot plus its validated metadata."""

    node: str
    name: str
    state: MemberState
    role: str
    """One of ``ROLES``, or ``""`` for a member that publishes none (a plain ``ftmesh node``:
    in the membership, not in the mesh)."""
    data: Address | None
    """Data-plane address; always set for a ``train`` member."""
    state_addr: Address | None
    """State server address, if it runs one."""
    state_bytes: int | None
    """Advertised committed-state size, if any."""
    progress: Progress | None = None
    """Its training progress, if it publishes any (``Mesh.report_progress``)."""
    site: str = ""
    """Its explicit site label (``SITE_KEY``), ``""`` for none."""
    links: tuple[tuple[str, int], ...] = ()
    """Its published round-trip buckets (``LINKS_KEY``): ``(node id prefix, bucket)``."""
    rates: tuple[tuple[str, int], ...] = ()
    """Its published rate buckets (``LINKS_KEY``, version 2): ``(node id prefix, bucket)``."""
    dropped: str = ""
    """Why an optional key was dropped (``LINKS_KEY`` that does not parse), ``""`` if none."""


def host_port(text: object, what: str) -> Address:
    """``HOST:PORT`` from the network as an address, or ``BadMetadataError`` naming ``what``."""
    if not isinstance(text, str):
        raise BadMetadataError(f"{what}: expected HOST:PORT, got {type(text).__name__}")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        raise BadMetadataError(f"{what}: expected HOST:PORT, got {text[:80]!r}")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        bad = len(host) > MAX_HOSTNAME or not _HOSTNAME.fullmatch(host)
        if bad or host.replace(".", "").isdigit():
            raise BadMetadataError(f"{what}: bad host in {text[:80]!r}") from None
    return host, int(port)


def read_member(m: MemberSnapshot) -> MemberInfo:
    """Validate the keys the mesh interprets in ``m.meta``; raise ``BadMetadataError``."""
    meta: Meta = m.meta
    role = meta.get(ROLE_KEY, "")
    if role != "" and role not in ROLES:
        raise BadMetadataError(f"{ROLE_KEY}: expected one of {ROLES}, got {str(role)[:40]!r}")
    data = host_port(meta[DATA_KEY], DATA_KEY) if DATA_KEY in meta else None
    if role == "train" and data is None:
        raise BadMetadataError(f"a {role!r} member without a {DATA_KEY!r} address")
    state_addr = host_port(meta[STATE_KEY], STATE_KEY) if STATE_KEY in meta else None
    nbytes = meta.get(STATE_BYTES_KEY)
    if nbytes is not None and (type(nbytes) is not int or nbytes < 0):
        raise BadMetadataError(f"{STATE_BYTES_KEY}: expected a size, got {str(nbytes)[:40]!r}")
    progress = Progress.parse(meta[PROGRESS_KEY]) if PROGRESS_KEY in meta else None
    site = meta.get(SITE_KEY, "")
    if site != "":
        try:
            topology.check_label(site)  # type: ignore[arg-type]
        except ValueError as exc:
            raise BadMetadataError(f"{SITE_KEY}: {exc}") from None
    links: tuple[tuple[str, int], ...] = ()
    rates: tuple[tuple[str, int], ...] = ()
    dropped = ""
    if LINKS_KEY in meta:
        try:
            rtt, rate = topology.parse_summary(meta[LINKS_KEY])
        except ValueError as exc:
            dropped = str(exc)
        else:
            links, rates = tuple(sorted(rtt.items())), tuple(sorted(rate.items()))
    return MemberInfo(
        node=m.node,
        name=m.name,
        state=MemberState(m.state),
        role=str(role),
        data=data,
        state_addr=state_addr,
        state_bytes=nbytes,
        progress=progress,
        site=str(site),
        links=links,
        rates=rates,
        dropped=dropped,
    )


def role_of(m: MemberSnapshot) -> str:
    """``m``'s role, ``""`` if it has none or its metadata does not parse."""
    try:
        return read_member(m).role
    except BadMetadataError:
        return ""


def advertises_state(m: MemberSnapshot) -> bool:
    """Whether ``m`` (with metadata that parses) advertises a committed state."""
    try:
        return read_member(m).state_bytes is not None
    except BadMetadataError:
        return False


class MetadataGate:
    """The door from membership to the mesh: the members whose metadata parses, with every
    other one counted (``bad_meta``: each version of a member's metadata once) and logged
    (each member at most once per ``LOG_EVERY`` seconds)."""

    def __init__(self) -> None:
        self.bad_meta = 0
        self._seen: dict[str, int] = {}  # node -> incarnation whose metadata was counted
        self._logged: dict[str, float] = {}
        self._problems: dict[str, str] = {}

    def usable(self, members: Iterable[MemberSnapshot]) -> list[MemberInfo]:
        """The members of ``members`` (all of them: see ``problems``) whose metadata parses."""
        out = []
        problems = {}
        for m in members:
            try:
                info = read_member(m)
            except BadMetadataError as exc:
                problems[m.node] = str(exc)
                self._count(m, exc)
                continue
            out.append(info)
            if info.dropped:
                self._count(m, BadMetadataError(info.dropped), left_out=False)
        self._problems = problems
        return out

    def problems(self) -> dict[str, str]:
        """Node id -> why its metadata is unusable, as of the last ``usable`` call."""
        return dict(self._problems)

    def _count(self, m: MemberSnapshot, exc: BadMetadataError, *, left_out: bool = True) -> None:
        if self._seen.get(m.node) == m.incarnation:
            return
        if len(self._seen) >= MAX_TRACKED:
            self._seen.clear()
            self._logged.clear()
        self._seen[m.node] = m.incarnation
        self.bad_meta += 1
        now = time.monotonic()
        if now - self._logged.get(m.node, -1e9) >= LOG_EVERY:
            self._logged[m.node] = now
            log.warning(
                "member %s (%s, %s:%d) %s: its metadata does not parse (%s; %d such so far)",
                m.name,
                m.node[:12],
                m.addr[0],
                m.addr[1],
                "is left out of the mesh" if left_out else "keeps its place, a key dropped",
                exc,
                self.bad_meta,
            )


def ring_plan(members: Sequence[MemberInfo]) -> topology.RingPlan:
    """The ring plan of a view of ``members`` (``topology.plan_ring``) from what they publish:
    site labels and measured links, the links' id prefixes resolved against the view's
    members. The same for every member holding the same metadata; cached (a view is computed
    on every membership event and before collectives)."""
    ids = [m.node for m in members]
    return _plan(
        tuple(
            topology.MemberLinks.of(
                m.node,
                m.site,
                topology.links_of(dict(m.links), ids),
                topology.links_of(dict(m.rates), ids),
            )
            for m in sorted(members, key=lambda m: m.node)
        )
    )


@functools.lru_cache(maxsize=64)
def _plan(members: tuple[topology.MemberLinks, ...]) -> topology.RingPlan:
    return topology.plan_ring(members)


REACH_KEY = "reach"
"""Our accusations of ring neighbours (``ftmesh.collective.reach``), published for every
member to compute the same exclusions (``ring_exclusions``)."""


def ring_exclusions(
    members: Sequence[MemberSnapshot], release: str = RELEASE
) -> dict[str, Exclusion]:
    """The training members the ring leaves out (``_reach.exclusions``), computed from the
    accusations they publish under ``REACH_KEY``: the same for every member that holds the same
    membership. Accusations count while their reporter is alive or suspect (a suspicion, as
    a one-way link causes now and then, must not take an accused member back for a moment).
    A member whose accusations do not parse is left out (reason ``bad_meta``), and so is one
    that publishes a ``RELEASE_KEY`` other than ``release`` (reason ``release``: members of
    two releases never share a ring; one that publishes none predates the key)."""
    candidates: list[str] = []
    reports: dict[str, dict[str, str]] = {}
    bad: dict[str, Exclusion] = {}
    for m in members:
        if m.state not in _COUNTED or m.meta.get(ROLE_KEY) != "train":
            continue
        theirs = m.meta.get(RELEASE_KEY, release)
        if theirs != release:
            bad[m.node] = Exclusion(m.node, "release", (str(theirs)[:16],))
            continue
        try:
            found = _reach.parse_reports(m.meta.get(REACH_KEY))
        except ValueError:
            bad[m.node] = Exclusion(m.node, "bad_meta", ())
            continue
        candidates.append(m.node)
        if found:
            reports[m.node] = found
    out = _reach.exclusions(reports, candidates) if reports else {}
    return {**out, **bad}


_COUNTED = (MemberState.ALIVE, MemberState.SUSPECT)
