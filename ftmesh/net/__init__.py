"""trio runtime: drives the membership machine over real sockets."""

from __future__ import annotations

from .node import Node, NodeConfig, open_node, parse_hostport

__all__ = ["Node", "NodeConfig", "open_node", "parse_hostport"]
