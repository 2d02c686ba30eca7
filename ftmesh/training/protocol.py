"""The per-step agreement of fault-tolerant training, as pure functions.

Theory of operation. Every member counts its *committed* steps. A step runs on one view:

1. **Sync (only when the view's epoch differs from the last one we trained on).** One
   allreduce(max) of a vector with slots per ring rank: each member writes its committed step
   (``-1`` for a fresh member that never trained in this mesh), the byte size of its serialized
   state and 62 bits of its state digest. Everyone then computes the same :class:`SyncPlan`
   from the same vector: the newest committed step ``M`` wins; the first rank holding it is the
   *root*; every rank behind ``M``, or at ``M`` with another digest (two sides of a healed
   partition that trained separately), receives the root's state by a ring broadcast. (When
   nobody has trained yet, ``M == -1``: rank 0's initial weights become everybody's, so all
   start identical.)
2. **Step.** Each member computes gradients on its share of the step's global batch (see
   ``ftmesh.torch.sampler``) and one allreduce(sum) adds them up, with the sample counts and
   losses riding in the same buffer. A member whose allreduce completes applies the update
   and commits the step.
3. **Failure.** If the allreduce fails (a ring member died or stalled), every survivor's round
   fails too (the ring is broken). Survivors wait for membership to drop the dead member, then
   go back to 1 on the new view. Members that completed the round before it broke are one
   step ahead of those that did not; the sync makes the latter adopt the former's state
   instead of recomputing. So a step is committed by every survivor or by none (when nobody
   completed it, or only members that then died), never applied twice, never skipped.

Two cheap checks guard against ever acting on collective data of another round (a data-plane
bug, or a peer running other code): after the sync allreduce each member finds its own slots
unchanged (:func:`own_slots_intact`), and the gradient allreduce carries a round-check slot
that must add up to ``size * round_tag(step)``. A failed check is treated like a failed
collective: the ring is reconnected and the step retried from a sync.

The invariant this rests on: two members with the same committed step hold bitwise-identical
state, because they started identical (1) and applied the same reduced gradients, which every
ring member receives bitwise identical (``ftmesh.collective``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

QUORUM_POLICIES = ("majority", "any")

FRESH = -1
"""Committed step of a member that has not yet trained in this mesh."""


@dataclass(frozen=True, slots=True)
class SyncPlan:
    target_step: int
    """The committed step every member holds after the sync."""
    root: int
    """Rank whose state is broadcast (``-1``: nobody is behind, no broadcast)."""
    behind: tuple[int, ...]
    """Ranks that load the root's state."""
    nbytes: int
    """Size of the broadcast state in bytes."""


def sync_vector(rank: int, size: int, committed: int, nbytes: int, digest: str) -> np.ndarray:
    """This member's contribution to the sync allreduce(max). ``digest`` is a hex state
    digest; its first 62 bits take part."""
    v = np.full(3 * size, FRESH, dtype=np.int64)
    v[rank] = committed
    v[size + rank] = nbytes
    v[2 * size + rank] = int(digest[:16], 16) >> 2
    return v


def own_slots_intact(reduced: np.ndarray, own: np.ndarray, rank: int, size: int) -> bool:
    """Whether the reduced sync vector still holds this member's own values: every other
    member writes ``FRESH`` (the minimum) there, so a vector that does not is data of another
    round and must not be acted on."""
    slots = [rank, size + rank, 2 * size + rank]
    return bool(np.array_equal(reduced[slots], own[slots]))


def round_tag(step: int) -> float:
    """Each member's value in the gradient allreduce's round-check slot for computing
    ``step``: the reduced sum must be ``size * round_tag(step)``, exactly (float32 holds it for
    any view of up to 256 members), else the reduced gradients are not all of this step."""
    return float(step % (1 << 15) + 1)


def plan_sync(reduced: np.ndarray) -> SyncPlan:
    """The sync decision from the reduced vector; every member computes the same one."""
    size = len(reduced) // 3
    steps = [int(s) for s in reduced[:size]]
    sizes = [int(b) for b in reduced[size : 2 * size]]
    digests = [int(d) for d in reduced[2 * size :]]
    newest = max(steps)
    if newest == FRESH:
        # Nobody has trained: rank 0's initial state becomes everybody's starting point.
        behind = tuple(range(1, size))
        return SyncPlan(0, 0 if behind else -1, behind, sizes[0])
    root = steps.index(newest)
    behind = tuple(r for r, s in enumerate(steps) if s < newest or digests[r] != digests[root])
    if not behind:
        return SyncPlan(newest, -1, (), 0)
    return SyncPlan(newest, root, behind, sizes[root])


def has_quorum(
    policy: str, ring: Iterable[str], last_view: Iterable[str], dead: Iterable[str]
) -> bool:
    """May a member train on ``ring``, given the view it last trained on?

    ``majority`` (default): the ring must hold more than half of the last view's members,
    not counting those in ``dead`` (the caller passes members that left gracefully, and
    members declared dead for longer than a grace period). A member cut off from the others
    (or so slow that it suspects everybody) therefore stops and waits instead of training
    alone, while a crash costs no wait as long as the survivors are a majority; lost members
    stop counting after the grace period, so a mesh can shrink down to one member. A true
    partition whose sides declare each other dead lets both sides go on after the grace
    period; when it heals, the sync keeps the side with the newest step (ties: the lowest
    ring rank), deterministically.

    ``any``: every view trains (no waiting, no protection against split brain).
    """
    if policy == "any":
        return True
    dead_set = set(dead)
    base = {m for m in last_view if m not in dead_set}
    if not base:
        return True
    return 2 * len(base & set(ring)) > len(base)
