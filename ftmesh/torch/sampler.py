"""Elastic data partitioning: which samples each member trains on at each step.

Theory of operation: an epoch is a seeded permutation of the dataset, cut into global batches
of ``global_batch`` samples, one per step. At every step the global batch is split among the
members of the current view in ring (sorted id) order with ``numpy.array_split``. Because the
split is recomputed from the view at every attempt of a step, a view change between attempts
(a member died mid-step, or joined at the boundary) only changes who trains on which samples,
never which samples the step covers.

Guarantee: in every epoch, each sample of the first ``steps_per_epoch * global_batch`` of the
permutation is trained in exactly one committed step, whatever the deaths and joins. A step
interrupted by a death is retried on the new view with the same global batch, so the dead
member's share is recomputed by the survivors, not dropped. The tail that does not fill a
global batch (fewer than ``global_batch`` samples) is skipped, like ``drop_last=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import LocalUsageError


class ElasticSampler:
    def __init__(
        self, dataset_len: int, global_batch: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        if global_batch < 1 or dataset_len < global_batch:
            raise LocalUsageError(
                f"need 1 <= global_batch <= dataset_len, got {global_batch} and {dataset_len}"
            )
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self._perm_epoch = -1
        self._perm = np.arange(dataset_len)

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_len // self.global_batch

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng((self.seed, epoch)).permutation(self.dataset_len)
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, step: int) -> np.ndarray:
        """The samples of (global) step ``step``, for all members together."""
        epoch, k = divmod(step, self.steps_per_epoch)
        perm = self._permutation(epoch)
        return perm[k * self.global_batch : (k + 1) * self.global_batch]

    def indices(self, step: int, members: Sequence[str], me: str) -> np.ndarray:
        """This member's share of step ``step`` for the view ``members`` (any order)."""
        ordered = sorted(members)
        if me not in ordered:
            raise LocalUsageError(f"{me} is not in the view")
        parts = np.array_split(self.global_indices(step), len(ordered))
        return parts[ordered.index(me)]
