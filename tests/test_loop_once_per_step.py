"""Code after ``with step:`` runs once per committed step, through kills (#25): the loop API on
the in-process fake mesh of ``trainer_sim``, four members of which three die at different
points of a step's body (before its micro-batches, in the middle of them, after the
reduction). Counted: how often each member ran the code after its ``with`` block and the code
after its loop over micro-batches, per step; and the result is single-process training's."""

from __future__ import annotations

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
    all_ok,
    max_diff,
    reference,
    start_loop,
    trainer_of,
    wait_all,
)

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
