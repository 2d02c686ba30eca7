"""Training state: commit/restore, digests, sharding math, disk checkpoints, state transfer.

``State`` holds what a member trains (model and optimizer state dicts, arrays, step, RNG,
scalars); ``Snapshot`` is its immutable serialised form. ``sharding`` is the pure ZeRO-1 math
with ring replicas, ``checkpoint`` writes and finds verified disk checkpoints, ``transfer``
serves and fetches snapshots between peers, striped and hash-verified.

This face re-exports lazily (PEP 562): ``sharding`` is part of the sans-IO core, and
importing it must not load state transfer (trio, sockets) through this ``__init__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy_face

if TYPE_CHECKING:
    from .checkpoint import (
        Checkpoint,
        CheckpointScan,
        CheckpointStatistics,
        CheckpointWriter,
        SkippedCheckpoint,
        latest_valid_checkpoint,
        load_checkpoint,
        save_checkpoint,
        scan_checkpoints,
    )
    from .errors import (
        CheckpointFormatError,
        NoCommittedStateError,
        StaleSnapshotError,
        StateError,
        StateLostError,
        StateMismatchError,
        StateTransferError,
    )
    from .sharding import (
        RecoveryPlan,
        ShardLayout,
        Transfer,
        plan_recovery,
        shard_holders,
        shard_ranges,
    )
    from .snapshot import Snapshot
    from .state import State
    from .transfer import (
        Lookup,
        StateServer,
        TransferConfig,
        TransferStats,
        fetch_state,
        serve_state,
    )

_EXPORTS = {
    "Checkpoint": ".checkpoint",
    "CheckpointFormatError": ".errors",
    "CheckpointScan": ".checkpoint",
    "CheckpointStatistics": ".checkpoint",
    "CheckpointWriter": ".checkpoint",
    "Lookup": ".transfer",
    "NoCommittedStateError": ".errors",
    "RecoveryPlan": ".sharding",
    "ShardLayout": ".sharding",
    "SkippedCheckpoint": ".checkpoint",
    "Snapshot": ".snapshot",
    "StaleSnapshotError": ".errors",
    "State": ".state",
    "StateError": ".errors",
    "StateLostError": ".errors",
    "StateMismatchError": ".errors",
    "StateServer": ".transfer",
    "StateTransferError": ".errors",
    "Transfer": ".sharding",
    "TransferConfig": ".transfer",
    "TransferStats": ".transfer",
    "fetch_state": ".transfer",
    "latest_valid_checkpoint": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "plan_recovery": ".sharding",
    "save_checkpoint": ".checkpoint",
    "scan_checkpoints": ".checkpoint",
    "serve_state": ".transfer",
    "shard_holders": ".sharding",
    "shard_ranges": ".sharding",
}
"""Lazily exported name -> the module that defines it."""


__getattr__, __dir__ = _lazy_face(globals(), _EXPORTS)


__all__ = [
    "Checkpoint",
    "CheckpointFormatError",
    "CheckpointScan",
    "CheckpointStatistics",
    "CheckpointWriter",
    "Lookup",
    "NoCommittedStateError",
    "RecoveryPlan",
    "ShardLayout",
    "SkippedCheckpoint",
    "Snapshot",
    "StaleSnapshotError",
    "State",
    "StateError",
    "StateLostError",
    "StateMismatchError",
    "StateServer",
    "StateTransferError",
    "Transfer",
    "TransferConfig",
    "TransferStats",
    "fetch_state",
    "latest_valid_checkpoint",
    "load_checkpoint",
    "plan_recovery",
    "save_checkpoint",
    "scan_checkpoints",
    "serve_state",
    "shard_holders",
    "shard_ranges",
]
