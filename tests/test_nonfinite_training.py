"""End to end (issue 26): one ``ftmesh launch`` worker of ``examples/train_digits.py`` computes
NaN gradients for three steps (``FTMESH_TEST_NAN_GRADS`` in ``tests/hooks/sitecustomize.py``:
a tensor hook, as a diverging loss would). Every member skips those steps' updates alike (one
digest per step everywhere), names the worker in a WARNING, trains on, and ends within 0.02
of the single-process accuracy (the plateau of ``tests_support.plateau``); with int8
compression too (the NaN member sends zeros, so nobody's error-feedback residual turns NaN).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from tests_support import (
    EXAMPLE,
    ROOT,
    References,
    check_consistency,
    launch,
    plateau,
    progress,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FIRST, COUNT = 20, 3
"""The NaN steps: 20, 21 and 22 (of 135)."""


@pytest.mark.parametrize("compression", [None, "int8"])
def test_nan_steps_from_one_worker_are_skipped_and_the_run_ends_at_the_clean_accuracy(
    tmp_path: Path, references: References, compression: str | None
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "tests" / "hooks"), os.environ.get("PYTHONPATH", "")]
        ),
        "FTMESH_TEST_NAN_GRADS": f"w2:{FIRST}:{COUNT}",
    }
    extra = ("--compression", compression) if compression else ()
    args = ("-n", "3", EXAMPLE, "--eval-every", "15", "--step-delay", "0", *extra)
    res = launch(tmp_path / "mesh", *args, timeout=280, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = progress(tmp_path / "mesh")
    assert len(records) == 3
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    check_consistency(records, total)  # skipped alike: one state everywhere at every step
    # Each member named w2's node, in one WARNING per NaN step, and for no other step.
    w2 = str(records["w2"][0]["node"])
    for name in ("w0", "w1", "w2"):
        text = (tmp_path / "mesh" / f"{name}.log").read_text()
        found = re.findall(r"step (\d+): non-finite gradients from (\S+): every member", text)
        assert found == [(str(s), w2) for s in range(FIRST, FIRST + COUNT)], (name, found)
    finals = {plateau(r) for r in records.values()}
    assert len(finals) == 1, finals  # the same model everywhere
    single = references.run("--single", "--eval-every", "15")
    reference = [
        json.loads(line[len("FTMESH ") :])
        for line in single.out.splitlines()
        if line.startswith("FTMESH ")
    ]
    got, clean = finals.pop(), plateau(reference)
    print(f"compression={compression}: plateau {got:.4f} vs single-process {clean:.4f}")
    assert abs(got - clean) <= 0.02, (got, clean)
