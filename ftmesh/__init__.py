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
from .mesh.blocking import SyncMesh, connect
from .mesh.core import Mesh, MeshConfig, open_mesh
from .mesh.meta import Progress
from .net.node import Node, NodeConfig, open_node
from .state import State

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
    "Progress",
    "RemoteProtocolError",
    "State",
    "SyncMesh",
    "TrainingFinishedError",
    "__version__",
    "connect",
    "open_mesh",
    "open_node",
]
