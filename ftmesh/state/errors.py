"""Errors of the state layer. All live under ``ftmesh.errors``' hierarchy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import FtmeshError, LocalUsageError, PeerLostError


class StateError(FtmeshError):
    """Base class of the state layer's own errors."""


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


class StateLostError(StateError):
    """More adjacent members died than there are replicas: some shards have no surviving copy.

    ``lost`` lists ``(shard_index, start, stop, holders)`` for each lost shard (element ranges
    in the flat buffer, and the members that held it) when they are known; ``what`` describes
    the loss instead. The caller falls back to the newest valid disk checkpoint.
    """

    def __init__(
        self, lost: Sequence[tuple[int, int, int, tuple[str, ...]]], what: str = ""
    ) -> None:
        self.lost = tuple(lost)
        self.what = what
        if not what:
            desc = ", ".join(
                f"shard {i} [{a}:{b}) held by {list(h)}" for i, a, b, h in self.lost[:8]
            )
            more = f" (+{len(self.lost) - 8} more)" if len(self.lost) > 8 else ""
            what = f"{len(self.lost)} shard(s) lost with no surviving replica: {desc}{more}"
            self.what = what
        super().__init__(f"{what}; fall back to the last disk checkpoint")


class StateTransferError(PeerLostError):
    """No set of peers could supply the requested state. ``failures`` maps each peer address
    to the reason it was given up on (``"connect"``, ``"bad_mac"``, ``"unavailable"``,
    ``"bad_chunk"``, ``"timeout"``, ``"eof"``...)."""

    def __init__(self, message: str, failures: Mapping[str, str]) -> None:
        self.failures = dict(failures)
        detail = "; ".join(f"{k}: {v}" for k, v in sorted(self.failures.items()))
        super().__init__(f"{message} ({detail})" if detail else message)
