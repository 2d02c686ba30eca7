"""Starting together (``ftmesh.training.start``, ``ftmesh.torch.starting``), below the torch layer.

The start race of issue #12: the first member to see ``start_peers`` ready enters the ring
(role ``train``) at once, so a member that counts only ``starting`` members never counts it
and waits out the whole timeout (11 of 19 ``ftmesh launch -n 2/-n 4`` runs stalled 60 s).
Reproduced here deterministically, on the machine and on real meshes (SWIM over loopback).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

import ftmesh
from ftmesh.cli.main import run
from ftmesh.errors import MeshNotFormedError, TrainingFinishedError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch.starting import wait_to_start
from ftmesh.training import start
from ftmesh.training.start import Decision, Peer, StartConfig, StartGate


def peer(
    name: str, role: str, *, alive: bool = True, left: bool = False, started: bool = False
) -> Peer:
    return Peer(
        node=name, name=name, alive=alive and not left, left=left, role=role, started=started
    )


def test_a_member_that_already_entered_the_ring_counts() -> None:
    # b saw both of us "starting" and entered the ring within one poll of ours.
    gate = StartGate(StartConfig(start_peers=2), now=0.0)
    status = gate.observe(0.1, [peer("a", "starting"), peer("b", "train")])
    assert status.decision is Decision.ENTER, status
    # A cold spare waiting for a slot has passed the start too; a member still joining not.
    gate = StartGate(StartConfig(start_peers=3), now=0.0)
    ready = [peer("a", "starting"), peer("b", "spare"), peer("c", "joining")]
    assert gate.observe(0.1, ready).decision is Decision.WAIT
    assert gate.observe(0.2, [*ready[:2], peer("c", "starting")]).decision is Decision.ENTER


def test_timeout_majority_goes_ahead_minority_gives_up() -> None:
    cfg = StartConfig(start_peers=4, timeout=60.0)
    three = [peer(n, "starting") for n in "abc"]
    gate = StartGate(cfg, now=0.0)
    assert gate.observe(59.9, three).decision is Decision.WAIT
    assert gate.observe(60.0, three).decision is Decision.GO_AHEAD
    two = StartGate(cfg, now=0.0).observe(60.0, three[:2])
    assert two.decision is Decision.GIVE_UP  # 2 of 4 is not more than half: no split
    assert two.describe().startswith("found 2 of 4 members (start_peers) after 60s: a, b")
    # Dead members are not ready; a member that has committed a step means the mesh started.
    dead = StartGate(cfg, now=0.0).observe(60.0, [*three[:2], peer("c", "starting", alive=False)])
    assert dead.decision is Decision.GIVE_UP
    assert StartGate(cfg, 0.0).observe(1.0, [peer("x", "train", started=True)]).decision is (
        Decision.JOIN
    )
    # A mesh whose members finished (they idle as "done"): a newcomer never trains alone.
    over = [peer("me", "starting"), peer("x", "done", started=True)]
    assert StartGate(cfg, 0.0).observe(1.0, over).decision is Decision.FINISHED
    assert StartGate(cfg, 0.0).observe(1.0, [over[0], peer("x", "done")]).decision is (
        Decision.FINISHED
    )
    ending = [*over, peer("y", "train", started=True)]  # some still finishing: join them
    assert StartGate(cfg, 0.0).observe(1.0, ending).decision is Decision.JOIN


def test_reports_come_early_and_keep_coming() -> None:
    gate = StartGate(StartConfig(start_peers=2, timeout=60.0), now=0.0)
    alone = [peer("a", "starting")]
    reports = [t for t in range(60) if gate.observe(float(t), alone).report]
    assert reports == [5, 20, 35, 50]  # REPORT_AFTER, then every REPORT_EVERY


def test_a_member_joining_a_running_mesh_never_starts_one() -> None:
    cfg = StartConfig(join_running=True, timeout=30.0)
    gate = StartGate(cfg, now=0.0)
    assert gate.observe(1.0, [peer("me", "joining")]).decision is Decision.WAIT
    # Members of a fresh mesh about to start are not a running mesh.
    assert gate.observe(2.0, [peer("me", "joining"), peer("a", "starting")]).decision is (
        Decision.WAIT
    )
    running = [peer("me", "joining"), peer("a", "train", started=True)]
    assert gate.observe(3.0, running).decision is Decision.JOIN
    over = [peer("me", "joining"), peer("a", "done", started=True), peer("b", "train", left=True)]
    assert gate.observe(3.0, over).decision is Decision.FINISHED
    assert gate.observe(30.0, [peer("me", "joining")]).decision is Decision.GIVE_UP


# ---------------------------------------------------------------- real meshes, no torch


def _connect(registry: Path, mesh: str) -> SyncMesh:
    return ftmesh.connect(mesh=mesh, registry_dir=str(registry), preset="local", role="joining")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[SyncMesh]]:
    with ExitStack() as stack:
        ms = [stack.enter_context(_connect(tmp_path, "race")) for _ in range(2)]
        deadline = time.monotonic() + 20
        while any(len(m.members()) < 2 for m in ms) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield ms


def test_start_race_on_real_meshes(pair: list[SyncMesh]) -> None:
    a, b = pair
    # b saw the count reached and moved to "train" before a's next look at the membership.
    b.set_role("train")
    wait_to_start(a, StartConfig(start_peers=2, timeout=10.0))
    view = a.view()
    assert view is not None and {p.node_id for p in view.members} == {a.node_id, b.node_id}


def test_a_lonely_member_says_so_and_gives_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(start, "REPORT_AFTER", 0.5)
    with _connect(tmp_path, "alone") as m, caplog.at_level(logging.WARNING, "ftmesh.start"):
        with pytest.raises(MeshNotFormedError) as err:
            wait_to_start(m, StartConfig(start_peers=3, timeout=2.0))
        assert m.role == "starting"  # it never entered a ring of its own
    text = str(err.value)
    assert "found 1 of 3 members (start_peers)" in text and "local discovery" in text, text
    assert "--start-peers" in text and "\n" not in text
    warned = [r.getMessage() for r in caplog.records if "waiting to start" in r.getMessage()]
    assert warned and "found 1 of 3" in warned[0], caplog.records


def test_a_late_joiner_finds_the_training_over(tmp_path: Path) -> None:
    with _connect(tmp_path, "late") as done, _connect(tmp_path, "late") as late:
        deadline = time.monotonic() + 20
        while len(late.members()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        done.set_role("done")  # what ElasticTrainer.finish() says before it leaves
        with pytest.raises(TrainingFinishedError):
            wait_to_start(late, StartConfig(join_running=True, timeout=20.0))


def test_status_shows_a_member_waiting_for_its_start_peers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ftmesh.connect(
        mesh="lonely", registry_dir=str(tmp_path), preset="local", start_peers=3, role="starting"
    ):
        rc = run(["status", "--mesh", "lonely", "--registry-dir", str(tmp_path), "--timeout", "2"])
    out = capsys.readouterr()
    assert rc == 0 and "role=starting" in out.out, out
    assert "was told to expect 3 members (start_peers) but this mesh has 1" in out.err, out.err
    assert "waiting to start" in out.err


def test_a_member_whose_seeds_never_answer_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ftmesh.net import node

    monkeypatch.setattr(node, "ALONE_WARN_AFTER", 0.5)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))  # a port nobody listens on
        seed = f"127.0.0.1:{closed.getsockname()[1]}"
        with (
            caplog.at_level(logging.WARNING, "ftmesh.node"),
            ftmesh.connect(join=[seed], preset="local", environ={}),
        ):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                "still alone" in r.getMessage() for r in caplog.records
            ):
                time.sleep(0.1)
    alone = [r.getMessage() for r in caplog.records if "still alone" in r.getMessage()]
    assert alone and f"no answer from {seed} (connection refused)" in alone[0], caplog.records
    assert "seeds discovery" in alone[0] and "--join" in alone[0]
