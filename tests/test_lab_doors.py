"""The commands of docs/guide/running.md for several machines (and the mDNS node of
docs/guide/membership.md), as written, on network namespaces the tests create (each a
"machine" with a default route, on one bridge; multicast never leaves them).

* ``ftmesh worker --start-peers 3 examples/train_digits.py`` on three machines: one mesh
  forms with no other flag, survives a ``kill -9`` and the survivors reach the accuracy of
  a single process.
* Seeds where multicast is blocked: the first machine starts alone and waits to be joined
  (``ftmesh worker --discovery seeds --port 7946 --start-peers 4 train.py``); a worker on a
  second machine (``ftmesh worker --discovery seeds --join 10.0.0.4:7946 --start-peers 4
  train.py``) and ``ftmesh launch -n 2 --discovery seeds --join 10.0.0.4:7946 --start-peers 4
  train.py`` on a third join through it (the lab's addresses for 10.0.0.4).
* The interface choice on a machine without a default route, with ``ftmesh node --mesh lab
  --discovery mdns``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from tests_support import EXAMPLE, FTMESH, Machine, SingleRun, accuracy, wait_until

from ftmesh.lab import VirtualLan

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="needs root (and iproute2) to create network namespaces; CI runs as root",
    ),
]


def test_readme_multi_machine_command(tmp_path: Path, single_run: SingleRun) -> None:
    with VirtualLan(hosts=3) as lan:
        argv = [FTMESH, "worker", "--start-peers", "3", EXAMPLE]  # the page's, as written
        ms = [Machine(lan, h, argv, tmp_path / f"h{h}.log") for h in range(3)]
        try:
            wait_until(lambda: min(m.step() for m in ms) >= 150, 240, "3 workers at 150", ms)
            ms[2].proc.kill()  # kill -9, mid-run
            outs = [m.finish(timeout=300) for m in ms[:2]]
        finally:
            for m in ms:
                if m.proc.poll() is None:
                    m.proc.kill()
    for m, out in zip(ms[:2], outs, strict=True):
        assert m.proc.returncode == 0, out[-3000:]
    # One mesh of three from the first step, with no flag but --start-peers...
    for m in ms:
        assert m.records[0]["step"] == 1 and m.records[0]["members"] == 3, m.records[0]
    # ...that lost one member and went on with two, to one final model.
    for m in ms[:2]:
        assert m.records[-2]["members"] == 2, m.records[-2]
    assert len({m.records[-1]["digest"] for m in ms[:2]}) == 1
    total = int(ms[0].records[0]["total"])
    assert {int(m.records[-1]["step"]) for m in ms[:2]} == {total}
    single = single_run.accuracy()
    for out in outs:
        assert abs(accuracy(out) - single) <= 0.02, (accuracy(out), single)


def test_seed_mesh_first_member_alone_then_others_join(tmp_path: Path) -> None:
    script = [EXAMPLE, "--epochs", "2", "--step-delay", "0"]  # the user's train.py
    seeds = ["--discovery", "seeds"]
    with VirtualLan(hosts=3) as lan:
        seed = f"{lan.host_ip(0)}:7946"
        # The page's seed commands. The first machine has nobody to join: it waits.
        first = Machine(
            lan, 0, [FTMESH, "worker", *seeds, "--port", "7946", "--start-peers", "4", *script],
            tmp_path / "first.log",
        )  # fmt: skip
        time.sleep(3)  # up alone (no seed, nobody there) before anyone joins
        assert first.proc.poll() is None, "".join(first.lines)
        other = Machine(
            lan, 1, [FTMESH, "worker", *seeds, "--join", seed, "--start-peers", "4", *script],
            tmp_path / "other.log",
        )  # fmt: skip
        launch = Machine(
            lan,
            2,
            [FTMESH, "launch", "-n", "2", "--no-live", "--log-dir", str(tmp_path / "launch"),
             *seeds, "--join", seed, "--start-peers", "4", *script],
            tmp_path / "launch.log",
        )  # fmt: skip
        machines = [first, other, launch]
        try:
            outs = [m.finish(timeout=300) for m in machines]
        finally:
            for m in machines:
                if m.proc.poll() is None:
                    m.proc.kill()
    for m, out in zip(machines, outs, strict=True):
        assert m.proc.returncode == 0, out[-3000:]
    runs = [first.records, other.records]
    for log in sorted((tmp_path / "launch").glob("w*.log")):
        runs.append(
            [
                json.JSONDecoder().raw_decode(line[7:])[0]
                for line in log.read_text().splitlines()
                if line.startswith("FTMESH ")
            ]
        )
    assert len(runs) == 4
    for recs in runs:  # one mesh of four from the first step
        assert recs[0]["step"] == 1 and recs[0]["members"] == 4, recs[0]
    assert len({recs[-1]["digest"] for recs in runs}) == 1


def test_interface_choice_without_a_default_route(tmp_path: Path) -> None:
    with VirtualLan(hosts=1) as lan:
        ip = lan.host_ip(0)
        node = [FTMESH, "node", "--mesh", "lab", "--discovery", "mdns"]  # the membership page's

        def self_addr(argv: list[str]) -> str:
            """The address the node announces: its first line, ``self NAME ADDR inc=0``."""
            p = lan.popen(0, argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                assert p.stderr is not None
                line = p.stderr.readline().split()
                assert line[:1] == ["self"], line
                return line[2].rpartition(":")[0]
            finally:
                p.kill()
                p.wait(10)

        assert self_addr(node) == ip  # the default route's interface
        lan.run(0, ["ip", "route", "del", "default"], timeout=10)
        assert self_addr(node) == ip  # no default route, one candidate: that one
        lan.run(0, ["ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"], timeout=10)
        lan.run(0, ["ip", "addr", "add", "10.88.0.1/24", "dev", "v0"], timeout=10)
        for dev in ("v0", "v1"):
            lan.run(0, ["ip", "link", "set", dev, "up"], timeout=10)
        res = lan.run(0, node, timeout=30)  # two candidates: which is the LAN?
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and f"eth0 {ip}" in lines[0] and "v0 10.88.0.1" in lines[0], lines
        assert "--interface" in lines[0]
        assert self_addr([*node, "--interface", "v0"]) == "10.88.0.1"
