"""End to end: the training page's (docs/guide/training.md) ``ftmesh launch -n 3
examples/train_digits.py --shares speed --epochs 2 --step-delay 0`` trains with
speed-proportional shares: every step covers its whole global batch (the members' shares add
up to it), states are bitwise identical at every reported step, and every member reports the
same steps. (The throttled case, where one
member's share falls and rises back, is ``test_training_shares``, on the fake mesh.)"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from tests_support import EXAMPLE, check_consistency, launch, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_digits_with_speed_shares(tmp_path: Path) -> None:
    res = launch(
        tmp_path / "mesh",
        *("-n", "3", EXAMPLE, "--shares", "speed", "--epochs", "2", "--step-delay", "0"),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = progress(tmp_path / "mesh")
    assert len(records) == 3
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    check_consistency(records, total)
    shares: dict[int, list[int]] = defaultdict(list)
    for recs in records.values():
        for r in recs:
            if "done" not in r:
                shares[int(r["step"])].append(int(r["share"]))  # type: ignore[call-overload]
    full = [s for s, got in shares.items() if len(got) == 3]
    bad = {  # (the whole records of a step whose shares do not add up, to tell why)
        s: [r for recs in records.values() for r in recs if r.get("step") == s]
        for s in full
        if sum(shares[s]) != 32
    }
    assert full and not bad, bad
    print("smallest share by step:", [min(shares[s]) for s in sorted(full)])
