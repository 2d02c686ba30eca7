"""Errors raised by collectives (subclasses of the ``ftmesh.errors`` hierarchy)."""

from __future__ import annotations

from ..errors import CollectiveError, DeadlineExceeded, PeerLostError


class ViewMismatchError(CollectiveError):
    """A ring neighbour did not confirm our view epoch in time; no collective ran."""

    def __init__(self, msg: str, *, epoch: str, peer: str) -> None:
        super().__init__(msg)
        self.epoch = epoch
        self.peer = peer


class ViewSupersededError(CollectiveError):
    """A member of the ring moved on to a newer view (a member joined or came back) while this
    collective ran or waited on ``epoch``: the members that moved on will not run it, so it is
    abandoned. Nobody was lost; retry on the current view (with the original inputs: an
    in-place collective may have partly overwritten its buffer)."""

    def __init__(self, msg: str, *, epoch: str) -> None:
        super().__init__(msg)
        self.epoch = epoch


class InputMismatchError(CollectiveError):
    """Members called different collectives, or with different dtype, shape, op or root.

    Raised on every member of the ring (the abort travels round it); no output was written
    except, possibly, partial results in the in-place buffer."""


class RingPeerLostError(PeerLostError):
    """A ring member died (connection closed or reset) during a collective. ``peer`` is its id."""

    def __init__(self, msg: str, *, peer: str, epoch: str) -> None:
        super().__init__(msg)
        self.peer = peer
        self.epoch = epoch


class PeerStalledError(RingPeerLostError, DeadlineExceeded):
    """A ring neighbour made no progress for ``io_timeout`` seconds. Also a ``PeerLostError`` so
    the fault-tolerance layer treats it as a loss, and a ``TimeoutError``."""
