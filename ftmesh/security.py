"""Mesh secrets: keyed BLAKE2b message authentication shared by gossip and streams.

Theory of operation: every member of a mesh with a secret derives one 16-byte tag per packet
or stream frame with keyed BLAKE2b (a MAC by construction, no HMAC wrapping needed). Several
secrets may be configured at once so a key can be rotated without a flag day: the first signs,
all of them verify. Replay protection (timestamps and nonces) is the caller's job, because it
needs a clock and the caller's notion of a window; see ``ftmesh.membership.wire``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

TAG_BYTES = 16
"""Length of an authentication tag. 128 bits: forging one by guessing is hopeless."""

MIN_SECRET_BYTES = 16
"""Shortest accepted secret: anything shorter is guessable offline from one captured packet."""

SECRET_ENV = "FTMESH_SECRET"


def _derive_key(secret: bytes) -> bytes:
    # Domain-separated key derivation so the raw secret is never used as a MAC key directly.
    return hashlib.blake2b(secret, digest_size=32, person=b"ftmesh-key-v1").digest()


@dataclass(frozen=True)
class MeshAuth:
    """Signs with the first key, verifies with any. ``MeshAuth.none()`` disables authentication."""

    keys: tuple[bytes, ...] = ()

    @classmethod
    def none(cls) -> MeshAuth:
        return cls(())

    @classmethod
    def from_secrets(cls, secrets: Sequence[bytes]) -> MeshAuth:
        for s in secrets:
            if len(s) < MIN_SECRET_BYTES:
                raise ConfigError(
                    f"mesh secret too short ({len(s)} bytes); use at least {MIN_SECRET_BYTES}"
                )
        return cls(tuple(_derive_key(s) for s in secrets))

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def tag(self, data: bytes) -> bytes:
        """Tag ``data`` with the primary key. Only valid when ``enabled``."""
        return hashlib.blake2b(data, key=self.keys[0], digest_size=TAG_BYTES).digest()

    def verify(self, data: bytes, tag: bytes) -> bool:
        """True when ``tag`` was made over ``data`` by any configured key (constant time)."""
        ok = False
        for key in self.keys:
            want = hashlib.blake2b(data, key=key, digest_size=TAG_BYTES).digest()
            ok |= hmac.compare_digest(want, tag)
        return ok


def load_secrets(secret_file: str | Path | None = None) -> MeshAuth:
    """Build a ``MeshAuth`` from ``--secret-file`` (one secret per non-empty line; the first
    line signs) or, if no file is given, from ``$FTMESH_SECRET``. Neither set: no auth."""
    lines: list[bytes] = []
    if secret_file is not None:
        try:
            raw = Path(secret_file).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read secret file {secret_file}: {exc}") from exc
        lines = [ln.strip() for ln in raw.splitlines() if ln.strip()]
        if not lines:
            raise ConfigError(f"secret file {secret_file} is empty")
    elif os.environ.get(SECRET_ENV):
        lines = [os.environ[SECRET_ENV].encode()]
    return MeshAuth.from_secrets(lines) if lines else MeshAuth.none()
