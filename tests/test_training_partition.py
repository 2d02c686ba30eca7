"""A training mesh split in two by a network partition (in namespaces the test creates): after
the grace period both sides go on (each commits steps in a view of its side alone: the test
waits for that, not for a fixed time); when the partition heals the mesh merges and ends with
one model (the side with the newest step wins, deterministically)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ftmesh.lab import VirtualLan

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "train_digits.py")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
        reason="needs root (and iproute2, nftables) to create network namespaces",
    ),
]


class Worker:
    def __init__(self, lan: VirtualLan, host: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        argv = [
            "ip", "netns", "exec", lan.ns_name(host), sys.executable, "-m", "ftmesh", "worker",
            "--mesh", "split", "--discovery", "mdns", "--interface", lan.host_ip(host),
            "--preset", "local", EXAMPLE, "--epochs", "6", "--step-delay", "0.05",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
        )
        self.records: list[dict[str, object]] = []
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("FTMESH "):
                self.records.append(json.loads(line[7:]))

    def step(self) -> int:
        return max((int(r["step"]) for r in self.records if "step" in r), default=0)  # type: ignore[call-overload]

    def side_step(self, split_at: int) -> int:
        """The first step past ``split_at`` this worker committed with its side alone (2 of
        the 4 members), or 0."""
        steps = [
            int(r["step"])  # type: ignore[call-overload]
            for r in list(self.records)
            if r.get("members") == 2 and int(r.get("step", 0)) > split_at  # type: ignore[call-overload]
        ]
        return min(steps, default=0)


def test_partition_heals_into_one_model(tmp_path: Path) -> None:
    with VirtualLan(hosts=4) as lan:
        workers = [Worker(lan, h) for h in range(4)]
        try:
            deadline = time.monotonic() + 120
            while min(w.step() for w in workers) < 20 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert min(w.step() for w in workers) >= 20, [w.lines[-5:] for w in workers]
            lan.partition([[0, 1], [2, 3]])
            split_at = max(w.step() for w in workers)
            # Suspicion, the quorum grace, then both sides train: every worker commits a step
            # past the split in a view of its own side alone (2 members).
            deadline = time.monotonic() + 120
            while not all(w.side_step(split_at) for w in workers) and time.monotonic() < deadline:
                time.sleep(0.2)
            progressed = [w.side_step(split_at) for w in workers]
            lan.heal()
            for w in workers:
                w.proc.wait(timeout=400)
        finally:
            for w in workers:
                if w.proc.poll() is None:
                    w.proc.kill()
            (tmp_path / "logs.txt").write_text("".join(line for w in workers for line in w.lines))
        assert all(w.proc.returncode == 0 for w in workers), [w.lines[-10:] for w in workers]
        assert min(progressed) > 0, f"a side did not train alone during the partition: {progressed}"
        finals = {str(w.records[-1]["digest"]) for w in workers if w.records[-1].get("done")}
        assert len(finals) == 1, finals
