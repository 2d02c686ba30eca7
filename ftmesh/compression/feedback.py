"""What a compressed allreduce is given: the codec, and the error-feedback residual it keeps.

Theory of operation (error feedback, as in 1-bit SGD / EF-SGD): a member does not send its
value ``x`` but ``c = x + r``, where ``r`` is what earlier rounds lost to quantization, and
keeps ``r' = c - decode(encode(c))`` for the next round. Over T rounds the decoded values add
up to ``sum(x) + r_0 - r_T``: the accumulated error is one round's residual, whatever T.

The shared-scale allreduce (``ftmesh.collective.shared_scale``) quantizes once, with scales
all members agreed on, and adds the integers exactly: its error is the member's own, kept in
its residual. The one-shot allreduce quantizes twice (``ftmesh.collective.compressed``): a
member's share of every other member's shard, and, as a shard's owner, the sum of its
shard. Both errors go to
the same per-element residual of that member: a worker residual where it sent a shard, an
owner residual where it reduced one. The next round adds the whole residual to the member's
contribution, so each error reaches the sum once, through whichever member owns the element
then. That is also how view changes are handled: a residual is per element and per member,
not per shard, so when the view changes (other shard owners, another member count) nothing is
reset or moved — an owner residual for elements the member no longer owns travels to their
new owner inside its next contribution (quantized with it, its error kept again). A member
that leaves takes its residual with it (at most one round's error of its share is lost); a
joiner starts at zero.

The residual is updated only when the collective completes on this member, so a collective
that fails is retried with the same residual. One object per stream of allreduces (one
gradient bucket, one tensor updated step after step): reusing it for a tensor of another size
is refused, and calls through one object must not overlap.

*Attempts.* A caller whose collectives are part of a larger unit that can still fail after
them (the trainer's step: its gathered rows, the header's check, the update's allgather) keeps
the residual of an attempt aside until the unit commits: ``attempt()`` at the start of every
attempt, ``settle()`` when the step commits. A collective that completes inside an attempt
advances the residual as usual (the next collective of the attempt, if any, builds on it), but
the next ``attempt()`` without a ``settle()`` in between puts back the residual the failed
attempt started with: a failed attempt leaves no trace. Without that, its residual (for an
element below half a level of its block's scale: the whole value the attempt did not send)
would be added to the retry's contribution of the same gradients, which counts part of the
failed attempt's gradient once more, and unevenly across members when the attempt completed
on some of them only. Cost: none; the buffer kept aside is the one the completed collective
would have recycled as its spare, and it becomes the spare again at ``settle()``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, LocalUsageError
from .int8 import DEFAULT_BLOCK_SIZE, F32, Int8Codec

SHARED_SCALE_FROM = 1 << 18
"""Default ``Int8Compression.shared_scale_from`` (262,144 values, 1 MiB of float32): the
shared-scale round costs one more small allreduce's latency (a few hops of a millisecond or
less), which the bytes it saves outweigh from about this size on a 1 Gbit/s link, and from a
tenth of it on 100 Mbit/s."""

COMPRESSIONS = ("int8",)
"""Names ``compression=`` accepts besides an ``Int8Compression`` object."""


class Int8Compression:
    """Blockwise int8 compression of one stream of allreduces, with error feedback.

    ``block_size``: elements per float32 scale (``ftmesh.compression.int8``).
    ``error_feedback``: keep each member's quantization error and add it to its next
    contribution (default); without it every round's error is simply lost.
    ``exact_tail``: the last this many elements are not quantized but added in float32, like
    an uncompressed allreduce (counters riding along with gradients: the trainer's sample
    count, loss and round check).
    ``shared_scale_from``: from this many quantized elements on, on views of 3 members or
    more, the allreduce agrees on shared scales first and sums integers on a plain ring
    (``ftmesh.collective.shared_scale``: about 3.9x fewer bytes than float32 at any N, for one
    more small round); below it, the one-shot ring (``ftmesh.collective.compressed``: one
    round, ``16/(N+2)`` x fewer bytes). 0: always shared scales.
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        error_feedback: bool = True,
        exact_tail: int = 0,
        shared_scale_from: int = SHARED_SCALE_FROM,
    ) -> None:
        self.codec = Int8Codec(block_size)
        self.error_feedback = error_feedback
        for name, v in (("exact_tail", exact_tail), ("shared_scale_from", shared_scale_from)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {v!r}")
        self.exact_tail = exact_tail
        self.shared_scale_from = shared_scale_from
        self._residual: F32 | None = None
        self._spare: F32 | None = None
        self._held = False
        self._kept: F32 | None = None
        """With ``_held``: the residual the current attempt started with (None: zeros)."""
        self._work: dict[str, npt.NDArray[Any]] = {}
        self._busy = False

    @property
    def name(self) -> str:
        """What members compare in the collective's header (``int8/256``)."""
        return self.codec.name

    def residual(self, n: int) -> F32 | None:
        """The residual to add to a contribution of ``n`` elements (zeros the first time), or
        None without error feedback. Raises ``LocalUsageError`` for another ``n`` than
        before."""
        if not self.error_feedback:
            return None
        if self._residual is None:
            self._residual = np.zeros(n, np.float32)
        elif self._residual.size != n:
            raise LocalUsageError(
                f"this Int8Compression holds residuals of {self._residual.size} elements, "
                f"got {n}: use one Int8Compression per tensor"
            )
        return self._residual

    def next_residual(self, n: int) -> F32 | None:
        """The buffer a collective writes the new residual into (``commit`` adopts it); None
        without error feedback."""
        if not self.error_feedback:
            return None
        if self._spare is None or self._spare.size != n:
            self._spare = np.empty(n, np.float32)
        return self._spare

    def commit(self, new: F32 | None) -> None:
        """The collective completed: ``new`` (from ``next_residual``) is the residual now, and
        the workspaces are free again."""
        self._busy = False
        if new is None or not self.error_feedback:
            return
        old, self._residual = self._residual, new
        # (the residual an attempt started with is kept until the step commits)
        self._spare = None if self._held and old is self._kept else old

    def attempt(self) -> None:
        """An attempt of a step starts (see *Attempts* in the module docstring): the first
        since ``settle()`` keeps the residual as it is now aside; a later one (the last
        attempt failed) goes back to it first."""
        if not self._held:
            self._held, self._kept = True, self._residual
            return
        if self._residual is not self._kept:
            if not self._busy:  # (else begin() drops the spare: an aborted run may write it)
                self._spare = self._residual
            self._residual = self._kept

    def settle(self) -> None:
        """The step whose attempts ``attempt()`` marked committed: its residual stands (the
        one kept aside is the spare again)."""
        kept = self._kept
        if kept is not None and kept is not self._residual and self._spare is None:
            self._spare = None if self._busy else kept
        self._held, self._kept = False, None

    def begin(self) -> None:
        """A collective starts using this object's workspaces (and the buffer of the next
        residual). If the last one never finished (aborted: its engine thread may still be
        winding down), they are dropped rather than shared with it."""
        if self._busy:
            self._work.clear()
            self._spare = None
        self._busy = True

    def workspace(self, key: str, n: int, dtype: Any) -> npt.NDArray[Any]:
        """A scratch array of ``n`` elements kept for the next call with the same ``n``: a
        fresh buffer costs a page fault per page (slow on some VMs), every call."""
        buf = self._work.get(key)
        if buf is None or buf.size != n or buf.dtype != dtype:
            buf = self._work[key] = np.empty(n, dtype)
        return buf

    def reset(self) -> None:
        """Forget the residual (e.g. after loading a checkpoint)."""
        self._residual = self._spare = self._kept = None
        self._held = False
        self._work.clear()

    def residual_norm(self) -> float:
        """Largest absolute residual held (0 without one): what error feedback still owes."""
        if self._residual is None or not self._residual.size:
            return 0.0
        return float(np.max(np.abs(self._residual)))

    def __repr__(self) -> str:
        return (
            f"Int8Compression(block_size={self.codec.block_size}, "
            f"error_feedback={self.error_feedback}, exact_tail={self.exact_tail}, "
            f"shared_scale_from={self.shared_scale_from})"
        )


def as_compression(spec: Any) -> Int8Compression | None:
    """``compression=`` as given by a caller: None or ``"none"`` (off), ``"int8"`` (a fresh
    ``Int8Compression``: nothing to carry a residual to the next call, so no error feedback
    across calls), or an ``Int8Compression`` (error feedback across the calls made with it)."""
    if spec is None or spec == "none":
        return None
    if isinstance(spec, Int8Compression):
        return spec
    if spec == "int8":
        return Int8Compression(error_feedback=False)
    raise LocalUsageError(
        f"unknown compression {spec!r}; use None, one of {COMPRESSIONS} or an Int8Compression"
    )


def per_stream(spec: Any, exact_tails: list[int]) -> list[Int8Compression | None]:
    """One compression object per stream (e.g. per gradient bucket) for the setting ``spec``
    (as ``as_compression`` takes it), stream ``i`` with ``exact_tails[i]`` exact elements at
    its end: each keeps its own residual. ``"int8"`` means error feedback here, since the
    streams live as long as the caller; an ``Int8Compression`` lends its block size and
    error-feedback setting (its own residual is not used)."""
    comp = as_compression(spec)
    if comp is None:
        return [None] * len(exact_tails)
    feedback = comp.error_feedback or not isinstance(spec, Int8Compression)
    block, shared = comp.codec.block_size, comp.shared_scale_from
    return [
        Int8Compression(block, error_feedback=feedback, exact_tail=t, shared_scale_from=shared)
        for t in exact_tails
    ]
