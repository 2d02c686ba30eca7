"""Several models and optimizers on one trainer (issue #29): the recipe of ``docs/PORTING.md``,
"Several models and optimizers". A GAN-like pair (a generator and a discriminator) is the
trainer's model as one ``torch.nn.ModuleDict``; the generator's Adam is the trainer's
optimizer, the discriminator's SGD with momentum is registered (``trainer.register``), and so
is an EMA copy of the generator (``AveragedModel``, a module with no gradients). Every step
runs two backward passes per micro-batch (the discriminator's loss, then the generator's with
the discriminator frozen) and both optimizers step.

On the fake mesh of ``trainer_sim`` (threads, in process): three members and one that joins
mid-run hold one digest at every step, end at the single-process run of the same steps (to
float tolerance; a step whose gradients one member made NaN is skipped by both optimizers, as
the single-process run skips it), and the joiner holds the discriminator's optimizer state
and the EMA; so does a trainer that resumes from a checkpoint. A second optimizer the trainer
could not keep right is refused, and the gradient buckets refuse a second gradient that
arrives after its bucket left.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from trainer_sim import (
    DATA_X,
    FakeMesh,
    Hub,
    Member,
    all_ok,
    make_sampler,
    member_thread,
    trainer_of,
    wait_all,
)

from ftmesh.errors import LocalUsageError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch import ElasticTrainer, Step
from ftmesh.torch.buckets import GradBuckets

pytestmark = pytest.mark.timeout(60)

Z = torch.randn(len(DATA_X), 3, generator=torch.Generator().manual_seed(7))
"""The generator's input for each sample (fixed, so the mesh and the reference agree)."""

NAN_STEP = 7
"""The step whose gradients member b makes NaN: every member skips its updates."""

CLOSE = 1e-5
"""Mesh vs single-process: equal up to summation order."""


class Gan:
    """The models, the two optimizers and the EMA, the same initial state every time."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.models = torch.nn.ModuleDict(
            {
                "g": torch.nn.Linear(3, 6),
                "d": torch.nn.Sequential(
                    torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
                ),
            }
        )
        with torch.no_grad():
            for p in self.models.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.opt_g = torch.optim.Adam(self.models["g"].parameters(), lr=0.01)
        self.opt_d = torch.optim.SGD(self.models["d"].parameters(), lr=0.05, momentum=0.9)
        self.ema = AveragedModel(self.models["g"], multi_avg_fn=get_ema_multi_avg_fn(0.8))

    def backward(self, idx: np.ndarray, nan: bool = False) -> None:
        """Both losses of one (micro-)batch, each the mean over its samples: the
        discriminator's (on a detached fake), then the generator's with the discriminator
        frozen, so that each parameter gets one gradient."""
        i = torch.as_tensor(idx)
        g, d = self.models["g"], self.models["d"]
        real, fake = DATA_X[i], g(Z[i])
        ones, zeros = torch.ones(len(i), 1), torch.zeros(len(i), 1)
        d_loss = F.binary_cross_entropy_with_logits(d(real), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(d(fake.detach()), zeros)
        if nan:
            d_loss = d_loss * float("nan")
        d_loss.backward()  # type: ignore[no-untyped-call]
        d.requires_grad_(False)
        F.binary_cross_entropy_with_logits(d(fake), ones).backward()  # type: ignore[no-untyped-call]
        d.requires_grad_(True)

    def update(self) -> None:
        self.opt_d.step()
        self.opt_g.step()
        self.ema.update_parameters(self.models["g"])

    def state(self) -> dict[str, torch.Tensor]:
        """Everything compared: the models, both optimizers' state, the EMA."""
        out = {f"model.{k}": v.clone() for k, v in self.models.state_dict().items()}
        out |= {f"ema.{k}": v.clone().float() for k, v in self.ema.state_dict().items()}
        for name, opt in (("opt_g", self.opt_g), ("opt_d", self.opt_d)):
            for i, st in opt.state_dict()["state"].items():
                for k, v in st.items():
                    out[f"{name}.{i}.{k}"] = torch.as_tensor(v).clone().float()
        return out


def reference(total: int) -> dict[str, torch.Tensor]:
    """``total`` steps in one process on the whole global batches (step ``NAN_STEP``'s
    updates skipped, as on the mesh; the EMA still averages that step)."""
    gan = Gan()
    sampler = make_sampler()
    for s in range(total):
        gan.opt_d.zero_grad()
        gan.opt_g.zero_grad()
        gan.backward(sampler.global_indices(s))
        if s + 1 == NAN_STEP:
            gan.ema.update_parameters(gan.models["g"])
        else:
            gan.update()
    return gan.state()


def run_gan_member(
    hub: Hub,
    member: Member,
    gans: dict[str, Gan],
    digests: dict[str, dict[int, str]],
    *,
    total: int,
    joined: threading.Event,
    start_after: threading.Event | None = None,
) -> None:
    with member_thread(hub, member, start_after):
        gans[member.name] = gan = Gan()
        mine = digests.setdefault(member.name, {})
        t = ElasticTrainer(
            cast(SyncMesh, FakeMesh(hub, member.name)),
            gan.models,
            gan.opt_g,
            make_sampler(),
            quorum="any",
            join_settle=0.0,
            step_timeout=30.0,
            check_every=2,
            micro_batch=2,
            bucket_mb=24 / 2**20,  # several buckets: some leave during the backward passes
            state={"opt_d": gan.opt_d, "ema_g": gan.ema},
        )
        t.add_step_hook(lambda tr, report: mine.__setitem__(report.step, tr.digest()))
        member.trainer = t
        try:
            for step in t.steps(total):
                with step:
                    _body(gan, member.name, step)
                if step.number == 4:
                    joined.set()
            t.finish(timeout=20.0)
        finally:
            t.close()


def _body(gan: Gan, name: str, step: Step) -> None:
    for idx in step.indices():
        gan.backward(idx, nan=name == "b" and step.number == NAN_STEP)
    gan.update()


def test_a_gan_with_two_optimizers_and_an_ema_trains_as_one_process() -> None:
    hub = Hub(start_with=3)
    total = 12
    joined = threading.Event()
    gans: dict[str, Gan] = {}
    digests: dict[str, dict[int, str]] = {}
    members = {n: Member(n) for n in "abcj"}
    try:
        for n, m in members.items():
            kwargs: dict[str, Any] = {"total": total, "joined": joined}
            if n == "j":
                kwargs["start_after"] = joined
            th = threading.Thread(
                target=run_gan_member,
                args=(hub, m, gans, digests),
                kwargs=kwargs,
                daemon=True,
                name=n,
            )
            hub.threads.append(th)
            th.start()
        wait_all(hub, 50)
        all_ok(members, "abcj")
        # one state everywhere after every step, the joiner's steps included
        for s in range(1, total + 1):
            at_s = {digests[n][s] for n in "abcj" if s in digests[n]}
            assert len(at_s) == 1, (s, {n: digests[n].get(s) for n in "abcj"})
        assert set(digests["a"]) == set(range(1, total + 1))
        joined_at = min(digests["j"])
        assert 4 <= joined_at <= total, digests["j"]  # it fetched the state of step >= 4
        assert len({trainer_of(members[n]).digest() for n in "abcj"}) == 1
        # ... and it is the single-process run's
        ref = reference(total)
        for n in "abcj":
            got = gans[n].state()
            assert got.keys() == ref.keys(), (n, sorted(got.keys() ^ ref.keys()))
            worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
            assert worst < CLOSE, (n, worst)
        # the joiner got the discriminator's momentum and the EMA (bitwise)
        a, j = gans["a"], gans["j"]
        assert int(j.ema.n_averaged) == total
        params_a, params_j = (g.opt_d.param_groups[0]["params"] for g in (a, j))
        for p_a, p_j in zip(params_a, params_j, strict=True):
            buf_a = a.opt_d.state[p_a]["momentum_buffer"]
            assert torch.equal(buf_a, j.opt_d.state[p_j]["momentum_buffer"])
            assert buf_a.abs().sum() > 0
        ema_a, ema_j = a.ema.state_dict(), j.ema.state_dict()
        for (k, v_a), v_j in zip(ema_a.items(), ema_j.values(), strict=True):
            assert torch.equal(v_a, v_j), k
        assert all(trainer_of(members[n]).statistics().committed_step == total for n in "abc")
    finally:
        hub.shutdown()


def test_a_second_optimizer_the_trainer_cannot_keep_is_refused() -> None:
    hub = Hub()
    try:
        gan = Gan()
        mesh = cast(SyncMesh, FakeMesh(hub, "a"))
        t = ElasticTrainer(mesh, gan.models, gan.opt_g, make_sampler(), join_settle=0.0)
        with pytest.raises(LocalUsageError, match="'optimizer': it updates a parameter"):
            ElasticTrainer(  # the trainer's optimizer over both models, the model only g's
                cast(SyncMesh, FakeMesh(hub, "c")),
                gan.models["g"],
                torch.optim.SGD(gan.models.parameters(), lr=0.1),
                make_sampler(),
            )
        outside = torch.nn.Linear(2, 2)
        with pytest.raises(LocalUsageError, match="not in the trainer's model"):
            t.register("opt_x", torch.optim.SGD(outside.parameters(), lr=0.1))
        with pytest.raises(LocalUsageError, match="registered already"):
            t.register("opt_g", gan.opt_g)
        t.register("opt_d", gan.opt_d)
        with pytest.raises(LocalUsageError, match="outside a trainer step"):
            gan.opt_d.step()
        step = next(t.steps(1))
        with pytest.raises(LocalUsageError, match="before the step's gradients"), step:
            gan.opt_d.step()
        t.close()
        other = Gan()
        sharded = ElasticTrainer(
            cast(SyncMesh, FakeMesh(hub, "b")),
            other.models,
            other.opt_g,
            make_sampler(),
            join_settle=0.0,
            shard_optimizer=True,
        )
        with pytest.raises(LocalUsageError, match="shard_optimizer=True"):
            sharded.register("opt_d", other.opt_d)
        sharded.close()
    finally:
        hub.shutdown()


def _done(buf: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(None)
    return fut


def test_two_backward_passes_count_each_gradient_once() -> None:
    """Several backward passes through the same parameters in the last micro-batch: a bucket
    leaves once each of its parameters counted, not when one counted twice; a gradient for a
    bucket already sent is refused (it would be lost, or sent half-added)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(1, 1))
    bias, weight = model[1].bias, model[1].weight
    buckets = GradBuckets(list(model.parameters()), bucket_bytes=8, header_slots=2)
    try:
        assert [len(g) for g in buckets.groups] == [2, 1]  # {bias, weight}, then the first layer
        buckets.start(_done, lambda buf: None)
        buckets.micro_batch(1.0, last=True)
        bias.sum().backward()  # type: ignore[no-untyped-call]
        (bias * 2).sum().backward()  # type: ignore[no-untyped-call]
        assert buckets._launched == 0  # the weight's gradient has not come yet
        (weight * 1).sum().backward()  # type: ignore[no-untyped-call]
        assert buckets._launched == 1
        assert float(buckets.buffers[0][0]) == 3.0  # bias: both passes, sent once
        with pytest.raises(LocalUsageError, match="second gradient"):
            bias.sum().backward()  # type: ignore[no-untyped-call]
    finally:
        buckets.close()


def test_a_checkpoint_resume_restores_the_second_optimizer_and_the_ema(tmp_path: Path) -> None:
    """A fresh trainer that resumes from a checkpoint holds the discriminator's optimizer state
    and the EMA of the run that wrote it."""
    hub = Hub()
    try:
        gan = Gan()
        settings: dict[str, Any] = {
            "join_settle": 0.0,
            "checkpoint_dir": tmp_path,
            "checkpoint_every": 2,
        }
        t = ElasticTrainer(
            cast(SyncMesh, FakeMesh(hub, "a")),
            gan.models,
            gan.opt_g,
            make_sampler(),
            state={"opt_d": gan.opt_d, "ema_g": gan.ema},
            **settings,
        )
        for step in t.steps(4):
            with step:
                _body(gan, "a", step)
        t.close()
        fresh = Gan()
        resumed = ElasticTrainer(
            cast(SyncMesh, FakeMesh(hub, "r")),
            fresh.models,
            fresh.opt_g,
            make_sampler(),
            state={"opt_d": fresh.opt_d, "ema_g": fresh.ema},
            **settings,
        )
        assert resumed.resume() == 4
        assert resumed.digest() == t.digest()
        got, want = fresh.state(), gan.state()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert int(fresh.ema.n_averaged) == 4 and any(k.startswith("opt_d.") for k in got)
        resumed.close()
    finally:
        hub.shutdown()
