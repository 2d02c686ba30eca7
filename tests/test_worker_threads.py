"""``ftmesh worker`` shares the host's cores among the workers on it (issue #25, item 5): with
no ``OMP_NUM_THREADS`` set, each gets ``cores // workers`` threads (``LOCAL_WORLD_SIZE`` if
set, else the ``ftmesh worker`` processes running), as ``ftmesh launch`` does; one set by the
user is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests_support import ROOT

from ftmesh.cli.worker_cmd import _workers_on_host, default_threads


def _fake_proc(root: Path, cmdlines: list[list[str]]) -> Path:
    for pid, argv in enumerate(cmdlines, start=100):
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (root / "self").mkdir()  # (not a pid)
    return root


def test_workers_on_host_counts_ftmesh_workers_only(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path,
        [
            ["python", "-m", "ftmesh", "worker", "train.py"],
            ["/usr/bin/python3", "-m", "ftmesh", "-v", "worker", "-m", "pkg.train"],
            ["python", "-m", "ftmesh", "status", "--watch"],
            ["python", "train.py", "worker"],
        ],
    )
    assert _workers_on_host(proc) == 2


def test_default_threads() -> None:
    assert default_threads({"OMP_NUM_THREADS": "3"}, cpus=16) is None
    assert default_threads({"LOCAL_WORLD_SIZE": "4"}, cpus=16) == 4
    assert default_threads({"LOCAL_WORLD_SIZE": "32"}, cpus=16) == 1


def test_the_worker_sets_threads_before_the_script_runs(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text("import os\nprint('threads', os.environ.get('OMP_NUM_THREADS'))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["LOCAL_WORLD_SIZE"] = "2"
    res = subprocess.run(
        [sys.executable, "-m", "ftmesh", "worker", "--discovery", "none", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert f"threads {max(1, (os.cpu_count() or 1) // 2)}" in res.stdout, res.stdout
    env["OMP_NUM_THREADS"] = "7"
    res = subprocess.run(
        [sys.executable, "-m", "ftmesh", "worker", "--discovery", "none", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert "threads 7" in res.stdout, res.stdout + res.stderr
