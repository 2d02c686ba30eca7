"""Streaming data (``ftmesh.torch.stream``): the deal of shards and the split of the global
batch, the position's advance and epochs, the check of the members' stream slots, the reader
(retries served from its buffer, a shard's end seen in the step of its last sample), and on
the in-process fake mesh of ``trainer_sim`` three members training a stream through a kill
and a join: every sample of every epoch trained in exactly one committed step."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils.data as tud
from trainer_sim import (
    FakeMesh,
    Hub,
    Member,
    Round,
    all_ok,
    make_model,
    make_optimizer,
    start_loop,
    trainer_of,
    wait_all,
)

from ftmesh.errors import LocalUsageError, PeerLostError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch import ElasticTrainer, ShardedStream, Step
from ftmesh.torch.stream import (
    Position,
    ShardReader,
    assign,
    merge_rows,
    planned_counts,
    stream_row,
)

pytestmark = pytest.mark.timeout(60)


def test_live_shards_are_dealt_round_robin_to_the_sorted_workers() -> None:
    pos = Position(0, (0,) * 5, (False, True, False, False, False))
    got = assign(pos, ("c", "a", "b"))
    assert got == {"a": [0, 4], "b": [2], "c": [3]}
    # fewer live shards than workers: the last workers hold none
    two = Position(0, (0,) * 3, (True, False, False))
    assert assign(two, ("z", "y", "x")) == {"x": [1], "y": [2]}
    # every member derives the same deal whatever order it lists the workers in
    assert assign(pos, ("b", "c", "a")) == got


def test_the_global_batch_is_split_among_the_holders_only() -> None:
    holders = {"a": [0], "b": [1]}
    assert planned_counts(10, holders, ("a", "b", "c")) == {"a": 5, "b": 5, "c": 0}
    assert planned_counts(7, {"a": [0], "b": [1], "c": [2]}, ("a", "b", "c")) == {
        "a": 3,
        "b": 2,
        "c": 2,
    }
    # speed weights (in the sorted order of all workers) restricted to the holders
    assert planned_counts(12, {"a": [0], "c": [1]}, ("a", "b", "c"), (0.5, 0.25, 0.25)) == {
        "a": 8,
        "b": 0,
        "c": 4,
    }
    assert planned_counts(5, {}, ("a",)) == {"a": 0}


def test_the_position_advances_by_what_was_taken_and_rolls_over_to_the_next_epoch() -> None:
    pos = Position.start(3)
    pos = pos.advance([4, 0, 2], [False, False, True])
    assert pos == Position(0, (4, 0, 2), (False, False, True), 6)
    assert pos.live == [0, 1]
    pos = pos.advance([1, 3, 0], [True, False, False])
    assert pos == Position(0, (5, 3, 2), (True, False, True), 10)
    pos = pos.advance([0, 1, 0], [False, True, False])
    assert pos == Position.start(3, epoch=1)
    assert Position.of(pos.state_dict()) == pos
    with pytest.raises(LocalUsageError, match="without a sample"):
        Position.start(2).advance([0, 0], [True, True])


def test_the_members_stream_slots_are_checked_and_added_up() -> None:
    holders = {"a": [0, 2], "b": [1]}
    counts = {"a": 4, "b": 4, "c": 0}
    rows = np.stack(
        [stream_row(3, {0: 2, 2: 2}, [2]), stream_row(3, {1: 3}, [1]), stream_row(3, {}, [])]
    )
    assert merge_rows(rows, ["a", "b", "c"], holders, counts) == ([2, 3, 2], [False, True, True])
    # a member that reports a shard it does not hold, or more than its planned count
    bad = rows.copy()
    bad[2, 0] = 1
    assert "c: reports shards [0]" in str(merge_rows(bad, ["a", "b", "c"], holders, counts))
    bad = rows.copy()
    bad[1, 1] = 5
    assert "b: took 5" in str(merge_rows(bad, ["a", "b", "c"], holders, counts))
    bad = rows.copy()
    bad[0, 0] = 0.5
    assert "not counts" in str(merge_rows(bad, ["a", "b", "c"], holders, counts))
    bad = rows.copy()
    bad[0, 5] = 2
    assert "flags" in str(merge_rows(bad, ["a", "b", "c"], holders, counts))
    assert "shape" in str(merge_rows(rows[:2], ["a", "b", "c"], holders, counts))


class Shards:
    """Shards of given lengths whose samples are ``(shard, offset)``; counts the openings."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.opened: list[tuple[int, int]] = []

    def __call__(self, shard: int, offset: int) -> Iterator[tuple[int, int]]:
        self.opened.append((shard, offset))
        return ((shard, i) for i in range(offset, self.lengths[shard]))


def test_the_reader_draws_in_turn_sees_ends_and_serves_a_retry_from_its_buffer() -> None:
    shards = Shards([3, 5])
    reader = ShardReader(shards)
    pos = Position.start(2)
    samples, taken, ended = reader.draw(pos, [0, 1], 6)
    assert samples == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert taken == {0: 3, 1: 3} and ended == {0}  # shard 0's end seen with its last sample
    # a retry of the same attempt: the same samples, no shard opened again
    again = reader.draw(pos, [0, 1], 6)
    assert again == (samples, taken, ended) and shards.opened == [(0, 0), (1, 0)]
    assert reader.opened == 2
    pos = pos.advance([3, 3], [True, False])
    reader.settle(pos, [1])
    samples, taken, ended = reader.draw(pos, [1], 4)  # short: the shard ends
    assert samples == [(1, 3), (1, 4)] and taken == {1: 2} and ended == {1}
    assert shards.opened == [(0, 0), (1, 0)]
    # a shard that moved here at an offset: opened there
    other = ShardReader(shards)
    assert other.draw(Position(0, (1, 4), (False, False)), [0], 1)[0] == [(0, 1)]
    assert shards.opened[-1] == (0, 1)


def test_an_iterable_dataset_is_sharded_round_robin_and_skipped_into() -> None:
    class Numbers(tud.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(10))

    stream = ShardedStream.from_iterable(Numbers(), 3, batch_size=4)
    assert list(stream.open_shard(0, 0)) == [0, 3, 6, 9]
    assert list(stream.open_shard(1, 2)) == [7]
    assert list(stream.open_shard(2, 5)) == []


def test_a_loader_over_an_iterable_dataset_points_to_the_stream() -> None:
    from ftmesh.torch.data import sampler_for

    class Numbers(tud.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(10))

    with pytest.raises(LocalUsageError, match="ShardedStream"):
        sampler_for(tud.DataLoader(Numbers(), batch_size=2), 0)


# -- on the fake mesh ---------------------------------------------------------------------

LENGTHS = [9, 14, 5, 11, 0, 13, 7, 10]
"""Shard lengths (one empty): 69 samples, steps of 8."""


def _sample(shard: int, offset: int) -> tuple[int, torch.Tensor, int]:
    sid = shard * 1000 + offset
    x = torch.sin(torch.arange(6, dtype=torch.float32) * (sid % 97 + 1) * 0.1)
    return sid, x, sid % 3


def _open(shard: int, offset: int) -> Iterator[tuple[int, torch.Tensor, int]]:
    return (_sample(shard, i) for i in range(offset, LENGTHS[shard]))


def _stream() -> ShardedStream:
    return ShardedStream(len(LENGTHS), _open, batch_size=8)


class Record:
    """What the members drew per attempt and which attempts committed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.draws: dict[tuple[int, str, str], list[int]] = {}
        self.attempt: dict[tuple[int, str, str], int] = {}
        self.commits: dict[int, set[tuple[str, tuple[str, ...], int]]] = {}

    def body(self, t: ElasticTrainer, step: Step) -> None:
        for ids, x, y in step.batches():
            key = (step.index, step.action.view.epoch, t.mesh.node_id)
            with self.lock:  # an attempt's draw: its micro-batches (a retry starts over)
                if self.attempt.get(key) != step.attempt:
                    self.attempt[key], self.draws[key] = step.attempt, []
                self.draws[key] += ids.tolist()
            F.cross_entropy(t.model(x), y).backward()  # type: ignore[no-untyped-call]
        t.optimizer.step()

    def after(self, m: Member, t: ElasticTrainer, step: Step) -> None:
        report = step.report
        if report is not None and not report.adopted:
            with self.lock:
                self.commits.setdefault(step.index, set()).add(
                    (step.action.view.epoch, step.workers, step.epoch)
                )

    def trained(self) -> dict[int, list[int]]:
        """Per epoch, the sample ids of every committed step's committed attempt."""
        out: dict[int, list[int]] = {}
        for index, found in sorted(self.commits.items()):
            assert len(found) == 1, (index, found)  # every committer committed one attempt
            ((view, workers, epoch),) = found
            for w in workers:
                out.setdefault(epoch, []).extend(self.draws.get((index, view, w), []))
        return out


@pytest.mark.parametrize(
    "settings",
    [{}, {"shares": "speed"}, {"shard_optimizer": True, "micro_batch": 2}],
    ids=["equal", "speed", "sharded-micro"],
)
def test_three_members_train_every_sample_once_through_a_kill_and_a_join(
    settings: dict[str, Any],
) -> None:
    """Members a, b, c; c dies during the 5th gradient allreduce (the attempt fails on every
    member and is retried on a and b), d joins after step 7, and b alone loses the 12th
    gathered header rows (the others commit that step and b adopts it; with a sharded
    optimizer the parameter allgather fails for all, and the step is handed back); 22 steps:
    two epochs and more."""
    hub = Hub(start_with=3)
    rec = Record()
    total = 22
    joined = threading.Event()
    seen = {"grads": 0, "rows": 0}

    def inject(r: Round) -> dict[str, BaseException]:
        x = next(iter(r.contrib.values()))[2]
        if r.kind == "allreduce" and x.dtype == np.float32:
            seen["grads"] += 1
            if seen["grads"] == 5:
                hub.kill("c")
                return {m: PeerLostError("c died") for m in r.members}
        if r.kind == "allgather" and x.dtype == np.float64 and x.size > 1:
            seen["rows"] += 1
            if seen["rows"] == 12:
                return {"b": PeerLostError("b lost the rows")}
        return {}

    def after(m: Member, t: ElasticTrainer, step: Step) -> None:
        rec.after(m, t, step)
        if step.number == 7:
            joined.set()

    hub.inject = inject
    try:
        kw: dict[str, Any] = {"data": _stream, "body": rec.body, "after_step": after, **settings}
        members = start_loop(hub, "abc", total=total, **kw)
        members |= start_loop(hub, "d", total=total, start_after=joined, **kw)
        wait_all(hub, 45)
        all_ok(members, "abd")
        assert members["c"].status == "killed"
        trained = rec.trained()
        every = sorted(s * 1000 + i for s, n in enumerate(LENGTHS) for i in range(n))
        assert sorted(trained[0]) == every
        assert sorted(trained[1]) == every
        positions = {trainer_of(members[n]).stream_position for n in "abd"}
        assert len(positions) == 1
        (pos,) = positions
        assert pos is not None and pos.epoch == 2
        assert len({trainer_of(members[n]).digest() for n in "abd"}) == 1
        assert members["d"].reports and members["d"].reports[0].step > 7
        if not settings.get("shard_optimizer"):  # (sharded: the others' allgather fails too)
            assert any(r.adopted for r in members["b"].reports)
        assert seen["grads"] > 5 and seen["rows"] > 12
    finally:
        hub.shutdown()


def test_a_mesh_resumed_from_a_checkpoint_goes_on_where_the_stream_stood(tmp_path: Any) -> None:
    """Two members train 7 steps with a checkpoint every 3 (the 7th step is lost), then two
    fresh members resume from the checkpoint of step 6 and train to step 14: across both
    runs, every sample of epoch 0 is trained once."""
    first, second = Record(), Record()
    hub = Hub(start_with=2)
    kw: dict[str, Any] = {"data": _stream, "checkpoint_dir": tmp_path, "checkpoint_every": 3}
    try:
        members = start_loop(hub, "ab", total=7, body=first.body, after_step=first.after, **kw)
        wait_all(hub, 45)
        all_ok(members, "ab")
    finally:
        hub.shutdown()
    hub = Hub(start_with=2)
    try:
        members = start_loop(hub, "ab", total=14, body=second.body, after_step=second.after, **kw)
        wait_all(hub, 45)
        all_ok(members, "ab")
        assert min(second.commits) == 6  # resumed after the checkpoint's step 6
        first.commits = {i: c for i, c in first.commits.items() if i < 6}
        trained = first.trained()[0] + second.trained()[0]
        every = sorted(s * 1000 + i for s, n in enumerate(LENGTHS) for i in range(n))
        assert sorted(trained) == every
    finally:
        hub.shutdown()


def test_epochs_end_where_the_stream_s_epochs_end() -> None:
    """``trainer.epochs(2)`` on a stream: each epoch's steps train exactly its samples (the
    last ones short), and the code after an epoch runs once, at its end."""
    hub = Hub(start_with=1)
    try:
        mesh = FakeMesh(hub, "a")
        model = make_model()
        t = ElasticTrainer(
            cast(SyncMesh, mesh), model, make_optimizer("sgd", model), _stream(), join_settle=0.0
        )
        seen: dict[int, list[int]] = {}
        ends: list[tuple[int, int]] = []
        for label in t.epochs(2):
            for step in t.steps():
                with step:
                    for ids, x, y in step.batches():
                        seen.setdefault(step.epoch, []).extend(ids.tolist())
                        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                    t.optimizer.step()
                assert step.epoch == label - 1
            pos = t.stream_position
            assert pos is not None
            ends.append((label, pos.epoch))
        every = sorted(s * 1000 + i for s, n in enumerate(LENGTHS) for i in range(n))
        assert sorted(seen[0]) == every and sorted(seen[1]) == every
        assert ends == [(1, 1), (2, 2)]
        # 69 samples in steps of 8: at least 9 steps an epoch, some of them short
        assert t.committed >= 18
        with pytest.raises(LocalUsageError, match="loop API"):
            t.step(lambda idx: torch.zeros(()))
        t.close()
    finally:
        hub.shutdown()


def test_a_short_step_trains_the_mean_over_the_samples_it_has() -> None:
    """One shard of 5 samples, steps of 8: the one step is short; its update and its
    reported loss are those of the mean over its 5 samples, as in one process."""
    hub = Hub(start_with=1)
    try:
        mesh = FakeMesh(hub, "a")
        model = make_model()
        reference = make_model()
        samples = [_sample(0, i) for i in range(5)]
        stream = ShardedStream(1, lambda s, o: iter(samples[o:]), batch_size=8)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        t = ElasticTrainer(cast(SyncMesh, mesh), model, opt, stream, join_settle=0.0)
        for step in t.steps(1):
            with step:
                for _, x, y in step.batches():
                    loss = F.cross_entropy(model(x), y)
                    step.record_loss(loss)
                    loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
        report = t.last_report
        assert report is not None
        x = torch.stack([s[1] for s in samples])
        y = torch.tensor([s[2] for s in samples])
        want = F.cross_entropy(reference(x), y)
        want.backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for p in reference.parameters():
                assert p.grad is not None
                p -= 0.5 * p.grad
        got = dict(model.named_parameters())
        for name, p in reference.named_parameters():
            assert torch.allclose(got[name], p, atol=1e-6), name
        assert report.loss == pytest.approx(float(want.detach()), rel=1e-5)
        pos = t.stream_position
        assert pos is not None and pos.epoch == 1  # the only shard ended: the epoch too
        t.close()
    finally:
        hub.shutdown()
