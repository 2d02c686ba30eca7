"""A training mesh of real ``ftmesh worker`` processes beside hostile or broken peers (probes 1
and 3 of issue #17), on loopback with same-host discovery. One mesh serves every test here,
in order:

* a member whose metadata does not parse (``data=garbage``) used to kill every training
  member's mesh loop; now it is left out of the view, counted and reported;
* sustained floods of idle TCP connections (1,100 to the data-plane port of a worker limited to
  1,024 descriptors, 64 to its gossip port) used to stall the mesh for minutes, refuse every
  join and crash the worker with ``EMFILE``; now the idle connections are shed, a join through
  the flooded gossip port (``--discovery none``, retried) succeeds within 5 s, a new worker
  enters the ring and training goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests_support import ROOT, Worker

from ftmesh.lab.flood import IdleFlood
from ftmesh.lab.procs import NodeProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)"),
]

MESH = "hostile"
COMMON = ("--mesh", MESH, "--discovery", "local", "--preset", "local")
FLOOD_SOURCES = tuple(f"127.0.0.{i}" for i in range(2, 6))
"""The flood comes from four other hosts (loopback aliases)."""


@dataclass
class Mesh:
    env: dict[str, str]
    log_dir: Path
    workers: list[Worker]
    nodes: list[NodeProcess]

    def node(self, name: str, *args: str) -> NodeProcess:
        argv = [sys.executable, "-m", "ftmesh", "node", *args, "--events", "json"]
        node = NodeProcess(argv, env=self.env, stderr_path=self.log_dir / f"{name}.log")
        self.nodes.append(node)
        return node

    def status(self) -> dict[str, dict[str, object]]:
        res = subprocess.run(
            [sys.executable, "-m", "ftmesh", "status", *COMMON[:4], "--json"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert res.returncode == 0, res.stderr
        return {m["node"]: m for m in json.loads(res.stdout)}

    def keeps_training(self, steps: int = 5, within: float = 60.0) -> None:
        """Every worker commits ``steps`` more steps within ``within`` seconds (a machine busy
        with other work slows them down: this asserts that training goes on, not a rate)."""
        for w, start in [(w, w.last_step()) for w in self.workers]:
            w.wait(lambda w, s=start: w.last_step() >= s + steps, within, "training going on")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("hostile")
    env = {**os.environ, "FTMESH_REGISTRY_DIR": str(tmp / "registry"), "FTMESH_LOG": "WARNING"}
    args = ("--step-delay", "0.05", "--epochs", "1000", "--digest-every", "0")
    m = Mesh(env, tmp, [], [])
    try:
        m.workers.append(
            Worker(
                tmp / "w0.log", env, *COMMON, prefix=("prlimit", "--nofile=1024"), script_args=args
            )
        )
        m.workers.append(Worker(tmp / "w1.log", env, *COMMON, script_args=args))
        for w in m.workers:
            w.wait(lambda w: any(r["members"] == 2 for r in w.steps()), 120, "training in two")
        yield m
    finally:
        for w in m.workers:
            w.stop()
        for n in m.nodes:
            n.kill()


def test_a_member_with_garbage_metadata_is_left_out_counted_and_reported(mesh: Mesh) -> None:
    bad = mesh.node("bad", *COMMON, "--meta", "role=train", "--meta", "data=garbage")
    for w in mesh.workers:
        w.wait(lambda w: "is left out of the mesh" in w.text(), 30, "the bad member reported")
        assert "data: expected HOST:PORT, got 'garbage'" in w.text()
    mesh.keeps_training()
    assert all(w.steps()[-1]["members"] == 2 for w in mesh.workers)
    flagged = mesh.status()[bad.node_id]
    assert "UNUSABLE" in str(flagged.get("problem")) and "garbage" in str(flagged["problem"])
    bad.kill()


def test_idle_connection_floods_neither_crash_nor_block_the_mesh(mesh: Mesh) -> None:
    w0 = mesh.workers[0]
    members = mesh.status()
    me = members[w0.steps()[-1]["node"]]
    data = str(me["meta"]["data"]).rsplit(":", 1)  # type: ignore[index]
    gossip = str(me["addr"]).rsplit(":", 1)
    with (
        IdleFlood(data[0], int(data[1]), 1100, sources=FLOOD_SOURCES) as data_flood,
        IdleFlood(gossip[0], int(gossip[1]), 64, sources=FLOOD_SOURCES) as gossip_flood,
    ):
        assert data_flood.opened == 1100 and gossip_flood.opened == 64
        # A new worker enters the ring through the flooded port. (Started before the flood,
        # it was once in before the 1100 connections were open: nothing tested.)
        w2 = Worker(mesh.log_dir / "w2.log", mesh.env, *COMMON, script_args=("--epochs", "1000"))
        mesh.workers.append(w2)
        # A joiner that knows only the flooded gossip port (no discovery: it must retry).
        joiner = mesh.node("joiner", *COMMON[:2], "--discovery", "none", "--join", ":".join(gossip))
        seen = joiner.wait_seen(lambda r: r["event"] == "self", 10)
        joined = joiner.wait_seen(lambda r: r["event"] == "joined" and r["node"] == me["node"], 10)
        assert joined.mono - seen.mono < 5.0
        w2.wait(lambda w: bool(w.steps()), 120, "the new worker's first step")
        mesh.keeps_training()
        assert mesh.workers[0].steps()[-1]["members"] == 3
        assert data_flood.closed_by_peer > 100 and gossip_flood.closed_by_peer > 0
        joiner.stop()  # (w2 stays: the next tests train with it)
    assert w0.proc.poll() is None and "Traceback" not in w0.text()
    assert "closed unauthenticated" in w0.text()  # the shed flood, reported
    mesh.keeps_training()
