"""A member's local contribution to a step, kept across the step's attempts: the one concept
behind ``TrainerConfig.recovery="keep"`` and DiLoCo's retried rounds.

Theory of operation. A step's allreduce sums every computing member's *local contribution*
(its gradients, or a DiLoCo round's outer gradient ``Δ``). When a member is lost during the
step, the attempt fails and the survivors try the same step again on a new ring. Two users
send, in that retry, what they had already computed instead of computing it again: the
synchronous trainer under ``recovery="keep"`` (the step machine's *kept attempt*,
``Compute.kept``, ``ftmesh.training.step``) and DiLoCo (``ftmesh.torch.diloco.Rounds``: a
round's inner steps run once, unless a retry gives the member another share). Both hold the
contribution in a :class:`Kept`:

* *When it is kept, for which index.* :meth:`Kept.expect` opens a contribution to step (round)
  ``index``, 0-based, made of a known number of *parts*, and drops whatever was kept before;
  :meth:`Kept.put` adds one part under a key. The contribution is *whole* when every part
  came in since ``expect``, and :meth:`Kept.kept_for` answers for ``index`` only: a copy of
  another step is never sent. The trainer's parts are its gradient buckets, one per wire
  buffer (keyed by ``id(buffer)``), put as each bucket's allreduce is launched, so a copy is
  whole only when every bucket of one computed attempt went out (:class:`KeptContribution`).
  DiLoCo's are the parameters' ``Δ`` (keyed by parameter position; in streaming DiLoCo the
  step's fragment only), put at once when the round's inner steps end.
* *What goes out.* :meth:`Kept.contribute` writes a part into the outgoing buffer, times a
  factor (the trainer's ``batch / trained``, the mean over the samples the kept attempt
  trains; DiLoCo's 1, its weight being applied by the buckets), or zeros when the
  contribution to that index is not whole (the part was not in it, or nothing is). Zeros are
  a DiLoCo hot spare's contribution, and in the trainer's kept attempt the mark of a member
  that cannot send its share: the machine decides from the views alone that every member
  sends what it kept, a member without a whole copy sends zeros and a sample count of 0, the
  reduced header's count disagrees with the attempt's and the attempt fails for every member
  (``DESYNC``), which computes the step again.
* *The loss and the samples* (``loss_sum``, ``samples``) it was computed with, for the
  step's header when it goes out again.
* *The non-finite flag* (``nonfinite``): set when the member sent zeros instead of
  non-finite gradients (the trainer's check runs before the copy, so the copy holds those
  zeros) and sent again with them as its gathered row's flag, so that every member skips the
  update alike in a kept attempt too. DiLoCo leaves it unset: its ``Δ`` goes through the same
  check at every attempt, as it goes out.
* *When it is dropped.* :meth:`Kept.clear` when the step is over: the trainer's at the report
  of every step committed or adopted, DiLoCo's at the round's outer step (a round this member
  adopted leaves it, for an index that is past); and :meth:`Kept.expect` when a new
  contribution starts (each computed attempt of the trainer, whose copy is whole only if that
  attempt's every bucket went out; DiLoCo's next round computed). In between, failures do not
  drop it: after a failure that no loss explains the step machine forgets the split the copy
  was computed on (``StepMachine.kept``), so the next attempt computes again and starts a new
  copy; DiLoCo keeps its ``Δ`` for the attempts that send it again (kept attempts, or one
  whose split gives this member the same share) and drops it for one that computes another
  share (``Rounds.attempt``).
* *Memory.* While kept: one model's worth of contribution, on the parts' device. The
  trainer's copy is float32 like the wire, taken at every step (only under
  ``recovery="keep"``: one copy of the gradients per step is what the policy costs when no
  member is lost) into arrays :class:`KeptContribution` reuses from step to step, so they
  outlive ``clear``. DiLoCo's parts are the ``Δ`` tensors themselves (the parameters' dtype,
  no copy), released by ``clear``; ``Rounds`` keeps beside them a copy of the inner
  optimizer's state as the round found it (Adam: two models' worth), for a round that must
  run again on a new split.
"""

from __future__ import annotations

import numpy as np
import torch

from .buckets import Wire

__all__ = ["Kept", "KeptContribution"]


class Kept:
    """A member's contribution to one step (round), kept across the step's attempts; see the
    module docstring."""

    def __init__(self) -> None:
        self.index = -1
        """The step (0-based) the contribution is of; -1: none."""
        self._parts: dict[int, Wire] = {}
        """Key -> a part of the contribution, put since :meth:`expect`."""
        self._expected = 0
        self.loss_sum = 0.0
        """The summed loss of the samples the contribution was computed on."""
        self.samples = 0
        """How many samples that was."""
        self.nonfinite = False
        """We sent zeros for non-finite values (our gathered row's flag)."""

    def expect(self, index: int, parts: int) -> None:
        """A contribution to step ``index`` of ``parts`` parts starts: whatever was kept
        before is dropped."""
        self.index = index
        self._expected = parts
        self._parts.clear()
        self.loss_sum = 0.0
        self.samples = 0
        self.nonfinite = False

    def put(self, key: int, part: Wire) -> None:
        """Hold ``part`` (by reference) as the part ``key`` of the contribution."""
        self._parts[key] = part

    def kept_for(self, index: int) -> bool:
        """Whether this member holds its whole contribution to step ``index``."""
        return self.index == index and len(self._parts) == self._expected > 0

    def contribute(self, index: int, key: int, out: Wire, factor: float = 1.0) -> None:
        """Write the part ``key`` of the contribution to step ``index`` into ``out``, times
        ``factor`` (zeros without a whole contribution to ``index``, or without that
        part)."""
        part = self._parts.get(key) if self.kept_for(index) else None
        if isinstance(out, torch.Tensor):
            with torch.no_grad():
                if part is None:
                    out.zero_()
                    return
                assert isinstance(part, torch.Tensor)
                if factor == 1.0:
                    out.copy_(part)
                else:
                    torch.mul(part, factor, out=out)
        elif part is None:
            out[:] = 0.0
        else:
            assert isinstance(part, np.ndarray)
            if factor == 1.0:
                np.copyto(out, part)
            else:
                np.multiply(part, np.float32(factor), out=out)

    def clear(self) -> None:
        """The step committed (or was adopted): nothing is kept, and the parts' references
        are let go."""
        self.index = -1
        self._parts.clear()


class KeptContribution(Kept):
    """``recovery="keep"``: one trainer's gradients as they went out, bucket by bucket (the
    parts: one per wire buffer, keyed by ``id(buffer)``), copied into float32 arrays reused
    from step to step; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._copies: dict[int, Wire] = {}
        """id(wire buffer) -> the array its gradient part is copied into (kept across steps:
        what :meth:`Kept.clear` lets go of is only the reference)."""
        self.indices = np.empty(0, dtype=np.int64)
        """The samples the contribution was computed on (the attempt's share)."""

    def start(self, index: int, indices: np.ndarray, buckets: int) -> None:
        """A computed attempt of step ``index`` on ``indices`` starts (over ``buckets``
        buffers): whatever was kept before is dropped."""
        self.expect(index, buckets)
        self.indices = indices
        self.samples = len(indices)

    def keep(self, key: int, grads: Wire, nonfinite: bool) -> None:
        """Copy one bucket's gradient part ``grads`` (buffer ``key``) as it goes out (after
        the non-finite check: ``nonfinite``, our flag so far)."""
        held = self._copies.get(key)
        if isinstance(grads, torch.Tensor):
            if isinstance(held, torch.Tensor) and held.shape == grads.shape:
                held.copy_(grads.detach())
            else:
                held = self._copies[key] = grads.detach().clone()
        elif isinstance(held, np.ndarray) and held.shape == grads.shape:
            np.copyto(held, grads)
        else:
            held = self._copies[key] = np.array(grads, copy=True)
        self.put(key, held)
        self.nonfinite = nonfinite
