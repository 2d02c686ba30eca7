"""Why a GPU collective was aborted: typed reasons, and the error each one raises.

Every abort of a GPU communicator (``ftmesh.collective.epochs``) carries one of these frozen
reasons; ``error_for`` turns it into the exception the collective raises, a subclass of the
data plane's error for the same situation (``RingPeerLostError``, ``PeerStalledError``,
``ViewSupersededError``), so the training loop's retry logic needs no new case. The first
reason recorded for an epoch wins (a suspicion, then the view change it causes, reads as the
suspicion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from ..errors import CollectiveError, FtmeshError, MeshClosedError
from .errors import PeerStalledError, RingPeerLostError, ViewSupersededError


@dataclass(frozen=True)
class PeerSuspected:
    """Membership suspects (or declared dead) a member of the view."""

    peer: str
    why: str


@dataclass(frozen=True)
class ViewChanged:
    """This member moved on to another view (``None``: it is in no view)."""

    new_epoch: str | None


@dataclass(frozen=True)
class DeadlineExpired:
    """``phase`` (``init`` or a collective's kind) took more than ``seconds``."""

    phase: str
    seconds: float


@dataclass(frozen=True)
class CommFailed:
    """The library reported an error (``code``: NCCL's ``ncclResult_t``)."""

    code: int
    message: str


@dataclass(frozen=True)
class ManagerClosed:
    pass


AbortReason: TypeAlias = PeerSuspected | ViewChanged | DeadlineExpired | CommFailed | ManagerClosed
NCCL_REMOTE_ERROR = 6
"""``ncclRemoteError``: a peer went away (NCCL saw a socket or a flag of a dead rank)."""


class _ReasonMixin:
    reason: AbortReason


class GpuPeerLostError(RingPeerLostError, _ReasonMixin):
    """A member of the view was suspected, or NCCL reported a remote error."""

    def __init__(self, msg: str, *, peer: str, epoch: str, reason: AbortReason) -> None:
        super().__init__(msg, peer=peer, epoch=epoch)
        self.reason = reason


class GpuStalledError(PeerStalledError, _ReasonMixin):
    """A GPU collective or init passed its deadline; the communicator was aborted."""

    def __init__(self, msg: str, *, epoch: str, reason: AbortReason) -> None:
        super().__init__(msg, peer="", epoch=epoch)
        self.reason = reason


class GpuViewSupersededError(ViewSupersededError, _ReasonMixin):
    def __init__(self, msg: str, *, epoch: str, reason: AbortReason) -> None:
        super().__init__(msg, epoch=epoch)
        self.reason = reason


class GpuCommError(CollectiveError, _ReasonMixin):
    """The GPU library failed for a reason that names no lost peer."""

    def __init__(self, msg: str, *, reason: AbortReason) -> None:
        super().__init__(msg)
        self.reason = reason


def error_for(reason: AbortReason, epoch: str) -> FtmeshError:
    """The exception a collective on ``epoch`` raises when aborted for ``reason``."""
    if isinstance(reason, PeerSuspected):
        msg = f"GPU collective on view {epoch} aborted: {reason.peer} suspected ({reason.why})"
        return GpuPeerLostError(msg, peer=reason.peer, epoch=epoch, reason=reason)
    if isinstance(reason, DeadlineExpired):
        msg = f"GPU {reason.phase} on view {epoch} passed its {reason.seconds:g}s deadline"
        return GpuStalledError(msg, epoch=epoch, reason=reason)
    if isinstance(reason, ViewChanged):
        msg = f"view {epoch} was left for {reason.new_epoch}"
        return GpuViewSupersededError(msg, epoch=epoch, reason=reason)
    if isinstance(reason, CommFailed):
        msg = f"GPU collective on view {epoch} failed: {reason.message} (code {reason.code})"
        if reason.code == NCCL_REMOTE_ERROR:
            return GpuPeerLostError(msg, peer="", epoch=epoch, reason=reason)
        return GpuCommError(msg, reason=reason)
    return MeshClosedError(f"the GPU collectives of view {epoch} were closed")


class CommFailure(FtmeshError):
    """Raised by a ``Communicator`` to report the library's error (``code``, ``message``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} (code {code})")
        self.code = code
        self.message = message
