"""Ring collectives on the CPU data plane (TCP, trio). See ``dataplane`` for the overview.

This face re-exports lazily (PEP 562): the pure modules of this package (``view``,
``schedule``, ``reach``, ``ops``, ``aborts``) are part of the sans-IO core, and importing one
of them must not load the data plane (trio, sockets) through this ``__init__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy_face

if TYPE_CHECKING:
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

_EXPORTS = {
    "CollectiveConfig": ".config",
    "CollectiveResult": ".dataplane",
    "DataPlane": ".dataplane",
    "InputMismatchError": ".errors",
    "Peer": ".view",
    "PeerStalledError": ".errors",
    "RingPeerLostError": ".errors",
    "RingView": ".view",
    "SyncDataPlane": ".sync",
    "ViewMismatchError": ".errors",
    "ViewSupersededError": ".errors",
    "open_data_plane": ".dataplane",
    "view_epoch": ".view",
}
"""Lazily exported name -> the module that defines it."""


__getattr__, __dir__ = _lazy_face(globals(), _EXPORTS)


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
