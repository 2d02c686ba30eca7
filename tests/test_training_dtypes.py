"""Parameters of every common dtype, and mixed precision, through the trainer (issue 13):
the buckets hold gradients in the parameters' dtype and reduce them in float32 (bitwise the
same on every member); bfloat16 and float16 models, float32 under ``autocast`` (bfloat16, and
float16 with a registered ``GradScaler``) and gradient clipping each train on 3 members with a
kill, with one state digest per step on every member. CUDA parameters take the same staged
path with device copies (through pinned host memory): the ``cuda`` variants run where a GPU
is, and are skipped, saying so, where none is."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from trainer_sim import (
    DATA_X,
    DATA_Y,
    FakeMesh,
    Hub,
    Member,
    all_ok,
    make_model,
    start_loop,
    trainer_of,
    wait_all,
)

from ftmesh.errors import LocalUsageError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch import ElasticSampler, ElasticTrainer, Step
from ftmesh.torch.buckets import GradBuckets

pytestmark = pytest.mark.timeout(60)


def test_mixed_dtype_buckets_reduce_in_float32_and_cast_back() -> None:
    """A model with bfloat16, float16 and float32 parameters: one bucket per dtype run, each
    ``.grad`` keeps its parameter's dtype, and the reduced gradient is the float32 sum cast
    back (here a "2-member" allreduce of identical inputs: doubling)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8).to(torch.bfloat16),
        torch.nn.Linear(8, 8).to(torch.float16),
        torch.nn.Linear(8, 3),
    )
    x = torch.randn(5, 6, dtype=torch.bfloat16)

    def forward() -> torch.Tensor:
        h = model[0](x).to(torch.float16)
        h = model[1](h).float()
        return model[2](h).square().mean()

    forward().backward()  # type: ignore[no-untyped-call]
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    params = list(model.parameters())
    buckets = GradBuckets(params, bucket_bytes=1 << 20, header_slots=3)
    assert [bk.dtype for bk in buckets.buckets] == [torch.float32, torch.float16, torch.bfloat16]
    assert [bk.staged for bk in buckets.buckets] == [False, True, True]
    assert {b.dtype for b in buckets.buffers} == {np.dtype(np.float32)}

    def run(buf: np.ndarray) -> None:
        buf *= 2

    def launch(buf: np.ndarray) -> Future[Any]:
        run(buf)
        fut: Future[Any] = Future()
        fut.set_result(None)
        return fut

    buckets.start(launch, run)
    buckets.micro_batch(0.5, last=True)
    forward().backward()  # type: ignore[no-untyped-call]
    buckets.finish(timeout=5)
    for p, g in zip(params, want, strict=True):
        assert p.grad is not None and p.grad.dtype == p.dtype
        assert torch.equal(p.grad, (g.float() * 0.5 * 2).to(p.dtype)), p.dtype
    buckets.close()


class _Variant:
    """How a model trains: its parameters' dtype, an autocast dtype, a GradScaler, a clip."""

    def __init__(
        self,
        params: torch.dtype = torch.float32,
        autocast: torch.dtype | None = None,
        scaler: bool = False,
        clip: float = 0.0,
        device: str = "cpu",
    ) -> None:
        self.params, self.autocast, self.scaler, self.clip = params, autocast, scaler, clip
        self.device = device

    def setup(self, t: ElasticTrainer) -> None:
        t.model.to(self.device, self.params)
        if self.scaler:
            t.register("scaler", torch.amp.GradScaler(self.device, init_scale=2.0**10))

    def body(self, t: ElasticTrainer, step: Step) -> None:
        scaler = t._state.state.objects["scaler"].obj if self.scaler else None
        cast_to = torch.autocast(self.device, dtype=self.autocast) if self.autocast else None
        for idx in step.indices():
            i = torch.as_tensor(idx)
            x, y = DATA_X[i].to(self.device, self.params), DATA_Y[i].to(self.device)
            with cast_to if cast_to is not None else contextlib.nullcontext():
                loss = F.cross_entropy(t.model(x).float(), y)
            step.record_loss(loss)
            (scaler.scale(loss) if scaler else loss).backward()  # type: ignore[no-untyped-call]
        if scaler is not None:
            scaler.unscale_(t.optimizer)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(t.model.parameters(), self.clip)
        if scaler is not None:
            scaler.step(t.optimizer)
            scaler.update()
        else:
            t.optimizer.step()


VARIANTS = {
    "bfloat16": _Variant(params=torch.bfloat16),
    "float16": _Variant(params=torch.float16),
    "autocast-bfloat16": _Variant(autocast=torch.bfloat16),
    "autocast-float16-scaler": _Variant(autocast=torch.float16, scaler=True),
    "clip": _Variant(clip=0.05),
    "cuda": _Variant(device="cuda"),
    "cuda-bfloat16": _Variant(params=torch.bfloat16, device="cuda"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_precision_trains_through_a_kill_with_one_digest_per_step(name: str) -> None:
    variant = VARIANTS[name]
    if variant.device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the staged CUDA path of the gradient buckets)")
    hub = Hub(start_with=3)
    total = 16
    digests: dict[int, set[str]] = defaultdict(set)
    losses: dict[str, list[float]] = defaultdict(list)
    lock = threading.Lock()

    def after(m: Member, t: ElasticTrainer, step: Step) -> None:
        if step.report is not None:  # (this attempt committed: not a failed one)
            with lock:
                digests[step.number].add(t.digest())
                losses[m.name].append(step.report.loss)
        if step.number == 5 and m.name == "c":
            hub.kill("c")

    data: Callable[[], ElasticSampler] = lambda: ElasticSampler(len(DATA_X), 16, seed=2)  # noqa: E731
    try:
        members = start_loop(
            hub,
            "abc",
            total=total,
            body=variant.body,
            setup=variant.setup,
            data=data,
            after_step=after,
            check_every=4,
        )
        wait_all(hub, 45)
        all_ok(members, "ab")
        assert {trainer_of(members[n]).committed for n in "ab"} == {total}
        split = {s: d for s, d in digests.items() if len(d) > 1}
        assert not split, f"members disagree at steps {sorted(split)}"
        assert len(digests) >= total - 2  # (a step a member adopted is not recorded)
        for p in trainer_of(members["a"]).model.parameters():
            assert p.dtype == variant.params and bool(torch.isfinite(p).all())
        a = losses["a"]
        assert all(np.isfinite(a)) and np.mean(a[-4:]) < np.mean(a[:4]), a  # it learns
    finally:
        hub.shutdown()


def test_sharded_mode_refuses_low_precision_parameters_by_name() -> None:
    hub = Hub()
    model = make_model().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(LocalUsageError, match=r"parameter '0\.weight' \(torch\.bfloat16 on cpu\)"):
        ElasticTrainer(
            cast(SyncMesh, FakeMesh(hub, "a")),
            model,
            opt,
            ElasticSampler(len(DATA_X), 8),
            shard_optimizer=True,
        )
    hub.shutdown()
