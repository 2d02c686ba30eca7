"""DiLoCo rounds whose outer gradient travels as int8 (``sync=DiLoCo(...)``,
``compression="int8"``): three real members in this process (SWIM over loopback, the
data-plane ring, the int8 codec with error feedback). Every member holds the same registered
state after every round (global parameters and outer momentum, bit for bit), and the run
ends as close to the data as the same rounds with float32 outer gradients."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
from test_compression_trainer_shared import SAMPLES, _data, _loss
from test_sync_mesh import common_view
from tests_support import local_mesh_config, on_member_threads

from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch import ElasticSampler, ElasticTrainer
from ftmesh.training.config import DiLoCo

pytestmark = pytest.mark.timeout(180)

ROUND_BATCH, ROUNDS = 24, 8
SETTINGS = DiLoCo(inner_steps=4, outer_lr=0.7, outer_momentum=0.9, nesterov=True)


def _model() -> torch.nn.Module:
    """Smaller than the shared-scale test's (its data, its loss): one bucket, per-block scales."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))


def _train(ms: list[SyncMesh], compression: str | None) -> tuple[list[list[str]], float]:
    """ROUNDS DiLoCo rounds on every member; each member's part digests after each round, and
    the loss of member 0's final model on all the data."""
    x, y = _data()
    digests: list[list[str]] = [[] for _ in ms]
    losses: list[float] = []
    models = [_model() for _ in ms]  # (built here: torch's generator is one per process)

    def member(i: int) -> None:
        model = models[i]
        trainer = ElasticTrainer(
            ms[i], model, torch.optim.AdamW(model.parameters(), lr=3e-3),
            ElasticSampler(SAMPLES, ROUND_BATCH), quorum="any", join_settle=0.0,
            compression=compression, min_peers=len(ms), sync=SETTINGS,
        )  # fmt: skip

        def loss_fn(idx: np.ndarray) -> torch.Tensor:
            i_ = torch.as_tensor(idx)
            return torch.nn.functional.mse_loss(model(x[i_]), y[i_])

        while trainer.committed < ROUNDS:
            trainer.step(loss_fn)
            digests[i].append(str(sorted(trainer.part_digests().items())))
        trainer.finish(timeout=20.0)
        if i == 0:
            losses.append(_loss(model))

    on_member_threads(len(ms), member)
    return digests, losses[0]


def _members(stack: ExitStack, tmp_path: Path, name: str) -> list[SyncMesh]:
    ms = [stack.enter_context(SyncMesh.start(local_mesh_config(tmp_path, name))) for _ in range(3)]
    common_view(ms, 3)
    return ms


def test_int8_outer_gradients_stay_identical_and_train_like_float32(tmp_path: Path) -> None:
    with ExitStack() as stack:
        digests, compressed = _train(_members(stack, tmp_path, "int8"), "int8")
    for r in range(ROUNDS):
        assert len({d[r] for d in digests}) == 1, f"members differ after round {r + 1}"
    with ExitStack() as stack:
        exact, plain = _train(_members(stack, tmp_path, "f32"), None)
    assert exact[0][-1] != digests[0][-1]  # the outer gradients did travel as int8
    start = _loss(_model())
    print(f"loss: start {start:.5f}, float32 outer {plain:.5f}, int8 outer {compressed:.5f}")
    assert plain < 0.7 * start  # the rounds train
    assert abs(compressed - plain) <= 0.05 * (start - plain), (start, plain, compressed)
