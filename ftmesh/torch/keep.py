"""A member's local contribution to a step, kept across the step's attempts
(``TrainerConfig.recovery="keep"``).

Theory of operation. Under ``recovery="keep"`` the step machine (``ftmesh.training.step``)
may answer the loss of a member during a step with a *kept attempt* (``Compute.kept``): the
survivors send again, on the new ring, the gradients they had computed for the failed
attempt, with no forward or backward, and the step commits without the lost members' shares.
What each survivor sends again must be its *local* contribution, but the gradient buckets
(``ftmesh.torch.buckets``) are allreduced in place, some of them while backward still runs:
when the attempt fails, a bucket may hold a partial sum of other members' gradients. So the
contribution is copied as it goes out: :meth:`KeptContribution.keep` takes each bucket's
gradient part just before its allreduce is launched (after the non-finite check, so a
member that sent zeros keeps zeros and its flag), and :meth:`KeptContribution.contribute`
writes it back into the same wire buffer, times ``batch / trained``, in the kept attempt.
The copy is float32, like the wire (one model's gradients of memory, on the bucket's
device, reused from step to step), and is taken, at every step, only under
``recovery="keep"``: one copy of the gradients per step is what the policy costs when no
member is lost.

The shape is DiLoCo's (``ftmesh.torch.diloco.Rounds``: ``kept_for`` / ``contribute``), for
one step's gradients instead of one round's outer gradient: a contribution tagged with its
step index, complete only when every bucket was copied in the same attempt, and dropped when
the step commits. The machine decides from the views alone whether every member sends what
it kept (it keeps the split the contribution was computed on, ``StepMachine.kept``); a
member that holds no complete copy when asked sends zeros and a sample count of 0, so the
reduced header's count disagrees with the kept attempt's and the attempt fails for every
member (``DESYNC``), which computes the step again.
"""

from __future__ import annotations

import numpy as np
import torch

from .buckets import Wire

__all__ = ["KeptContribution"]


class KeptContribution:
    """One trainer's kept local contribution to a step; see the module docstring."""

    def __init__(self) -> None:
        self.index = -1
        """The step (0-based) the contribution is of; -1: none."""
        self._grads: dict[int, Wire] = {}
        """id(wire buffer) -> the gradient part of that buffer as it went out (the arrays
        are reused from step to step)."""
        self._copied: set[int] = set()
        """The buffers copied in the current attempt."""
        self._buckets = 0
        self.indices = np.empty(0, dtype=np.int64)
        """The samples the contribution was computed on (the attempt's share)."""
        self.loss_sum = 0.0
        """The summed loss of those samples (the header's loss slot)."""
        self.nonfinite = False
        """We sent zeros for non-finite gradients (our row's flag)."""

    def start(self, index: int, indices: np.ndarray, buckets: int) -> None:
        """A computed attempt of step ``index`` on ``indices`` starts (over ``buckets``
        buffers): whatever was kept before is dropped."""
        self.index = index
        self.indices = indices
        self._buckets = buckets
        self._copied.clear()
        self.loss_sum = 0.0
        self.nonfinite = False

    def keep(self, key: int, grads: Wire, nonfinite: bool) -> None:
        """Copy one bucket's gradient part ``grads`` (buffer ``key``) as it goes out."""
        held = self._grads.get(key)
        if isinstance(grads, torch.Tensor):
            if isinstance(held, torch.Tensor) and held.shape == grads.shape:
                held.copy_(grads.detach())
            else:
                self._grads[key] = grads.detach().clone()
        elif isinstance(held, np.ndarray) and held.shape == grads.shape:
            np.copyto(held, grads)
        else:
            self._grads[key] = np.array(grads, copy=True)
        self._copied.add(key)
        self.nonfinite = nonfinite

    def kept_for(self, index: int) -> bool:
        """Whether this member holds its whole contribution to step ``index``."""
        return self.index == index and len(self._copied) == self._buckets > 0

    def contribute(self, index: int, key: int, grads: Wire, factor: float) -> None:
        """Write the kept gradient part of buffer ``key`` into ``grads``, times ``factor``
        (zeros without a whole contribution to step ``index``)."""
        kept = self._grads.get(key) if self.kept_for(index) else None
        if kept is None:
            grads[:] = 0.0
        elif isinstance(grads, torch.Tensor):
            assert isinstance(kept, torch.Tensor)
            with torch.no_grad():
                torch.mul(kept, factor, out=grads)
        else:
            assert isinstance(kept, np.ndarray)
            np.multiply(kept, np.float32(factor), out=grads)

    def clear(self) -> None:
        """The step committed (or was adopted): nothing is kept (the arrays stay, for the
        next step's copies)."""
        self.index = -1
        self._copied.clear()
