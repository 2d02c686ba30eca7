"""``ftmesh.torch.keep``: a step's local contribution kept as it goes out and sent again,
rescaled, in a kept attempt; a member without a whole copy sends zeros."""

from __future__ import annotations

import numpy as np
import torch

from ftmesh.torch.keep import KeptContribution


def test_a_whole_copy_is_sent_again_rescaled_even_after_the_wire_was_reduced() -> None:
    kept = KeptContribution()
    host = np.arange(6, dtype=np.float32)
    dev = torch.arange(4, dtype=torch.float32)
    kept.start(3, np.array([5, 7, 9]), buckets=2)
    kept.keep(1, host, nonfinite=False)
    assert not kept.kept_for(3)  # one bucket of two
    kept.keep(2, dev, nonfinite=False)
    assert kept.kept_for(3) and not kept.kept_for(4)
    host += 100.0  # the allreduce reduces in place: the copy must not follow
    dev += 100.0
    kept.contribute(3, 1, host, 2.0)
    kept.contribute(3, 2, dev, 0.5)
    assert host.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert dev.tolist() == [0.0, 0.5, 1.0, 1.5]
    assert kept.indices.tolist() == [5, 7, 9]


def test_without_a_whole_copy_zeros_go_out_and_a_new_attempt_starts_over() -> None:
    kept = KeptContribution()
    grads = np.ones(3, dtype=np.float32)
    kept.start(0, np.arange(3), buckets=2)
    kept.keep(1, grads, nonfinite=True)
    kept.contribute(0, 1, grads, 1.0)  # bucket 2 never went out: nothing is whole
    assert grads.tolist() == [0.0, 0.0, 0.0]
    kept.start(0, np.arange(3), buckets=1)  # the next computed attempt
    assert not kept.kept_for(0) and not kept.nonfinite
    kept.keep(1, np.full(3, 4.0, dtype=np.float32), nonfinite=False)
    assert kept.kept_for(0)
    kept.clear()  # committed
    assert not kept.kept_for(0)
