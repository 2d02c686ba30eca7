"""One error hierarchy for ftmesh.

``FtmeshError`` is the root. Two families below it follow h11's split:

* ``LocalUsageError`` — the caller misused the API (bad config, wrong argument). Raised to the
  caller immediately.
* ``RemoteProtocolError`` — a peer sent something we cannot accept. These never escape the
  node's receive paths: the I/O layer catches them, counts them and drops the input.
"""

from __future__ import annotations


class FtmeshError(Exception):
    """Base class of every error ftmesh raises on purpose."""


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


class PeerLostError(FtmeshError):
    """A peer needed by the operation died or became unreachable."""


class CollectiveError(FtmeshError):
    """A collective could not complete (mismatched inputs across members, aborted round...)."""


class DeadlineExceeded(FtmeshError, TimeoutError):
    """An operation did not finish within its deadline."""


class MeshNotFormedError(DeadlineExceeded):
    """The mesh did not form as asked: a member found fewer of its ``start_peers`` than
    would let it start without splitting the mesh, or no running mesh to join."""
