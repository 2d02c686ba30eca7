"""The GPU device check's plumbing, on this CPU machine: ``tests/gpu/run_device_check.py
--dry-run`` runs every phase that does not need a GPU (NVRTC, the N=1 lifecycle on the TCP
ring, three real mesh members in separate processes with the TCP ring standing in for NCCL:
ring correctness, busbw against gloo in the same processes, kill -9 of one mid-allreduce,
the survivors' recovery and training) and must print a table without a failed row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_device_check_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests/gpu/run_device_check.py"),
            "--dry-run",
            "--json",
            str(out),
            "--logs",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["check"]: r for r in json.loads(out.read_text())}
    failed = [r for r in rows.values() if r["status"] == "FAIL"]
    assert not failed, failed
    names = " | ".join(rows)
    for expected in (
        "NVRTC compile",
        "lifecycle N=1 (TCP)",
        "ring correctness float32",
        "ring correctness bfloat16",
        "busbw 4 MiB",
        "kill -9 -> survivors'",
        "kill -9 -> next collective",
        "ElasticTrainer",
        "not covered by one GPU",
    ):
        assert expected in names, (expected, names)
    assert "check" in proc.stdout and "wall time" in proc.stdout  # the table itself
