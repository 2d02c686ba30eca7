"""int8 error feedback across a failed step attempt: three real members in this process (SWIM
over loopback, the data-plane ring), ``compression="int8"``. One step's first attempt fails on
every member *after* its gradient allreduce completed (its check of the reduced header says so,
as a malformed header would); the retry must start from the residual the attempt started
with, so the training ends with bitwise the same weights as the same training without that
failure. Two models: one whose bucket takes the shared-scale path, one the one-shot ring. And
``Int8Compression.attempt``/``settle`` on their own."""

from __future__ import annotations

import dataclasses
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
from test_sync_mesh import common_view
from tests_support import local_mesh_config, on_member_threads

from ftmesh.compression.feedback import SHARED_SCALE_FROM, Int8Compression
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch import ElasticSampler, ElasticTrainer
from ftmesh.training.actions import Failed, Failure
from ftmesh.training.step import StepMachine

pytestmark = pytest.mark.timeout(180)

SAMPLES, BATCH, STEPS, FAIL_AT = 96, 24, 6, 2


def _model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4)
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 64, generator=g)
    return x, (x[:, :4] * 2).tanh()


def _train(ms: list[SyncMesh], hidden: int) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Each member trains STEPS steps with int8 gradients; returns each member's weights
    after each step (flat) and its number of attempts."""
    x, y = _data()
    weights: list[list[torch.Tensor]] = [[] for _ in ms]
    attempts: list[int] = [0] * len(ms)
    # (built here: torch's generator is one for the process, so models built in the members'
    # threads would draw their initial weights in whatever order the threads run)
    models = [_model(hidden) for _ in ms]

    def member(i: int) -> None:
        model = models[i]
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        trainer = ElasticTrainer(
            ms[i], model, opt, ElasticSampler(SAMPLES, BATCH), quorum="any",
            join_settle=0.0, compression="int8", min_peers=len(ms),
        )  # fmt: skip
        for step in trainer.steps(STEPS):
            with step:
                for idx in step.indices():
                    attempts[i] += 1
                    torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
                opt.step()
            weights[i].append(_flat(model))

    on_member_threads(len(ms), member)
    return weights, attempts


def _mesh_run(tmp_path: Path, name: str, hidden: int) -> tuple[list[list[torch.Tensor]], list[int]]:
    """``_train`` on three fresh members."""
    with ExitStack() as stack:
        ms = [
            stack.enter_context(SyncMesh.start(local_mesh_config(tmp_path, name))) for _ in range(3)
        ]
        common_view(ms, 3)
        return _train(ms, hidden)


@pytest.mark.parametrize("hidden", [4200, 600], ids=["shared-scale", "one-shot"])
def test_a_failed_attempt_leaves_no_trace_in_the_residual(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hidden: int
) -> None:
    params = sum(p.numel() for p in _model(hidden).parameters())
    assert (params > SHARED_SCALE_FROM) == (hidden == 4200)
    reference, attempts = _mesh_run(tmp_path, "plain", hidden)
    assert attempts == [STEPS] * 3  # no failure of its own
    _check_identical(reference)

    # The same training again, where step FAIL_AT's first attempt fails on every member after
    # the gradient allreduce and the gathered rows completed: each member's judge of the
    # reduced header says it is malformed (a Failure.HEADER is retried).
    real_check = StepMachine.check_step
    failed: list[int] = []
    lock = threading.Lock()

    def check_step(machine: StepMachine, action: Any, *args: Any, **kw: Any) -> Any:
        verdict = real_check(machine, action, *args, **kw)
        with lock:
            if action.index == FAIL_AT and id(machine) not in failed:
                failed.append(id(machine))
                return dataclasses.replace(
                    verdict, failed=Failed(Failure.HEADER, "injected after the allreduce")
                )
        return verdict

    monkeypatch.setattr(StepMachine, "check_step", check_step)
    weights, attempts = _mesh_run(tmp_path, "failing", hidden)
    assert len(failed) == 3, "the failure was not injected on every member"
    assert attempts == [STEPS + 1] * 3, attempts  # one retry each, at step FAIL_AT
    _check_identical(weights)
    before = zip(weights[0][:FAIL_AT], reference[0][:FAIL_AT], strict=True)
    assert all(torch.equal(a, b) for a, b in before)  # (the runs are deterministic)
    differ = [s for s in range(STEPS) if not torch.equal(weights[0][s], reference[0][s])]
    assert not differ, f"the failed attempt changed the weights after steps {differ}"


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _check_identical(weights: list[list[torch.Tensor]]) -> None:
    for step in range(STEPS):
        assert all(torch.equal(w[step], weights[0][step]) for w in weights), step


def test_attempt_puts_back_the_residual_without_allocating() -> None:
    """``Int8Compression.attempt``/``settle`` on their own: a completed collective inside an
    attempt advances the residual, the next attempt goes back to the one the step started
    with, a commit keeps the new one; two buffers in all, reused step after step."""
    comp = Int8Compression()
    n = 8

    def collective(value: float) -> None:  # what a completed allreduce does to the residual
        comp.begin()
        assert comp.residual(n) is not None
        new = comp.next_residual(n)
        assert new is not None
        new[:] = value
        comp.commit(new)

    def residual() -> list[float]:
        r = comp.residual(n)
        assert r is not None
        return r.tolist()

    comp.attempt()
    collective(1.0)
    comp.attempt()  # the attempt failed after its allreduce: back to zeros
    assert residual() == [0.0] * n
    collective(2.0)
    comp.settle()
    assert residual() == [2.0] * n
    buffers = set()
    for step in range(3, 7):
        comp.attempt()
        collective(-1.0)  # fails
        comp.attempt()
        assert residual() == [float(step - 1)] * n
        collective(float(step))
        comp.settle()
        assert residual() == [float(step)] * n
        buffers |= {id(comp.residual(n)), id(comp.next_residual(n))}
    assert len(buffers) == 2
    # An aborted collective (no commit) leaves the residual as it was; the retry's begin()
    # then drops the spare its run may still write.
    comp.attempt()
    comp.begin()
    spare = comp.next_residual(n)
    comp.attempt()
    assert residual() == [6.0] * n
    comp.begin()
    assert comp.next_residual(n) is not spare
    comp.reset()
    comp.attempt()
    assert residual() == [0.0] * n
