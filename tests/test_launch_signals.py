"""``ftmesh launch`` stopped by SIGTERM (issue #26, item 6), and ``ftmesh status`` reading the
mesh it started (issue #25, item 4): real processes on loopback, a same-host registry in the
test's directory, a training script that prints nothing
(``tests/scripts/leaving_worker.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests_support import ROOT

from ftmesh.cli.launch_cmd import LEAVE_GRACE_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
LEAVING = str(ROOT / "tests" / "scripts" / "leaving_worker.py")
TERM_AFTER_S = 25
"""``timeout -s TERM`` this many seconds after the launcher starts: time for the workers to
start and for the ``status`` checks below, on a loaded host."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # (a zombie is gone for our purpose)
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return False


def _status(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftmesh", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


def test_sigterm_stops_launch_cleanly_and_status_reads_its_mesh(tmp_path: Path) -> None:
    registry, records = tmp_path / "registry", tmp_path / "records"
    records.mkdir()
    env = {
        **os.environ,
        "FTMESH_REGISTRY_DIR": str(registry),
        "LEAVING_RECORDS": str(records),
        "LEAVING_STEPS": "100000",
    }
    env.pop("FTMESH_MESH", None)
    launcher = subprocess.Popen(
        ["timeout", "--preserve-status", "-s", "TERM", str(TERM_AFTER_S),
         sys.executable, "-m", "ftmesh", "launch", "--no-live", "--log-dir",
         str(tmp_path / "logs"), "-n", "3", LEAVING],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
    )  # fmt: skip
    guard = threading.Timer(180, launcher.kill)  # (a launcher that never ends fails the test)
    guard.start()
    lines: list[str] = []
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            lines.append(line)
            if re.match(r"  step [1-9]\d*  world 3 ", line):
                break  # the mesh trains
        out = "".join(lines)
        mesh = re.search(r"\] mesh (launch-\S+) \(see it with: ftmesh status --mesh \1\)", out)
        assert mesh, out
        name = mesh.group(1)
        # Plain status, no mesh named: the only mesh on this host.
        plain = _status(env)
        assert plain.returncode == 0, plain.stdout + plain.stderr
        assert f"reading mesh {name}" in plain.stderr, plain.stderr
        rows = {ln.split()[0]: ln.split() for ln in plain.stdout.splitlines()[1:] if ln.strip()}
        assert {"w0", "w1", "w2"} <= set(rows), plain.stdout
        # --watch with the name launch printed.
        # (Up to three reads: on a loaded host one read may catch a member between states.)
        watch = _status(env, "--mesh", name, "--watch", "--count", "3", "--interval", "0.5")
        assert watch.returncode == 0, watch.stdout + watch.stderr
        assert watch.stdout.startswith(f"mesh {name} at "), watch.stdout
        frames = watch.stdout.split(f"mesh {name} at ")[1:]
        assert len(frames) == 3, watch.stdout

        def trains(frame: str, i: int) -> bool:
            return re.search(rf"^w{i}\s+alive\s+train\s+\d+", frame, re.M) is not None

        assert any(all(trains(f, i) for i in range(3)) for f in frames), watch.stdout
        rest, _ = launcher.communicate(timeout=TERM_AFTER_S + LEAVE_GRACE_S + 60)
        ended = time.monotonic()
    finally:
        guard.cancel()
        if launcher.poll() is None:
            launcher.kill()
    out = "".join(lines) + rest
    pids = [int(p) for p in re.findall(r"started w\d \(pid (\d+),", out)]
    assert len(pids) == 3, out
    # The launcher exits with 128 + SIGTERM, saying what happened.
    assert launcher.returncode == 143, out[-3000:]
    assert "SIGTERM: every worker leaves the mesh" in out, out[-3000:]
    assert "stopped by SIGTERM: 3 worker(s) left the mesh" in out, out[-3000:]
    # No worker outlives the launcher: it waited for them (or killed them in the bound).
    assert not [p for p in pids if _alive(p)], out[-3000:]
    assert time.monotonic() - ended < LEAVE_GRACE_S
    # Each one left in a planned departure (its own record), and exited 0.
    for i in range(3):
        own = (records / f"w{i}.jsonl").read_text().splitlines()
        assert own[-1].startswith('{"left": '), (i, own[-3:])
        assert re.search(
            rf"^  w{i} \(pid \d+\): stopped by the launcher \(exit code 0\)", out, re.M
        )
    # No registry left behind.
    assert not (registry / name).exists(), list((registry / name).iterdir())
    assert "Traceback" not in out, out[-3000:]


def test_status_finds_nothing_and_watch_exits_like_status(tmp_path: Path) -> None:
    env = {**os.environ, "FTMESH_REGISTRY_DIR": str(tmp_path / "registry")}
    env.pop("FTMESH_MESH", None)
    plain = _status(env, "--mesh", "nobody")
    watch = _status(env, "--mesh", "nobody", "--watch", "--count", "3", "--interval", "0.1")
    assert plain.returncode == watch.returncode == 2, (plain, watch)
    assert plain.stderr == watch.stderr, (plain.stderr, watch.stderr)
    assert "no member of mesh 'nobody' found" in watch.stderr, watch.stderr
    assert watch.stdout == ""


def test_status_with_no_mesh_named_lists_the_meshes_on_this_host(tmp_path: Path) -> None:
    """Two meshes with live members on this host (entries of this test's own pid) and no mesh
    named: one line naming both, exit status 2."""
    registry = tmp_path / "registry"
    for mesh, node in (("launch-1-aa", "a" * 32), ("launch-2-bb", "b" * 32)):
        (registry / mesh).mkdir(parents=True)
        entry = (
            f'{{"format": 1, "mesh": "{mesh}", "node_id": "{node}", "name": "w0",'
            f' "host": "127.0.0.1", "port": 9, "version": 1, "pid": {os.getpid()}}}'
        )
        (registry / mesh / f"{node}.json").write_text(entry)
    env = {**os.environ, "FTMESH_REGISTRY_DIR": str(registry)}
    env.pop("FTMESH_MESH", None)
    res = _status(env, "--watch", "--count", "1")
    assert res.returncode == 2, res
    assert "launch-1-aa (1 members), launch-2-bb (1 members)" in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
