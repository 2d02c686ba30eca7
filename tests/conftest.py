from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftmesh.lab.procs import NodeGroup

ROOT = Path(__file__).resolve().parent.parent
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to create network namespaces (CI runs as root)"
)


@pytest.fixture
def node_group(tmp_path: Path) -> Iterator[NodeGroup]:
    """``ftmesh node`` processes on this host; all killed after the test, pass or fail."""
    with NodeGroup(log_dir=tmp_path) as group:
        yield group
