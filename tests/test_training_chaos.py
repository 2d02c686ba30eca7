"""Fault-tolerant training under repeated SIGKILLs with rejoins (issue 4's acceptance run):
kills in a row at random moments of a step (mid-allreduce, mid-sync, mid-state-transfer
happen among them), each followed by a new worker joining; after every committed step all
live members hold bitwise-identical state, no step is skipped or repeated, and the result
trains as well as a single process.

The default run is 5 kills 15 steps apart on 4 workers, 10 epochs at full speed
(``--step-delay 0``): ``--min-peers 3`` (one fewer than started) makes the survivors of a
kill wait for the previous kill's joiner when it has not arrived yet, so every joiner lands
mid-run however slowly it starts, without a fixed floor. ``FTMESH_TWENTY_KILLS=1`` (or
``FTMESH_NIGHTLY=1``) runs issue 4's full acceptance run instead: 20 kills 40 steps apart,
on 4 and on 5 workers, at 0.1 s a step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests_support import (
    EXAMPLE,
    NIGHTLY,
    References,
    accuracy,
    check_consistency,
    launch,
    progress,
)

FULL = NIGHTLY or os.environ.get("FTMESH_TWENTY_KILLS") == "1"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800 if FULL else 300)]

KILLS = 20 if FULL else 5
SPACING = 40 if FULL else 15  # committed steps between kills
PACING = ["--step-delay", "0.1"] if FULL else ["--step-delay", "0"]


@pytest.mark.parametrize("n", [4, 5] if FULL else [4])
def test_twenty_kills_with_rejoins(tmp_path: Path, n: int) -> None:
    logs = tmp_path / "mesh"
    chaos: list[str] = []
    for k in range(KILLS):
        step = 15 + k * SPACING
        chaos += ["--kill-at", str(step), "--join-at", str(step + 1)]
    # (10 epochs at least: the accuracy asserted below is the default 10-epoch run's)
    epochs = max((15 + KILLS * SPACING) // 44 + 2, 10)
    gate = [] if FULL else ["--min-peers", str(n - 1)]
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
        *PACING,
        *gate,
        "--digest-every",
        "1",
        timeout=1700 if FULL else 280,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("kill -9") == KILLS, res.stdout[-3000:]
    records = progress(logs)
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    check_consistency(records, total)
    finals = {str(r[-1]["digest"]) for r in records.values() if r and r[-1].get("done")}
    assert len(finals) == 1
    assert accuracy(res.stdout) >= 0.95


REPLAY_EPOCHS = 2
"""The replay tests' length: 88 steps, the kills and joins at 20-50. Summation order alone
keeps the mesh within ~1e-7 of the replay for most of a run, but the example's training is
chaotic: now and then that noise decides a ReLU or max-pool near-tie the other way (a jump of
~5e-5 at one step, seen at step 99 of a 176-step run), and the dynamics then grow any
difference about tenfold every 5-10 steps (1e-6 of noise on every weight at step 20 -> 1e-2
at step 88, 1e-1 at 176, measured in one process). The shorter the run, the rarer such a
jump within it; a lost sample at step 45 still moves the weights by ~5e-2 by step 88."""


def test_final_model_matches_a_replay_of_the_committed_steps(
    tmp_path: Path, references: References
) -> None:
    """The committed steps, replayed in one process (``--single`` trains the same global
    batches in the same order), give the mesh's final model up to float32 summation order:
    a step applied twice, skipped, or with a sample lost or doubled moves weights by ~1e-3 and
    more, far above the bound. The run is kept short (``REPLAY_EPOCHS``)."""
    import torch

    tmp = tmp_path
    # Joiners take seconds to start on a loaded host: --min-peers 3 holds the survivors of
    # the second kill until the first joiner is in, so both land mid-run at full speed.
    chaos = ["--kill-at", "20", "--join-at", "21", "--kill-at", "45", "--join-at", "46"]
    args = ["--epochs", str(REPLAY_EPOCHS), "--step-delay", "0", "--min-peers", "3"]
    args += ["--digest-every", "1"]
    res = launch(
        tmp / "mesh",
        "-n",
        "4",
        "--seed",
        "5",
        *chaos,
        EXAMPLE,
        *args,
        "--save-model",
        str(tmp / "mesh.pt"),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("kill -9") == 2, res.stdout[-3000:]
    records = progress(tmp / "mesh")
    check_consistency(records, int(records["w0"][0]["total"]))  # type: ignore[call-overload]
    replayed = references.run("--single", *args[:2], save_model=True).model
    assert replayed is not None
    mesh, replay = torch.load(tmp / "mesh.pt"), torch.load(replayed)
    assert mesh.keys() == replay.keys()
    worst = max(float((mesh[k] - replay[k]).abs().max()) for k in mesh)
    assert worst < 1e-4, f"final model differs from the replay by {worst}"
