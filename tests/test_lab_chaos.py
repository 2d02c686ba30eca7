"""Chaos soak: random faults on a 5-host mesh with a fixed seed, zero violations (root only);
and on 4 hosts that train a model with ``ElasticTrainer`` (``--workload train``, the fault
kinds of issue 17 among them), zero violations with digests compared at every step.

Each soak is sized to what it shows: it ends after the fault that completes its seed's set
of kinds (``SOAK_FAULTS``: all ten kinds of a membership run; ``TRAIN_SOAK_FAULTS``: every
kind of issue 17, a kill and a 2+2 partition), within a time cap. The schedule is a function
of the seed (:func:`_schedule` replays the runner's draws; each soak checks that its run
injected exactly that schedule). ``FTMESH_SOAK_SECONDS`` / ``FTMESH_TRAIN_SOAK_SECONDS`` (or
``FTMESH_NIGHTLY=1``: 180 s and 120 s) run them for that long instead, whatever the count.
Plus the runner's planning and plug-in interface without a lab. (The training invariants
themselves are tested on fabricated records in ``test_lab_training.py``.)"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from tests_support import NIGHTLY

from ftmesh.bench.plots import chaos_series
from ftmesh.lab import chaos
from ftmesh.lab.chaos import (
    KINDS,
    WORKLOAD_KINDS,
    ChaosContext,
    ChaosRunner,
    ChaosSummary,
    FaultPlan,
    Phase,
    parse_kinds,
)
from ftmesh.lab.netns import LabError
from ftmesh.lab.procs import SeenRecord
from ftmesh.lab.training import TrainingWorkload

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
    reason="needs root to create network namespaces (and iproute2, nftables); CI runs as root",
)

TIMED = NIGHTLY or "FTMESH_SOAK_SECONDS" in os.environ
SOAK_SECONDS = float(os.environ.get("FTMESH_SOAK_SECONDS", "180"))
SOAK_SEED = 10237
SOAK_FAULTS = 10
"""Its seed's first 10 faults are the 10 kinds of a membership run, one each: a 2+3
partition for 5 s, link flaps, a one-way link, a rate limit, a kill, a freeze, a rogue with
garbage metadata, an idle-connection flood, a junk flood and loss on one host."""
MEMBERSHIP_KINDS = set(KINDS) - set(WORKLOAD_KINDS)
TRAIN_TIMED = NIGHTLY or "FTMESH_TRAIN_SOAK_SECONDS" in os.environ
TRAIN_SOAK_SECONDS = float(os.environ.get("FTMESH_TRAIN_SOAK_SECONDS", "120"))
TRAIN_SOAK_SEED = 3142
TRAIN_SOAK_FAULTS = 8
"""Its first 8 faults hold every kind of issue 17 (a rogue member with garbage metadata, an
idle-connection flood, a one-way link, a blocked data port, a clock step), a kill (a fresh
worker joins and catches up) and a 2+2 partition (no side has a majority), the 8th. (The
membership soak above covers freezes, link flaps and junk.)"""
NEW_KINDS = {"bad_meta", "conn_flood", "one_way", "unreachable", "clock_step"}


def _schedule(runner: ChaosRunner, count: int) -> list[FaultPlan]:
    """The first ``count`` faults ``runner`` injects: its plans, with the other draws a run
    makes from the same generator in between (a link flap's pauses, a junk flood's seed, the
    pause after every fault) taken in the same order."""
    plans = []
    for _ in range(count):
        plan = runner.plan()
        if plan.kind == "link_flap":
            for _ in range(plan.flaps - 1):
                runner.rng.random()
        elif plan.kind == "junk":
            runner.rng.randrange(1 << 30)
        runner.rng.uniform(0.5, 2.0)
        plans.append(plan)
    return plans


def _ran_its_schedule(summary: ChaosSummary, runner: ChaosRunner) -> None:
    """The run injected the faults :func:`_schedule` predicts of its seed (what the counts
    of the soaks rely on)."""
    ran = [(r.kind, tuple(r.hosts), r.hold_s) for r in summary.records]
    fresh = ChaosRunner(hosts=runner.hosts, seed=runner.seed, workload=runner.workload)
    planned = _schedule(fresh, len(ran))
    assert ran == [(p.kind, p.hosts, p.hold) for p in planned]


def test_the_counted_soaks_hold_their_kinds() -> None:
    """What the soaks below assert of their kinds holds of their first faults by plan."""
    membership = _schedule(ChaosRunner(hosts=5, seed=SOAK_SEED), SOAK_FAULTS)
    assert {p.kind for p in membership} == MEMBERSHIP_KINDS
    workload = TrainingWorkload(seed=TRAIN_SOAK_SEED)
    train = _schedule(
        ChaosRunner(hosts=4, seed=TRAIN_SOAK_SEED, workload=workload), TRAIN_SOAK_FAULTS
    )
    assert {p.kind for p in train} >= NEW_KINDS | {"kill", "partition"}, train
    (split,) = [p.groups for p in train if p.kind == "partition"]
    assert sorted(map(len, split)) == [2, 2], split


def test_plan_is_a_function_of_the_seed() -> None:
    a = ChaosRunner(hosts=5, seed=7)
    b = ChaosRunner(hosts=5, seed=7)
    plans_a = [a.plan() for _ in range(200)]
    assert plans_a == [b.plan() for _ in range(200)]
    # Without a workload, the kinds that need a data plane are left out by default.
    assert {p.kind for p in plans_a} == set(KINDS) - set(WORKLOAD_KINDS)
    with_train = ChaosRunner(hosts=5, seed=7, workload=TrainingWorkload())
    assert {with_train.plan().kind for _ in range(300)} == set(KINDS)
    with pytest.raises(LabError):
        ChaosRunner(hosts=5, kinds=["unreachable"])
    for p in plans_a:
        assert all(0 <= h < 5 for h in p.hosts)
        if p.kind == "partition":
            a_side, b_side = p.groups
            assert a_side and b_side and not set(a_side) & set(b_side)
            assert sorted(a_side + b_side) == list(range(5))
        if p.kind in ("one_way", "conn_flood"):
            assert len(p.hosts) == 2 and p.hosts[0] != p.hosts[1]
        if p.kind == "bad_meta":
            assert p.meta and all("=" in m for m in p.meta)
    only = ChaosRunner(hosts=3, seed=1, kinds=["kill", "partition"])
    assert {only.plan().kind for _ in range(50)} == {"kill", "partition"}


def test_bad_arguments() -> None:
    with pytest.raises(LabError):
        parse_kinds("kill,meteor")
    with pytest.raises(LabError):
        ChaosRunner(hosts=1)
    with pytest.raises(LabError):
        ChaosRunner(duration=0)


class CountPhases:
    """A plug-in invariant (what a training workload would add); never fails, counts calls."""

    name = "phases"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def check(self, ctx: ChaosContext, phase: Phase) -> Sequence[str]:
        self.calls[phase] = self.calls.get(phase, 0) + 1
        assert len(ctx.mesh.slots) == ctx.lan.hosts
        return []


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timing  # no false death while faults (rate limits, loss, freezes) come and go
@needs_root
@pytest.mark.timeout(SOAK_SECONDS + 240)
def test_chaos_soak_fixed_seed_has_no_violations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not TIMED:
        monkeypatch.setattr(chaos, "MAX_FAULTS", SOAK_FAULTS)
    plugin = CountPhases()
    runner = ChaosRunner(
        hosts=5,
        duration=SOAK_SECONDS,
        seed=SOAK_SEED,
        log_dir=tmp_path,
        invariants=[plugin],
        progress=print,
    )
    summary = runner.run()
    print(summary.text())
    assert summary.violations == []
    assert summary.faults_total >= 10
    assert summary.recoveries == summary.faults_total
    assert len(summary.faults) >= 5, summary.faults  # most kinds were exercised
    if not TIMED:
        assert set(summary.faults) == MEMBERSHIP_KINDS, summary.faults  # all of them
    _ran_its_schedule(summary, runner)
    assert plugin.calls.get("settled", 0) == summary.faults_total + 1
    assert plugin.calls.get("final") == 1 and plugin.calls.get("tick", 0) > 0
    # The timeline --plot draws: ftmesh node members commit nothing; view changes were seen.
    series = chaos_series(summary.to_json())
    assert summary.timeline["commits"] == {} and series.steps == {}
    assert series.faults.keys() == summary.faults.keys()
    assert "joined" in series.view_changes
    assert ("dead" in series.view_changes) == (summary.deaths > 0)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timing  # no false death (a starved member is not a dead one) under faults
@needs_root
@pytest.mark.timeout(TRAIN_SOAK_SECONDS + 240)
def test_training_chaos_soak_fixed_seed_has_no_violations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    if not TRAIN_TIMED:
        monkeypatch.setattr(chaos, "MAX_FAULTS", TRAIN_SOAK_FAULTS)
    workload = TrainingWorkload(seed=TRAIN_SOAK_SEED)
    runner = ChaosRunner(
        hosts=4,
        duration=TRAIN_SOAK_SECONDS,
        seed=TRAIN_SOAK_SEED,
        log_dir=tmp_path,
        workload=workload,
        progress=print,
    )
    summary = runner.run()
    print(summary.text())
    assert summary.violations == [], summary.violations_by_kind
    assert summary.faults_total >= 8
    assert set(summary.faults) >= NEW_KINDS, summary.faults
    if not TRAIN_TIMED:
        assert {"kill", "partition"} <= set(summary.faults), summary.faults
    _ran_its_schedule(summary, runner)
    assert summary.recoveries == summary.faults_total
    stats = summary.workload_stats
    resumed = [r for r in summary.records if r.resume_s is not None]
    assert len(resumed) == summary.faults_total  # training came back after every fault
    # Every agreed state (startup, then after each fault) was checked against the last one.
    assert stats["lineage_checks"] == summary.faults_total
    assert stats["commits"] > 100 and stats["digest_checks"] > 100, stats
    # Each kill started a fresh worker, which trained (joined and caught up).
    assert stats["processes"] == 4 + summary.faults.get("kill", 0), stats
    assert stats["mean_loss_last"] < stats["mean_loss_first"], stats
    # The timeline --plot draws: every process that trained, its commits counted (it reads
    # all records at the end, the workload's log only up to its last poll).
    commits = summary.timeline["commits"]
    assert len(commits) >= stats["processes"]
    assert sum(points[-1][2] for points in commits.values()) >= stats["commits"]
    series = chaos_series(summary.to_json())
    assert sorted(series.steps) == [f"h{h}" for h in range(4)]
    assert series.faults.keys() == summary.faults.keys() and series.throughput


def test_deaths_are_judged_against_faults_and_kills() -> None:
    """A running member declared dead with no fault active is a false death; a killed one is
    really dead (not false, however late), but seen alive again after that: a resurrection."""

    def node(name: str, node_id: str, events: list[tuple[float, str, str]]) -> SimpleNamespace:
        records = [SeenRecord(t, {"event": kind, "node": about}) for t, kind, about in events]
        return SimpleNamespace(
            name=name, node_id=node_id, records=records, _cond=threading.Condition()
        )

    killed, live = "k" * 32, "l" * 32
    observer = node(
        "h0",
        "o" * 32,
        [
            (10.0, "dead", killed),  # killed at 9.0: true, even with no fault active
            (12.0, "dead", live),  # running, no fault active: false
            (13.0, "alive", live),  # it refuted: fine
            (14.0, "joined", killed),  # the killed one back: a stale rumour won
        ],
    )
    slots = [
        SimpleNamespace(history=[observer]),
        SimpleNamespace(history=[node("h1", killed, []), node("h1", live, [])]),
    ]
    ctx = ChaosContext(
        lan=cast(Any, None), mesh=cast(Any, SimpleNamespace(slots=slots)), killed_at={killed: 9.0}
    )
    runner = ChaosRunner(hosts=2, seed=1)
    runner._t0 = 0.0
    runner._count_deaths(ctx)
    s = runner.summary
    assert (s.deaths, s.false_deaths, s.resurrections) == (2, 1, 1), s.violations
    assert s.violations_by_kind == {"false_death": 1, "resurrect": 1}
    assert "h1.1" in s.violations[0] and "h1.0" in s.violations[1]
