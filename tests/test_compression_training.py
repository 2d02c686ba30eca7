"""End to end: the README's ``ftmesh launch -n 3 examples/train_digits.py --compression int8``
trains to the accuracy of uncompressed training (within 0.01), with bitwise-identical state
on every member at every reported step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import EXAMPLE, ROOT, accuracy, check_consistency, launch, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_digits_with_int8_compression_reaches_the_uncompressed_accuracy(tmp_path: Path) -> None:
    res = launch(tmp_path / "mesh", "-n", "3", EXAMPLE, "--compression", "int8")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = progress(tmp_path / "mesh")
    assert len(records) == 3
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    check_consistency(records, total)  # the same digest everywhere: identical decoded bytes
    assert all(r["attempts"] == 1 for recs in records.values() for r in recs if "done" not in r)
    # the uncompressed reference: the same training in one process (what a mesh computes)
    single = subprocess.run(
        [sys.executable, EXAMPLE, "--single"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=True,
    )
    assert accuracy(res.stdout) >= accuracy(single.stdout) - 0.01
