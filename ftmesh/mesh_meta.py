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
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import RemoteProtocolError
from .membership.messages import Address, MemberSnapshot, MemberState, Meta

log = logging.getLogger("ftmesh.mesh")

DATA_KEY = "data"
"""Member metadata key holding the data-plane ``host:port``."""
STATE_KEY = "state"
"""Member metadata key holding the ``host:port`` of the member's state server, if it runs one
(``Mesh.serve_state``): where members that are behind fetch committed state from."""
STATE_BYTES_KEY = "state_bytes"
"""Member metadata key: the size of the member's committed state (``Mesh.advertise_state``),
so that a member about to fetch it can prepare its receive buffer while it waits to join."""
ROLE_KEY = "role"
"""Member metadata key: ``train`` members form the ring; others not (``joining``: about to
train; ``spare``: waits for a free slot, see ``ElasticTrainer(max_peers=...)``; ``observer``;
``done``: finished training, about to leave)."""
ROLES = ("train", "joining", "starting", "spare", "observer", "done")

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
    return MemberInfo(
        node=m.node,
        name=m.name,
        state=MemberState(m.state),
        role=str(role),
        data=data,
        state_addr=state_addr,
        state_bytes=nbytes,
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
                out.append(read_member(m))
            except BadMetadataError as exc:
                problems[m.node] = str(exc)
                self._count(m, exc)
        self._problems = problems
        return out

    def problems(self) -> dict[str, str]:
        """Node id -> why its metadata is unusable, as of the last ``usable`` call."""
        return dict(self._problems)

    def _count(self, m: MemberSnapshot, exc: BadMetadataError) -> None:
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
                "member %s (%s, %s:%d) is left out of the mesh: its metadata does not parse "
                "(%s; %d such so far)",
                m.name,
                m.node[:12],
                m.addr[0],
                m.addr[1],
                exc,
                self.bad_meta,
            )
