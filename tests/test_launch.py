"""End to end: ``ftmesh launch`` trains ``examples/train_digits.py`` on a local mesh of real
processes while workers are killed with SIGKILL and new ones join."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "train_digits.py")


def launch(tmp: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftmesh", "launch", "--no-live", "--log-dir", str(tmp), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


def progress(log_dir: Path) -> dict[str, list[dict[str, object]]]:
    out: dict[str, list[dict[str, object]]] = {}
    for log in sorted(log_dir.glob("w*.log")):
        out[log.stem] = [json.loads(line[len("FTMESH "):])
                         for line in log.read_text().splitlines() if line.startswith("FTMESH ")]
    return out


def accuracy(text: str) -> float:
    found = re.findall(r"^test accuracy: (0\.\d+)$", text, re.M)
    assert found, text[-2000:]
    return float(found[-1])


def check_consistency(records: dict[str, list[dict[str, object]]], total: int) -> None:
    """Bitwise-identical states at every step (digests), steps never repeat, every step is
    committed by somebody, and every step covered its whole global batch."""
    digests: dict[int, set[str]] = defaultdict(set)
    committed: set[int] = set()
    for name, recs in records.items():
        steps = [int(r["step"]) for r in recs if "done" not in r]  # type: ignore[call-overload]
        assert steps == sorted(set(steps)), f"{name} repeated or reordered a step"
        for prev, cur in zip(recs, recs[1:], strict=False):
            if "done" in cur:
                continue
            if int(cur["step"]) != int(prev["step"]) + 1:  # type: ignore[call-overload]
                assert cur["synced"], f"{name} skipped from {prev['step']} to {cur['step']}"
        for r in recs:
            if r.get("digest"):
                digests[int(r["step"])].add(str(r["digest"]))  # type: ignore[call-overload]
            if "done" not in r:
                committed.add(int(r["step"]))  # type: ignore[call-overload]
                assert r["samples"] == 32, r
    assert committed == set(range(1, total + 1)), "some step was never committed"
    split = {s: d for s, d in digests.items() if len(d) > 1}
    assert not split, f"members disagree at steps {sorted(split)[:5]}"


def test_launch_kill_and_join_trains_digits(tmp_path: Path) -> None:
    res = launch(tmp_path / "mesh", "-n", "4", "--kill-at", "20", "--join-at", "40", EXAMPLE,
                 "--digest-every", "1")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    acc = accuracy(res.stdout)
    assert acc >= 0.95
    records = progress(tmp_path / "mesh")
    assert len(records) == 5  # four at start, one joiner
    done = {name: r[-1] for name, r in records.items() if r and r[-1].get("done")}
    assert len(done) == 4, "the killed worker should be the only one not finishing"
    assert len({str(r["digest"]) for r in done.values()}) == 1, "final weights differ"
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    check_consistency(records, total)
    # The joiner entered mid-run, with the others' state.
    joiner = records["w4"]
    assert 40 < int(joiner[0]["step"]) < total and joiner[0]["synced"]  # type: ignore[call-overload]
    single = subprocess.run([sys.executable, EXAMPLE, "--single"], capture_output=True,
                            text=True, timeout=600, cwd=ROOT, check=True)
    assert abs(accuracy(single.stdout) - acc) <= 0.01


def test_script_error_is_reported_with_worker_and_traceback(tmp_path: Path) -> None:
    script = str(ROOT / "tests" / "scripts" / "failing_worker.py")
    res = launch(tmp_path, "-n", "3", script, timeout=120)
    assert res.returncode != 0
    assert "worker w1" in res.stdout
    assert "RuntimeError: boom: the model diverged in w1" in res.stdout
    assert "Traceback" in res.stdout
