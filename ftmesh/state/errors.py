"""Errors of the state layer. All live under ``ftmesh.errors``' hierarchy (``StateError`` and
``StateLostError`` are defined there, for the sans-IO core, and re-exported here)."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import LocalUsageError, PeerLostError, StateError, StateLostError


class NoCommittedStateError(LocalUsageError):
    """``restore()``/``digest()`` was called before any ``commit()`` or ``load_snapshot()``."""


class StateMismatchError(LocalUsageError):
    """A snapshot does not fit the objects registered in this ``State`` (names or shapes)."""


class CheckpointFormatError(LocalUsageError):
    """A checkpoint in the directory was written in another format (by another version of
    ftmesh). Raised, not skipped: silently starting from an older checkpoint, or from scratch,
    would lose the user's training."""


class StaleSnapshotError(LocalUsageError):
    """The snapshot's buffers were reused by a later commit. Hold a ``lease()`` to prevent it."""


class StateTransferError(PeerLostError):
    """No set of peers could supply the requested state. ``failures`` maps each peer address
    to the reason it was given up on (``"connect"``, ``"bad_mac"``, ``"unavailable"``,
    ``"bad_chunk"``, ``"timeout"``, ``"eof"``...)."""

    def __init__(self, message: str, failures: Mapping[str, str]) -> None:
        self.failures = dict(failures)
        detail = "; ".join(f"{k}: {v}" for k, v in sorted(self.failures.items()))
        super().__init__(f"{message} ({detail})" if detail else message)


__all__ = [
    "CheckpointFormatError",
    "NoCommittedStateError",
    "StaleSnapshotError",
    "StateError",
    "StateLostError",
    "StateMismatchError",
    "StateTransferError",
]
