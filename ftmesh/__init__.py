"""ftmesh: a peer-to-peer, coordinator-free, fault-tolerant training mesh."""

from __future__ import annotations

from .errors import (
    CollectiveError,
    ConfigError,
    DeadlineExceeded,
    Departed,
    FtmeshError,
    LocalUsageError,
    MeshClosedError,
    MeshNotFormedError,
    PeerLostError,
    RemoteProtocolError,
    TrainingFinishedError,
)
from .membership.config import MembershipConfig
from .mesh import Mesh, MeshConfig, open_mesh
from .net.node import Node, NodeConfig, open_node
from .state import State
from .sync import SyncMesh, connect

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "ConfigError",
    "DeadlineExceeded",
    "Departed",
    "FtmeshError",
    "LocalUsageError",
    "MembershipConfig",
    "Mesh",
    "MeshClosedError",
    "MeshConfig",
    "MeshNotFormedError",
    "Node",
    "NodeConfig",
    "PeerLostError",
    "RemoteProtocolError",
    "State",
    "SyncMesh",
    "TrainingFinishedError",
    "__version__",
    "connect",
    "open_mesh",
    "open_node",
]
