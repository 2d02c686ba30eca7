"""End to end: ``ftmesh launch`` on a local mesh of real processes: a script's error, a cold
restart from checkpoints, respawn slots and late joiners. Its kill-and-join run is the README's
demo, run as written from a user's install: ``test_install.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests_support import (
    EXAMPLE,
    ROOT,
    check_consistency_from,
    launch,
    progress,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # the slowest ~130 s on a loaded host


def test_script_error_is_reported_with_worker_and_traceback(tmp_path: Path) -> None:
    script = str(ROOT / "tests" / "scripts" / "failing_worker.py")
    res = launch(tmp_path, "-n", "3", script, timeout=120)
    assert res.returncode != 0
    assert "worker w1" in res.stdout
    assert "RuntimeError: boom: the model diverged in w1" in res.stdout
    assert "Traceback" in res.stdout


def test_cold_restart_resumes_from_newest_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    common = ["--step-delay", "0", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"]
    first = launch(tmp_path / "first", "-n", "2", EXAMPLE, "--epochs", "1", *common)
    assert first.returncode == 0, first.stdout[-3000:]
    assert sorted(p.name for p in ckpt.glob("*")), "no checkpoint written"
    # The whole mesh is gone; a new one started cold resumes at the newest checkpoint (40).
    second = launch(tmp_path / "second", "-n", "2", EXAMPLE, "--epochs", "2", *common)
    assert second.returncode == 0, second.stdout[-3000:]
    for recs in progress(tmp_path / "second").values():
        assert int(recs[0]["step"]) == 41, recs[0]  # type: ignore[call-overload]
    check_consistency_from(progress(tmp_path / "second"), first=41, total=88)


def test_launch_module_respawn_slots_and_a_late_joiner(tmp_path: Path) -> None:
    """``-m``, ``--respawn`` (a killed worker is replaced by a new member in its slot, with
    its GPU), and a ``--join-at`` worker that arrives when training is over: it must not
    train the whole run alone; launch still succeeds. ``--min-peers 2`` holds the survivor
    after the kill until the replacement (importing torch on a busy host) is in, so that it
    arrives mid-run however long it takes to start; the run is at full speed otherwise."""
    res = subprocess.run(
        [sys.executable, "-m", "ftmesh", "launch", "--no-live", "--log-dir", str(tmp_path),
         "-n", "2", "--respawn", "--kill-at", "3", "--join-at", "172",
         "-m", "examples.train_digits", "--epochs", "4", "--step-delay", "0",
         "--min-peers", "2", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "3,5"},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert (
        "LOCAL_RANK 0, CUDA_VISIBLE_DEVICES 3)" in out
        and "LOCAL_RANK 1, CUDA_VISIBLE_DEVICES 5)" in out
    )
    killed = re.search(r"kill -9 (w\d)", out)
    assert killed, out[-3000:]
    slot = {"w0": "0", "w1": "1"}[killed.group(1)]
    # The replacement took the slot (and GPU) of the worker it replaced, and trained.
    assert (
        "started w2 (pid" in out
        and f"LOCAL_RANK {slot}, CUDA_VISIBLE_DEVICES" in out.split("started w2")[1].split("\n")[0]
    ), out[-3000:]
    records = progress(tmp_path)
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    # It entered mid-run with the survivor's state: at the kill's step when it arrived while
    # the survivor still waited for a quorum (one of two, for ``quorum_grace``), else later.
    first = records["w2"][0]
    assert 3 <= int(first["step"]) < total and first["synced"], first  # type: ignore[call-overload]
    assert any(int(r.get("share", 0)) > 0 for r in records["w2"][1:]), records["w2"][:3]  # type: ignore[call-overload]
    finishers = [r[-1] for r in records.values() if r and r[-1].get("done")]
    assert len(finishers) == 2 and len({str(r["digest"]) for r in finishers}) == 1
    # The late joiner never trained (it exited cleanly, or launch stopped it).
    assert not records.get("w3"), records.get("w3")
    assert (
        "no worker joins" in out
        or "w3 arrived after the training ended" in out
        or (
            "the training finished before this member could join"
            in (tmp_path / "w3.log").read_text()
        )
    ), out[-3000:]


def test_launch_has_no_default_time_limit(tmp_path: Path) -> None:
    from ftmesh.cli.launch_cmd import Launcher
    from ftmesh.cli.main import build_parser

    args = build_parser().parse_args(["launch", "-n", "2", "--log-dir", str(tmp_path), EXAMPLE])
    assert args.timeout is None
    assert Launcher(args, sys.stdout).deadline - time.monotonic() > 15 * 60


def _free_run(n: int) -> int:
    """The first of ``n`` consecutive TCP ports free on 127.0.0.1 right now."""
    import contextlib
    import socket

    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + n > 65536:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first, first + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise AssertionError(f"no {n} consecutive free ports")


def test_launch_gives_worker_k_the_fixed_data_and_state_ports_plus_k(tmp_path: Path) -> None:
    """``--data-port P --state-port Q``: worker k binds and publishes P+k and Q+k."""
    data = _free_run(4)
    state = data + 2
    script = str(ROOT / "tests" / "scripts" / "serve_state_only.py")
    res = launch(tmp_path, "-n", "2", "--data-port", str(data), "--state-port", str(state), script)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for k in range(2):
        log = (tmp_path / f"w{k}.log").read_text()
        want = f"published data 127.0.0.1:{data + k} state 127.0.0.1:{state + k}"
        assert want in log, log[-2000:]
