"""ftmesh: a peer-to-peer, coordinator-free, fault-tolerant training mesh."""

from __future__ import annotations

from .errors import (
    CollectiveError,
    ConfigError,
    DeadlineExceeded,
    FtmeshError,
    LocalUsageError,
    MeshClosedError,
    PeerLostError,
    RemoteProtocolError,
)

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "ConfigError",
    "DeadlineExceeded",
    "FtmeshError",
    "LocalUsageError",
    "MeshClosedError",
    "PeerLostError",
    "RemoteProtocolError",
    "__version__",
]
