"""Test and demo labs: virtual LANs of network namespaces (root only)."""

from __future__ import annotations

from .errors import LabError
from .netns import VirtualLan, cleanup_stale, is_root
from .wan import WanLink, WanStats

__all__ = ["LabError", "VirtualLan", "WanLink", "WanStats", "cleanup_stale", "is_root"]
