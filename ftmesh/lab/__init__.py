"""Test and demo labs: virtual LANs of network namespaces (root only)."""

from __future__ import annotations

from .errors import LabError
from .netns import VirtualLan, cleanup_stale, is_root

__all__ = ["LabError", "VirtualLan", "cleanup_stale", "is_root"]
