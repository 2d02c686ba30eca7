"""Code after ``with step:`` runs once per committed step, through kills (#25): the loop API on
the in-process fake mesh of ``trainer_sim``, four members of which three die at different
points of a step's body (before its micro-batches, in the middle of them, after the
reduction). Counted: how often each member ran the code after its ``with`` block and the code
after its loop over micro-batches, per step; and the result is single-process training's."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from trainer_sim import (
    DATA_X,
    DATA_Y,
    Hub,
    Member,
    Round,
    all_ok,
    max_diff,
    reference,
    start_loop,
    trainer_of,
    wait_all,
)

from ftmesh.errors import PeerLostError
from ftmesh.torch import ElasticTrainer, Step

pytestmark = pytest.mark.timeout(60)

TOTAL = 12
CLOSE = 1e-5
KILLS = {("b", 3): "before", ("c", 6): "middle", ("d", 9): "after"}
"""(member, step number) -> where in the step's body it dies."""


def test_code_after_a_step_runs_once_per_committed_step_through_kills() -> None:
    hub = Hub(start_with=4)
    lock = threading.Lock()
    after_block: Counter[tuple[str, int]] = Counter()
    after_batches: Counter[tuple[str, int]] = Counter()
    uncommitted: list[tuple[str, int]] = []
    a_in = {s: threading.Event() for _, s in KILLS}
    """Set when a's body of the step began: a kill then fails a's attempt (not a view change
    a sees before it starts)."""

    def die(me: str, step: int) -> None:
        assert a_in[step].wait(20.0)
        hub.kill(me)

    def body(t: ElasticTrainer, step: Step) -> None:
        me = t.mesh.node_id
        if me == "a" and step.number in a_in:
            a_in[step.number].set()
        where = KILLS.get((me, step.number))
        if where == "before":
            die(me, step.number)
        for k, idx in enumerate(step.indices()):
            if where == "middle" and k == 1:
                die(me, step.number)
            i = torch.as_tensor(idx)
            F.cross_entropy(t.model(DATA_X[i]), DATA_Y[i]).backward()  # type: ignore[no-untyped-call]
        with lock:
            after_batches[me, step.number] += 1
        if where == "after":
            die(me, step.number)
        t.optimizer.step()

    def after(m: Member, t: ElasticTrainer, step: Step) -> None:
        with lock:
            after_block[m.name, step.number] += 1
            if step.report is None:
                uncommitted.append((m.name, step.number))

    try:
        members = start_loop(hub, "abcd", total=TOTAL, body=body, micro_batch=1, after_step=after)
        wait_all(hub, 50)
        all_ok(members, "a")
        assert trainer_of(members["a"]).committed == TOTAL
        assert not uncommitted, uncommitted
        assert trainer_of(members["a"]).recoveries >= 2  # the kills did fail a's attempts
        for name in "abcd":
            ran = sorted(s for (n, s), c in after_block.items() if n == name for _ in range(c))
            last = {"a": TOTAL, "b": 2, "c": 5, "d": 9}[name]  # d died after committing 9
            assert ran == list(range(1, last + 1)), (name, ran)
        # The body's code after its micro-batches: once per step too (retries happen inside).
        assert all(c == 1 for c in after_batches.values()), after_batches
        assert (
            max_diff(
                {k: v.clone() for k, v in trainer_of(members["a"]).model.state_dict().items()},
                reference("sgd", TOTAL),
            )
            < CLOSE
        )
    finally:
        hub.shutdown()


@pytest.mark.parametrize("read_report", [False, True])
def test_a_hand_back_the_loop_does_not_look_at_is_logged(
    caplog: pytest.LogCaptureFixture, read_report: bool
) -> None:
    """Sharded: step 3's parameter allgather fails on every member (nobody commits it). The
    members cannot retry inside the body (their optimizer step ran): the step is handed back
    after the block, and a loop that never looks at ``step.report`` ran its code after the
    block for an attempt that did not commit, so each member says so once, naming the step
    and the failure; a loop that looks at ``step.report`` is not told."""
    hub = Hub(start_with=3)
    after_block: Counter[tuple[str, int]] = Counter()
    gathers = [0]

    def stall_all(r: Round) -> dict[str, BaseException]:
        if r.kind != "allgather" or r.dtype != "float32":
            return {}
        gathers[0] += 1
        return {m: PeerLostError("stalled") for m in r.members} if gathers[0] == 3 else {}

    def after(m: Member, t: ElasticTrainer, step: Step) -> None:
        after_block[m.name, step.number] += 1  # (looks at step.report only if read_report)

    hub.inject = stall_all
    try:
        with caplog.at_level(logging.WARNING, logger="ftmesh.torch"):
            members = start_loop(
                hub,
                "abc",
                total=5,
                shard_optimizer=True,
                read_report=read_report,
                after_step=after,
            )
            wait_all(hub, 50)
        all_ok(members, "abc")
    finally:
        hub.shutdown()
    warned = [r for r in caplog.records if "handed back" in r.getMessage()]
    assert all(after_block[n, 3] == 2 for n in "abc"), after_block  # failed, then committed
    if read_report:
        assert not warned
        return
    assert sorted(r.threadName for r in warned) == ["a", "b", "c"], after_block
    for r in warned:
        assert r.getMessage().startswith("step 3: ") and "stalled" in r.getMessage()
        assert "if step.report is None: continue" in r.getMessage()
