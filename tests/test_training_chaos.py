"""Fault-tolerant training under repeated SIGKILLs with rejoins (issue 4's acceptance run):
20 kills in a row at random moments of a step (mid-allreduce, mid-sync, mid-state-transfer
happen among them), each followed by a new worker joining; after every committed step all
live members hold bitwise-identical state, no step is skipped or repeated, and the result
trains as well as a single process."""

from __future__ import annotations

import pytest
from tests_support import EXAMPLE, accuracy, check_consistency, launch, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KILLS = 20
SPACING = 40  # committed steps between kills


@pytest.mark.parametrize("n", [4, 5])
def test_twenty_kills_with_rejoins(tmp_path: object, n: int) -> None:
    from pathlib import Path

    logs = Path(str(tmp_path)) / "mesh"
    chaos: list[str] = []
    for k in range(KILLS):
        step = 15 + k * SPACING
        chaos += ["--kill-at", str(step), "--join-at", str(step + 1)]
    epochs = (15 + KILLS * SPACING) // 44 + 2
    res = launch(
        logs,
        "-n",
        str(n),
        "--seed",
        str(n),
        *chaos,
        EXAMPLE,
        "--epochs",
        str(epochs),
        "--step-delay",
        "0.1",
        "--digest-every",
        "1",
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("kill -9") == KILLS, res.stdout[-3000:]
    records = progress(logs)
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    check_consistency(records, total)
    finals = {str(r[-1]["digest"]) for r in records.values() if r and r[-1].get("done")}
    assert len(finals) == 1
    assert accuracy(res.stdout) >= 0.95
