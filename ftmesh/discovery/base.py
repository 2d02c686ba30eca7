"""What every discovery mechanism promises, and the validation they share.

Theory of operation: discovery only *feeds joins*. A mechanism announces this node and reports
every other member of the same mesh it sees as an :class:`Advert` ("there is a peer at
host:port"); the node turns that into a SWIM join. Liveness is SWIM's job, so discovery never
reports departures, and repeats are allowed (the caller deduplicates). Mechanisms re-report the
peers they know every ``refresh_interval`` seconds so a join that failed once is retried.

Everything a peer advertises is input from the network: it is validated here against named
caps, and a bad advert is dropped and counted, never raised out of ``run()``.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from ..errors import ConfigError, RemoteProtocolError

PROTOCOL_VERSION = 1
"""ftmesh wire protocol version advertised by every discovery mechanism."""

MAX_MESH_LEN = 63
"""Longest mesh name, in characters. One DNS label; it is also a directory name for local
discovery, hence the restricted alphabet of :data:`_MESH_RE`."""

MAX_NAME_LEN = 64
"""Longest human node name, in UTF-8 bytes. Bounds what a LAN peer can make us store and print."""

NODE_ID_LEN = 32
"""A node id is 128 random bits written as 32 lowercase hex characters."""

_MESH_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_NODE_ID_RE = re.compile(r"[0-9a-f]{32}")

log = logging.getLogger("ftmesh.discovery")


@dataclass(frozen=True, slots=True)
class Advert:
    """One member of a mesh as discovery sees it: enough to send it a SWIM join."""

    mesh: str
    """Mesh name; adverts of other meshes are ignored by every discovery."""
    node_id: str
    """32 lowercase hex characters; ``""`` for a seed address whose identity is not known yet."""
    name: str
    """Human name (``hostname-pid`` by default); ``""`` for seeds."""
    host: str
    """Gossip address other members can reach, an IPv4 dotted quad."""
    port: int
    """Gossip UDP/TCP port."""
    version: int = PROTOCOL_VERSION
    """Protocol version the member speaks. Reported as seen; the node decides compatibility."""


FoundCallback = Callable[[Advert], None]


class Discovery(Protocol):
    """A way to find the other members of a mesh. See the module docstring."""

    async def run(
        self,
        me: Advert,
        found: FoundCallback,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Announce ``me`` and call ``found(advert)`` for every *other* member of ``me.mesh``.

        Repeats are fine; the caller deduplicates. ``task_status.started()`` is called once
        announcing works. Runs until cancelled; withdraws the announcement on cancel.
        """
        ...

    async def browse(self, mesh: str, timeout: float) -> list[Advert]:
        """One-shot: the members of ``mesh`` visible now (for ``ftmesh status``).

        Bounded by ``timeout`` seconds.
        """
        ...


@dataclass(frozen=True, slots=True)
class DiscoveryStatistics:
    """Snapshot of a discovery mechanism's counters (see :meth:`statistics`)."""

    reported: int = 0
    """Calls made to ``found``."""
    malformed: int = 0
    """Adverts, registry files or TXT records that could not be parsed or failed validation."""
    other_mesh: int = 0
    """Well-formed adverts of another mesh, ignored."""
    stale: int = 0
    """Local registry entries whose process had died, removed."""
    errors: int = 0
    """Transient failures of our own: name resolution failed, a lookup timed out, I/O errors."""


class _Counters:
    """Mutable counters behind :class:`DiscoveryStatistics`, with rate-limited logging.

    A hostile or broken LAN can produce a bad advert every millisecond; logging each one would
    be a denial of service on the log. Each reason logs its first occurrence and then at most
    once per :attr:`LOG_EVERY` seconds, with the running count.
    """

    LOG_EVERY = 60.0
    QUIET = frozenset({"reported", "other_mesh"})  # normal events: debug only

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._last_log: dict[str, float] = {}

    def bump(self, reason: str, detail: str = "") -> None:
        self._counts[reason] = self._counts.get(reason, 0) + 1
        if reason in self.QUIET:
            log.debug("discovery: %s: %s", reason, detail)
            return
        now = time.monotonic()
        last = self._last_log.get(reason)
        if last is None or now - last >= self.LOG_EVERY:
            self._last_log[reason] = now
            log.warning("discovery: %s (%d so far): %s", reason, self._counts[reason], detail)
        else:
            log.debug("discovery: %s: %s", reason, detail)

    def snapshot(self) -> DiscoveryStatistics:
        c = self._counts
        return DiscoveryStatistics(
            reported=c.get("reported", 0),
            malformed=c.get("malformed", 0),
            other_mesh=c.get("other_mesh", 0),
            stale=c.get("stale", 0),
            errors=c.get("errors", 0),
        )


def check_mesh_name(mesh: str) -> None:
    """Raise :class:`ConfigError` unless ``mesh`` is a valid mesh name.

    1 to 63 characters from ``[A-Za-z0-9._-]``, not starting with ``.``, ``_`` or ``-``: it must
    fit in one DNS label and be a safe directory name.
    """
    if not isinstance(mesh, str) or not _MESH_RE.fullmatch(mesh):
        raise ConfigError(
            f"invalid mesh name {mesh!r}: use 1-{MAX_MESH_LEN} characters from [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )


def advert_problem(a: Advert, *, seed: bool = False) -> str | None:
    """Why ``a`` is not a valid advert, or ``None``. ``seed`` allows empty node id and name."""
    if not isinstance(a.mesh, str) or not _MESH_RE.fullmatch(a.mesh):
        return f"bad mesh name {a.mesh!r}"
    if not isinstance(a.node_id, str) or not (
        _NODE_ID_RE.fullmatch(a.node_id) or (seed and a.node_id == "")
    ):
        return f"bad node id {a.node_id!r}"
    if not isinstance(a.name, str) or len(a.name.encode("utf-8", "replace")) > MAX_NAME_LEN:
        return "name too long or not a string"
    if not a.name and not seed:
        return "empty name"
    if not isinstance(a.host, str):
        return "host is not a string"
    try:
        ipaddress.IPv4Address(a.host)
    except ValueError:
        return f"host {a.host!r} is not an IPv4 address"
    if isinstance(a.port, bool) or not isinstance(a.port, int) or not 1 <= a.port <= 65535:
        return f"port {a.port!r} out of range"
    if isinstance(a.version, bool) or not isinstance(a.version, int) or not 0 <= a.version < 2**16:
        return f"version {a.version!r} out of range"
    return None


def check_own_advert(me: Advert) -> None:
    """Raise :class:`ConfigError` if the advert we are asked to announce is invalid."""
    problem = advert_problem(me)
    if problem is not None:
        raise ConfigError(f"cannot announce this node: {problem}")


def check_remote_advert(a: Advert) -> Advert:
    """Return ``a`` or raise :class:`RemoteProtocolError` ``"malformed"`` if it is invalid."""
    problem = advert_problem(a)
    if problem is not None:
        raise RemoteProtocolError("malformed", problem)
    return a
