"""When a view is taken without a sync: what a member knows the others hold.

Theory of operation. A sync costs an agreement round and maybe a state transfer; after a
planned departure, or after a loss that struck before anything was committed without us, it
is needless: every member of the new view already holds our state. :class:`Held` keeps what
that judgement needs, fed by the step machine (``ftmesh.training.step``): the members of the
view we last settled on (a sync, or a departure) while no member can have committed a step
without us since (:meth:`Held.settle`, :meth:`Held.forget`), the views an attempt of ours
failed on since our last committed step or sync (``tried``), and whether the row of the
pending step went out (``row_out``: from then on others can commit it without us).

:meth:`Held.needless` takes a view without a sync when it is made only of members of the
view we last settled on, none of our attempts since failed after our row of its step went
out, or after a sync's agreement, or otherwise than by a lost peer or a changed view
(:data:`LOSSES`), and no attempt of ours already failed on it since our last commit or sync
(``tried``). Sharded optimizer state always needs the sync (it re-spreads the shards).

Why that suffices. A step commits on a member only once it has gathered every member's row,
ours included: when all our failures came before our row went out, no member committed a
step we did not. Were some member X of the view one step *ahead* of us, we would have sent
our row of that step: that failure clears what we hold. Were some member Y *behind* us, Y
sent its row of a step we committed and failed after it, so Y holds nothing and Y syncs. So
the members that skip all stand at our step, reached by the same reduced gradients from the
state of the same sync; one that syncs meets our step's collectives with its sync's and the
collective layer fails both (a mismatch: no data is combined), after which everyone syncs:
the collective layer says ``INPUT_MISMATCH``, which forgets what we held, but another path
(a GPU process group's set-up, a test's fake mesh) may say it as any failure, so a view we
failed on is never taken without a sync twice (no livelock). The round tag in the step
header stays the backstop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .actions import Failure
from .protocol import FRESH

if TYPE_CHECKING:
    from ..collective.view import RingView

LOSSES = (Failure.PEER_LOST, Failure.VIEW)
"""The failures of a collective that a lost member or a changed view explain: struck before
our row of a step went out, they leave the state where it was (:meth:`Held.needless`)."""


class Held:
    """What we know the others hold; see the module docstring."""

    def __init__(self) -> None:
        self.members: frozenset[str] = frozenset()
        """The members of the view we last settled on, while no member can have committed a
        step without us since (empty: the next view change syncs)."""
        self.tried: set[str] = set()
        """Epochs of the views an attempt of ours failed on since our last committed step or
        sync: not taken without a sync again."""
        self.row_out = False
        """The row of the pending ``Compute`` went out (``StepMachine.row``): from then on
        others can commit its step without us."""

    def needless(self, view: RingView, committed: int, sharded: bool) -> bool:
        """Whether we take ``view`` without a sync (the module docstring), at ``committed``
        steps; ``sharded``: the optimizer state is sharded."""
        return (
            bool(self.members)
            and not sharded
            and committed != FRESH
            and set(view.node_ids) <= self.members
            and view.epoch not in self.tried
        )

    def settle(self, members: Sequence[str], synced: bool) -> None:
        """Every one of ``members`` holds our state (``synced``: after a sync, which every
        one of them ran)."""
        self.members = frozenset(members)
        if synced:
            self.tried.clear()

    def forget(self) -> None:
        """The next view change syncs."""
        self.members = frozenset()
        self.tried.clear()
