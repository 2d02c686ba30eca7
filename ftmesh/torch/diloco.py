"""DiLoCo rounds (``TrainerConfig.sync = DiLoCo(...)``): what one round computes, in torch.

Theory of operation. A *round* is one trainer step: the step machine, the sync, the header,
the commit and every fault path are the synchronous step's, unchanged; only what a member
contributes to the step's allreduce and how the reduced result is applied differ.

* The round starts, like a step, on the committed state: the model's parameters are the
  *global* parameters ``θ``, the same on every member (the sync made sure of it).
* Each member computing the round (``Compute.workers``) copies ``θ``, splits its share of the
  round's global batch into ``inner_steps`` inner batches (``np.array_split``, then
  ``micro_batch``), and runs one step of the user's optimizer (the *inner* optimizer) on
  each: no collective, the buckets detached. Then it keeps ``Δ = θ - θ_local`` (the outer
  gradient) aside, and puts ``θ`` back into the model: the live state is the committed one
  again, which is what a re-sync after a failed attempt compares and serves.
* The step's allreduce carries ``Δ / n`` (``n``: the members computing the attempt), so the
  reduced ``.grad`` is the mean outer gradient over the members that finished the round, in
  float32 whatever the parameters' dtype (``ftmesh.torch.buckets``). A hot spare contributes
  zeros.
* The outer optimizer (``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum,
  nesterov=...)``, a registered part named ``outer_optimizer``) steps on it: ``θ`` becomes
  the new global parameters on every member, bit for bit, and the outer momentum with it.
  Both are registered state: the state check compares them, a joiner fetches them, a
  checkpoint holds them.

*A failed attempt.* A member lost during the round fails the round's allreduce (or its sync);
the survivors re-sync on the new view and retry the same round: each contributes the ``Δ`` it
kept (its inner steps are not run again), divided by the new number of members computing.
The lost member's inner steps, and with them its share of the round's samples, are not in the
round. A member that enters the ring at the retry (a joiner) has no ``Δ`` of that round: it
computes its share of the retry's split, which overlaps the survivors'. So a round trains
each of its samples at most once without faults; with a fault, the lost member's samples are
dropped from that epoch, and a joiner's retry share counts twice. That replaces "every sample
once per epoch" of synchronous steps.

*The inner optimizer's state* (Adam's moments, SGD's momentum) is member-local, as in the
paper: it differs between members, so it is not part of the committed state. Each member
keeps it aside between rounds (``InnerState``) and the registered ``optimizer`` part holds
the hyper-parameters with an empty state, the same on every member. A joiner, a member that
fetched state, and a run resumed from a checkpoint start their inner state fresh.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..training.config import DiLoCo
from .buckets import GradBuckets, micro_batches

__all__ = ["DiLoCo", "Rounds", "inner_batches"]

OUTER_PART = "outer_optimizer"
"""The registered part that holds the outer optimizer (its momentum)."""


def inner_batches(share: np.ndarray, inner_steps: int) -> list[np.ndarray]:
    """A member's share of a round as ``inner_steps`` inner batches (sizes that differ by at
    most one; empty ones when the share has fewer samples than that)."""
    return list(np.array_split(share, inner_steps))


@dataclass
class _Kept:
    """What a member computed of a round: kept across the round's attempts."""

    index: int
    delta: list[torch.Tensor]
    """``θ - θ_local`` per parameter."""
    loss_sum: float
    """The inner steps' losses times their samples, summed."""
    samples: int


class Rounds:
    """One trainer's DiLoCo state: the outer optimizer, the inner optimizer's local state and
    the outer gradient of the round in progress; see the module docstring."""

    def __init__(
        self, settings: DiLoCo, params: list[torch.nn.Parameter], inner: torch.optim.Optimizer
    ) -> None:
        self.settings = settings
        self.params = params
        self.inner = inner
        self.outer = torch.optim.SGD(
            params,
            lr=settings.outer_lr,
            momentum=settings.outer_momentum,
            nesterov=settings.nesterov,
        )
        self._inner_state: collections.defaultdict[Any, Any] = collections.defaultdict(dict)
        """The inner optimizer's state between rounds (member-local)."""
        self._kept: _Kept | None = None
        self.running_inner = False
        """True while the inner steps run (the inner optimizer may step then)."""
        self.rounds_computed = 0
        """Rounds whose inner steps this member ran (one per round, not per attempt)."""

    def kept_for(self, index: int) -> bool:
        """Whether this member holds its outer gradient of round ``index``."""
        return self._kept is not None and self._kept.index == index

    @contextlib.contextmanager
    def _inner_optimizer(self) -> Iterator[None]:
        """The inner optimizer with this member's own state, for the inner steps; afterwards
        its state is put aside, and the optimizer left with an empty one (the same on every
        member: the registered part)."""
        opt = self.inner
        opt.state = self._inner_state
        self.running_inner = True
        try:
            yield
        finally:
            self.running_inner = False
            self._inner_state = opt.state
            opt.state = collections.defaultdict(dict)

    def compute(
        self,
        index: int,
        share: np.ndarray,
        micro_batch: int,
        loss_fn: Callable[[np.ndarray], torch.Tensor],
        buckets: GradBuckets,
    ) -> None:
        """Run the round's inner steps on ``share`` and keep ``Δ``; the model's parameters
        are the global ones again afterwards."""
        start = [p.detach().clone() for p in self.params]
        loss_sum = 0.0
        delta: list[torch.Tensor] = []
        try:
            with buckets.detached(), self._inner_optimizer():
                for batch in inner_batches(share, self.settings.inner_steps):
                    if not len(batch):
                        continue
                    self.inner.zero_grad()
                    for mb in micro_batches(batch, micro_batch):
                        loss = loss_fn(mb)
                        loss_sum += float(loss.detach()) * len(mb)
                        (loss * (len(mb) / len(batch))).backward()  # type: ignore[no-untyped-call]
                    self.inner.step()
                self.inner.zero_grad()
            with torch.no_grad():
                delta = [g - p.detach() for g, p in zip(start, self.params, strict=True)]
        finally:  # (also when the user's loss_fn raised: the live state stays the committed one)
            with torch.no_grad():
                for g, p in zip(start, self.params, strict=True):
                    p.copy_(g)
        self._kept = _Kept(index, delta, loss_sum, len(share))
        self.rounds_computed += 1

    def contribute(self, index: int, weight: float, buckets: GradBuckets) -> float:
        """Write the kept ``Δ`` of round ``index`` into the gradient buckets, to be sent as
        ``weight * Δ`` (zeros without one: a hot spare); returns the mean loss of the inner
        steps (0 without)."""
        buckets.micro_batch(weight, last=True)  # (attaches the bucket views as .grad)
        kept = self._kept if self.kept_for(index) else None
        with torch.no_grad():
            for k, p in enumerate(self.params):
                assert p.grad is not None
                if kept is None:
                    p.grad.zero_()
                else:
                    p.grad.copy_(kept.delta[k])
        if kept is None or not kept.samples:
            return 0.0
        return kept.loss_sum / kept.samples

    def outer_step(self, skip: bool) -> None:
        """Apply the reduced mean outer gradient (``.grad``) to the global parameters;
        ``skip``: every member skips it alike (non-finite)."""
        if not skip:
            self.outer.step()
        self._kept = None
