"""trio runtime: drives the membership machine over real sockets.

This face re-exports lazily (PEP 562), so that ``net.admission`` (used by the data plane and
state transfer) does not load the node, discovery and zeroconf through this ``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .node import Node, NodeConfig, open_node, parse_hostport

_EXPORTS = {"Node": ".node", "NodeConfig": ".node", "open_node": ".node", "parse_hostport": ".node"}
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


__all__ = ["Node", "NodeConfig", "open_node", "parse_hostport"]
