"""trio runtime: drives the membership machine over real sockets.

This face re-exports lazily (PEP 562), so that ``net.admission`` (used by the data plane and
state transfer) does not load the node, discovery and zeroconf through this ``__init__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy_face

if TYPE_CHECKING:
    from .node import Node, NodeConfig, open_node, parse_hostport

_EXPORTS = {"Node": ".node", "NodeConfig": ".node", "open_node": ".node", "parse_hostport": ".node"}
"""Lazily exported name -> the module that defines it."""


__getattr__, __dir__ = _lazy_face(globals(), _EXPORTS)


__all__ = ["Node", "NodeConfig", "open_node", "parse_hostport"]
