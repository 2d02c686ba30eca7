"""Ring views: the ordered list of training members a collective runs on.

Theory of operation: membership (SWIM gossip) gives every member the same list of training
members once gossip has converged, and with it the same inputs of the ring plan
(``topology``: site labels and measured round trips, gossiped in member metadata). The ring
order is the plan's order -- sites one after the other, members by node id inside a site; with
one site (the default: no labels, no measured clusters) simply the node ids sorted -- so every
member derives the same ring without anyone deciding it: rank ``i`` sends to rank ``i+1`` and
receives from rank ``i-1`` (mod N). The epoch is a hash of the member ids, and of the plan's
hash when the plan has more than one site (a one-site view's epoch is exactly what it was
before plans existed); neighbours compare epochs when they connect (see ``transport``), and if
every adjacent pair agrees the whole ring agrees (DESIGN.md, "Ring and epochs"). Two members
that hold different plans therefore never agree on an epoch: a loud mismatch that resolves
when gossip converges, never a ring in two orders.

A *sub-view* (``RingView.sub``) is a ring over some members of a view, in a given order, for
one phase of a hierarchical collective (``DataPlane``): its epoch hashes the parent's epoch,
a group tag and the members, under another personalisation, so it never equals a real view's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import LocalUsageError
from .topology import RingPlan


@dataclass(frozen=True, slots=True)
class Peer:
    """One member of a view: its node id and its data-plane TCP address."""

    node_id: str
    host: str
    port: int


def view_epoch(node_ids: Iterable[str], plan_hash: str = "") -> str:
    """Epoch id of a view: BLAKE2b over the sorted member ids (and, for a plan of several
    sites, the plan's hash after a marker no id's length prefix can take), 16 hex characters
    (64 bits)."""
    h = hashlib.blake2b(digest_size=8, person=b"ftmesh-view-v1")
    for nid in sorted(node_ids):
        _put(h, nid)
    if plan_hash:
        h.update(b"\xff\xff\xff\xff")
        _put(h, plan_hash)
    return h.hexdigest()


def sub_epoch(parent: str, tag: str, node_ids: Iterable[str]) -> str:
    """Epoch id of a sub-view: BLAKE2b (its own personalisation) over the parent's epoch, the
    group tag and the member ids in ring order."""
    h = hashlib.blake2b(digest_size=8, person=b"ftmesh-sub-v1")
    _put(h, parent)
    _put(h, tag)
    for nid in node_ids:
        _put(h, nid)
    return h.hexdigest()


def _put(h: hashlib.blake2b, text: str) -> None:
    raw = text.encode()
    h.update(len(raw).to_bytes(4, "little"))
    h.update(raw)


@dataclass(frozen=True)
class RingView:
    """An immutable view. ``members`` is kept in ring order (the constructor sorts it): by node
    id, or the order of ``plan`` when it has several sites; a sub-view's in the order given."""

    members: tuple[Peer, ...]
    plan: RingPlan | None = field(default=None, compare=False)
    """The ring plan of the view's members (``topology``); None: one site, no plan made. Not
    compared: two views of the same members and epoch are equal whatever told them one site."""
    parent: str = ""
    """A sub-view's parent epoch (``sub``); ``""`` for a view."""
    tag: str = ""
    """A sub-view's group tag (``site:0``, ``cross:1``)."""
    epoch: str = field(init=False)
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = [p.node_id for p in self.members]
        if not ids:
            raise LocalUsageError("a view needs at least one member")
        if len(set(ids)) != len(ids):
            raise LocalUsageError(f"duplicate node ids in view: {ids}")
        plan = self.plan
        if self.parent:
            members = tuple(self.members)
            epoch = sub_epoch(self.parent, self.tag, ids)
        elif plan is None or plan.flat:
            members = tuple(sorted(self.members, key=lambda p: p.node_id))
            epoch = view_epoch(ids)
        else:
            if sorted(plan.order) != sorted(ids):
                raise LocalUsageError(f"the plan's members are not the view's: {ids}")
            by_id = {p.node_id: p for p in self.members}
            members = tuple(by_id[n] for n in plan.order)
            epoch = view_epoch(ids, plan.hash)
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "epoch", epoch)
        object.__setattr__(self, "_index", {p.node_id: i for i, p in enumerate(members)})

    @classmethod
    def of(cls, peers: Iterable[Peer], plan: RingPlan | None = None) -> RingView:
        return cls(tuple(peers), plan)

    def sub(self, tag: str, node_ids: Iterable[str]) -> RingView:
        """The sub-view of this view's members ``node_ids``, in that order, for group ``tag``
        (see the module doc)."""
        return RingView(
            tuple(self.members[self.rank_of(n)] for n in node_ids), None, self.epoch, tag
        )

    @property
    def hierarchical(self) -> bool:
        """Whether an allreduce on this view runs hierarchically (``plan.hierarchical``)."""
        return self.plan is not None and self.plan.hierarchical and not self.parent

    def groups(self, node_id: str) -> tuple[RingView, RingView | None]:
        """For a hierarchical view: ``node_id``'s site sub-view and its cross-site sub-view
        (the members at the same place in every site, site by site), ``None`` for a member
        at a place beyond the smallest site's size (``RingPlan.blocks``: it holds no block)."""
        plan = self.plan
        if plan is None or not plan.hierarchical:
            raise LocalUsageError(f"view {self.epoch} is not hierarchical")
        s = plan.site_of(node_id)
        k = plan.sites[s].members.index(node_id)
        site = self.sub(f"site:{s}", plan.sites[s].members)
        if k >= plan.blocks:
            return site, None
        return site, self.sub(f"cross:{k}", [x.members[k] for x in plan.sites])

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
