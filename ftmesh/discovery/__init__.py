"""Zero-configuration discovery: how a node finds the other members of its mesh.

Three mechanisms behind one :class:`Discovery` protocol, picked by :func:`make_discovery`:

* ``local``: same host, a registry directory, no network at all (:class:`LocalDiscovery`).
* ``seeds``: a ``host:port`` list or DNS names, for clouds without multicast
  (:class:`SeedDiscovery`).
* ``mdns``: mDNS / DNS-SD on one LAN interface, zero configuration (:class:`MdnsDiscovery`).

Discovery only feeds joins; SWIM membership owns liveness.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from .base import PROTOCOL_VERSION, Advert, Discovery, DiscoveryStatistics
from .interfaces import default_interface_ip
from .local import LocalDiscovery, default_registry_dir
from .mdns import MdnsDiscovery
from .seeds import SeedDiscovery

KINDS = ("local", "seeds", "mdns")
"""Discovery kinds accepted by :func:`make_discovery`."""


def make_discovery(
    kind: str,
    *,
    seeds: Sequence[str] = (),
    interface_ip: str | None = None,
    registry_dir: Path | str | None = None,
) -> Discovery:
    """Build the discovery mechanism named ``kind`` (one of :data:`KINDS`).

    Options that do not apply to ``kind`` are ignored (a node may pass its whole
    configuration). Raises :class:`ConfigError` for an unknown kind or a bad option.
    """
    if kind == "local":
        return LocalDiscovery(registry_dir)
    if kind == "seeds":
        return SeedDiscovery(seeds)
    if kind == "mdns":
        return MdnsDiscovery(interface_ip)
    raise ConfigError(f"unknown discovery kind {kind!r}; use one of {', '.join(KINDS)}")


__all__ = [
    "KINDS",
    "PROTOCOL_VERSION",
    "Advert",
    "Discovery",
    "DiscoveryStatistics",
    "LocalDiscovery",
    "MdnsDiscovery",
    "SeedDiscovery",
    "default_interface_ip",
    "default_registry_dir",
    "make_discovery",
]
