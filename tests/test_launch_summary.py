"""The launcher's numbers are the mesh's numbers (issue #25, item 3): with a script that prints
no ``FTMESH`` lines, a kill and a join, the view and the summary agree with each member's own
records; a dead worker's numbers leave the view; a ``--kill-at`` that never fired says what
happened instead."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import ROOT

from ftmesh.cli.launch_cmd import Launcher, Worker
from ftmesh.cli.main import build_parser

LEAVING = str(ROOT / "tests" / "scripts" / "leaving_worker.py")
FAILING = str(ROOT / "tests" / "scripts" / "failing_worker.py")
STEPS = 150


def _records(path: Path) -> dict[str, dict[int, int]]:
    """Each worker's own records: step -> world size (a killed worker's last line may be cut
    short: it is not a record)."""
    out: dict[str, dict[int, int]] = {}
    for f in path.glob("w*.jsonl"):
        out[f.stem] = {}
        for line in f.read_text().splitlines():
            if line.endswith("}") and '"step"' in line:
                r = json.loads(line)
                out[f.stem][r["step"]] = r["world"]
    return out


def _launch(tmp: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftmesh", "launch", "--no-live", "--log-dir", str(tmp), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_summary_and_view_are_the_members_records_through_a_kill_and_a_join(
    tmp_path: Path,
) -> None:
    records = tmp_path / "records"
    records.mkdir()
    env = {
        **os.environ,
        "FTMESH_REGISTRY_DIR": str(tmp_path / "registry"),
        "LEAVING_RECORDS": str(records),
        "LEAVING_STEPS": str(STEPS),
        "LEAVING_DELAY": "0.1",
    }
    res = _launch(
        tmp_path / "logs", "-n", "3", "--kill-at", "10", "--join-at", "20", LEAVING, env=env
    )
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    for log in (tmp_path / "logs").glob("w*.log"):
        assert "FTMESH " not in log.read_text(), f"{log} printed progress records"
    own = _records(records)
    assert sorted(own) == ["w0", "w1", "w2", "w3"], out[-3000:]
    kill = re.search(r"step \d+: kill -9 (w\d) ", out)
    assert kill, out[-3000:]
    victim = kill.group(1)
    # The summary: the run's committed steps, and each worker's last step as it recorded it.
    summary = out.split("\nworkers:\n")[1]
    assert re.search(rf"^committed steps: {STEPS}$", summary, re.M), summary
    for name, steps in own.items():
        line = re.search(rf"^  {name} \(pid \d+\): (.*) at step (\d+)$", summary, re.M)
        assert line, summary
        if name == victim:
            assert line.group(1).startswith("killed by the launcher"), line.group(0)
            assert int(line.group(2)) <= max(steps), (line.group(0), max(steps))
        else:
            assert line.group(1) == "exit code 0", line.group(0)
            assert int(line.group(2)) == max(steps) == STEPS, (line.group(0), max(steps))
    # The joiner joins with the world of its first published step, as it recorded it.
    joined = re.search(r"step (\d+): w3 joins \(world (\d+)\)", out)
    assert joined, out[-3000:]
    assert int(joined.group(2)) == own["w3"][int(joined.group(1))] == 3, joined.group(0)
    # The view: every step/world it shows is that member's own record; a worker leaves the
    # view when it ends; no line is repeated.
    view = [ln for ln in out.splitlines() if ln.startswith("  ")]
    assert all(a != b for a, b in itertools.pairwise(view)), view
    assert sum("waiting for the first committed step" in ln for ln in view) == 1, view
    shown_after_death = False
    for ln in out.splitlines():
        if re.search(rf"\] {victim} ended: ", ln):
            shown_after_death = True
        if ln.startswith("  step "):
            for name, step, world in re.findall(r"(w\d) (\d+)/(\d+)", ln):
                assert own[name][int(step)] == int(world), (ln, own[name].get(int(step)))
                assert not (shown_after_death and name == victim), ln
            for world in re.findall(r"^  step \d+  world (\d+) ", ln):
                assert int(world) in (2, 3), ln
    assert "never fired" not in out


def test_a_kill_that_never_fired_says_every_worker_failed(tmp_path: Path) -> None:
    env = {**os.environ, "FTMESH_REGISTRY_DIR": str(tmp_path / "registry")}
    res = _launch(tmp_path / "logs", "-n", "2", "--kill-at", "5", FAILING, env=env)
    assert res.returncode == 1, res.stdout[-3000:]
    warn = re.search(r"^warning: --kill-at 5 never fired: (.*)$", res.stdout, re.M)
    assert warn, res.stdout[-3000:]
    assert "w1 (exit code 1) failed" in warn.group(1), warn.group(0)


def _worker(tmp: Path, name: str, *, running: bool, step: int, loss: float) -> Worker:
    cmd = ["sleep", "30"] if running else ["true"]
    proc = subprocess.Popen(cmd)
    if not running:
        proc.wait()
    w = Worker(name, proc, tmp / f"{name}.log", 0.0, 0)
    w.step, w.members, w.progressed, w.loss = step, 2, True, loss
    return w


def test_the_plain_view_never_shows_a_dead_workers_loss(tmp_path: Path) -> None:
    args = build_parser().parse_args(["launch", "-n", "2", "--log-dir", str(tmp_path), LEAVING])
    launcher = Launcher(args, sys.stdout)
    live = _worker(tmp_path, "w0", running=True, step=5, loss=1.25)
    dead = _worker(tmp_path, "w1", running=False, step=6, loss=0.5)
    launcher.workers = [live, dead]
    try:
        line = launcher.line()
    finally:
        live.proc.kill()
        live.proc.wait()
    assert "loss 1.2500" in line and "w1" not in line, line
    assert "[w0 5/2]" in line, line
