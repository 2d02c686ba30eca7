"""Issue #26 item 4: a checkpoint whose state holds a NaN or an infinity never replaces a
finite one (the NaN checkpoints verified, and three saves later pushed out the last good
one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ftmesh.state import CheckpointWriter, State, latest_valid_checkpoint
from ftmesh.state.checkpoint import non_finite_entries


def test_a_non_finite_state_is_never_checkpointed(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    state = State(model=model, arrays={"w": np.zeros(4, np.float32)}, rng=False)
    writer = CheckpointWriter(tmp_path, keep=2)
    assert writer.save(state.commit(1)) is not None
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    for step in (2, 3, 4):  # more than ``keep`` saves of a poisoned state
        snap = state.commit(step)
        assert non_finite_entries(snap) != []
        assert writer.save(snap) is None
    state.arrays["w"][1] = np.inf
    with torch.no_grad():
        model.weight[0, 0] = 0.0
    assert writer.save(state.commit(5)) is None  # (an array too)
    found = latest_valid_checkpoint(tmp_path)
    assert found is not None and found.snapshot.step == 1
    stats = writer.statistics()
    assert (stats.saved, stats.refused, stats.last_step) == (1, 4, 1)


def test_finite_states_are_written_as_before(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    state = State(model=model, rng=False)
    writer = CheckpointWriter(tmp_path, keep=2)
    assert non_finite_entries(state.commit(1)) == []
    assert writer.save(state.commit(1)) is not None
    assert writer.statistics().refused == 0
