"""Ring views: the sorted list of training members a collective runs on.

Theory of operation: membership (SWIM gossip) gives every member the same sorted list of
training members once gossip has converged. The ring order is that sort order, so every member
derives the same ring without anyone deciding it: rank ``i`` sends to rank ``i+1`` and receives
from rank ``i-1`` (mod N). The epoch is a hash of the member ids; neighbours compare epochs
when they connect (see ``transport``), and if every adjacent pair agrees the whole ring agrees
(DESIGN.md, "Ring and epochs").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import LocalUsageError


@dataclass(frozen=True, slots=True)
class Peer:
    """One member of a view: its node id and its data-plane TCP address."""

    node_id: str
    host: str
    port: int


def view_epoch(node_ids: Iterable[str]) -> str:
    """Epoch id of a view: BLAKE2b over the sorted member ids, 16 hex characters (64 bits)."""
    h = hashlib.blake2b(digest_size=8, person=b"ftmesh-view-v1")
    for nid in sorted(node_ids):
        raw = nid.encode()
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.hexdigest()


@dataclass(frozen=True)
class RingView:
    """An immutable view. ``members`` is kept sorted by node id (the constructor sorts it)."""

    members: tuple[Peer, ...]
    epoch: str = field(init=False)
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        members = tuple(sorted(self.members, key=lambda p: p.node_id))
        ids = [p.node_id for p in members]
        if not ids:
            raise LocalUsageError("a view needs at least one member")
        if len(set(ids)) != len(ids):
            raise LocalUsageError(f"duplicate node ids in view: {ids}")
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "epoch", view_epoch(ids))
        object.__setattr__(self, "_index", {nid: i for i, nid in enumerate(ids)})

    @classmethod
    def of(cls, peers: Iterable[Peer]) -> RingView:
        return cls(tuple(peers))

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(p.node_id for p in self.members)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._index

    def rank_of(self, node_id: str) -> int:
        try:
            return self._index[node_id]
        except KeyError:
            raise LocalUsageError(f"{node_id!r} is not a member of view {self.epoch}") from None

    def right_of(self, node_id: str) -> Peer:
        """The member this node sends to."""
        return self.members[(self.rank_of(node_id) + 1) % self.size]

    def left_of(self, node_id: str) -> Peer:
        """The member this node receives from."""
        return self.members[(self.rank_of(node_id) - 1) % self.size]
