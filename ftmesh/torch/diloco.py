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
the survivors re-sync on the new view and retry the same round. When every member of the new
view ran the round's inner steps on the failed attempt's split, the retry is the step
machine's *kept attempt* (``Compute.kept``, ``ftmesh.training.step``): each contributes the
``Δ`` it kept (its inner steps are not run again), divided by the new number of members
computing, and the round commits over the samples they trained; the lost member's share is
*skipped* (``StepReport.skipped``: not trained, not returned to the epoch). Otherwise (a
joiner or a spare in the new view, a survivor whose attempt failed before its inner steps
ran, a failure no loss explains) the retry computes the round on the new split, and a member
whose kept ``Δ`` was taken on another share drops it (:meth:`Rounds.attempt`) and runs the
inner steps again from the global parameters, its inner optimizer's state put back as that
run found it (a copy of that state is kept for the purpose while the round is open). The
reduced header's sample count checks that every member did the same (``DESYNC`` otherwise,
and the next attempt computes). So a round trains each of its samples at most once; with a
fault the lost member's samples are skipped and counted. That replaces "every sample once per
epoch" of synchronous steps.

*Who runs the inner steps.* The closure API hands ``loss_fn`` to :meth:`Rounds.compute`; the
loop API's body runs them itself, inside :meth:`Rounds.inner_steps` (``ftmesh.torch.loop``:
``step.indices()`` yields the inner batches). Both keep the same ``Δ`` and put ``θ`` back, on
an error too.

*The inner optimizer's state* (Adam's moments, SGD's momentum) is member-local, as in the
paper: it differs between members, so it is not part of the committed state. Each member
keeps it aside between rounds (``InnerState``) and the registered ``optimizer`` part holds
the hyper-parameters with an empty state, the same on every member. A joiner, a member that
fetched state, and a run resumed from a checkpoint start their inner state fresh.

*Streaming DiLoCo* (``DiLoCo(fragments=F)``, Douillard et al. 2025). The parameter tensors,
in registration order, are cut into ``F`` contiguous runs of about equal size
(``fragments_of``); the gradient buckets never span two (``GradBuckets(fragments=...)``) and
the header has a bucket of its own. A trainer step runs ``H / F`` inner steps and syncs one
fragment, ``p = step % F``: fragment ``p`` is synced every ``H`` inner steps, the fragments at
offsets ``H / F`` apart, and each step's allreduce carries fragment ``p``'s buckets only
(``1 / F`` of the bytes) and the header. So each member's *local* parameters now outlive a
step: the model holds the global parameters ``θ`` between steps (the committed state, the
same on every member: what the state check compares and a joiner fetches), and each member
keeps its local ones ``θ_m`` aside (``Rounds.local``, member-local like the inner optimizer's
state). A step loads ``θ_m`` into the model, runs its inner steps, keeps ``θ_m`` and
``Δ_p = θ_p - θ_m,p`` (fragment ``p`` only), and puts ``θ`` back; the reduced mean ``Δ_p``
goes to the outer SGD with the other fragments' ``.grad`` set to ``None``, so the outer step
(and its momentum) moves fragment ``p`` only; then ``θ_m,p = θ_p`` (the paper's merge with
``alpha = 0``). ``θ_m`` is valid only for the step after the one it was committed with: a member
that did not commit the previous step with its own outer gradient (a joiner, a hot spare
taking over, a member that fetched state) starts from ``θ_m = θ``. Without overlap a step's
allreduce runs after its inner steps, as in plain DiLoCo, so streaming lowers the bytes of
each sync (its peak bandwidth), not the time per inner step.

*Overlap* (``DiLoCo(overlap=True, mix=a)``, the paper's ``τ`` of one step's inner steps; with
``fragments=1`` the whole model, one-step delayed DiLoCo). As an attempt of step ``t`` starts
(``send``), a member takes ``Δ_p = θ_p - θ_m,p`` of fragment ``p = t % F`` from its local
parameters as they stand (the inner steps since ``p``'s last merge), writes it into ``p``'s
buckets unweighted and launches them (``GradBuckets.send``); the step's inner steps then run
while they travel, and only the header's bucket waits for them. A member without local
parameters of step ``t - 1`` sends zeros, and the header's last slot (1 from a member that
sent a ``Δ_p``) reduces to the count of senders, which the outer step divides the sum by (no
sender, as at the first step: no outer step). On commit the outer SGD moves ``θ_p`` and every
member that ran the step's inner steps mixes ``θ_m,p = a θ_m,p + (1 - a) θ_p``: its inner
steps during the sync count with weight ``a``. A retry sends the kept ``Δ_p`` again (the
inner steps are not run again: ``ran``). So one step costs about the longer of its inner
steps and its sync rather than their sum.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import LocalUsageError
from ..training.config import DiLoCo
from .buckets import GradBuckets, micro_batches
from .keep import Kept

__all__ = ["DiLoCo", "InnerRun", "Rounds", "fragments_of", "inner_batches"]

OUTER_PART = "outer_optimizer"
"""The registered part that holds the outer optimizer (its momentum)."""


def inner_batches(share: np.ndarray, inner_steps: int) -> list[np.ndarray]:
    """A member's share of a round as ``inner_steps`` inner batches (sizes that differ by at
    most one; empty ones when the share has fewer samples than that)."""
    return list(np.array_split(share, inner_steps))


def fragments_of(sizes: list[int], fragments: int) -> list[int]:
    """The fragment of each parameter tensor (``sizes``: their element counts, in
    registration order): ``fragments`` contiguous runs, none empty, each ending where its
    share of the total (``(f + 1) / fragments``) falls closest to a tensor's middle."""
    if not 1 <= fragments <= len(sizes):
        raise LocalUsageError(
            f"DiLoCo fragments={fragments}: the model has {len(sizes)} parameter tensors, "
            "and each fragment needs one at least"
        )
    total, out, cum, i = sum(sizes), [], 0, 0
    for f in range(fragments):
        start = i
        goal = total * (f + 1) / fragments
        while i < len(sizes) - (fragments - f - 1) and (
            i == start or f == fragments - 1 or cum + sizes[i] / 2 <= goal
        ):
            cum += sizes[i]
            out.append(f)
            i += 1
    return out


@dataclass
class InnerRun:
    """What the caller of ``Rounds.inner_steps`` adds up while it runs them."""

    loss_sum: float = 0.0
    """The inner steps' losses times their samples, summed."""


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
        self._kept = Kept()
        """The round's ``Δ`` (``ftmesh.torch.keep``): parameter position -> ``θ - θ_local``
        (streaming: the step's fragment only), kept across the round's attempts."""
        self._kept_local: list[torch.Tensor] | None = None
        """Streaming: the member's local parameters after the kept round's inner steps."""
        self._share: np.ndarray | None = None
        """The share (sample indices) the kept round's inner steps ran on."""
        self._inner_before: dict[Any, dict[str, Any]] | None = None
        """The inner optimizer's state as the kept round's inner steps found it (a round run
        again starts from it: :meth:`attempt`)."""
        self.overlap = settings.overlap
        self.fragment_of = (
            fragments_of([p.numel() for p in params], settings.fragments)
            if settings.fragments > 1 or settings.overlap
            else None
        )
        """Streaming (or overlap): each parameter's fragment (``None``: plain DiLoCo)."""
        self._ran: tuple[int, float, int] | None = None
        """Overlap: (the step whose inner steps this member ran, their summed loss, samples);
        their local parameters are ``_kept_local``."""
        self._none_for = -1
        """Overlap: the step this member sends no outer gradient in (it had no local
        parameters of the step before)."""
        self.local: list[torch.Tensor] | None = None
        """Streaming: this member's local parameters, as committed with step ``local_step``."""
        self.local_step = -1
        self.running_inner = False
        """True while the inner steps run (the inner optimizer may step then)."""
        self.rounds_computed = 0
        """Runs of a round's inner steps by this member: one per round, not per attempt, but
        for a round run again on a new split (:meth:`attempt`)."""

    def fragment(self, index: int) -> int | None:
        """Streaming: the fragment step ``index`` (0-based) syncs (``None``: all of them)."""
        return None if self.fragment_of is None else index % self.settings.fragments

    def kept_for(self, index: int) -> bool:
        """Whether this member holds its outer gradient of round ``index``."""
        return self._kept.kept_for(index)

    def ran(self, index: int) -> bool:
        """Whether this member ran the inner steps of round ``index`` (in any attempt)."""
        if self.overlap:
            return self._ran is not None and self._ran[0] == index
        return self._kept.kept_for(index)

    def attempt(self, index: int, share: np.ndarray) -> None:
        """An attempt of round ``index`` that computes (not a kept attempt) starts, with
        ``share`` this member's share of its split: a ``Δ`` kept from the round's inner steps
        on another share is dropped, and the inner optimizer's state put back as they found
        it, so that :meth:`ran` is false and the inner steps run again on ``share``."""
        if not self.ran(index) or (self._share is not None and np.array_equal(self._share, share)):
            return
        if self._inner_before is not None:
            self._inner_state = collections.defaultdict(dict, self._inner_before)
        self._drop_round()

    def kept_share(self, index: int) -> np.ndarray:
        """The share this member ran round ``index``'s inner steps on (empty when it holds no
        outer gradient of it): what a kept attempt trains."""
        if not self.ran(index) or self._share is None:
            return np.empty(0, dtype=np.int64)
        return self._share

    def _drop_round(self) -> None:
        """Forget the round in progress: its kept ``Δ``, local parameters and share."""
        self._kept.clear()
        self._kept_local = None
        self._ran = None
        self._share = None
        self._inner_before = None

    def _local_for(self, index: int) -> list[torch.Tensor] | None:
        """This member's local parameters as step ``index`` begins, if it has them (it
        committed step ``index - 1`` with its own inner steps)."""
        return self.local if self.local_step == index - 1 else None

    def send(self, index: int, computing: bool, buckets: GradBuckets) -> bool:
        """Overlap, as an attempt of step ``index`` starts: write this member's outer gradient
        of the step's fragment, ``Δ_p = θ_p - θ_m,p`` from its local parameters as they stand
        (taken at the step's first attempt, kept for the others), into the buckets, unweighted
        (the mean divides by the count of members that sent one, the header's last slot);
        zeros without one (no local parameters of the step before, or not ``computing``: a
        hot spare). Returns whether it sent one. The caller launches the buckets."""
        kept, due = self._kept, self.fragment(index)
        if computing and not kept.kept_for(index) and self._none_for != index:
            local = self._local_for(index)
            if local is not None:
                parts = [k for k in range(len(self.params)) if self._in(k, due)]
                kept.expect(index, len(parts))
                with torch.no_grad():
                    for k in parts:
                        kept.put(k, self.params[k].detach() - local[k])
            else:
                self._none_for = index
        buckets.micro_batch(1.0, last=True)  # (attaches the bucket views as .grad)
        sends = computing and kept.kept_for(index)
        for k, p in enumerate(self.params):
            assert p.grad is not None
            if self._in(k, due):
                if sends:
                    kept.contribute(index, k, p.grad)
                else:
                    p.grad.zero_()
        return sends

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
        with self.inner_steps(index, share, buckets) as acc:
            for batch in inner_batches(share, self.settings.steps_per_sync):
                if not len(batch):
                    continue
                self.inner.zero_grad()
                for mb in micro_batches(batch, micro_batch):
                    loss = loss_fn(mb)
                    acc.loss_sum += float(loss.detach()) * len(mb)
                    (loss * (len(mb) / len(batch))).backward()  # type: ignore[no-untyped-call]
                self.inner.step()

    @contextlib.contextmanager
    def inner_steps(
        self, index: int, share: np.ndarray, buckets: GradBuckets
    ) -> Iterator[InnerRun]:
        """The inner steps of round ``index`` on ``share`` (its sample indices), run by the caller
        inside: the inner optimizer holds this member's own state and may step, the buckets
        are detached; the caller adds its losses (times their samples) to the yielded
        ``loss_sum``. On a normal exit ``Δ`` is kept for the round; on any exit (an error,
        the generator of a loop body closed) the model holds the global parameters again."""
        start = [p.detach().clone() for p in self.params]
        before = {
            p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for p, st in self._inner_state.items()
        }
        due = self.fragment(index)
        acc = InnerRun()
        delta: list[torch.Tensor | None] = []
        own = self._local_for(index) if due is not None else None
        local: list[torch.Tensor] | None = None
        try:
            if own is not None:
                with torch.no_grad():  # streaming: from this member's own parameters
                    for p, mine in zip(self.params, own, strict=True):
                        p.copy_(mine)
            with buckets.detached(), self._inner_optimizer():
                yield acc
                self.inner.zero_grad()
            with torch.no_grad():
                delta = [
                    g - p.detach() if not self.overlap and self._in(k, due) else None
                    for k, (g, p) in enumerate(zip(start, self.params, strict=True))
                ]
                if due is not None:
                    local = [p.detach().clone() for p in self.params]
        finally:  # (also when the user's code raised: the live state stays the committed one)
            with torch.no_grad():
                for g, p in zip(start, self.params, strict=True):
                    p.copy_(g)
        self.rounds_computed += 1
        self._share, self._inner_before = share, before
        if self.overlap:  # (its outer gradient went out as the step began: ``send``)
            self._ran, self._kept_local = (index, acc.loss_sum, len(share)), local
            return
        kept = self._kept
        kept.expect(index, sum(d is not None for d in delta))
        for k, d in enumerate(delta):
            if d is not None:
                kept.put(k, d)
        kept.loss_sum, kept.samples, self._kept_local = acc.loss_sum, len(share), local

    def _in(self, k: int, fragment: int | None) -> bool:
        """Whether parameter ``k`` is synced by a step that syncs ``fragment``."""
        return fragment is None or self.fragment_of is None or self.fragment_of[k] == fragment

    def contribute(self, index: int, weight: float, buckets: GradBuckets) -> float:
        """Write the kept ``Δ`` of round ``index`` into the gradient buckets, to be sent as
        ``weight * Δ`` (zeros without one: a hot spare); returns the mean loss of the inner
        steps (0 without). Overlap: the buckets went out as the step began (``send``); only
        the loss."""
        if self.overlap:
            ran = self._ran
            return ran[1] / ran[2] if ran is not None and ran[0] == index and ran[2] else 0.0
        buckets.micro_batch(weight, last=True)  # (attaches the bucket views as .grad)
        for k, p in enumerate(self.params):
            assert p.grad is not None
            self._kept.contribute(index, k, p.grad)
        kept = self._kept
        if not kept.kept_for(index) or not kept.samples:
            return 0.0
        return kept.loss_sum / kept.samples

    def outer_step(self, index: int, skip: bool, senders: int = 0) -> None:
        """Apply the reduced mean outer gradient (``.grad``) of round ``index`` to the global
        parameters (streaming: of its fragment only; the member's local parameters of that
        fragment become the global ones, or with overlap are mixed with them); ``skip``:
        every member skips it alike (non-finite). Overlap: ``.grad`` holds the sum of the
        outer gradients of ``senders`` members (none sent one: no outer step)."""
        due = self.fragment(index)
        if self.overlap and senders == 0:
            skip = True
        if not skip:
            grads = [p.grad for p in self.params]
            try:
                for k, p in enumerate(self.params):
                    if not self._in(k, due):
                        p.grad = None  # (SGD passes over it: no step, no momentum decay)
                    elif self.overlap and p.grad is not None:
                        p.grad.div_(senders)
                self.outer.step()
            finally:
                for p, g in zip(self.params, grads, strict=True):
                    p.grad = g
        local = self._kept_local if self.ran(index) else None
        if due is not None and local is not None:
            mix = self.settings.mix if self.overlap else 0.0
            with torch.no_grad():
                for k, (p, mine) in enumerate(zip(self.params, local, strict=True)):
                    if self._in(k, due) and mix:
                        mine.mul_(mix).add_(p.detach(), alpha=1.0 - mix)
                    elif self._in(k, due):
                        mine.copy_(p.detach())
            self.local, self.local_step = local, index
        else:
            self.local, self.local_step = None, -1
        self._drop_round()
