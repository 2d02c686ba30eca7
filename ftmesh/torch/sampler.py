"""Elastic data partitioning: which samples each member trains on at each step.

Theory of operation: an epoch is a seeded permutation of the dataset, cut into global batches
of ``global_batch`` samples, one per step. At every step the global batch is split among the
members computing on the current view in ring (sorted id) order: equally as
``numpy.array_split`` does, or proportionally to weights (``ftmesh.training.protocol.
split_share``). Because the split is recomputed from the view at every attempt of a step, a
view change between attempts (a member died mid-step, or joined at the boundary) only changes
who trains on which samples, never which samples the step covers.

Guarantee: in every epoch, each sample of the permutation is trained in exactly one committed
step, whatever the deaths and joins, except for the epoch's last partial batch: with
``drop_last=True`` (default) the tail that does not fill a global batch (fewer than
``global_batch`` samples) is skipped, a different tail each epoch since every epoch has its
own permutation; with ``drop_last=False`` it is the epoch's last step, with a smaller global
batch (gradients are averaged over the samples the step has, so it weighs each sample as much
as any other step does).

The position in the data is the committed step alone (``epoch_of``, ``global_indices``), so a
joiner or a mesh resumed from a checkpoint continues the epoch where it stands.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..errors import LocalUsageError
from ..training.protocol import split_share
from ..training.shards import LAYOUT_BITS


class ElasticSampler:
    """Which samples each member computes at each step; see the module docstring.
    ``global_batch`` samples per step, a permutation per epoch seeded by ``(seed, epoch)``."""

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if global_batch < 1 or dataset_len < global_batch:
            raise LocalUsageError(
                f"need 1 <= global_batch <= dataset_len, got {global_batch} and {dataset_len}"
            )
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._perm_epoch = -1
        self._perm = np.arange(dataset_len)

    @property
    def steps_per_epoch(self) -> int:
        """Steps in an epoch (one more, a short one, with ``drop_last=False`` and a tail)."""
        if self.drop_last:
            return self.dataset_len // self.global_batch
        return -(-self.dataset_len // self.global_batch)

    @property
    def layout(self) -> int:
        """A hash of what decides the data order (every member must have the same)."""
        text = f"{self.dataset_len},{self.global_batch},{self.seed},{self.shuffle},{self.drop_last}"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> (64 - LAYOUT_BITS)

    def epoch_of(self, step: int) -> int:
        """The 0-based epoch of 0-based step ``step``."""
        return step // self.steps_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng((self.seed, epoch)).permutation(self.dataset_len)
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, step: int) -> np.ndarray:
        """The samples of (global, 0-based) step ``step``, for all members together."""
        epoch, k = divmod(step, self.steps_per_epoch)
        perm = self._permutation(epoch)
        return perm[k * self.global_batch : (k + 1) * self.global_batch]

    def batch_size(self, step: int) -> int:
        """How many samples step ``step`` has (``global_batch`` but for a short last one)."""
        k = step % self.steps_per_epoch
        return min(self.global_batch, self.dataset_len - k * self.global_batch)

    def split(
        self, step: int, members: Sequence[str], weights: Sequence[float] | None = None
    ) -> list[np.ndarray]:
        """Step ``step``'s samples for each of ``members`` (any order) in sorted order,
        equally or by ``weights`` (given in sorted member order)."""
        samples = self.global_indices(step)
        if weights is None:
            return list(np.array_split(samples, len(members)))
        counts = split_share(len(samples), weights, len(members))
        return list(np.split(samples, np.cumsum(counts)[:-1]))

    def indices(
        self,
        step: int,
        members: Sequence[str],
        me: str,
        weights: Sequence[float] | None = None,
    ) -> np.ndarray:
        """This member's share of step ``step`` for the view ``members`` (any order)."""
        ordered = sorted(members)
        if me not in ordered:
            raise LocalUsageError(f"{me} is not in the view")
        return self.split(step, ordered, weights)[ordered.index(me)]
