"""The trainer's int8 gradient buckets on the shared-scale path: three real members in this
process (SWIM over loopback, the data-plane ring), a model whose bucket holds more than
``Int8Compression.shared_scale_from`` values, ``compression="int8"`` as a user writes it.
Every member ends every step with bitwise-identical weights, and the compressed run ends as
close to the data as the same training uncompressed (one member alone: the same global
batches, as the mesh computes them)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from test_sync_mesh import common_view
from tests_support import local_mesh_config, on_member_threads

from ftmesh.collective.shared_scale import SharedScaleRun
from ftmesh.compression.feedback import SHARED_SCALE_FROM
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch import ElasticSampler, ElasticTrainer

pytestmark = pytest.mark.timeout(180)

SAMPLES, BATCH, STEPS = 96, 24, 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 4200), torch.nn.Tanh(), torch.nn.Linear(4200, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 64, generator=g)
    return x, (x[:, :4] * 2).tanh()


def _loss(model: torch.nn.Module) -> float:
    x, y = _data()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def _train(ms: list[SyncMesh], compression: str | None) -> tuple[list[list[str]], float]:
    """Each member trains STEPS steps; returns each member's digests (one per step) and the
    loss of member 0's final model on all the data."""
    x, y = _data()
    digests: list[list[str]] = [[] for _ in ms]
    losses: list[float] = []
    # Built here, one after the other: torch's generator is one for the whole process, so
    # models built in the members' threads would draw their initial weights interleaved in
    # whatever order the threads run (under load, each member a different model, and the
    # mesh trains the one of whoever serves the first state).
    models = [_model() for _ in ms]

    def member(i: int) -> None:
        model = models[i]
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        trainer = ElasticTrainer(
            ms[i], model, opt, ElasticSampler(SAMPLES, BATCH), quorum="any",
            join_settle=0.0, compression=compression, min_peers=len(ms),
        )  # fmt: skip
        for step in trainer.steps(STEPS):
            with step:
                for idx in step.indices():
                    torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
                opt.step()
            digests[i].append(trainer.digest())
        if i == 0:
            losses.append(_loss(model))

    on_member_threads(len(ms), member)
    return digests, losses[0]


def test_int8_buckets_on_the_shared_scale_path_stay_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = sum(p.numel() for p in _model().parameters())
    assert params > SHARED_SCALE_FROM  # one bucket (25 MiB) far above the threshold
    finished: list[int] = []  # a spy: the shared-scale path really ran, once per step
    real_finish = SharedScaleRun.finish

    def finish(run: SharedScaleRun) -> None:
        finished.append(run.quantized)
        real_finish(run)

    monkeypatch.setattr(SharedScaleRun, "finish", finish)
    with ExitStack() as stack:
        ms = [
            stack.enter_context(SyncMesh.start(local_mesh_config(tmp_path, "shared")))
            for _ in range(3)
        ]
        common_view(ms, 3)
        digests, compressed = _train(ms, "int8")
        for step in range(STEPS):
            assert len({d[step] for d in digests}) == 1, f"members differ at step {step}"
    assert len(finished) == 3 * STEPS and min(finished) >= SHARED_SCALE_FROM
    with SyncMesh.start(local_mesh_config(tmp_path, "alone")) as alone:
        _, plain = _train([alone], None)
    start = _loss(_model())
    assert plain < 0.8 * start  # the training does something
    print(f"loss: start {start:.4f}, uncompressed {plain:.4f}, int8 {compressed:.4f}")
    assert abs(compressed - plain) <= 0.05 * (start - plain), (start, plain, compressed)
