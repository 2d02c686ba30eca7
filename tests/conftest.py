from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftmesh.lab.procs import NodeGroup


@pytest.fixture
def node_group(tmp_path: Path) -> Iterator[NodeGroup]:
    """``ftmesh node`` processes on this host; all killed after the test, pass or fail."""
    with NodeGroup(log_dir=tmp_path) as group:
        yield group
