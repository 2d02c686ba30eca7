"""A training worker whose checkpoint directory holds corrupt checkpoints and then runs out of
space (probe 5 of issue #17), on a small tmpfs the test mounts and removes (root).

Before: pruning kept the three newest files whether or not they verified, so three corrupt
checkpoints newer than the run's deleted every new checkpoint right after it was written; and
a full disk killed the worker at its next save. Now the directory keeps valid checkpoints,
a save that fails is reported while training goes on, and the next one after space returns
is written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from tests_support import Worker

from ftmesh.state import State, latest_valid_checkpoint, load_checkpoint, save_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root: mounts a small tmpfs to fill (CI runs as root)"
    ),
]


def _corrupt_checkpoints(directory: Path, steps: list[int]) -> list[Path]:
    state = State(arrays={"w": np.zeros(2_000, np.float32)}, rng=False)
    out = []
    for step in steps:
        path = save_checkpoint(directory, state.commit(step), keep=len(steps))
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size // 2)
            f.write(b"\xff" * 32)
        out.append(path)
    return out


def _valid_step(directory: Path) -> int:
    found = latest_valid_checkpoint(directory)
    return found.step if found is not None else -1


def test_corrupt_checkpoints_and_a_full_disk_lose_no_good_checkpoint(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
    worker = None
    try:
        ckpt = disk / "ckpt"
        corrupt = _corrupt_checkpoints(ckpt, [9_000, 9_100, 9_200])
        env = {**os.environ, "FTMESH_REGISTRY_DIR": str(tmp_path / "reg"), "FTMESH_LOG": "WARNING"}
        worker = Worker(
            tmp_path / "w0.log",
            env,
            *("--mesh", "ckpt", "--discovery", "local", "--preset", "local"),
            script_args=(
                *("--epochs", "1000", "--step-delay", "0.02", "--digest-every", "0"),
                *("--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"),
            ),
        )
        worker.wait(lambda _: _valid_step(ckpt) >= 20, 120, "a valid checkpoint kept")
        assert "does not verify" in worker.text()  # the corrupt ones, noticed and not counted
        # Fill the disk: less room than one checkpoint.
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * max(0, free - 8_192))
        worker.wait(lambda w: "failed (ENOSPC" in w.text(), 60, "the failed save reported")
        at_failure = worker.last_step()
        worker.wait(lambda w: w.last_step() >= at_failure + 25, 60, "training after the failure")
        (disk / "filler").unlink()
        worker.wait(lambda w: "written after" in w.text(), 60, "a save once space returned")
        assert _valid_step(ckpt) > at_failure
        assert worker.proc.poll() is None and "Traceback" not in worker.text()
        worker.stop()
        written = {p for p in ckpt.glob("step-*.ftmckpt") if p.with_name(p.name + ".json").exists()}
        kept = sorted(written - set(corrupt))  # (a save the kill interrupted has no manifest)
        assert len(kept) == 3, kept  # keep=3, all of them valid
        for path in kept:
            load_checkpoint(path)
    finally:
        if worker is not None:
            worker.stop()
        subprocess.run(["umount", "-l", str(disk)], check=False)
