"""End to end: ``ftmesh launch`` trains ``examples/train_digits.py`` on a local mesh of real
processes while workers are killed with SIGKILL and new ones join."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests_support import (
    EXAMPLE,
    ROOT,
    SingleRun,
    accuracy,
    check_consistency,
    check_consistency_from,
    launch,
    progress,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_launch_kill_and_join_trains_digits(tmp_path: Path, single_run: SingleRun) -> None:
    res = launch(
        tmp_path / "mesh",
        "-n",
        "4",
        "--kill-at",
        "20",
        "--join-at",
        "40",
        EXAMPLE,
        "--digest-every",
        "1",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    acc = accuracy(res.stdout)
    assert acc >= 0.95
    records = progress(tmp_path / "mesh")
    assert len(records) == 5  # four at start, one joiner
    done = {name: r[-1] for name, r in records.items() if r and r[-1].get("done")}
    assert len(done) == 4, "the killed worker should be the only one not finishing"
    assert len({str(r["digest"]) for r in done.values()}) == 1, "final weights differ"
    for name in ("w0", "w1", "w2", "w3"):  # the first four took their first step together
        first = records[name][0]
        assert (first["step"], first["members"]) == (1, 4), (name, first)
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    check_consistency(records, total)
    # The joiner entered mid-run, with the others' state.
    joiner = records["w4"]
    assert 40 < int(joiner[0]["step"]) < total and joiner[0]["synced"]  # type: ignore[call-overload]
    assert abs(single_run.accuracy() - acc) <= 0.01


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
