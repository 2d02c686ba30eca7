"""Training state: commit/restore, digests, sharding math, disk checkpoints, state transfer.

``State`` holds what a member trains (model and optimizer state dicts, arrays, step, RNG,
scalars); ``Snapshot`` is its immutable serialised form. ``sharding`` is the pure ZeRO-1 math
with ring replicas, ``checkpoint`` writes and finds verified disk checkpoints, ``transfer``
serves and fetches snapshots between peers, striped and hash-verified.
"""

from __future__ import annotations

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
    TransferBenchmark,
    TransferConfig,
    TransferStats,
    fetch_state,
    measure_transfer,
    serve_state,
)

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
    "TransferBenchmark",
    "TransferConfig",
    "TransferStats",
    "fetch_state",
    "latest_valid_checkpoint",
    "load_checkpoint",
    "measure_transfer",
    "plan_recovery",
    "save_checkpoint",
    "scan_checkpoints",
    "serve_state",
    "shard_holders",
    "shard_ranges",
]
