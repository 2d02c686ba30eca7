"""``ftmesh.torch.keep``: a step's local contribution kept as it goes out and sent again,
rescaled, in a kept attempt; a member without a whole copy sends zeros. And
``recovery="keep"`` in three trainers on the in-process fake mesh (``trainer_sim``): the
committed weights are those of single-process SGD on the samples actually trained."""

from __future__ import annotations

import threading
import weakref
from typing import cast

import numpy as np
import torch
from trainer_sim import (
    DATA_X,
    DATA_Y,
    GLOBAL_BATCH,
    FakeMesh,
    Hub,
    Member,
    loss_fn_for,
    make_model,
    make_optimizer,
    make_sampler,
    member_thread,
    wait_all,
)

from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch import ElasticTrainer
from ftmesh.torch.keep import Kept, KeptContribution


def test_a_whole_copy_is_sent_again_rescaled_even_after_the_wire_was_reduced() -> None:
    kept = KeptContribution()
    host = np.arange(6, dtype=np.float32)
    dev = torch.arange(4, dtype=torch.float32)
    kept.start(3, np.array([5, 7, 9]), buckets=2)
    kept.keep(1, host, nonfinite=False)
    assert not kept.kept_for(3)  # one bucket of two
    kept.keep(2, dev, nonfinite=False)
    assert kept.kept_for(3) and not kept.kept_for(4)
    host += 100.0  # the allreduce reduces in place: the copy must not follow
    dev += 100.0
    kept.contribute(3, 1, host, 2.0)
    kept.contribute(3, 2, dev, 0.5)
    assert host.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert dev.tolist() == [0.0, 0.5, 1.0, 1.5]
    assert kept.indices.tolist() == [5, 7, 9]


def test_without_a_whole_copy_zeros_go_out_and_a_new_attempt_starts_over() -> None:
    kept = KeptContribution()
    grads = np.ones(3, dtype=np.float32)
    kept.start(0, np.arange(3), buckets=2)
    kept.keep(1, grads, nonfinite=True)
    kept.contribute(0, 1, grads, 1.0)  # bucket 2 never went out: nothing is whole
    assert grads.tolist() == [0.0, 0.0, 0.0]
    kept.start(0, np.arange(3), buckets=1)  # the next computed attempt
    assert not kept.kept_for(0) and not kept.nonfinite
    kept.keep(1, np.full(3, 4.0, dtype=np.float32), nonfinite=False)
    assert kept.kept_for(0)
    kept.clear()  # committed
    assert not kept.kept_for(0)


def test_a_kept_round_sends_its_parts_as_they_are_and_lets_them_go_when_it_ends() -> None:
    # DiLoCo's use (``Rounds``): the parts are the Δ tensors themselves, put by reference,
    # sent with factor 1 (a plain copy, whatever their dtype), zeros for a parameter outside
    # the kept parts (streaming: outside the step's fragment) and for another round.
    kept = Kept()
    delta = torch.tensor([1.5, -2.0], dtype=torch.float64)
    kept.expect(7, parts=1)
    assert not kept.kept_for(7)
    kept.put(0, delta)
    kept.loss_sum, kept.samples = 6.0, 3
    assert kept.kept_for(7) and not kept.kept_for(6)
    grad, other = torch.full((2,), 9.0), torch.full((3,), 9.0)
    kept.contribute(7, 0, grad)
    kept.contribute(7, 1, other)  # no part 1: zeros
    assert grad.tolist() == [1.5, -2.0] and other.tolist() == [0.0, 0.0, 0.0]
    kept.contribute(8, 0, grad)  # another round: nothing kept for it
    assert grad.tolist() == [0.0, 0.0]
    ref = weakref.ref(delta)
    del delta
    assert ref() is not None  # held while the round is kept
    kept.clear()
    assert ref() is None and not kept.kept_for(7)  # the outer step let it go
    kept.expect(8, parts=1)  # a new round starts from nothing kept
    assert kept.loss_sum == 0.0 and kept.samples == 0 and not kept.kept_for(8)


def test_the_trainer_copies_outlive_clear_and_are_reused() -> None:
    kept = KeptContribution()
    grads = np.ones(4, dtype=np.float32)
    kept.start(0, np.arange(2), buckets=1)
    kept.keep(1, grads, nonfinite=False)
    first = kept._copies[1]
    kept.clear()
    kept.start(1, np.arange(2), buckets=1)
    kept.keep(1, grads * 3.0, nonfinite=False)
    assert kept._copies[1] is first  # the same array, rewritten
    out = np.zeros(4, dtype=np.float32)
    kept.contribute(1, 1, out)
    assert out.tolist() == [3.0] * 4 and kept.samples == 2


# -- three trainers on the in-process fake mesh (``trainer_sim``) -----------------------------

DIES = 2
"""The 0-based step in which ``c`` dies, once ``a`` and ``b`` computed their shares."""


def _member(hub: Hub, member: Member, total: int, computed: dict[str, threading.Event]) -> None:
    with member_thread(hub, member, None):
        mesh = FakeMesh(hub, member.name)
        model = make_model()
        t = ElasticTrainer(
            cast(SyncMesh, mesh), model, make_optimizer("sgd", model), make_sampler(),
            quorum="any", join_settle=0.0, step_timeout=30.0, recovery="keep",
        )  # fmt: skip
        member.trainer = t
        loss = loss_fn_for(model)

        def loss_fn(idx: np.ndarray) -> torch.Tensor:
            if t.committed == DIES and member.name in computed:
                computed[member.name].set()
            elif t.committed == DIES:  # c: dies once the others' micro-batches ran
                assert all(e.wait(10.0) for e in computed.values())
                hub.kill(member.name)
            return loss(idx)

        while t.committed < total:
            member.reports.append(t.step(loss_fn))
        t.finish(timeout=20.0)


def test_survivors_commit_the_mean_over_their_kept_shares() -> None:
    """c dies in step 3 after a and b computed their shares of it: they commit it with the
    gradients they had (their shares not computed again), the mean over their samples, and
    c's share skipped; the weights are single-process SGD's with that step's batch cut to
    a's and b's shares."""
    total = 5
    hub = Hub(start_with=3)
    try:
        members = {n: Member(n) for n in "abc"}
        computed = {n: threading.Event() for n in "ab"}
        for m in members.values():
            th = threading.Thread(
                target=_member, args=(hub, m, total, computed), name=m.name, daemon=True
            )
            hub.threads.append(th)
            th.start()
        wait_all(hub, 45)
    finally:
        hub.shutdown()
    assert members["c"].status == "killed"
    sampler = make_sampler()
    kept = {m: sampler.indices(DIES, ["a", "b", "c"], m) for m in "abc"}
    for n in "ab":
        m = members[n]
        assert m.status == "ok", f"{n}: {m.status} {m.error!r}"
        r = m.reports[DIES]
        assert (r.step, r.attempts, r.share) == (DIES + 1, 2, len(kept[n]))
        assert r.skipped == len(kept["c"]) > 0 and r.samples == GLOBAL_BATCH
        assert all(x.skipped == 0 for x in m.reports if x is not r)
        assert cast(ElasticTrainer, m.trainer).statistics().samples_skipped_total == r.skipped
    a, b = (cast(ElasticTrainer, members[n].trainer) for n in "ab")
    assert a.digest() == b.digest()
    model = make_model()
    opt = make_optimizer("sgd", model)
    for step in range(total):
        idx = sampler.global_indices(step)
        if step == DIES:
            idx = np.concatenate([kept["a"], kept["b"]])
        i = torch.as_tensor(idx)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(DATA_X[i]), DATA_Y[i]).backward()  # type: ignore[no-untyped-call]
        opt.step()
    ref = model.state_dict()
    worst = max(float((a.model.state_dict()[k] - ref[k]).abs().max()) for k in ref)
    assert worst < 1e-5, f"differs from SGD on the kept shares by {worst}"
