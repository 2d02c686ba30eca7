"""Disk checkpoints: atomic writes, corrupt/truncated files skipped and reported, keep K."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ftmesh.state import (
    CheckpointFormatError,
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


def test_a_checkpoint_of_another_format_is_refused_and_never_pruned(tmp_path: Path) -> None:
    """A checkpoint written by another ftmesh version (manifest format 1: SHA-256 leaves) is
    neither taken for a corrupt one (which would silently resume from an older step or from
    scratch) nor deleted to make room: scanning raises, pruning leaves it alone."""
    import json

    old = save_checkpoint(tmp_path, make_state().commit(900))
    manifest = old.with_name(old.name + ".json")
    fields = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**fields, "format": 1}))
    with pytest.raises(CheckpointFormatError, match="has format 1"):
        latest_valid_checkpoint(tmp_path)
    state = make_state()
    for step in (1, 2):
        new = save_checkpoint(tmp_path, state.commit(step), keep=1)
    assert old.exists() and manifest.exists() and new.exists()
    assert not any(p.name.startswith("step-000000000001") for p in tmp_path.iterdir())
