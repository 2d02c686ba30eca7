"""Sharding math for ZeRO-1 style sharded state, with ring replicas. Pure: no I/O, no clocks.

Theory of operation: a flat buffer of ``length`` elements is cut into ``n`` contiguous shards,
one per member in ring order (the view's sorted member ids): shard ``i`` is
``[i*length//n, (i+1)*length//n)`` and is *owned* by member ``i``. Each shard is also held by
the next ``r-1`` members on the ring (``replicas=r``; ``min(r, n)`` holders in all), so the
shards a member holds are its own and those of its ``r-1`` left neighbours.

A set of dead members loses a shard exactly when it contains all of that shard's holders, i.e.
``r`` ring-adjacent members (or everyone, when ``n <= r``). ``plan_recovery`` checks this for
the old layout, raising ``StateLostError`` naming the lost shards (the caller then falls back to
the newest disk checkpoint), and otherwise says, for each range the members of the new view
must hold under the new layout, whether they already have it or which surviving member to
fetch it from. Every member computes the same plan from the same two views: no coordination.
Sources are spread deterministically over the surviving holders of each old shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import LocalUsageError
from .errors import StateLostError

DEFAULT_REPLICAS = 2


def _ids(members: Sequence[str] | object) -> tuple[str, ...]:
    ids: Iterable[str] = getattr(members, "node_ids", members)  # type: ignore[arg-type]
    out = tuple(ids)
    if not out:
        raise LocalUsageError("a shard layout needs at least one member")
    if len(set(out)) != len(out):
        raise LocalUsageError(f"duplicate members: {out}")
    return out


@dataclass(frozen=True)
class ShardLayout:
    """The shards of one buffer over one ordered member list."""

    members: tuple[str, ...]
    length: int
    replicas: int = DEFAULT_REPLICAS

    @classmethod
    def of(
        cls, members: Sequence[str] | object, length: int, replicas: int = DEFAULT_REPLICAS
    ) -> ShardLayout:
        if length < 0:
            raise LocalUsageError(f"buffer length must be >= 0, got {length}")
        if replicas < 1:
            raise LocalUsageError(f"replicas must be >= 1, got {replicas}")
        return cls(_ids(members), length, replicas)

    @property
    def n(self) -> int:
        return len(self.members)

    @property
    def copies(self) -> int:
        """Holders per shard: ``min(replicas, n)``."""
        return min(self.replicas, self.n)

    def shard_range(self, index: int) -> tuple[int, int]:
        """Element range ``[start, stop)`` of shard ``index``."""
        return index * self.length // self.n, (index + 1) * self.length // self.n

    def owner(self, index: int) -> str:
        return self.members[index]

    def index_of(self, member: str) -> int:
        try:
            return self.members.index(member)
        except ValueError:
            raise LocalUsageError(f"{member!r} is not in the layout") from None

    def owned_range(self, member: str) -> tuple[int, int]:
        return self.shard_range(self.index_of(member))

    def holders(self, index: int) -> tuple[str, ...]:
        """Owner first, then the next ``copies-1`` members on the ring."""
        return tuple(self.members[(index + k) % self.n] for k in range(self.copies))

    def held_by(self, member: str) -> tuple[int, ...]:
        """Indices of the shards ``member`` holds (its own first, then its left neighbours')."""
        i = self.index_of(member)
        return tuple((i - k) % self.n for k in range(self.copies))


def shard_ranges(members: Sequence[str] | object, length: int) -> dict[str, tuple[int, int]]:
    """Each member's owned element range. Ranges partition ``[0, length)`` in ring order."""
    lay = ShardLayout.of(members, length, 1)
    return {m: lay.shard_range(i) for i, m in enumerate(lay.members)}


def shard_holders(
    members: Sequence[str] | object, length: int, replicas: int = DEFAULT_REPLICAS
) -> list[tuple[tuple[int, int], tuple[str, ...]]]:
    """For each shard in ring order: its element range and its holders (owner first)."""
    lay = ShardLayout.of(members, length, replicas)
    return [(lay.shard_range(i), lay.holders(i)) for i in range(lay.n)]


@dataclass(frozen=True, slots=True)
class Transfer:
    """Member ``dest`` needs elements ``[start, stop)``; ``src`` has them (``src == dest``:
    already local, nothing to move)."""

    dest: str
    src: str
    start: int
    stop: int

    @property
    def local(self) -> bool:
        return self.src == self.dest


@dataclass(frozen=True)
class RecoveryPlan:
    old: ShardLayout
    new: ShardLayout
    sources: tuple[tuple[str, ...], ...]
    """Per old shard: its surviving holders (empty only for an empty shard)."""
    transfers: tuple[Transfer, ...]
    """Every range each new member must hold under ``new``, split at old shard boundaries,
    with where to get it. Remote ones are what must move."""

    def fetches(self, dest: str) -> list[Transfer]:
        """What ``dest`` must pull from others."""
        return [t for t in self.transfers if t.dest == dest and not t.local]


def plan_recovery(
    old_members: Sequence[str] | object,
    new_members: Sequence[str] | object,
    length: int,
    replicas: int = DEFAULT_REPLICAS,
) -> RecoveryPlan:
    """Plan the move from the layout over ``old_members`` to the one over ``new_members``.

    Members in ``old`` but not ``new`` are dead (their copies are gone); members in ``new``
    but not ``old`` are joiners (they hold nothing). Raises ``StateLostError`` when some
    non-empty old shard has no surviving holder.
    """
    old = ShardLayout.of(old_members, length, replicas)
    new = ShardLayout.of(new_members, length, replicas)
    alive = set(new.members)
    sources: list[tuple[str, ...]] = []
    lost: list[tuple[int, int, int, tuple[str, ...]]] = []
    for i in range(old.n):
        holders = old.holders(i)
        surviving = tuple(h for h in holders if h in alive)
        start, stop = old.shard_range(i)
        if not surviving and stop > start:
            lost.append((i, start, stop, holders))
        sources.append(surviving)
    if lost:
        raise StateLostError(lost)

    transfers: list[Transfer] = []
    for dest in new.members:
        for j in new.held_by(dest):
            nstart, nstop = new.shard_range(j)
            for i in _overlapping(old, nstart, nstop):
                ostart, ostop = old.shard_range(i)
                start, stop = max(nstart, ostart), min(nstop, ostop)
                if start >= stop:
                    continue
                srcs = sources[i]
                # already local, or spread the load: rotate over holders by destination
                src = dest if dest in srcs else srcs[new.index_of(dest) % len(srcs)]
                transfers.append(Transfer(dest, src, start, stop))
    return RecoveryPlan(old, new, tuple(sources), tuple(transfers))


def _overlapping(lay: ShardLayout, start: int, stop: int) -> range:
    """Indices of the shards of ``lay`` that may intersect ``[start, stop)``."""
    if stop <= start or lay.length == 0:
        return range(0)
    # shard i starts at i*L//n; the first shard containing `start` is the largest i with
    # i*L//n <= start, found from the inverse and fixed up by one step either way.
    n, length = lay.n, lay.length
    first = min(n - 1, start * n // length)
    while first > 0 and lay.shard_range(first)[0] > start:
        first -= 1
    while first < n - 1 and lay.shard_range(first)[1] <= start:
        first += 1
    last = first
    while last < n - 1 and lay.shard_range(last + 1)[0] < stop:
        last += 1
    return range(first, last + 1)
