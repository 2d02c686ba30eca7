from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests_support import SingleRun

from ftmesh.lab.procs import NodeGroup


@pytest.fixture
def node_group(tmp_path: Path) -> Iterator[NodeGroup]:
    """``ftmesh node`` processes on this host; all killed after the test, pass or fail."""
    with NodeGroup(log_dir=tmp_path) as group:
        yield group


@pytest.fixture(scope="session")
def single_run() -> Iterator[SingleRun]:
    """The single-process baseline of ``examples/train_digits.py``, run once per session."""
    run = SingleRun()
    yield run
    run.stop()
