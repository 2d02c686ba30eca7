"""Ring collectives on the CPU data plane (TCP, trio). See ``dataplane`` for the overview.

This face re-exports lazily (PEP 562): the pure modules of this package (``view``,
``schedule``, ``reach``, ``ops``, ``aborts``) are part of the sans-IO core, and importing one
of them must not load the data plane (trio, sockets) through this ``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value: object = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


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
