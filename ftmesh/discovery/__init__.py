"""Zero-configuration discovery: how a node finds the other members of its mesh.

Three mechanisms behind one :class:`Discovery` protocol, picked by :func:`make_discovery`:

* ``local``: same host, a registry directory, no network at all (:class:`LocalDiscovery`).
* ``seeds``: a ``host:port`` list or DNS names, for clouds without multicast
  (:class:`SeedDiscovery`).
* ``mdns``: mDNS / DNS-SD on one LAN interface, zero configuration (:class:`MdnsDiscovery`).

Discovery only feeds joins; SWIM membership owns liveness.

The three mechanisms are imported lazily (PEP 562, ``ftmesh._lazy_face``), each when
:func:`make_discovery` builds it or its name is first read here: a member started with
``local`` discovery (every ``ftmesh launch`` and bench worker) never loads zeroconf, ifaddr
and the mDNS code, which only ``mdns`` needs (a joiner's start-up, issue #30).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import _lazy_face
from ..errors import ConfigError
from .base import PROTOCOL_VERSION, Advert, Discovery, DiscoveryStatistics
from .interfaces import default_interface_ip

if TYPE_CHECKING:
    from .local import LocalDiscovery, default_registry_dir
    from .mdns import MdnsDiscovery
    from .seeds import SeedDiscovery

_EXPORTS = {
    "LocalDiscovery": ".local",
    "MdnsDiscovery": ".mdns",
    "SeedDiscovery": ".seeds",
    "default_registry_dir": ".local",
}
"""Lazily exported name -> the module that defines it."""

__getattr__, __dir__ = _lazy_face(globals(), _EXPORTS)

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
        from .local import LocalDiscovery

        return LocalDiscovery(registry_dir)
    if kind == "seeds":
        from .seeds import SeedDiscovery

        return SeedDiscovery(seeds)
    if kind == "mdns":
        from .mdns import MdnsDiscovery

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
