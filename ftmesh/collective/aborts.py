"""Why a collective was aborted: one typed reason for every backend, and the error it raises.

Every abort -- of a TCP ring round (``engine``, ``transport``, ``dataplane``) or of a GPU
communicator (``epochs``) -- carries one frozen ``Abort``: its ``kind``, the ``peer`` it
blames (if any), the member that first saw it (``origin``) and a human ``detail``. On the TCP
ring it also travels as the body of an ``ABORT`` frame (``to_wire``/``from_wire``: a msgpack
map ``kind/peer/origin/msg``, the wire format of earlier versions); a reason from the network
is validated (``from_wire``) before anything acts on it.

``error_for`` turns a reason into the exception the collective raises -- the data plane's
error for that situation (``RingPeerLostError``, ``PeerStalledError``, ``ViewSupersededError``,
``InputMismatchError``, ``CollectiveError``, ``MeshClosedError``) with the reason attached as
``.abort`` -- so the training loop's retry logic is the same for every backend.

Glossary. A ring is *broken* when its byte streams are out of sync (it is dropped and reopened);
*killed* when the mesh aborted its view (nothing may start on it again); a collective is
*aborted* when it ends with a reason; a view is *superseded* when a member moved on to a newer
one; a *loss* (``PEER_LOST``, ``STALLED``) names a member to report to membership; a *fatal*
abort (the losses and ``SUPERSEDED``) ends the ring for every member, so it is sent both ways
round it. The first reason recorded wins, except that a later loss replaces a supersession (a
loss says who to report).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ..errors import CollectiveError, FtmeshError, MeshClosedError
from .errors import InputMismatchError, PeerStalledError, RingPeerLostError, ViewSupersededError

DETAIL_CAP = 2000
"""Characters of an abort's detail kept (a peer's text included): bounds what a peer can make
us store and log."""


class AbortKind(enum.Enum):
    """What went wrong. The values are the wire's ``kind`` strings (append-only)."""

    PEER_LOST = "lost"
    """A member of the view died, closed its connection, or membership suspects it."""
    STALLED = "stalled"
    """A peer (or a GPU call) made no progress within its deadline."""
    SUPERSEDED = "superseded"
    """A member moved on to another view; nobody was lost."""
    MISMATCH = "mismatch"
    """Members called different collectives (kind, dtype, shape, op, root, compression)."""
    DESYNC = "protocol"
    """A frame failed to parse or authenticate: the stream is out of sync."""
    COMM_FAILED = "comm_failed"
    """The collective library failed, naming no peer (or an unknown kind from the wire)."""
    CLOSED = "closed"
    """This member's collectives were closed."""


LOSSES = frozenset({AbortKind.PEER_LOST, AbortKind.STALLED})
"""Aborts that name a member to report to membership."""
FATAL = LOSSES | {AbortKind.SUPERSEDED}
"""Aborts that end the ring for everyone: sent both ways round it, the ring is dropped."""


@dataclass(frozen=True)
class Abort:
    """Why one collective (or every collective of a view) was aborted; see the module doc."""

    kind: AbortKind
    peer: str = ""
    origin: str = ""
    detail: str = ""

    def __post_init__(self) -> None:
        if len(self.detail) > DETAIL_CAP:
            object.__setattr__(self, "detail", self.detail[:DETAIL_CAP])

    @property
    def fatal(self) -> bool:
        return self.kind in FATAL

    @property
    def loss(self) -> bool:
        return self.kind in LOSSES

    def to_wire(self) -> dict[str, str]:
        return {
            "kind": self.kind.value,
            "peer": self.peer,
            "origin": self.origin,
            "msg": self.detail,
        }

    @classmethod
    def from_wire(cls, msg: dict[str, Any]) -> Abort | None:
        """The reason a peer sent, or None if it is not one (``kind`` and ``msg`` strings;
        ``peer`` and ``origin`` strings or absent). An unknown kind (a newer peer) reads as
        ``COMM_FAILED``: the round ends, nobody is blamed."""
        kind, detail = msg.get("kind"), msg.get("msg")
        peer, origin = msg.get("peer", ""), msg.get("origin", "")
        if not all(isinstance(v, str) for v in (kind, detail, peer, origin)):
            return None
        try:
            k = AbortKind(kind)
        except ValueError:
            k = AbortKind.COMM_FAILED
            detail = f"{str(kind)[:40]}: {detail}"
        return cls(k, str(peer)[:200], str(origin)[:200], str(detail))


NCCL_REMOTE_ERROR = 6
"""``ncclRemoteError``: a peer went away (NCCL saw a socket or a flag of a dead rank)."""


def comm_failed(code: int, message: str, origin: str = "") -> Abort:
    """The reason for a library error ``code``: NCCL's remote error is a loss (of a peer it
    does not name), anything else a failure."""
    kind = AbortKind.PEER_LOST if code == NCCL_REMOTE_ERROR else AbortKind.COMM_FAILED
    return Abort(kind, "", origin, f"{message} (code {code})")


def error_for(reason: Abort, epoch: str, node_id: str = "") -> FtmeshError:
    """The exception a collective on ``epoch`` raises when aborted for ``reason`` (``node_id``:
    this member, so that an abort another member reported says who); ``.abort`` holds it."""
    msg = reason.detail
    if reason.origin and node_id and reason.origin != node_id:
        msg = f"{msg} (reported by {reason.origin})"
    err: FtmeshError
    if reason.kind is AbortKind.STALLED:
        err = PeerStalledError(msg, peer=reason.peer, epoch=epoch)
    elif reason.kind is AbortKind.PEER_LOST:
        err = RingPeerLostError(msg, peer=reason.peer, epoch=epoch)
    elif reason.kind is AbortKind.SUPERSEDED:
        err = ViewSupersededError(msg, epoch=epoch)
    elif reason.kind is AbortKind.MISMATCH:
        err = InputMismatchError(msg)
    elif reason.kind is AbortKind.CLOSED:
        err = MeshClosedError(msg or f"the collectives of view {epoch} were closed")
    else:
        err = CollectiveError(f"collective aborted: {msg}")
    err.abort = reason
    return err


def abort_of(exc: BaseException) -> Abort | None:
    """The abort behind a collective's error, if it carries one."""
    reason = getattr(exc, "abort", None)
    return reason if isinstance(reason, Abort) else None


class CommFailure(FtmeshError):
    """Raised by a ``Communicator`` to report the library's error (``code``, ``message``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} (code {code})")
        self.code = code
        self.message = message
