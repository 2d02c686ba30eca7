"""The chaos soak's training workload: its invariants fire on fabricated commit records (no
lab needed), and its worker trains with identical digests on loopback (no root needed)."""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ftmesh.lab.chaos import ChaosContext
from ftmesh.lab.procs import NodeProcess, SeenRecord
from ftmesh.lab.training import (
    CommitLog,
    DigestAgreement,
    NoLostCommits,
    StepSequence,
    TrainingWorkload,
)

A, B, C = "a" * 32, "b" * 32, "c" * 32


def rec(
    step: int,
    digest: str,
    parent: str,
    *,
    epoch: str = "e1",
    members: tuple[str, ...] = (A, B),
    synced: bool = False,
    parent_step: int | None = None,
) -> dict[str, Any]:
    """A commit record as ``ftmesh.lab.train_worker`` prints it."""
    return {
        "event": "commit",
        "step": step,
        "digest": digest,
        "parent": parent,
        "parent_step": step - 1 if parent_step is None else parent_step,
        "epoch": epoch,
        "members": list(members),
        "synced": synced,
        "fetched": 0,
        "loss": 1.0,
    }


def test_digest_mismatch_on_one_view_is_a_violation_and_forks_are_counted() -> None:
    log = CommitLog()
    inv = DigestAgreement(log)
    log.add("h0.0", 0, rec(1, "d1", "d0", synced=True), 1.0)
    log.add("h1.0", 1, rec(1, "d1", "d0", synced=True), 1.0)
    assert inv.check(None, "tick") == []
    assert inv.checks == 1
    log.add("h0.0", 0, rec(2, "d2", "d1"), 2.0)
    log.add("h1.0", 1, rec(2, "XX", "d1"), 2.0)  # same step, same view, other state
    found = inv.check(None, "tick")
    assert len(found) == 1 and "step 2 on view e1" in found[0] and "h1.0" in found[0], found
    # The same step on another view with another digest: a fork, not a violation.
    log.add("h2.0", 2, rec(2, "d2b", "d1", epoch="e2", members=(C,), synced=True), 3.0)
    assert inv.check(None, "tick") == []
    assert inv.forks == {2: {"d2", "XX", "d2b"}}


def test_step_sequence_catches_repeats_skips_and_unsynced_starts() -> None:
    log = CommitLog()
    inv = StepSequence(log)
    log.add("h0.0", 0, rec(5, "d5", "d4", synced=True), 1.0)  # a joiner: first step synced
    log.add("h0.0", 0, rec(6, "d6", "d5"), 1.0)
    log.add("h0.0", 0, rec(9, "d9", "d8", synced=True), 1.0)  # adopted newer state: fine
    assert inv.check(None, "tick") == []
    assert inv.jumps == 1
    log.add("h0.0", 0, rec(9, "d9", "d8"), 1.0)  # repeated
    log.add("h0.0", 0, rec(12, "d12", "d11"), 1.0)  # skipped without a sync
    log.add("h1.0", 1, rec(3, "d3", "d2"), 1.0)  # first commit without a sync
    log.add("h1.0", 1, rec(4, "d4", "d2", parent_step=2), 1.0)  # computed from step 2
    found = inv.check(None, "tick")
    assert len(found) == 4, found
    assert "committed step 9 after step 9" in found[0]
    assert "skipped from step 9 to 12" in found[1]
    assert "first commit (step 3) began without a sync" in found[2]
    assert "computed from a state of step 2" in found[3]


def test_adopted_steps_must_be_the_state_fetched() -> None:
    log = CommitLog()
    inv = StepSequence(log)
    log.add("h0.0", 0, rec(5, "d5", "d4", synced=True), 1.0)
    adopted = rec(6, "d6", "d6", synced=True, parent_step=6)  # failed at its end: took it
    log.add("h0.0", 0, {**adopted, "adopted": True, "loss": None}, 1.0)
    assert inv.check(None, "tick") == []
    wrong = rec(7, "d7", "dX", synced=True, parent_step=7)
    log.add("h0.0", 0, {**wrong, "adopted": True}, 1.0)
    found = inv.check(None, "tick")
    assert len(found) == 1 and "adopted step 7 is not the state it fetched" in found[0], found


def test_lost_commit_fires_when_an_agreed_state_is_abandoned() -> None:
    log = CommitLog()
    inv = NoLostCommits(log)
    # One line d0 <- d1 <- d2 <- d3, and a fork d1 <- x2 <- x3 <- x4.
    for step, digest, parent in [(1, "d1", "d0"), (2, "d2", "d1"), (3, "d3", "d2")]:
        log.add("h0.0", 0, rec(step, digest, parent), 1.0)
    for step, digest, parent in [(2, "x2", "d1"), (3, "x3", "x2"), (4, "x4", "x3")]:
        log.add("h1.0", 1, rec(step, digest, parent, epoch="e2"), 1.0)
    inv.agree((1, "d1"))
    inv.agree((3, "d3"))
    assert inv.check(None, "settled") == []  # d3 descends from d1
    inv.agree((4, "x4"))  # the mesh had agreed on d3, now trains on a line without it
    found = inv.check(None, "settled")
    assert len(found) == 1 and "step 3" in found[0] and "does not descend" in found[0]
    inv.agree((9, "unknown"))  # no records link it: undecided, not a violation
    assert inv.check(None, "settled") == []
    assert (inv.checks, inv.unknown) == (3, 1)
    assert log.line((3, "d3")) == {(3, "d3"), (2, "d2"), (1, "d1"), (0, "d0")}


class FakeNode:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.records: list[SeenRecord] = []
        self._cond = threading.Condition()


def fake_ctx(nodes: list[FakeNode]) -> ChaosContext:
    slots = [SimpleNamespace(history=[n], node=n, frozen=False) for n in nodes]
    mesh = SimpleNamespace(
        slots=slots,
        expected=lambda: {h: s.node for h, s in enumerate(slots)},
        running=lambda: {h: s.node for h, s in enumerate(slots)},
    )
    return cast(ChaosContext, SimpleNamespace(mesh=mesh))


def test_recovery_needs_progress_then_one_ring_of_every_member() -> None:
    n0, n1 = FakeNode(A), FakeNode(B)
    ctx = fake_ctx([n0, n1])
    wl = TrainingWorkload()
    n0.records.append(SeenRecord(1.0, {"event": "self", "node": A}))
    n0.records.append(SeenRecord(1.0, rec(10, "d10", "d9", synced=True)))
    n1.records.append(SeenRecord(1.0, rec(10, "d10", "d9", synced=True)))
    n1.records.append(SeenRecord(1.0, {"event": "commit", "step": "junk"}))
    wl.mark(ctx)
    assert wl.log.malformed == 1 and wl.log.max_step == 10
    assert wl.recovered(ctx) == ("progress", "no step committed after step 10")
    # h0 trains alone on its own view: progress, but not one ring.
    n0.records.append(SeenRecord(2.0, rec(11, "d11", "d10", epoch="e0", members=(A,))))
    why = wl.recovered(ctx)
    assert why is not None and why[0] == "converge", why
    # Both commit step 12 on the view of both: recovered, and that state is agreed.
    n0.records.append(SeenRecord(3.0, rec(12, "d12", "d11", synced=True)))
    n1.records.append(SeenRecord(3.0, rec(12, "d12", "d11", synced=True)))
    assert wl.recovered(ctx) is None
    assert wl.lost.agreed == [(12, "d12")]
    for inv in wl.invariants():
        assert inv.check(ctx, "settled") == [], inv.name
    stats = wl.summary()
    assert stats["commits"] == 5 and stats["max_step"] == 12 and stats["digest_checks"] == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_trains_with_identical_digests_and_leaves_on_sigterm() -> None:
    """Two workers on loopback (local discovery): they commit the same steps on one view with
    the same digests, name each step's parent, and exit 0 with their counters on SIGTERM."""
    with tempfile.TemporaryDirectory(prefix="ftmesh-trainw-") as tmp:
        argv = [sys.executable, "-m", "ftmesh.lab.train_worker", "--discovery", "local"]
        argv += ["--registry-dir", str(Path(tmp) / "reg"), "--mesh", "trainw"]
        argv += ["--step-delay", "0.02"]
        procs = [
            NodeProcess([*argv, "--name", f"w{i}"], stderr_path=Path(tmp) / f"w{i}.stderr")
            for i in range(2)
        ]
        try:
            log = CommitLog()
            digests, steps = DigestAgreement(log), StepSequence(log)
            ids = {p.node_id for p in procs}

            def together(after: int) -> Any:
                return lambda r: (
                    r.get("event") == "commit" and set(r["members"]) == ids and r["step"] > after
                )

            start = int(procs[0].wait_for(together(0), timeout=90.0)["step"])
            for p in procs:
                p.wait_for(together(start + 5), timeout=60.0)
            for i, p in enumerate(procs):
                p.signal(signal.SIGTERM)
                assert p.proc.wait(10.0) == 0, (Path(tmp) / f"w{i}.stderr").read_text()[-2000:]
                assert p.find(lambda r: r.get("event") == "stats") is not None
                for s in list(p.records):
                    if s.record.get("event") == "commit":
                        log.add(f"w{i}", i, s.record, s.mono)
            assert [*digests.check(None, "final"), *steps.check(None, "final")] == []
            assert digests.checks >= 5  # both committed the same steps on one view
            first, last = log.commits[0], log.commits[-1]
            assert log.descends((last.step, last.digest), (first.step, first.digest))
        finally:
            for p in procs:
                if p.proc.poll() is None:
                    p.kill()
                p.stop(1.0)
        assert not [p for p in procs if p.proc.poll() is None]
