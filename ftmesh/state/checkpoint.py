"""Disk checkpoints: atomic writes, verified reads, keep the last K.

Theory of operation: a checkpoint is a snapshot blob (see ``snapshot``) in
``step-<step>-<digest16>.ftmckpt`` plus a small JSON manifest next to it
(``...ftmckpt.json``: format, step, digest, size). Both are written the crash-safe way: write
a uniquely named temporary file in the same directory, ``fsync`` it, ``rename`` it over the
final name, ``fsync`` the directory. The data file is renamed before its manifest, so a
manifest only ever names a complete data file; a crash leaves at worst a temporary file or a
data file without manifest, both ignored (and reported) when scanning.

``latest_valid_checkpoint`` walks manifests from the newest step down and returns the first
whose file has the announced size and whose content hashes to the announced digest; every
checkpoint skipped on the way is logged and listed, so nothing is lost silently. One of
another format (another ftmesh version) is skipped like a corrupt one when an older valid
checkpoint exists (with a warning naming it), and raises ``CheckpointFormatError`` when none
does (starting from scratch would throw the user's training away). Several members may share
one directory: they write the same name for the same committed state.

Pruning keeps the newest ``keep`` checkpoints *that verify* and deletes only what is older
than the oldest of those, so corrupt or foreign files can never push a good checkpoint out
(each file is hashed once per writer, see ``CheckpointWriter``). Checkpoints of another format
are never deleted.

``CheckpointWriter`` is what a trainer uses: it checks the directory at start (it can be
created and written, with room for a few checkpoints) and reports a problem then; a save that
fails (``ENOSPC``, ``EROFS``, ``EIO``...) is logged, counted and left behind cleanly, and
training goes on; the next checkpoint step tries again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LocalUsageError, RemoteProtocolError
from .errors import CheckpointFormatError
from .snapshot import Snapshot, chunk_count, hash_chunks, root_digest

log = logging.getLogger(__name__)

DATA_SUFFIX = ".ftmckpt"
MANIFEST_SUFFIX = ".ftmckpt.json"
MANIFEST_FORMAT = 2
"""2: snapshots of format 2 (BLAKE3 leaves). Checkpoints of format 1 are skipped when scanning
(``CheckpointFormatError`` when nothing else is there), and pruning never deletes them."""
MAX_MANIFEST_BYTES = 64 << 10
"""A manifest is ~200 bytes; anything bigger is not ours and is not read into memory."""
STALE_TMP_S = 600.0
"""Temporary files older than this (by mtime) are leftovers of a crashed writer: removed."""
_NAME = re.compile(r"^step-(\d{12})-([0-9a-f]{16})\.ftmckpt$")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    digest: str
    snapshot: Snapshot


@dataclass(frozen=True)
class SkippedCheckpoint:
    path: Path
    reason: str


@dataclass
class CheckpointScan:
    latest: Checkpoint | None
    skipped: list[SkippedCheckpoint] = field(default_factory=list)


def checkpoint_name(step: int, digest: str) -> str:
    return f"step-{step:012d}-{digest[:16]}{DATA_SUFFIX}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(final: Path, parts: list[memoryview] | list[bytes]) -> None:
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(final.parent)


Verified = dict[tuple[str, int, int], bool]
"""``(file name, size, mtime_ns)`` -> whether it verified: a writer hashes each file once."""
MAX_VERIFIED = 256
"""Entries of a writer's verification cache; past it, the cache starts over."""


def save_checkpoint(
    directory: str | Path, snapshot: Snapshot, *, keep: int = 3, verified: Verified | None = None
) -> Path:
    """Write ``snapshot`` atomically into ``directory``; keep only the newest ``keep``
    checkpoints that verify (see the module doc; ``verified`` caches what was hashed).
    Returns the data file's path. Raises ``OSError`` when the write fails, having removed what
    it wrote. Blocking: call it from a worker thread when inside trio."""
    if keep < 1:
        raise LocalUsageError(f"keep must be >= 1, got {keep}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    with snapshot.lease():
        digest = snapshot.digest
        final = d / checkpoint_name(snapshot.step, digest)
        manifest_path = final.with_name(final.name + ".json")
        _atomic_write(final, snapshot.to_bytes_parts())
        manifest = {
            "format": MANIFEST_FORMAT,
            "step": snapshot.step,
            "digest": digest,
            "nbytes": snapshot.nbytes,
            "file": final.name,
        }
        body = json.dumps(manifest, sort_keys=True).encode()
        try:
            _atomic_write(manifest_path, [body])
        except OSError:
            if not manifest_path.exists():  # (another member may have written both)
                with contextlib.suppress(OSError):
                    final.unlink()
            raise
    cache = {} if verified is None else verified
    cache[_file_key(final)] = True
    _prune(d, keep, cache)
    return final


def _file_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (path.name, st.st_size, st.st_mtime_ns)


def _verifies(data: Path, verified: Verified) -> bool:
    try:
        key = _file_key(data)
    except OSError:
        return False
    if key not in verified:
        if len(verified) >= MAX_VERIFIED:
            verified.clear()
        try:
            load_checkpoint(data)
            verified[key] = True
        except (OSError, ValueError, RecursionError, CheckpointFormatError) as exc:
            log.warning("checkpoint %s does not verify (%s): not counted as kept", data, exc)
            verified[key] = False
    return verified[key]


def _prune(d: Path, keep: int, verified: Verified) -> None:
    manifests = sorted(
        (m for m in d.glob("step-*" + MANIFEST_SUFFIX) if _NAME.match(m.name[:-5])),
        key=lambda m: m.name,
        reverse=True,
    )
    kept = 0
    for m in manifests:
        if _other_format(m):
            continue  # not ours to judge or delete
        data = m.with_name(m.name[:-5])
        if kept < keep:
            kept += _verifies(data, verified)
            continue
        for p in (m, data):  # manifest first: never a manifest without its data
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    now = time.time()
    for tmp in d.glob(".step-*.tmp-*"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                tmp.unlink()


def _other_format(manifest: Path) -> bool:
    """Whether ``manifest`` is a well-formed manifest of another format (not ours to prune)."""
    try:
        _read_manifest(manifest)
    except CheckpointFormatError:
        return True
    except (OSError, ValueError, RecursionError):
        pass
    return False


def _read_manifest(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError("manifest too large")
    m = json.loads(raw)
    if isinstance(m, dict) and isinstance(m.get("format"), int) and m["format"] != MANIFEST_FORMAT:
        raise CheckpointFormatError(
            f"checkpoint {path.name[:-5]} in {path.parent} has format {m['format']}; this "
            f"version of ftmesh reads format {MANIFEST_FORMAT} only. Resume with the ftmesh "
            "that wrote it, or move it away to start without it"
        )
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise ValueError("unknown manifest format")
    for key, typ in (("step", int), ("digest", str), ("nbytes", int), ("file", str)):
        if not isinstance(m.get(key), typ):
            raise ValueError(f"manifest field {key!r} missing")
    if m["file"] != path.name[:-5]:
        raise ValueError("manifest names another file")
    return m


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify one checkpoint (its manifest must sit next to it). Raises
    ``ValueError`` (or ``OSError``) with the reason when it does not verify."""
    data = Path(path)
    m = _read_manifest(data.with_name(data.name + ".json"))
    size = data.stat().st_size
    if size != m["nbytes"]:
        raise ValueError(f"truncated: {size} bytes, manifest says {m['nbytes']}")
    buf = np.empty(size, dtype=np.uint8)
    with open(data, "rb") as f:
        got = f.readinto(buf.data)
    if got != size:
        raise ValueError(f"truncated: read {got} of {size} bytes")
    mv = buf.data
    digest = root_digest(size, hash_chunks(mv, 0, chunk_count(size), size))
    if digest != m["digest"]:
        raise ValueError("content hash mismatch")
    try:
        snap = Snapshot.from_buffer(buf)
    except RemoteProtocolError as exc:
        raise ValueError(f"unparseable: {exc}") from exc
    if snap.step != m["step"]:
        raise ValueError("step does not match the manifest")
    snap._digest = digest
    return Checkpoint(data, snap.step, digest, snap)


def scan_checkpoints(directory: str | Path) -> CheckpointScan:
    """Find the newest checkpoint that verifies; list (and log) every newer one skipped."""
    d = Path(directory)
    scan = CheckpointScan(None)
    if not d.is_dir():
        return scan
    data_files = {p.name for p in d.glob("step-*" + DATA_SUFFIX) if _NAME.match(p.name)}
    manifests = {m.name[:-5] for m in d.glob("step-*" + MANIFEST_SUFFIX)}
    candidates = sorted(data_files | manifests, reverse=True)  # zero-padded step: newest first
    foreign: CheckpointFormatError | None = None
    for name in candidates:
        path = d / name
        if not _NAME.match(name):
            scan.skipped.append(SkippedCheckpoint(path, "unexpected file name"))
            continue
        if name not in manifests:
            scan.skipped.append(SkippedCheckpoint(path, "no manifest (interrupted write)"))
            continue
        if name not in data_files:
            scan.skipped.append(SkippedCheckpoint(path, "manifest without data file"))
            continue
        try:
            scan.latest = load_checkpoint(path)
            break
        except CheckpointFormatError as exc:
            foreign = foreign or exc
            scan.skipped.append(SkippedCheckpoint(path, str(exc)))
        except (OSError, ValueError, RecursionError) as exc:
            scan.skipped.append(SkippedCheckpoint(path, str(exc)))
    if scan.latest is None and foreign is not None:
        raise foreign
    for s in scan.skipped:
        log.warning("skipping checkpoint %s: %s", s.path, s.reason)
    return scan


def latest_valid_checkpoint(directory: str | Path) -> Checkpoint | None:
    """The newest checkpoint in ``directory`` whose content verifies, or None. Skipped ones
    are logged; use ``scan_checkpoints`` to get them as a list. Checkpoints of another format
    and no valid one: ``CheckpointFormatError``."""
    return scan_checkpoints(directory).latest


@dataclass(frozen=True, slots=True)
class CheckpointStatistics:
    """What a ``CheckpointWriter`` did since it started."""

    saved: int
    """Checkpoints written."""
    failed: int
    """Saves that failed (each logged); training went on without them."""
    last_step: int
    """Step of the newest checkpoint written; -1 if none."""
    last_error: str
    """Why the last failed save failed (``""`` if none failed, or it was followed by a good
    save)."""
    refused: int = 0
    """Saves refused because the state held non-finite values (each logged at ERROR): a
    non-finite checkpoint never pushes a finite one out."""


def _why(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    return f"{name}: {exc.strerror or exc}" if name else str(exc)


_FLOAT_TENSORS = ("float16", "bfloat16", "float32", "float64")


def non_finite_entries(snapshot: Snapshot) -> list[str]:
    """The floating-point entries of ``snapshot`` that hold a NaN or an infinity (one pass
    over them; torch entries through torch, which reads bfloat16)."""
    odd: list[str] = []
    with snapshot.lease():
        for e in snapshot.entries:
            if e.kind == "t" and e.dtype in _FLOAT_TENSORS:
                import torch

                if not bool(torch.isfinite(snapshot.tensor(e.name)).all()):
                    odd.append(e.name)
            elif (
                e.kind == "n"
                and np.dtype(e.dtype).kind in "fc"
                and not bool(np.isfinite(snapshot.numpy(e.name)).all())
            ):
                odd.append(e.name)
    return odd


class CheckpointWriter:
    """Writes the checkpoints of one trainer into ``directory`` (see the module doc). Never
    raises on a disk problem: a failed save returns None, is logged and counted, and the next
    save tries again. Blocking, like ``save_checkpoint``."""

    SPACE_MARGIN = 2
    """``check`` warns unless the directory has room for this many more checkpoints: one
    being written next to the newest kept one."""

    def __init__(self, directory: str | Path, *, keep: int = 3) -> None:
        if keep < 1:
            raise LocalUsageError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self._verified: Verified = {}
        self._saved = 0
        self._failed = 0
        self._last_step = -1
        self._last_error = ""
        self._refused = 0

    def check(self, nbytes: int) -> str:
        """Whether checkpoints of ``nbytes`` can be written: ``""`` or the problem (also
        logged as a warning). Creates the directory; writes and removes a probe file."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                _atomic_write(probe, [b"ftmesh checkpoint directory probe"])
            finally:
                with contextlib.suppress(OSError):
                    probe.unlink()
            st = os.statvfs(self.directory)
        except OSError as exc:
            problem = f"cannot write checkpoints into {self.directory}: {_why(exc)}"
        else:
            free = st.f_bavail * st.f_frsize
            need = self.SPACE_MARGIN * (nbytes + MAX_MANIFEST_BYTES)
            problem = (
                f"checkpoint directory {self.directory} has {free / 2**20:.1f} MiB free; a "
                f"checkpoint takes {nbytes / 2**20:.1f} MiB: saves may fail"
                if free < need
                else ""
            )
        if problem:
            log.warning("%s (training will go on and retry at every checkpoint step)", problem)
        return problem

    def save(self, snapshot: Snapshot) -> Path | None:
        """Write ``snapshot``; the path, or None when the disk refused (logged, counted), or
        when the state holds a NaN or an infinity (not written: logged at ERROR, counted)."""
        odd = non_finite_entries(snapshot)
        if odd:
            self._refused += 1
            newest = f"step {self._last_step}" if self._last_step >= 0 else "none from this run"
            log.error(
                "checkpoint of step %d not written: %s hold non-finite values (NaN or "
                "infinity); the finite checkpoints stay (newest written: %s)",
                snapshot.step,
                ", ".join(odd[:4]) + (f" and {len(odd) - 4} more" if len(odd) > 4 else ""),
                newest,
            )
            return None
        try:
            path = save_checkpoint(
                self.directory, snapshot, keep=self.keep, verified=self._verified
            )
        except OSError as exc:
            self._failed += 1
            self._last_error = _why(exc)
            newest = f"step {self._last_step}" if self._last_step >= 0 else "none from this run"
            log.warning(
                "checkpoint of step %d into %s failed (%s; %d failed so far); training goes "
                "on, the next checkpoint step tries again (newest written: %s)",
                snapshot.step,
                self.directory,
                self._last_error,
                self._failed,
                newest,
            )
            return None
        if self._last_error:
            log.warning(
                "checkpoint of step %d written after %d failure(s)", snapshot.step, self._failed
            )
        self._saved += 1
        self._last_step = snapshot.step
        self._last_error = ""
        return path

    def statistics(self) -> CheckpointStatistics:
        return CheckpointStatistics(
            self._saved, self._failed, self._last_step, self._last_error, self._refused
        )
