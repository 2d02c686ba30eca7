"""ftmesh: a peer-to-peer, coordinator-free, fault-tolerant training mesh.

The public API, re-exported lazily (PEP 562): ``import ftmesh`` loads only the error
hierarchy, and ``ftmesh.connect`` (say) imports ``ftmesh.mesh.blocking`` on first use. So
importing one pure part (``ftmesh.membership.swim``, ``ftmesh.training.step``) never drags in
trio, sockets, zeroconf or torch through this package. The names, and where each one lives,
are in ``_EXPORTS``; the imports under ``TYPE_CHECKING`` are the same, for type checkers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from .membership.config import MembershipConfig
    from .mesh.blocking import SyncMesh, connect
    from .mesh.core import Mesh, MeshConfig, open_mesh
    from .mesh.meta import Progress
    from .net.node import Node, NodeConfig, open_node
    from .state.state import State

__version__ = "0.1.0"

_EXPORTS = {
    "MembershipConfig": ".membership.config",
    "Mesh": ".mesh.core",
    "MeshConfig": ".mesh.core",
    "Node": ".net.node",
    "NodeConfig": ".net.node",
    "Progress": ".mesh.meta",
    "State": ".state.state",
    "SyncMesh": ".mesh.blocking",
    "connect": ".mesh.blocking",
    "open_mesh": ".mesh.core",
    "open_node": ".net.node",
}
"""Lazily exported name -> the module that defines it."""


def __getattr__(name: str) -> object:
    """Import a lazily exported name (or a subpackage, ``ftmesh.state``) on first access."""
    module = _EXPORTS.get(name)
    if name.startswith("__"):  # probes such as ``__wrapped__`` never import anything
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module is not None:
        value: object = getattr(importlib.import_module(module, __name__), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


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


def _lazy_face(
    namespace: dict[str, object], exports: dict[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A subpackage's lazy face (PEP 562): ``__getattr__`` and ``__dir__`` that import each
    name of ``exports`` (name -> its module, relative to the package) on first use."""
    package = str(namespace["__name__"])

    def getattr_(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value: object = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # later accesses skip this function
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_
