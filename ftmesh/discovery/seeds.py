"""Seed-list discovery, for networks where multicast is blocked (clouds, Kubernetes).

Theory of operation: the user lists ``host:port`` entries. A host may be an IPv4 literal or a
DNS name, and a name may resolve to several addresses (a Kubernetes headless service resolves
to every ready pod). Every ``refresh_interval`` seconds each name is resolved again, with a
deadline, and every resolved address is reported as an :class:`Advert` with empty ``node_id``
and ``name``: the node sends a SWIM join there and learns who answers. Re-resolving finds seeds
that appear later (pods scheduled after us). Seeds announce nothing, so there is nothing to
withdraw; the seed's actual mesh is checked by the join handshake, not here.

The first member of a mesh has nobody to join: an empty list, seeds that do not answer yet
and seeds that resolve to the member itself (a StatefulSet's pod-0 finds its own address
behind the Service name) are all normal. Such a member runs alone and waits to be joined;
whether it was *meant* to be alone is for the layers above to say (``start_peers``, and the
node's warning when seeds were given and nobody answers).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

import trio

from ..errors import ConfigError
from .base import (
    PROTOCOL_VERSION,
    Advert,
    DiscoveryStatistics,
    FoundCallback,
    _Counters,
    check_mesh_name,
    check_own_advert,
)

DEFAULT_REFRESH_INTERVAL = 5.0
"""Seconds between resolutions. Lower finds late seeds sooner; each round costs one DNS
lookup per entry."""

DEFAULT_RESOLVE_TIMEOUT = 2.0
"""Deadline for one DNS lookup, in seconds. A lookup past it counts as an error for that round."""

MAX_SEEDS = 256
"""Entries accepted in a seed list."""

MAX_ADDRESSES_PER_NAME = 256
"""Addresses taken from one name's resolution. Bounds what a hostile or broken DNS answer can
make us join."""

_MAX_HOST_LEN = 253  # longest DNS name


def parse_seed(entry: str) -> tuple[str, int]:
    """Split ``"host:port"`` into (host, port); raise :class:`ConfigError` if malformed.

    ``host`` is an IPv4 literal or a DNS name; IPv6 is not supported by the gossip layer yet.
    """
    if not isinstance(entry, str):
        raise ConfigError(f"seed {entry!r} is not a string")
    text = entry.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"seed {entry!r}: expected host:port, e.g. 10.0.0.5:7946")
    if host.startswith("[") or ":" in host:
        raise ConfigError(f"seed {entry!r}: IPv6 addresses are not supported; use IPv4 or a name")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ConfigError(f"seed {entry!r}: port must be an integer in 1..65535")
    if len(host) > _MAX_HOST_LEN or any(c.isspace() or c == "/" for c in host):
        raise ConfigError(f"seed {entry!r}: {host!r} is not a valid host name or IPv4 address")
    return host, int(port_text)


def _is_ipv4_literal(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


class SeedDiscovery:
    """Reports the addresses behind a list of ``host:port`` seeds. See the module docstring."""

    def __init__(
        self,
        seeds: Sequence[str],
        *,
        refresh_interval: float = DEFAULT_REFRESH_INTERVAL,
        resolve_timeout: float = DEFAULT_RESOLVE_TIMEOUT,
    ) -> None:
        if isinstance(seeds, str):
            raise ConfigError("seeds must be a sequence of 'host:port' strings, not one string")
        seeds = list(seeds)
        if len(seeds) > MAX_SEEDS:
            raise ConfigError(f"{len(seeds)} seeds given; at most {MAX_SEEDS} are accepted")
        if not 0.1 <= refresh_interval <= 3600:
            raise ConfigError(f"refresh_interval {refresh_interval!r} s must be in [0.1, 3600]")
        if not 0.01 <= resolve_timeout <= 60:
            raise ConfigError(f"resolve_timeout {resolve_timeout!r} s must be in [0.01, 60]")
        self.seeds: tuple[tuple[str, int], ...] = tuple(dict.fromkeys(parse_seed(s) for s in seeds))
        self.refresh_interval = refresh_interval
        self.resolve_timeout = resolve_timeout
        self._counters = _Counters()

    def statistics(self) -> DiscoveryStatistics:
        """Counters since construction (reports, failed resolutions)."""
        return self._counters.snapshot()

    async def _resolve(self, host: str, port: int) -> list[str]:
        if _is_ipv4_literal(host):
            return [host]
        with trio.move_on_after(self.resolve_timeout) as scope:
            try:
                infos = await trio.socket.getaddrinfo(
                    host, port, family=socket.AF_INET, type=socket.SOCK_DGRAM
                )
            except (OSError, UnicodeError) as e:
                self._counters.bump("errors", f"cannot resolve seed {host}: {e}")
                return []
        if scope.cancelled_caught:
            self._counters.bump(
                "errors", f"resolving seed {host} took over {self.resolve_timeout}s"
            )
            return []
        addrs: dict[str, None] = {}
        for info in infos:
            addr = info[4][0]
            if isinstance(addr, str):
                addrs[addr] = None
            if len(addrs) >= MAX_ADDRESSES_PER_NAME:
                break
        return list(addrs)

    async def _resolve_all(self, mesh: str) -> list[Advert]:
        results: list[list[Advert]] = [[] for _ in self.seeds]

        async def one(i: int, host: str, port: int) -> None:
            results[i] = [
                Advert(mesh, "", "", addr, port, PROTOCOL_VERSION)
                for addr in await self._resolve(host, port)
            ]

        async with trio.open_nursery() as nursery:
            for i, (host, port) in enumerate(self.seeds):
                nursery.start_soon(one, i, host, port)
        out: dict[tuple[str, int], Advert] = {}
        for adverts in results:
            for a in adverts:
                out.setdefault((a.host, a.port), a)
        return list(out.values())

    async def run(
        self,
        me: Advert,
        found: FoundCallback,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Report every seed address (except ``me.host:me.port``) every ``refresh_interval``.

        Seeds announce nothing, so ``started()`` comes at once, before the first lookup.
        """
        check_own_advert(me)
        task_status.started()
        while True:
            next_round = trio.current_time() + self.refresh_interval
            for a in await self._resolve_all(me.mesh):  # bounded by resolve_timeout
                if (a.host, a.port) == (me.host, me.port):
                    continue
                self._counters.bump("reported")
                found(a)
            await trio.sleep_until(next_round)

    async def browse(self, mesh: str, timeout: float) -> list[Advert]:
        """The seed addresses resolvable now (node ids unknown), within ``timeout`` seconds."""
        check_mesh_name(mesh)
        with trio.move_on_after(timeout):
            return await self._resolve_all(mesh)
        return []
