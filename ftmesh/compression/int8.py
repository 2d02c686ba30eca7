"""Blockwise int8 codec: the NumPy reference (CPU path, and the oracle of the CUDA kernels).

Theory of operation: a run of ``n`` float32 values is cut into blocks of ``block_size``
elements (the last block may be short). Each block gets one float32 scale,
``scale = float32(max|x|) / 127.0f`` (IEEE float32 division), and each value becomes
``q = clip(rint(x / scale), -127, 127)`` as int8: float32 division, round half to even. A block
whose scale is 0 (all zeros, or so small that the division underflows) or not finite (the block
holds an inf or a NaN) gets ``q = 0`` everywhere. Decoding is ``x' = float32(q) * scale``: one
float32 multiplication, so a zero block decodes to zeros and a non-finite block decodes to NaN
(``0 * inf``, ``0 * nan``) — a non-finite gradient stays non-finite through compression, which
is what ``torch.amp.GradScaler`` needs to skip the step. No flush-to-zero anywhere: subnormal
inputs and scales are computed as IEEE float32 (CUDA kernels must not use fast-math division).

Wire layout of an encoded run (``encoded_bytes(n)`` bytes): the scales, float32 little-endian,
one per block, followed by the ``n`` int8 values. That is 4/256 = 1.6 % of overhead at the
default block size, and ``4n`` bytes become ``n + 4*ceil(n/block_size)``.

Error bound: for a finite block with maximum ``m`` and a normal scale, every value decodes
within ``scale/2`` (= ``m/254``) plus float32 rounding (a few ulps of ``m``) of the input. Error
feedback (``Int8Compression``) keeps ``x - x'`` and adds it to the next input, so the error
accumulated over many steps stays bounded by one step's error instead of growing with the
number of steps.

The codec is agreed with #14's CUDA kernels (``docs/DESIGN-NOTES.md``, "Interfaces agreed"):
change it there first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, LocalUsageError

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

DEFAULT_BLOCK_SIZE = 256
"""Elements per scale. Smaller blocks track the magnitude of the data more closely (less
error where values of very different size sit side by side) at 4 bytes of scale per block:
256 costs 1.6 % of the int8 payload; 4096 (hivemind, bitsandbytes) 0.1 %."""

MAX_BLOCK_SIZE = 1 << 20
"""Largest block size accepted: beyond that one outlier sets the precision of a megabyte of
values, which is never what one wants."""

_Q_MAX = np.float32(127.0)


@dataclass(frozen=True, slots=True)
class Int8Codec:
    """The codec's one setting. See the module doc for the format."""

    block_size: int = DEFAULT_BLOCK_SIZE
    """Elements sharing one float32 scale (1..``MAX_BLOCK_SIZE``; default 256)."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or not 1 <= self.block_size <= MAX_BLOCK_SIZE
        ):
            raise ConfigError(
                f"block_size must be an int in 1..{MAX_BLOCK_SIZE}, got {self.block_size!r}"
            )

    @property
    def name(self) -> str:
        """``int8/<block_size>``: what members compare before they exchange encoded bytes."""
        return f"int8/{self.block_size}"

    def blocks(self, n: int) -> int:
        """Blocks (= scales) of a run of ``n`` values."""
        return -(-n // self.block_size)

    def encoded_bytes(self, n: int) -> int:
        """Bytes of an encoded run of ``n`` values: 4 per block, then 1 per value."""
        return 4 * self.blocks(n) + n

    # -- encode -------------------------------------------------------------------------------
    def encode_into(self, x: F32, out: U8, residual: F32 | None = None) -> None:
        """Encode the flat float32 run ``x`` into ``out`` (``encoded_bytes(x.size)`` bytes).
        With ``residual`` (float32, ``x.size``), also write ``x - decode(out)`` there, 0 for
        the values of non-finite blocks (a NaN residual would poison every later round)."""
        n = int(x.size)
        if x.dtype != np.float32 or x.ndim != 1:
            raise LocalUsageError(f"encode wants a flat float32 array, got {x.dtype} {x.shape}")
        if out.size != self.encoded_bytes(n):
            raise LocalUsageError(f"{out.size} bytes for {self.encoded_bytes(n)} encoded bytes")
        nb = self.blocks(n)
        scales = out[: 4 * nb].view("<f4")
        q = out[4 * nb :].view(np.int8)
        for k0, k1, e0, e1, width in self._parts(n):
            self._encode_blocks(
                x[e0:e1].reshape(k1 - k0, width),
                scales[k0:k1],
                q[e0:e1].reshape(k1 - k0, width),
                None if residual is None else residual[e0:e1].reshape(k1 - k0, width),
            )

    @staticmethod
    def _encode_blocks(xb: Any, scales: Any, qb: Any, rb: Any) -> None:
        """``xb``: (blocks, width) float32; writes ``scales`` (blocks,), ``qb`` (int8)."""
        m = np.max(np.abs(xb), axis=1)  # a NaN anywhere makes the block's max NaN
        scale = np.divide(m, _Q_MAX, dtype=np.float32)
        scales[...] = scale
        _quantize_blocks(xb, scale, _Q_MAX, qb, rb)

    # -- shared scales (``ftmesh.collective.shared_scale``) -----------------------------------
    def block_maxabs_into(self, x: F32, out: F32) -> None:
        """``out[b] = max|x|`` over block ``b`` of the flat float32 run ``x`` (NaN if the
        block holds one): what members max-reduce to agree on shared scales."""
        for k0, k1, e0, e1, width in self._parts(int(x.size)):
            np.max(np.abs(x[e0:e1].reshape(k1 - k0, width)), axis=1, out=out[k0:k1])

    @staticmethod
    def shared_scales(maxabs: F32, levels: int) -> F32:
        """The scales of blocks whose largest value over all members is ``maxabs``, for
        integers in ``-levels..levels`` (``float32(maxabs) / levels``, IEEE division)."""
        return np.divide(maxabs, np.float32(levels), dtype=np.float32)

    def quantize_into(
        self, x: F32, scales: F32, levels: int, q: npt.NDArray[Any], residual: F32 | None
    ) -> None:
        """``q = clip(rint(x / scale), -levels, levels)`` per block with the given ``scales``
        (0 where a scale is 0 or not finite), into the integer array ``q``; with
        ``residual``, also ``x - float32(q) * scale`` (0 in non-finite blocks)."""
        qmax = np.float32(levels)
        for k0, k1, e0, e1, width in self._parts(int(x.size)):
            _quantize_blocks(
                x[e0:e1].reshape(k1 - k0, width),
                scales[k0:k1],
                qmax,
                q[e0:e1].reshape(k1 - k0, width),
                None if residual is None else residual[e0:e1].reshape(k1 - k0, width),
            )

    def dequantize_into(self, q: npt.NDArray[Any], scales: F32, out: F32) -> None:
        """``out = float32(q) * scale`` per block: one float32 multiplication per value."""
        for k0, k1, e0, e1, width in self._parts(int(out.size)):
            qb, ob = q[e0:e1].reshape(k1 - k0, width), out[e0:e1].reshape(k1 - k0, width)
            with np.errstate(invalid="ignore", over="ignore"):
                np.multiply(qb, scales[k0:k1, None], out=ob, dtype=np.float32)

    def _parts(self, n: int) -> list[tuple[int, int, int, int, int]]:
        """``(first block, end block, first element, end element, width)`` of the full blocks
        and of the short last block, if any, of a run of ``n`` values."""
        b, full = self.block_size, n // self.block_size
        parts = [(0, full, 0, full * b, b)] if full else []
        if full * b < n:
            parts.append((full, full + 1, full * b, n, n - full * b))
        return parts

    def encode(self, x: F32) -> U8:
        """``x`` encoded into a new byte array."""
        out = np.empty(self.encoded_bytes(int(x.size)), np.uint8)
        self.encode_into(np.ascontiguousarray(x, np.float32).reshape(-1), out)
        return out

    # -- decode -------------------------------------------------------------------------------
    def decode_into(self, buf: U8, out: F32, *, add: bool = False) -> None:
        """Decode the run in ``buf`` into the float32 array ``out`` (its size is the run's
        length); ``add=True`` adds the decoded values to ``out`` instead (one float32 addition
        of the decoded value per element)."""
        n = int(out.size)
        if buf.size != self.encoded_bytes(n):
            raise LocalUsageError(f"{buf.size} encoded bytes for a run of {n} values")
        nb = self.blocks(n)
        scales = buf[: 4 * nb].view("<f4")
        q = buf[4 * nb :].view(np.int8)
        for k0, k1, e0, e1, width in self._parts(n):
            qb, ob = q[e0:e1].reshape(k1 - k0, width), out[e0:e1].reshape(k1 - k0, width)
            with np.errstate(invalid="ignore", over="ignore"):
                if add:
                    ob += np.multiply(qb, scales[k0:k1, None], dtype=np.float32)
                else:
                    np.multiply(qb, scales[k0:k1, None], out=ob, dtype=np.float32)

    def decode(self, buf: U8, n: int) -> F32:
        """A new float32 array holding the ``n`` values encoded in ``buf``."""
        out = np.empty(n, np.float32)
        self.decode_into(np.asarray(buf, np.uint8).reshape(-1), out)
        return out

    def block_scales(self, buf: U8, n: int) -> F32:
        """The scales of the encoded run of ``n`` values in ``buf`` (a copy)."""
        return buf[: 4 * self.blocks(n)].view("<f4").astype(np.float32)


def _quantize_blocks(xb: Any, scale: Any, qmax: np.float32, qb: Any, rb: Any) -> None:
    """``xb``: (blocks, width) float32, ``scale``: (blocks,); writes the integers ``qb`` and,
    with ``rb``, the residual ``xb - float32(qb) * scale`` (0 in non-finite blocks)."""
    ok = np.isfinite(scale) & (scale > 0)
    safe = np.where(ok, scale, np.float32(1.0))[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        t = np.divide(xb, safe, dtype=np.float32)
        np.rint(t, out=t)
        np.clip(t, -qmax, qmax, out=t)
    if not ok.all():
        t[~ok] = 0.0
    qb[...] = t.astype(qb.dtype)
    if rb is not None:
        # decode(q) = float32(q) * scale, then residual = x - decode(q)
        with np.errstate(invalid="ignore", over="ignore"):
            np.multiply(t, scale[:, None], out=t)
            np.subtract(xb, t, out=rb)
        bad = ~np.isfinite(scale)
        if bad.any():
            rb[bad] = 0.0
