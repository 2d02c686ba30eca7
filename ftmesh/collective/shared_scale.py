"""The shared-scale int8 allreduce: members agree on each block's scale, then sum integers.

Theory of operation (homomorphic quantization, as in THC, NSDI '24). Integers quantized with
the *same* scale can be added exactly, so a plain ring allreduce can reduce them: no partial
sum is ever re-quantized, and each element is quantized once, by its member, whatever N.

1. *Scales round.* Each member computes ``max|c|`` per block of its contribution ``c`` (its
   values plus its error-feedback residual). One float32 ring allreduce max-reduces these
   (1/block_size of the buffer), with the exact tail (``Int8Compression(exact_tail=k)``)
   riding at its end, summed in float32 like an uncompressed allreduce.
2. Every member now holds the same ``M_b`` per block and derives the same scale,
   ``M_b / L`` with ``L = 127 // N`` levels (int8 lanes), so that N integers of at most ``L``
   in magnitude add up to at most 127: no overflow, whatever the data. With fewer than
   ``MIN_LEVELS`` levels (N > 8) the lanes are int16 (``L = 32767 // N``).
3. *Integer round.* Each member quantizes ``c`` with those scales (its error goes to its
   residual) and the integers go through the ordinary ring allreduce (sum), which adds them
   exactly, in any order: every member ends with the same integers.
4. Every member decodes ``q * scale`` per block, the same float32 multiplication everywhere,
   so every member ends with bitwise-identical values (``avg`` then divides by N).

Cost: the integer round moves ``2(N-1)/N`` int8 buffers per link against as many float32
ones (4x fewer bytes at any N; 2x with int16 lanes), and the scales round ``1/block_size`` of
that as float32 (1.6 % at the default 256), so about 3.9x in all, where the one-shot ring
(``compressed``) reaches ``16/(N+2)``: 2.7x at N=4. The price is one more round's latency
(a small allreduce) and a coarser grid: a member's values are quantized to ``L`` levels of
the largest value *any* member holds in that block (31 at N=4, 15 at N=8) instead of 127 of
its own. Error feedback carries that error to the next round, so nothing is lost over time
(the accumulated error stays one round's error). Hence ``Int8Compression.shared_scale_from``:
large buffers, where bytes dominate, take this path; small ones the one-shot ring.

Non-finite values: a NaN or inf in a block makes its agreed maximum non-finite, so every
member sends 0 for it and decodes ``0 * inf`` = NaN: the block is non-finite on every member,
as ``torch.amp.GradScaler`` needs. Commit-or-none: the residual is updated in ``finish``, once
the integer round completed; a round that aborts (either of the two) leaves it as it was.
(A caller whose step can still fail after a completed round puts the residual back itself:
``Int8Compression.attempt``.)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..compression import Int8Compression
from ..compression.int8 import F32
from ..errors import LocalUsageError
from .ops import Array, Staged, as_float32, store_float32

MIN_LEVELS = 15
"""Fewest integer levels per sign on int8 lanes (``127 // N``): up to N = 8. Larger views
use int16 lanes (``32767 // N`` levels), which halve the bytes instead of quartering them."""


def use_shared_scale(comp: Int8Compression, quantized: int, members: int) -> bool:
    """Whether a compressed allreduce of ``quantized`` (non-tail) elements on ``members``
    takes this path: from 3 members on (at 2 the one-shot ring moves as few bytes in one
    round) and from ``comp.shared_scale_from`` elements."""
    return members >= 3 and quantized > 0 and quantized >= comp.shared_scale_from


def lanes(members: int) -> tuple[np.dtype[np.signedinteger], int]:
    """The integer dtype and the levels per sign of a view of ``members``."""
    if 127 // members >= MIN_LEVELS:
        return np.dtype(np.int8), 127 // members
    if 32767 // members >= MIN_LEVELS:
        return np.dtype(np.int16), 32767 // members
    raise LocalUsageError(f"compressed allreduce supports views of up to 2184, not {members}")


def codec_header(comp: Int8Compression, members: int, phase: str) -> str:
    """What members compare before each round: codec, scheme, lanes, tail."""
    dtype, levels = lanes(members)
    return f"{comp.name} shared-scale {phase} {dtype.name}x{levels} exact_tail={comp.exact_tail}"


class SharedScaleRun:
    """One shared-scale allreduce on one member: the buffers of both rounds and the steps
    between them (``DataPlane`` wraps them in two plans)."""

    def __init__(self, comp: Int8Compression, st: Staged, op: str, members: int) -> None:
        self.comp, self.codec, self.st = comp, comp.codec, st
        self.avg, self.members = op == "avg", members
        self.lane, self.levels = lanes(members)
        n = int(st.flat.size)
        self.xf = as_float32(st.flat, st.dtype)
        self.quantized = m = n - comp.exact_tail
        self.blocks = nb = self.codec.blocks(m)
        comp.begin()
        self.residual = comp.residual(n)
        self.new_residual = comp.next_residual(n)
        self.contrib: F32 = self.xf[:m]
        if self.residual is not None:
            self.contrib = np.add(
                self.xf[:m], self.residual[:m], out=comp.workspace("contrib", m, np.float32)
            )
        self.scales_wire: F32 = comp.workspace("scales", nb + comp.exact_tail, np.float32)
        self.codec.block_maxabs_into(self.contrib, self.scales_wire[:nb])
        self.scales_wire[nb:] = self.xf[m:]  # the exact tail (its residual is always 0)
        self.ints: npt.NDArray[np.signedinteger] = comp.workspace("ints", m, self.lane)
        self.scales: F32 = np.empty(0, np.float32)
        """The agreed scales (``quantize``)."""
        self._base = _address(self.scales_wire)

    def reduce_scales(self, a: Array, b: Array, out: Array) -> None:
        """The scales round's reducer: max over the block maxima, float32 sum over the tail
        (``out`` is a slice of the wire; its offset says which part it covers)."""
        off = (_address(out) - self._base) // 4
        k = max(0, min(self.blocks - off, out.size))
        np.maximum(a[:k], b[:k], out=out[:k])
        np.add(a[k:], b[k:], out=out[k:])

    def quantize(self) -> None:
        """After the scales round: quantize the contribution with the agreed scales into the
        integer wire, its error into the new residual."""
        m = self.quantized
        self.scales = self.codec.shared_scales(self.scales_wire[: self.blocks], self.levels)
        res = None if self.new_residual is None else self.new_residual[:m]
        self.codec.quantize_into(self.contrib, self.scales, self.levels, self.ints, res)
        if self.new_residual is not None:
            self.new_residual[m:] = 0.0

    def finish(self) -> None:
        """After the integer round: decode the integer sums, then the tail, into the input."""
        m = self.quantized
        out = self.xf
        self.codec.dequantize_into(self.ints, self.scales, out[:m])
        out[m:] = self.scales_wire[self.blocks :]
        if self.avg:
            np.divide(out, np.float32(self.members), out=out)
        store_float32(out, self.st.flat, self.st.dtype)
        self.comp.commit(self.new_residual)
        if self.st.commit is not None:
            self.st.commit()


def _address(a: Array) -> int:
    return int(a.ctypes.data)
