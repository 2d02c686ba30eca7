"""NumPy references of the CUDA kernels in ``native/``: the CPU implementation and the test
oracle, bit for bit (see each ``.cu`` file's header for the shared definition).

Theory of operation: every operation is float32 arithmetic with one rounding to nearest per
operation, exactly as the kernels' ``__f*_rn`` intrinsics. Half-precision values are their
16-bit patterns in ``uint16`` arrays (NumPy has no bfloat16). Rounding to half precision is
round to nearest, ties to even; NaN results are canonical (float16 ``0x7e00``, bfloat16
``0x7fc0``, whatever the sign and payload), so the kernels never depend on how the hardware
carries a NaN's sign or payload (``inf - inf`` is negative on x86, positive on a GPU).

The int8 block codec follows the int8 bullet of ``docs/DESIGN-NOTES.md`` ("Interfaces
agreed") and ``ftmesh.compression.int8`` (the codec's owner, on the ``compress`` branch): a
non-finite block's scale is ``max|v| / 127`` there (+inf, or NaN), its values 0, its
residual 0. The one liberty: NaN bits are not part of the contract (NumPy keeps an input
NaN's payload, CUDA writes its own), so comparisons treat two NaNs as equal; this reference
writes NaN scales as ``0x7fc00000``, as the kernel does. The device check compares the
kernels against both references.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import LocalUsageError

F32 = npt.NDArray[np.float32]
U16 = npt.NDArray[np.uint16]
I8 = npt.NDArray[np.int8]

DEFAULT_BLOCK_SIZE = 256
"""Elements per int8 codec block (the agreed default)."""
CANONICAL_NAN_F32 = np.uint32(0x7FC00000)
F16_NAN = np.uint16(0x7E00)
BF16_NAN = np.uint16(0x7FC0)


def _f32(a: npt.ArrayLike, name: str) -> F32:
    arr = np.asarray(a)
    if arr.dtype != np.float32:
        raise LocalUsageError(f"{name} must be float32, got {arr.dtype}")
    return np.ascontiguousarray(arr).reshape(-1)


def _u16(a: npt.ArrayLike, name: str) -> U16:
    arr = np.asarray(a)
    if arr.dtype != np.uint16:
        raise LocalUsageError(f"{name} must hold 16-bit patterns as uint16, got {arr.dtype}")
    return np.ascontiguousarray(arr).reshape(-1)


def n_blocks(n: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Codec blocks of a run of ``n`` elements (the last one may be short)."""
    if block_size < 1:
        raise LocalUsageError(f"block_size must be >= 1, got {block_size}")
    return -(-n // block_size)


def int8_quantize(
    x: npt.ArrayLike, residual: F32 | None = None, block_size: int = DEFAULT_BLOCK_SIZE
) -> tuple[F32, I8]:
    """Encode ``x`` (float32) as per-block scales and int8 values; with ``residual`` (float32,
    same length, updated in place) quantize ``x + residual`` and keep what was lost.
    Returns ``(scales, q)``. See ``native/int8_codec.cu`` for the definition."""
    v = _f32(x, "x")
    if residual is not None:
        if residual.dtype != np.float32 or residual.shape != (v.size,):
            raise LocalUsageError("residual must be a flat float32 array as long as x")
        v = v + residual
    nb = n_blocks(v.size, block_size)
    pad = nb * block_size - v.size
    blocks = np.concatenate([v, np.zeros(pad, np.float32)]).reshape(nb, block_size)
    bad = ~np.isfinite(blocks).all(axis=1)
    with np.errstate(invalid="ignore"):
        amax = np.abs(np.where(np.isfinite(blocks), blocks, np.float32(0))).max(axis=1)
    scales = (amax / np.float32(127.0)).astype(np.float32)
    scales[bad & np.isinf(blocks).any(axis=1)] = np.float32(np.inf)
    scales[np.isnan(blocks).any(axis=1)] = CANONICAL_NAN_F32.view(np.float32)
    ok = ~bad & (scales != 0)
    q = np.zeros_like(blocks, dtype=np.int8)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.rint(blocks[ok] / scales[ok, None])
    q[ok] = np.clip(ratio, -127, 127).astype(np.int8)
    q_flat = q.reshape(-1)[: v.size]
    if residual is not None:
        x_hat = q.astype(np.float32) * np.where(bad, np.float32(0), scales)[:, None]
        new = (blocks - x_hat).astype(np.float32)
        new[bad] = 0.0
        residual[...] = new.reshape(-1)[: v.size]
    return scales, q_flat


def int8_dequantize_accumulate(
    scales: F32, q: I8, acc: F32, block_size: int = DEFAULT_BLOCK_SIZE
) -> F32:
    """``acc += float32(q) * scale`` of each element's block, in place; returns ``acc``."""
    if acc.dtype != np.float32 or q.dtype != np.int8 or scales.dtype != np.float32:
        raise LocalUsageError("acc/scales must be float32 and q int8")
    if acc.shape != q.shape or scales.size != n_blocks(q.size, block_size):
        raise LocalUsageError("acc and q must have one shape and scales one value per block")
    per_elem = np.repeat(scales, block_size)[: q.size]
    with np.errstate(invalid="ignore"):  # 0 * inf: a poisoned block decodes to NaN
        acc += q.astype(np.float32) * per_elem
    return acc


def int8_dequantize(scales: F32, q: I8, block_size: int = DEFAULT_BLOCK_SIZE) -> F32:
    """The decoded float32 run (``int8_dequantize_accumulate`` into zeros)."""
    return int8_dequantize_accumulate(scales, q, np.zeros(q.size, np.float32), block_size)


def f16_to_f32(h: npt.ArrayLike) -> F32:
    return _u16(h, "h").view(np.float16).astype(np.float32)


def bf16_to_f32(h: npt.ArrayLike) -> F32:
    return (_u16(h, "h").astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_f16(f: npt.ArrayLike) -> U16:
    a = _f32(f, "f")
    with np.errstate(over="ignore"):
        out = a.astype(np.float16).view(np.uint16)
    out[np.isnan(a)] = F16_NAN
    return out


def f32_to_bf16(f: npt.ArrayLike) -> U16:
    bits = _f32(f, "f").view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    with np.errstate(over="ignore"):
        out = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    out[(bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)] = BF16_NAN
    return out


_WIDEN = {"float16": f16_to_f32, "bfloat16": bf16_to_f32}
_NARROW = {"float16": f32_to_f16, "bfloat16": f32_to_bf16}


def _half(dtype: str) -> tuple[Any, Any]:
    if dtype not in _WIDEN:
        raise LocalUsageError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    return _WIDEN[dtype], _NARROW[dtype]


def accumulate_half(acc: F32, x: U16, dtype: str) -> F32:
    """``acc += float32(x)`` in place (``x`` the 16-bit patterns of ``dtype``)."""
    widen, _ = _half(dtype)
    if acc.dtype != np.float32 or acc.shape != np.shape(x):
        raise LocalUsageError("acc must be float32 with x's shape")
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, overflow: IEEE results
        acc += widen(x).reshape(acc.shape)
    return acc


def round_half(acc: F32, dtype: str) -> U16:
    """``acc`` rounded to ``dtype`` (16-bit patterns)."""
    _, narrow = _half(dtype)
    return narrow(acc).reshape(np.shape(acc))  # type: ignore[no-any-return]


def sum_half(a: U16, b: U16, dtype: str) -> U16:
    """``round(float32(a) + float32(b))``: the ring's reduction of two half-precision chunks."""
    widen, narrow = _half(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        wide = widen(a) + widen(b)
    return narrow(wide).reshape(np.shape(a))  # type: ignore[no-any-return]
