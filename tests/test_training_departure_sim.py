"""Planned departures (``SyncMesh.request_leave``, what SIGTERM does) on the in-process fake
mesh of ``trainer_sim``: the leaver announces in the gradient allreduce of the step it is
computing, leaves after it with ``Departed``, and the others' next step runs on the view
without it with no failed collective, no retried attempt and (replicated) no sync; the result
is still single-process training's. Also: several leavers in one step, an announcing step that
fails, sharded state, leaving before training, and a cold spare that takes the free slot."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from trainer_sim import Hub, Member, max_diff, reference, run_members

from ftmesh.errors import Departed, PeerLostError
from ftmesh.torch.trainer import ElasticTrainer, StepReport

pytestmark = pytest.mark.timeout(60)

TOTAL = 10
CLOSE = 1e-5  # mesh vs single-process weights: equal up to summation order


@pytest.fixture
def hub() -> Iterator[Hub]:
    h = Hub(start_with=4)
    yield h
    h.shutdown()


def _leave_at(step: int, *names: str) -> Callable[[Member, StepReport], None]:
    """An ``on_step`` that asks ``names`` to leave once they have committed ``step``."""

    def on_step(m: Member, r: StepReport) -> None:
        if m.name in names and r.step == step and m.mesh is not None:
            m.mesh.request_leave()

    return on_step


def _trainer(m: Member) -> ElasticTrainer:
    assert m.trainer is not None, f"{m.name} never started ({m.status}: {m.error!r})"
    return m.trainer


def _check(members: dict[str, Member], left: dict[str, int], opt: str = "sgd") -> None:
    """``left``: who departed after which step. The others finished, on one model equal to
    single-process training's."""
    for name, m in members.items():
        if name in left:
            assert m.status == "left", f"{name}: {m.status} {m.error!r}"
            assert isinstance(m.error, Departed) and m.error.code == 0
            assert m.error.step == left[name] == max(_trainer(m).committed, 0)
        else:
            assert m.status == "ok", f"{name}: {m.status} {m.error!r}"
            assert _trainer(m).committed == TOTAL
            assert m.mesh is not None and m.mesh.progress.step == TOTAL  # published progress
    stayed = [m for n, m in members.items() if n not in left]
    assert len({_trainer(m).digest() for m in stayed}) == 1, "survivors hold different models"
    model = {k: v.clone() for k, v in _trainer(stayed[0]).model.state_dict().items()}
    assert max_diff(model, reference(opt, TOTAL)) < CLOSE


def _after(m: Member, step: int) -> StepReport:
    return next(r for r in m.reports if r.step == step + 1)


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_leaver_announces_and_the_rest_go_on_without_a_retry(hub: Hub, shard: bool) -> None:
    members = run_members(
        hub, "abcd", opt="sgd", total=TOTAL, shard=shard, on_step=_leave_at(4, "b")
    )
    _check(members, {"b": 5})  # asked after step 4: announced in step 5, left after it
    assert hub.failed_rounds() == []  # no collective failed, for anybody
    # its last word before the leave: the role that takes it out of the others' next view
    assert hub.roles["b"] == "leaving"
    for name in "acd":
        m = members[name]
        announced = next(r for r in m.reports if r.step == 5)
        assert announced.leaving == ("b",), announced
        nxt = _after(m, 5)
        assert nxt.members == ("a", "c", "d") and nxt.attempts == 1, nxt
        # Replicated: the same state everywhere, no sync; sharded: the sync re-shards.
        assert nxt.synced == shard, nxt
        assert all(r.attempts == 1 for r in m.reports), [r.attempts for r in m.reports]


def test_two_leave_in_one_step(hub: Hub) -> None:
    members = run_members(
        hub, "abcd", opt="sgd", total=TOTAL, shard=False, on_step=_leave_at(3, "a", "d")
    )
    _check(members, {"a": 4, "d": 4})
    assert hub.failed_rounds() == []
    for name in "bc":
        assert _after(members[name], 4).members == ("b", "c")


def _rows(r: Any) -> bool:
    """Whether round ``r`` gathers a step's header rows (not a barrier's single value)."""
    return bool(next(iter(r.contrib.values()))[2].size > 1)


def test_a_leaver_whose_announcing_step_fails_leaves_at_once(hub: Hub) -> None:
    seen = {"grads": 0}

    def inject(r: Any) -> dict[str, BaseException]:
        # (a step ends with the gathered header rows, float64: DESIGN-NOTES, the step header)
        if r.kind == "allgather" and r.dtype == "float64" and _rows(r):
            seen["grads"] += 1
            if seen["grads"] == 6:  # step 6, the one "c" announces in: fails for "a" only
                return {"a": PeerLostError("injected")}
        return {}

    hub.inject = inject
    members = run_members(
        hub, "abcd", opt="sgd", total=TOTAL, shard=False, on_step=_leave_at(5, "c")
    )
    # "c" committed step 6 (its round completed for it) and went; "a", which missed that
    # step's end, adopts it from the others in a sync instead of computing it again.
    _check(members, {"c": 6})
    assert [r.step for r in members["a"].reports] == list(range(1, TOTAL + 1))


def test_a_leave_asked_during_the_gradient_allreduce_leaves_after_that_step(hub: Hub) -> None:
    """Asked once its leave bit had gone out (SIGTERM during the step's allreduce): it says
    so in its gathered row and leaves after that same step, not after one more."""
    armed: dict[str, Any] = {}

    def on_step(m: Member, r: StepReport) -> None:
        if m.name == "b" and r.step == 4:
            armed["b"] = m.mesh

    def inject(r: Any) -> dict[str, BaseException]:
        if r.kind == "allreduce" and r.dtype == "float32" and "b" in armed:
            armed.pop("b").request_leave()  # step 5's gradients are summed: too late for it
        return {}

    hub.inject = inject
    members = run_members(hub, "abcd", opt="sgd", total=TOTAL, shard=False, on_step=on_step)
    _check(members, {"b": 5})
    assert hub.failed_rounds() == []
    for name in "acd":
        m = members[name]
        assert next(r for r in m.reports if r.step == 5).leaving == ("b",)
        nxt = _after(m, 5)
        assert nxt.members == ("a", "c", "d") and nxt.attempts == 1 and not nxt.synced, nxt


def test_leaving_before_the_first_step(hub: Hub) -> None:
    """A member asked to leave before it entered the ring (SIGTERM during start-up) goes at
    once; the others never wait for it."""
    hub.start_with = 3

    def ask(m: Member) -> None:
        if m.name == "d" and m.mesh is not None:
            m.mesh.request_leave()

    members = run_members(hub, "abcd", opt="sgd", total=TOTAL, shard=False, before_steps=ask)
    _check(members, {"d": 0})
    assert members["d"].reports == []
    assert all(r.members == ("a", "b", "c") for r in members["a"].reports)


def test_a_cold_spare_takes_the_slot_of_a_leaver(hub: Hub) -> None:
    """Cold spares tell a departure (a slot to take) from the end of training."""
    hub.start_with = 2
    chosen: list[str] = []  # the first member to commit step 4 leaves (whoever trains)
    lock = threading.Lock()

    def first_leaves(m: Member, r: StepReport) -> None:
        with lock:
            if r.step == 4 and not chosen and m.mesh is not None:
                chosen.append(m.name)
                m.mesh.request_leave()
        if chosen and r.step > 4:
            time.sleep(0.1)  # (the fake steps are instant: leave the spare time to step in)

    members = run_members(
        hub,
        "abc",
        opt="sgd",
        total=TOTAL,
        shard=False,
        on_step=first_leaves,
        trainer_kwargs={"max_peers": 2, "spares": "cold"},
    )
    (leaver,) = chosen
    _check(members, {leaver: 5})
    spare = next(
        m for n, m in members.items() if n != leaver and m.reports and m.reports[0].step > 1
    )
    assert spare.reports[0].synced, spare.reports[0]  # stepped in and fetched the state
