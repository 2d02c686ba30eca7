"""Ring collectives on the CPU data plane (TCP, trio). See ``dataplane`` for the overview."""

from .config import CollectiveConfig
from .dataplane import CollectiveResult, DataPlane, open_data_plane
from .errors import (
    InputMismatchError,
    PeerStalledError,
    RingPeerLostError,
    ViewMismatchError,
    ViewSupersededError,
)
from .sync import SyncDataPlane
from .view import Peer, RingView, view_epoch

__all__ = [
    "CollectiveConfig",
    "CollectiveResult",
    "DataPlane",
    "InputMismatchError",
    "Peer",
    "PeerStalledError",
    "RingPeerLostError",
    "RingView",
    "SyncDataPlane",
    "ViewMismatchError",
    "ViewSupersededError",
    "open_data_plane",
    "view_epoch",
]
