"""Atomic, hash-verified checkpoint files holding a serialized training state.

A checkpoint is ``step-NNNNNNNNNN.ckpt``: a 16-byte BLAKE2b digest of the payload followed by
the payload. It is written to a temporary file, fsynced, renamed into place and the directory
fsynced, so a crash leaves either the old set of checkpoints or the new one, never a torn
file under a final name. Reading skips files whose digest does not match (a disk that lied).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger("ftmesh.checkpoint")

KEEP = 3
"""Checkpoints kept per directory; older ones are deleted after a successful write."""
_DIGEST = 16


def _name(step: int) -> str:
    return f"step-{step:010d}.ckpt"


def save_checkpoint(directory: Path, step: int, payload: bytes, keep: int = KEEP) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / _name(step)
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    digest = hashlib.blake2b(payload, digest_size=_DIGEST).digest()
    with open(tmp, "wb") as f:
        f.write(digest)
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in sorted(directory.glob("step-*.ckpt"))[:-keep]:
        old.unlink(missing_ok=True)
    return final


def latest_checkpoint(directory: Path) -> bytes | None:
    """The payload of the newest checkpoint whose digest verifies, or None."""
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob("step-*.ckpt"), reverse=True):
        data = path.read_bytes()
        digest, payload = data[:_DIGEST], data[_DIGEST:]
        if (
            len(digest) == _DIGEST
            and hashlib.blake2b(payload, digest_size=_DIGEST).digest() == digest
        ):
            return payload
        log.warning("skipping corrupt checkpoint %s", path)
    return None
