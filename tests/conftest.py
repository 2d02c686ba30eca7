"""Fixtures shared by the whole suite.

- ``node_group``: ``ftmesh node`` processes on this host, killed after the test.
- ``references`` / ``single_run``: single-process reference runs of the examples, one per
  argument set, cached on disk keyed by the code (``tests_support.References``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests_support import References, SingleRun, references_dir

from ftmesh.lab.procs import NodeGroup


@pytest.fixture
def node_group(tmp_path: Path) -> Iterator[NodeGroup]:
    """``ftmesh node`` processes on this host; all killed after the test, pass or fail."""
    with NodeGroup(log_dir=tmp_path) as group:
        yield group


@pytest.fixture(scope="session")
def references() -> References:
    """Cached single-process reference runs (``tests_support.References``)."""
    return References(references_dir())


@pytest.fixture(scope="session")
def single_run(references: References) -> SingleRun:
    """The single-process baseline of ``examples/train_digits.py`` (cached)."""
    return SingleRun(references)
