"""The int8-compressed allreduce on a hierarchical view: float32 inside each site, int8 across.

Theory of operation (``DataPlane.plan_phases`` runs it; the ring plan is in
docs/DESIGN-NOTES.md, "Ring plan"). A view whose plan has several sites reduces in three
phases: a reduce-scatter inside the site, an allreduce of each block among the members at
the same place of every site, an allgather inside the site. Compression pays where the bytes
are slow, which is between sites; inside a site it would only add quantization error. So:

1. Every member forms its contribution ``c = x + r`` in float32 (``r``: its error-feedback
   residual, the whole buffer's, ``ftmesh.compression.feedback``), in a workspace of the
   compression object.
2. The site's reduce-scatter and allgather run on ``c`` in float32, exactly like the
   uncompressed phases (the exact tail needs nothing special there).
3. The cross-site phase is the ordinary compressed allreduce (``compressed`` or
   ``shared_scale``, whichever the block's size and the number of sites choose) of the
   member's block of site partial sums, as ``sum``, with a compression object of its own for
   the block: a zero residual (the member's residual already rode in ``c``), the same codec
   and settings, and as exact tail the part of the whole buffer's exact tail that falls in
   this block (the tail is a suffix of the buffer, so its part of a block is a suffix of the
   block: the same for every member holding that block). Its decoded result is written back
   into the block before the allgather, so every member of the view ends with the same bits.
4. ``finish``: the member's new residual is the cross phase's error in its block and zero
   elsewhere (what it sent inside its site went in float32, exactly); ``avg`` divides by the
   view's size; the result is stored in the caller's dtype.

Error feedback thus keeps its contract: per element and per member, updated only when the
whole allreduce completed (a phase that fails leaves the residual as it was), and a view
change needs no reset, since the next round adds the whole residual to the contribution
before the site's reduce-scatter, wherever the element's block now lives. Bytes across the
sites: the compressed allreduce's share of ``S/k`` per member, instead of a flat compressed
ring's crossings of the whole buffer.
"""

from __future__ import annotations

import numpy as np

from ..compression import Int8Compression
from ..compression.int8 import F32
from ..errors import LocalUsageError
from .compressed import check_compressible
from .ops import Staged, as_float32, store_float32


class HierarchicalInt8:
    """One compressed allreduce of ``st`` on a hierarchical view of ``members`` (module doc):
    ``work`` is the float32 contribution the phases run on, ``block_compression`` the
    cross-site phase's compression, ``finish`` the residual update and the copy back."""

    def __init__(self, comp: Int8Compression, st: Staged, op: str, members: int) -> None:
        check_compressible(op, st.dtype)
        n = int(st.flat.size)
        if comp.exact_tail > n:
            raise LocalUsageError(f"exact_tail={comp.exact_tail} is longer than the {n} elements")
        self.comp, self.st, self.members, self.avg = comp, st, members, op == "avg"
        comp.begin()
        residual = comp.residual(n)
        self._new = comp.next_residual(n)
        self.work: F32 = comp.workspace("hierarchical", n, np.float32)
        np.copyto(self.work, as_float32(st.flat, st.dtype))
        if residual is not None:
            np.add(self.work, residual, out=self.work)
        self._block: tuple[int, int, Int8Compression] | None = None

    def block_compression(self, lo: int, hi: int) -> Int8Compression:
        """The compression of the cross-site phase of ``work[lo:hi]``, this member's block."""
        n = int(self.work.size)
        tail = max(0, hi - max(lo, n - self.comp.exact_tail))
        comp = self.comp
        sub = Int8Compression(
            comp.codec.block_size,
            error_feedback=comp.error_feedback,
            exact_tail=tail,
            shared_scale_from=comp.shared_scale_from,
        )
        self._block = (lo, hi, sub)
        return sub

    def finish(self) -> None:
        """All three phases completed: the new residual, ``avg``, the result in place."""
        new = self._new
        if new is not None:
            new.fill(0)
            if self._block is not None:
                lo, hi, sub = self._block
                err = sub.residual(hi - lo)
                if err is not None:
                    new[lo:hi] = err
        if self.avg:
            np.divide(self.work, np.float32(self.members), out=self.work)
        store_float32(self.work, self.st.flat, self.st.dtype)
        self.comp.commit(new)
