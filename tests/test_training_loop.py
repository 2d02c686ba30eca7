"""The loop API (``for step in trainer.steps(): with step: ...``) on the in-process fake mesh of
``trainer_sim``: several trainers in threads, deaths and joins at chosen steps. Checked:
micro-batches and DataLoader workers give single-process training's model, a survivor's
activation memory does not grow when peers die, registered state (a scheduler, scalars)
reaches joiners and checkpoints in both modes, a planted divergence is reported by every
member within the check interval, and misuse is a clear error."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
import torch.utils.data as tud
from trainer_sim import (
    DATA_X,
    DATA_Y,
    FakeMesh,
    Hub,
    Member,
    all_ok,
    loader_body,
    make_model,
    make_optimizer,
    make_sampler,
    max_diff,
    reference,
    sgd_body,
    start_loop,
    trainer_of,
    wait_all,
)

from ftmesh.errors import LocalUsageError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.state import latest_valid_checkpoint
from ftmesh.torch import ElasticSampler, ElasticTrainer, StateDivergedError, Step

pytestmark = pytest.mark.timeout(60)

CLOSE = 1e-5
"""Mesh vs single-process weights: equal up to summation order."""


@pytest.fixture
def hub() -> Iterator[Hub]:
    h = Hub(start_with=1)
    yield h
    h.shutdown()


def _model_of(m: Member) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer_of(m).model.state_dict().items()}


def test_micro_batches_give_the_single_process_model_through_a_kill_and_a_join() -> None:
    """3 members, micro-batches of 2 (shares of 3 and 2 samples: unequal micro-batches), one
    killed after step 4, a joiner after step 6: the result is single-process SGD's."""
    hub = Hub(start_with=3)
    total = 14
    joined = threading.Event()

    def after(m: Member, t: ElasticTrainer, step: Step) -> None:
        if step.number == 4 and m.name == "c":
            hub.kill("c")
        if step.number == 6:
            joined.set()

    try:
        members = start_loop(hub, "abc", total=total, micro_batch=2, after_step=after)
        members |= start_loop(hub, "d", total=total, micro_batch=2, start_after=joined)
        wait_all(hub, 45)
        all_ok(members, "abd")
        assert members["c"].status in ("killed", "ok")
        want = reference("sgd", total)
        for n in "abd":
            assert trainer_of(members[n]).committed == total
            assert max_diff(_model_of(members[n]), want) < CLOSE, n
        assert len({trainer_of(members[n]).digest() for n in "abd"}) == 1
        assert members["d"].reports and members["d"].reports[0].step > 6
        # Every step was run on a view (micro-batches or not) and counted its 8 samples.
        assert {r.samples for n in "ab" for r in members[n].reports} == {8}
    finally:
        hub.shutdown()


def test_a_data_loader_with_workers_gives_the_single_process_model() -> None:
    """The DataLoader the user would train with (batch_size = the global batch, shuffle, 2
    worker processes kept across iterators); a kill makes the trainer start its iterator over
    on the new view: the result is single-process SGD's on the same global batches."""
    hub = Hub(start_with=2)
    total = 10
    dataset = tud.TensorDataset(DATA_X, DATA_Y)

    def loader() -> tud.DataLoader[Any]:
        return tud.DataLoader(
            dataset, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True
        )

    def after(m: Member, t: ElasticTrainer, step: Step) -> None:
        if step.number == 4 and m.name == "b":
            hub.kill("b")

    try:
        members = start_loop(
            hub, "ab", total=total, body=loader_body, data=loader, data_seed=1, after_step=after
        )
        wait_all(hub, 50)
        all_ok(members, "a")
        t = trainer_of(members["a"])
        assert t.committed == total
        assert max_diff(_model_of(members["a"]), reference("sgd", total)) < CLOSE
        assert t._loader is not None and t._loader.restarts >= 2  # the kill started it over
    finally:
        hub.shutdown()


def _activation_bytes(model: torch.nn.Module) -> Callable[[], Any]:
    """A context that adds up the bytes autograd saves for backward during a forward, leaving
    out the parameters (what grows with the batch: the activations)."""
    params = {p.data_ptr() for p in model.parameters()}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            total[0] += t.numel() * t.element_size()
        return t

    def context() -> Any:
        total[0] = 0
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total

    return context


@pytest.mark.parametrize("micro_batch", [8, 0])
def test_a_survivors_activation_memory_stays_put_with_micro_batches(micro_batch: int) -> None:
    """4 members, a global batch of 32, 3 of them killed at once after step 3: the survivor
    computes all 32 samples. Its activation memory, measured as the bytes autograd saves for
    backward in one forward (saved-tensors hooks, parameters left out), stays within 20 % of
    what it was with 4 members when ``micro_batch=8``; without micro-batches it grows ~4x
    (which shows the measure sees it)."""
    hub = Hub(start_with=4)
    total = 6
    peak: dict[str, list[int]] = {"before": [0], "after": [0]}

    def body(t: ElasticTrainer, step: Step) -> None:
        measure = _activation_bytes(t.model)
        phase = "before" if step.world_size == 4 else "after"
        for idx in step.indices():
            i = torch.as_tensor(idx)
            hooks, saved = measure()
            with hooks:
                loss = F.cross_entropy(t.model(DATA_X[i]), DATA_Y[i])
            if t.mesh.node_id == "a":
                peak[phase][0] = max(peak[phase][0], saved[0])
            loss.backward()  # type: ignore[no-untyped-call]
        t.optimizer.step()

    def after(m: Member, t: ElasticTrainer, step: Step) -> None:
        if step.number == 3 and m.name == "a":
            for n in "bcd":
                hub.kill(n)

    try:
        members = start_loop(
            hub,
            "abcd",
            total=total,
            body=body,
            data=lambda: ElasticSampler(len(DATA_X), 32, seed=1),
            micro_batch=micro_batch,
            after_step=after,
        )
        wait_all(hub, 45)
        all_ok(members, "a")
        before, after_kill = peak["before"][0], peak["after"][0]
        assert before > 0 and after_kill > 0
        if micro_batch:
            assert after_kill <= 1.2 * before, (before, after_kill)
        else:
            assert after_kill >= 3 * before, (before, after_kill)
    finally:
        hub.shutdown()


def _with_scheduler(t: ElasticTrainer) -> None:
    t.register("scheduler", torch.optim.lr_scheduler.StepLR(t.optimizer, step_size=2, gamma=0.5))
    t.scalars["seen"] = 0


def _scheduled_body(t: ElasticTrainer, step: Step) -> None:
    sgd_body(t, step)
    t.scalars["seen"] += step.samples  # (the step's, the same on every member)
    sched = t._state.state.objects["scheduler"].obj
    sched.step()


def test_registered_state_reaches_a_joiner_and_is_checked() -> None:
    """A scheduler stepped inside the body and scalars changed every step: a joiner gets
    them with the model, and the state checks (every 3 steps) find every member equal."""
    hub = Hub(start_with=2)
    total = 12
    joined = threading.Event()

    def after(m: Member, t: ElasticTrainer, step: Step) -> None:
        if step.number == 5:
            joined.set()

    try:
        kwargs: dict[str, Any] = {
            "total": total,
            "body": _scheduled_body,
            "setup": _with_scheduler,
            "check_every": 3,
        }
        members = start_loop(hub, "ab", after_step=after, **kwargs)
        members |= start_loop(hub, "j", start_after=joined, **kwargs)
        wait_all(hub, 45)
        all_ok(members, "abj")
        lrs = {n: trainer_of(members[n]).optimizer.param_groups[0]["lr"] for n in "abj"}
        assert set(lrs.values()) == {0.05 * 0.5 ** (total // 2)}, lrs
        assert len({trainer_of(members[n]).digest() for n in "abj"}) == 1
        assert {trainer_of(members[n]).scalars["seen"] for n in "abj"} == {8 * total}
        j = members["j"]
        assert j.reports and j.reports[0].step > 5
        stats = trainer_of(members["a"]).statistics()
        assert stats.committed_step == total and stats.step_seconds.count == total
        assert stats.steps_total == total and stats.world_size in (2, 3)
        assert stats.samples_total == sum(r.share for r in members["a"].reports)
    finally:
        hub.shutdown()


def test_a_planted_divergence_is_reported_within_the_check_interval() -> None:
    """Member b steps its scheduler once more after step 5 (between steps): at the next state
    check (every 4 steps: step 9) b, alone against a strict majority, raises
    StateDivergedError naming the scheduler, and b against the others; the majority is told
    apart (issue #26: one member's numbers cannot end everybody's run), names b and goes on."""
    hub = Hub(start_with=3)

    def after(m: Member, t: ElasticTrainer, step: Step) -> None:
        if step.number == 5 and m.name == "b":
            t._state.state.objects["scheduler"].obj.step()

    try:
        members = start_loop(
            hub,
            "abc",
            total=20,
            body=_scheduled_body,
            setup=_with_scheduler,
            check_every=4,
            after_step=after,
        )
        wait_all(hub, 45)
        m = members["b"]
        assert m.status == "error" and isinstance(m.error, StateDivergedError), m.error
        assert "scheduler" in m.error.parts, m.error
        assert m.error.parts["scheduler"] == [["a", "c"], ["b"]]
        assert trainer_of(m).committed == 8  # detected at the first check after step 5
        all_ok(members, "ac")
        assert {(r, accused) for r, accused, _ in hub.offences} == {("a", "b"), ("c", "b")}
    finally:
        hub.shutdown()


def test_sharded_checkpoints_keep_the_registered_state(tmp_path: Path) -> None:
    """Sharded mode: a checkpoint holds the scheduler and the scalars too; a new trainer that
    resumes from it has them."""
    hub = Hub(start_with=2)
    try:
        members = start_loop(
            hub,
            "ab",
            total=6,
            body=_scheduled_body,
            setup=_with_scheduler,
            shard_optimizer=True,
            checkpoint_dir=tmp_path,
            checkpoint_every=3,
        )
        wait_all(hub, 45)
        all_ok(members, "ab")
        found = latest_valid_checkpoint(tmp_path)
        assert found is not None and found.snapshot.step == 6
        a = trainer_of(members["a"])
        sched = a._state.state.objects["scheduler"].obj
        hub2 = Hub()
        model = make_model()
        fresh = ElasticTrainer(
            cast(SyncMesh, FakeMesh(hub2, "r")),
            model,
            make_optimizer("sgd", model),
            make_sampler(),
            shard_optimizer=True,
            checkpoint_dir=tmp_path,
            checkpoint_every=3,
        )
        _with_scheduler(fresh)
        fresh._open()
        resumed = fresh._state.state.objects["scheduler"].obj
        assert fresh.committed == 6
        assert resumed.state_dict() == sched.state_dict()
        assert fresh.scalars == a.scalars and fresh.scalars["seen"] > 0
        hub2.shutdown()
    finally:
        hub.shutdown()


def test_misuse_is_a_clear_error(hub: Hub) -> None:
    model = make_model()
    opt = make_optimizer("sgd", model)
    t = ElasticTrainer(
        cast(SyncMesh, FakeMesh(hub, "a")), model, opt, make_sampler(), join_settle=0.0
    )
    with pytest.raises(LocalUsageError, match="state_dict"):
        t.register("thing", object())
    with pytest.raises(LocalUsageError, match="outside a trainer step"):
        opt.step()
    steps = t.steps(3)
    step = next(steps)
    assert (step.rank, step.world_size, step.is_leader, step.number) == (0, 1, True, 1)
    with pytest.raises(LocalUsageError, match="inside its `with step:`"):
        next(step.indices())
    with pytest.raises(LocalUsageError, match="inside `with step:`"):
        next(steps)
    with pytest.raises(LocalUsageError, match="before the first step"):
        t.register("late", torch.optim.lr_scheduler.StepLR(opt, 1))
    step = next(t.steps(3))
    with pytest.raises(LocalUsageError, match="before the step's gradients"), step:
        opt.step()
    step = next(t.steps(3))
    with pytest.raises(LocalUsageError, match="needs a trainer built with a DataLoader"), step:
        next(step.batches())
    step = next(t.steps(3))
    with pytest.raises(LocalUsageError, match="ended before its gradients were reduced"), step:
        pass
    step = next(t.steps(3))  # after all that, a step runs as it should
    with step:
        sgd_body(t, step)
    assert step.report is not None and t.committed == 1
