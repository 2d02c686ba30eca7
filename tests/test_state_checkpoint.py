"""Disk checkpoints: atomic writes, corrupt/truncated files skipped and reported, keep K."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ftmesh.state import (
    CheckpointFormatError,
    CheckpointStatistics,
    CheckpointWriter,
    State,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
    scan_checkpoints,
)


def make_state(n: int = 300_000) -> State:
    return State(arrays={"w": np.arange(n, dtype=np.float64)}, scalars={"epoch": 0}, rng=False)


def test_save_and_resume_from_newest(tmp_path: Path) -> None:
    state = make_state()
    digests = {}
    for step in range(1, 6):
        state.arrays["w"] += 1
        snap = state.commit(step)
        save_checkpoint(tmp_path, snap, keep=3)
        digests[step] = snap.digest
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 6  # 3 data files + 3 manifests
    ck = latest_valid_checkpoint(tmp_path)
    assert ck is not None and ck.step == 5 and ck.digest == digests[5]
    fresh = make_state()
    fresh.load_snapshot(ck.snapshot)
    assert fresh.step == 5 and fresh.digest() == digests[5]
    np.testing.assert_array_equal(fresh.arrays["w"], state.arrays["w"])


def _two_checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    state = make_state()
    p1 = save_checkpoint(tmp_path, state.commit(1))
    state.arrays["w"][0] = -1
    p2 = save_checkpoint(tmp_path, state.commit(2))
    return p1, p2


def test_truncated_newest_is_skipped_and_reported(tmp_path: Path) -> None:
    _p1, p2 = _two_checkpoints(tmp_path)
    size = p2.stat().st_size
    with open(p2, "r+b") as f:  # a kill mid-write, as seen by a later reader
        f.truncate(size // 2)
    scan = scan_checkpoints(tmp_path)
    assert scan.latest is not None and scan.latest.step == 1
    assert [(s.path, "truncated" in s.reason) for s in scan.skipped] == [(p2, True)]


def test_corrupt_byte_is_skipped(tmp_path: Path) -> None:
    _p1, p2 = _two_checkpoints(tmp_path)
    with open(p2, "r+b") as f:
        f.seek(p2.stat().st_size - 1000)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    scan = scan_checkpoints(tmp_path)
    assert scan.latest is not None and scan.latest.step == 1
    assert "hash mismatch" in scan.skipped[0].reason
    with pytest.raises(ValueError):
        load_checkpoint(p2)


def test_interrupted_writes_are_ignored(tmp_path: Path) -> None:
    p1, p2 = _two_checkpoints(tmp_path)
    # Crash after the data rename but before the manifest: data file without manifest.
    Path(str(p2) + ".json").unlink()
    # Crash mid-write of the temporary file.
    (tmp_path / (".step-000000000003-0123456789abcdef.ftmckpt.tmp-1-abc")).write_bytes(b"xx")
    scan = scan_checkpoints(tmp_path)
    assert scan.latest is not None and scan.latest.path == p1
    assert [s.reason for s in scan.skipped] == ["no manifest (interrupted write)"]


def test_garbage_manifest_and_empty_dir(tmp_path: Path) -> None:
    assert latest_valid_checkpoint(tmp_path / "missing") is None
    assert latest_valid_checkpoint(tmp_path) is None
    p1, p2 = _two_checkpoints(tmp_path)
    Path(str(p2) + ".json").write_bytes(b"{not json")
    scan = scan_checkpoints(tmp_path)
    assert scan.latest is not None and scan.latest.path == p1
    assert len(scan.skipped) == 1


def test_no_temporary_files_left_behind(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def _as_format_1(path: Path) -> Path:
    manifest = path.with_name(path.name + ".json")
    fields = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**fields, "format": 1}))
    return manifest


def test_a_checkpoint_of_another_format_is_skipped_loudly_and_never_pruned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint written by another ftmesh version (manifest format 1: SHA-256 leaves) does
    not block resuming from an older valid one (with a warning naming it); alone, it raises
    rather than letting training start from scratch. Pruning never deletes it."""
    older = save_checkpoint(tmp_path, make_state().commit(5))
    old = save_checkpoint(tmp_path, make_state().commit(900))
    manifest = _as_format_1(old)
    with caplog.at_level(logging.WARNING):
        found = latest_valid_checkpoint(tmp_path)
    assert found is not None and found.path == older
    assert "has format 1" in caplog.text and old.name in caplog.text
    older.unlink()
    with pytest.raises(CheckpointFormatError, match="has format 1"):
        latest_valid_checkpoint(tmp_path)
    state = make_state()
    for step in (1, 2):
        new = save_checkpoint(tmp_path, state.commit(step), keep=1)
    assert old.exists() and manifest.exists() and new.exists()
    assert not any(p.name.startswith("step-000000000001") for p in tmp_path.iterdir())


def _corrupt(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\xff" * 64)


def test_corrupt_newest_checkpoints_never_push_out_the_valid_ones(tmp_path: Path) -> None:
    """Probe 5: three corrupt checkpoints newer than anything written next. Pruning counts
    only checkpoints that verify, so every new one is kept (the newest valid one always),
    and what is older than the newest ``keep`` valid ones goes, corrupt or not."""
    state = make_state(20_000)
    for step in (700, 800, 900):
        _corrupt(save_checkpoint(tmp_path, state.commit(step)))
    stale = save_checkpoint(tmp_path, state.commit(1))
    _corrupt(stale)
    writer = CheckpointWriter(tmp_path, keep=2)
    for step in range(2, 7):
        state.arrays["w"][0] = step
        assert writer.save(state.commit(step)) is not None
        found = latest_valid_checkpoint(tmp_path)
        assert found is not None and found.step == step
    steps = sorted(int(p.name[5:17]) for p in tmp_path.glob("step-*.ftmckpt"))
    assert steps == [5, 6, 700, 800, 900], steps  # the stale corrupt step 1 went with 2-4
    assert writer.statistics() == CheckpointStatistics(5, 0, 6, "")


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: mounts a small tmpfs to fill (CI runs as root)"
)


@needs_root
def test_a_full_or_read_only_disk_fails_a_save_not_the_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ENOSPC and EROFS at save: logged and counted, nothing half-written left behind, and the
    next save after space returns succeeds. ``check`` reports both at start."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "1m")
    try:
        state = make_state(40_000)  # 320 kB: two fit, three do not
        writer = CheckpointWriter(disk / "ckpt", keep=1)
        assert writer.check(state.nbytes()) == ""
        (disk / "filler").write_bytes(b"x" * 800_000)
        with caplog.at_level(logging.WARNING):
            assert "MiB free" in writer.check(state.nbytes())
            assert writer.save(state.commit(1)) is None
        assert "ENOSPC" in caplog.text and "training goes on" in caplog.text
        assert writer.statistics().failed == 1 and "ENOSPC" in writer.statistics().last_error
        assert list((disk / "ckpt").iterdir()) == []  # nothing half-written
        (disk / "filler").unlink()
        assert writer.save(state.commit(2)) is not None
        assert writer.statistics() == CheckpointStatistics(1, 1, 2, "")
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        assert "EROFS" in writer.check(state.nbytes())
        assert writer.save(state.commit(3)) is None
        found = latest_valid_checkpoint(disk / "ckpt")
        assert found is not None and found.step == 2
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
