"""End to end: the training page's (docs/guide/training.md) ``ftmesh launch -n 3
examples/train_digits.py --compression int8 --eval-every 15 --step-delay 0`` trains to the
accuracy of uncompressed training (within 0.01), with bitwise-identical state on every member
at every reported step.

Accuracy is compared as the mean over the last three epochs' evaluations
(``tests_support.plateau``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests_support import EXAMPLE, References, check_consistency, launch, plateau, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_digits_with_int8_compression_reaches_the_uncompressed_accuracy(
    tmp_path: Path, references: References
) -> None:
    res = launch(
        tmp_path / "mesh",
        *("-n", "3", EXAMPLE, "--compression", "int8", "--eval-every", "15", "--step-delay", "0"),
        timeout=400,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = progress(tmp_path / "mesh")
    assert len(records) == 3
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    check_consistency(records, total)  # the same digest everywhere: identical decoded bytes
    assert len({plateau(r) for r in records.values()}) == 1  # the same model everywhere
    # the uncompressed reference: the same training in one process (what a mesh computes)
    single = references.run("--single", "--eval-every", "15")
    reference = [
        json.loads(line[len("FTMESH ") :])
        for line in single.out.splitlines()
        if line.startswith("FTMESH ")
    ]
    compressed, plain = plateau(records["w0"]), plateau(reference)
    assert compressed >= plain - 0.01, (compressed, plain)
