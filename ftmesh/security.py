"""Mesh secrets: keyed BLAKE2b message authentication shared by gossip and streams, and
optional authenticated encryption (AES-256-GCM) derived from the same secrets.

Theory of operation: every member of a mesh with a secret derives one 16-byte tag per packet
or stream frame with keyed BLAKE2b (a MAC by construction, no HMAC wrapping needed). Several
secrets may be configured at once so a key can be rotated without a flag day: the first signs,
all of them verify. Replay protection (timestamps and nonces) is the caller's job, because it
needs a clock and the caller's notion of a window; see ``ftmesh.membership.wire``.

Encryption (``MeshAuth.encrypt``, off by default) needs a secret. Nothing is ever encrypted
with a secret or a MAC key directly: ``MeshAuth.derive`` makes a 256-bit AEAD key per purpose
and context with keyed BLAKE2b under its own personalisation (a PRF independent of the MAC).
Callers choose contexts so that a key never sees a nonce twice: gossip derives a fresh key per
datagram from a random 128-bit salt (``ftmesh.membership.wire``); a data-plane connection
derives one key per direction from its handshake transcript, which holds a fresh nonce from
each side, and numbers its frames (``ftmesh.collective.secure``). Key rotation works as for
tags: the first key encrypts, every key is tried to decrypt. The AEAD comes from the
``cryptography`` package, imported only when encryption is switched on.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError, LocalUsageError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_BYTES = 16
"""Length of an authentication tag. 128 bits: forging one by guessing is hopeless."""

MIN_SECRET_BYTES = 16
"""Shortest accepted secret: anything shorter is guessable offline from one captured packet."""

AEAD_KEY_BYTES = 32
AEAD_TAG_BYTES = 16
"""AES-GCM tag: 128 bits, as for the MAC."""
AEAD_NONCE_BYTES = 12


def _derive_key(secret: bytes) -> bytes:
    # Domain-separated key derivation so the raw secret is never used as a MAC key directly.
    return hashlib.blake2b(secret, digest_size=32, person=b"ftmesh-key-v1").digest()


def new_aead(key: bytes) -> AESGCM:
    """An AES-256-GCM cipher for ``key`` (imports ``cryptography`` on first use)."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:  # pragma: no cover - it is a dependency
        raise ConfigError(
            "encryption needs the 'cryptography' package (pip install cryptography)"
        ) from exc
    return AESGCM(key)


@dataclass(frozen=True)
class MeshAuth:
    """Signs with the first key, verifies with any. ``MeshAuth.none()`` disables authentication.

    ``encrypt``: also encrypt gossip and the data plane (see the module doc). Every member of a
    mesh must agree on it: a member that encrypts and one that does not cannot talk."""

    keys: tuple[bytes, ...] = ()
    encrypt: bool = False

    def __post_init__(self) -> None:
        if self.encrypt:
            if not self.keys:
                raise ConfigError(
                    "encryption needs a mesh secret (--secret-file or $FTMESH_SECRET)"
                )
            new_aead(bytes(AEAD_KEY_BYTES))  # fail now, not on the first packet

    @classmethod
    def none(cls) -> MeshAuth:
        return cls(())

    @classmethod
    def from_secrets(cls, secrets: Sequence[bytes], *, encrypt: bool = False) -> MeshAuth:
        for s in secrets:
            if len(s) < MIN_SECRET_BYTES:
                raise ConfigError(
                    f"mesh secret too short ({len(s)} bytes); use at least {MIN_SECRET_BYTES}"
                )
        return cls(tuple(_derive_key(s) for s in secrets), encrypt=encrypt)

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

    def verify_index(self, data: bytes, tag: bytes) -> int | None:
        """Like ``verify``, but says which key made ``tag`` (its index in ``keys``), so that
        both ends of a handshake can derive session keys from the same one."""
        found = None
        for i, key in enumerate(self.keys):
            want = hashlib.blake2b(data, key=key, digest_size=TAG_BYTES).digest()
            if hmac.compare_digest(want, tag) and found is None:
                found = i
        return found

    def derive(self, index: int, purpose: bytes, context: bytes = b"") -> bytes:
        """A 256-bit AEAD key for ``purpose`` (a short label) and ``context`` (e.g. a salt or
        a handshake transcript) from key ``index``. Distinct purposes or contexts give
        independent keys; none of them equals a MAC key."""
        if len(purpose) > 16:
            raise LocalUsageError("purpose label longer than 16 bytes")
        return hashlib.blake2b(
            context,
            key=self.keys[index],
            digest_size=AEAD_KEY_BYTES,
            salt=purpose.ljust(16, b"\0"),
            person=b"ftmesh-aead-v1",
        ).digest()


def load_secrets(
    secret_file: str | Path | None = None, encrypt: bool = False, secret: str | None = None
) -> MeshAuth:
    """Build a ``MeshAuth`` from ``secret_file`` (one secret per non-empty line; the first line
    signs, all verify) or, without a file, from the one ``secret`` given as text. Neither: no
    authentication. ``encrypt`` without a secret is a ``ConfigError``.

    Where the file and the secret come from (``--secret-file``, ``$FTMESH_SECRET_FILE``,
    ``$FTMESH_SECRET``) is ``ftmesh.settings``' business: this never reads the environment."""
    lines: list[bytes] = []
    if secret_file is not None:
        try:
            raw = Path(secret_file).read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"cannot read secret file {str(secret_file)!r}: {exc.strerror}; check "
                "--secret-file ($FTMESH_SECRET_FILE)"
            ) from exc
        lines = [ln.strip() for ln in raw.splitlines() if ln.strip()]
        if not lines:
            raise ConfigError(f"secret file {secret_file} is empty")
    elif secret is not None:
        lines = [secret.encode()]
    if not lines:
        if encrypt:
            raise ConfigError("encryption needs a mesh secret (--secret-file or $FTMESH_SECRET)")
        return MeshAuth.none()
    return MeshAuth.from_secrets(lines, encrypt=encrypt)
