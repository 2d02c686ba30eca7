"""One error hierarchy for ftmesh.

``FtmeshError`` is the root. Two families below it follow h11's split:

* ``LocalUsageError`` — the caller misused the API (bad config, wrong argument). Raised to the
  caller immediately.
* ``RemoteProtocolError`` — a peer sent something we cannot accept. These never escape the
  node's receive paths: the I/O layer catches them, counts them and drops the input.
"""

from __future__ import annotations

from collections.abc import Sequence


class FtmeshError(Exception):
    """Base class of every error ftmesh raises on purpose."""

    abort: object = None
    """Why a collective failed, where this is a collective's error: its
    ``ftmesh.collective.aborts.Abort`` (the same type whatever the backend)."""


class LocalUsageError(FtmeshError, ValueError):
    """The API was used wrongly: invalid configuration, argument or call order."""


class ConfigError(LocalUsageError):
    """A configuration value is out of range or inconsistent with another."""


class RemoteProtocolError(FtmeshError):
    """Input from the network was malformed, oversized, unauthenticated or otherwise refused.

    ``reason`` is a short stable key used for drop counters (``"malformed"``, ``"oversized"``,
    ``"bad_version"``, ``"wrong_mesh"``, ``"bad_mac"``, ``"replayed"``, ``"stale"``...).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class MeshClosedError(FtmeshError):
    """The node or mesh was closed while the operation was waiting."""


class TrainingFinishedError(FtmeshError):
    """A spare was still waiting for a slot when the training members finished."""


class Departed(SystemExit):
    """This member left the mesh in a planned departure (SIGTERM/SIGINT, or
    ``SyncMesh.request_leave()``): ``ElasticTrainer.step`` raises it once the member has told
    the others and left. A ``SystemExit`` with code 0, so a training script that does not
    catch it ends with exit status 0 and its ``finally`` and ``with`` blocks run; catch it to
    do something else. ``step`` is the last committed step this member took part in. (Not a
    ``FtmeshError``: it is not an error, and ``except Exception`` must not swallow it.)"""

    def __init__(self, step: int) -> None:
        super().__init__(0)
        self.step = step

    def __str__(self) -> str:
        return f"left the mesh after step {self.step}"


class PeerLostError(FtmeshError):
    """A peer needed by the operation died or became unreachable."""


class CollectiveError(FtmeshError):
    """A collective could not complete (mismatched inputs across members, aborted round...)."""


class DeadlineExceeded(FtmeshError, TimeoutError):
    """An operation did not finish within its deadline."""


class MeshNotFormedError(DeadlineExceeded):
    """The mesh did not form as asked: a member found fewer of its ``start_peers`` than
    would let it start without splitting the mesh, or no running mesh to join."""


class StateError(FtmeshError):
    """Base class of the state layer's own errors (``ftmesh.state.errors``)."""


class StateLostError(StateError):
    """More adjacent members died than there are replicas: some shards have no surviving copy.

    ``lost`` lists ``(shard_index, start, stop, holders)`` for each lost shard (element ranges
    in the flat buffer, and the members that held it) when they are known; ``what`` describes
    the loss instead. The caller falls back to the newest valid disk checkpoint. Defined here,
    not in ``ftmesh.state``, because the sans-IO core (``training.shards``) raises it too.
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
