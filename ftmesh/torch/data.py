"""The elastic share of each step through a ``torch.utils.data.DataLoader``.

Theory of operation. Give ``ElasticTrainer`` the ``DataLoader`` you would train with
(map-style dataset, ``batch_size`` = the *global* batch, ``shuffle``, ``drop_last``,
``num_workers``, ``pin_memory``, ``collate_fn``...); the trainer keeps its options and builds
its own loader over the same dataset whose batch sampler, an :class:`ElasticBatchSampler`,
yields this member's micro-batches (``ftmesh.torch.sampler``) of the coming steps, planned from
the current step and view. The loader's workers therefore prefetch across step boundaries as
usual. ``Step.batches()`` takes the batches in order and checks each against what the current
attempt needs (step, compute set, micro-batch): when the view changed, a step is retried or
adopted, the prefetched batches belong to another plan and the loader's iterator is started
over from the current attempt (with ``persistent_workers=True`` the workers are kept).

The plan looks at most ``LOOKAHEAD_STEPS`` steps ahead (a hot spare's share is empty at every
step: its plan must end), after which the iterator is simply started again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch.utils.data as tud

from ..errors import FtmeshError, LocalUsageError
from .sampler import ElasticSampler

LOOKAHEAD_STEPS = 1024
"""How many steps ahead one iterator of the trainer's loader plans (bounds a spare's plan)."""

Key = tuple[int, tuple[str, ...], tuple[float, ...] | None, int]
"""(step, compute set, weights, micro-batch): which attempt a planned batch belongs to."""


class BatchSource(Protocol):
    """What ``Step.batches()`` takes its micro-batches from: the trainer's ``DataLoader`` face
    (:class:`ElasticLoader`) or its stream (``ftmesh.torch.stream.StreamFeed``)."""

    def next_batch(self, key: Key) -> Any:
        """The collated micro-batch of ``key``'s attempt."""
        ...


class ElasticBatchSampler(tud.Sampler[list[int]]):
    """Yields this member's micro-batches as planned by ``plan()`` (called at every new
    iterator), recording each one's key in ``keys`` in the order the loader takes them."""

    def __init__(self, plan: Callable[[], Iterator[tuple[Key, list[int]]]]) -> None:
        self._plan = plan
        self.keys: deque[Key] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        self.keys.clear()  # a new iterator of the loader: nothing of the old plan is pending
        return self._iterate()

    def _iterate(self) -> Iterator[list[int]]:
        for key, indices in self._plan():
            self.keys.append(key)
            yield indices


def sampler_for(loader: tud.DataLoader[Any], seed: int) -> ElasticSampler:
    """The ``ElasticSampler`` that matches a user's ``DataLoader`` (``batch_size`` is the
    global batch); refuses what the trainer cannot split."""
    dataset: Any = loader.dataset
    if isinstance(dataset, tud.IterableDataset):
        raise LocalUsageError(
            "the trainer splits each step's samples by index: use a map-style dataset, or give "
            "a stream as a ShardedStream (ftmesh.torch.ShardedStream.from_iterable(dataset, "
            "num_shards, batch_size), or your own open_shard: docs/PORTING.md)"
        )
    if loader.batch_size is None:
        raise LocalUsageError("give the DataLoader a batch_size: it is the step's global batch")
    if not isinstance(loader.sampler, tud.SequentialSampler | tud.RandomSampler):
        raise LocalUsageError(
            f"the trainer picks each member's samples, so the DataLoader cannot have its own "
            f"sampler ({type(loader.sampler).__name__}); use batch_size and shuffle, or pass "
            "an ElasticSampler"
        )
    return ElasticSampler(
        len(dataset),
        loader.batch_size,
        seed=seed,
        shuffle=isinstance(loader.sampler, tud.RandomSampler),
        drop_last=loader.drop_last,
    )


class ElasticLoader:
    """The trainer's loader over the user's dataset, with the iterator it keeps across steps."""

    def __init__(
        self, loader: tud.DataLoader[Any], plan: Callable[[], Iterator[tuple[Key, list[int]]]]
    ) -> None:
        self.batch_sampler = ElasticBatchSampler(plan)
        options: dict[str, Any] = {
            "num_workers": loader.num_workers,
            "collate_fn": loader.collate_fn,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": loader.generator,
            "persistent_workers": loader.persistent_workers,
            "pin_memory_device": loader.pin_memory_device,
            "in_order": True,  # batches come in plan order (checked against ``keys``)
        }
        if loader.num_workers:
            options["prefetch_factor"] = loader.prefetch_factor
        self.loader: tud.DataLoader[Any] = tud.DataLoader(
            loader.dataset, batch_sampler=self.batch_sampler, **options
        )
        self._it: Iterator[Any] | None = None
        self.restarts = 0
        """Times the iterator was started over (view changes, retries, adoptions)."""

    def next_batch(self, key: Key) -> Any:
        """The batch planned for ``key``; starts the iterator over when the next planned
        batch belongs to another attempt (``plan()`` then starts at the current one)."""
        for _ in range(2):  # the iterator we have, then at most one fresh one
            fresh = self._it is None
            if self._it is None:
                self._it = iter(self.loader)
                self.restarts += 1
            try:
                batch = next(self._it)
            except StopIteration:
                batch, self._it = None, None
            else:
                keys = self.batch_sampler.keys
                if keys and keys.popleft() == key:
                    return batch
                self._it = None
            if fresh:
                break
        raise FtmeshError(f"the trainer's data plan does not start at the current attempt {key}")

    def close(self) -> None:
        """Drop the iterator and end its worker processes, persistent ones too (the
        ``DataLoader`` keeps those in its private ``_iterator``; torch has no public way)."""
        it, self._it = self._it, None
        kept = getattr(self.loader, "_iterator", None)
        for x in (it, kept):
            shutdown = getattr(x, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        if kept is not None:
            self.loader._iterator = None
