"""Launchers of the ``native/`` kernels on CuPy arrays (imported by ``ftmesh.native.kernels()``
only: this is the one module that imports CuPy).

Every launcher checks dtypes, sizes and contiguity before launching (a kernel reading past
an array is memory corruption, not an exception), runs on the given stream (default: CuPy's
current one) and returns without synchronising. Half-precision arrays are ``uint16`` views
of the 16-bit patterns (``torch_tensor.view(torch.int16)`` then ``cupy.asarray(...)
.view(cupy.uint16)``, zero-copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import LocalUsageError
from .reference import DEFAULT_BLOCK_SIZE, n_blocks
from .sources import KERNEL_OPTIONS, KERNEL_SOURCES, NativeUnavailableError, read_source

THREADS = 256
"""Threads per CUDA block; the int8 kernel's shared-memory reduction assumes exactly this."""
MAX_GRID = 65535 * 16
"""Grid size cap of the grid-stride kernels (enough blocks to fill any current GPU)."""
_HALF = {"float16": "f16", "bfloat16": "bf16"}


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:  # cupy is an optional extra
        raise NativeUnavailableError(f"the CUDA kernels need CuPy: {exc}") from exc
    return cupy


def _check(arr: Any, dtype: Any, name: str, size: int | None = None) -> None:
    if arr.dtype != dtype:
        raise LocalUsageError(f"{name} must be {np.dtype(dtype).name}, got {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise LocalUsageError(f"{name} must be C-contiguous")
    if size is not None and arr.size != size:
        raise LocalUsageError(f"{name} must hold {size} elements, got {arr.size}")


@dataclass
class NativeKernels:
    """The compiled kernels. Get it from ``ftmesh.native.kernels()``."""

    functions: dict[str, Any]

    @classmethod
    def compile(cls) -> NativeKernels:
        cp = _cupy()
        try:
            cp.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDARuntimeError without a driver or a device
            raise NativeUnavailableError(f"no CUDA device: {exc}") from exc
        functions: dict[str, Any] = {}
        for name in KERNEL_SOURCES:
            module = cp.RawModule(code=read_source(name), options=KERNEL_OPTIONS)
            module.compile()
            for entry in _ENTRIES[name]:
                functions[entry] = module.get_function(entry)
        return cls(functions)

    def _launch(self, name: str, grid: int, args: tuple[Any, ...], stream: Any) -> None:
        fn = self.functions[name]  # a RawKernel: it launches on CuPy's current stream
        if stream is None:
            fn((max(grid, 1),), (THREADS,), args)
        else:
            with stream:
                fn((max(grid, 1),), (THREADS,), args)

    @staticmethod
    def _grid(n: int) -> int:
        return min(-(-n // THREADS), MAX_GRID)

    # -- int8 codec -----------------------------------------------------------------------
    def int8_quantize(
        self,
        x: Any,
        residual: Any | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        scales: Any | None = None,
        q: Any | None = None,
        stream: Any = None,
    ) -> tuple[Any, Any]:
        """Encode float32 ``x`` (with ``residual`` updated in place, if given); returns
        ``(scales, q)``, allocated unless passed in."""
        cp = _cupy()
        n = int(x.size)
        nb = n_blocks(n, block_size)
        _check(x, cp.float32, "x")
        if residual is not None:
            _check(residual, cp.float32, "residual", n)
        scales = cp.empty(nb, cp.float32) if scales is None else scales
        q = cp.empty(n, cp.int8) if q is None else q
        _check(scales, cp.float32, "scales", nb)
        _check(q, cp.int8, "q", n)
        res = residual if residual is not None else np.uint64(0)  # NULL: no error feedback
        if n:
            args = (x, res, scales, q, np.int64(n), np.int32(block_size))
            self._launch("ftmesh_int8_quantize", nb, args, stream)
        return scales, q

    def int8_dequantize_accumulate(
        self,
        scales: Any,
        q: Any,
        acc: Any,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        stream: Any = None,
    ) -> Any:
        """``acc += float32(q) * scale`` in place; returns ``acc``."""
        cp = _cupy()
        n = int(q.size)
        _check(q, cp.int8, "q")
        _check(acc, cp.float32, "acc", n)
        _check(scales, cp.float32, "scales", n_blocks(n, block_size))
        if n:
            args = (scales, q, acc, np.int64(n), np.int32(block_size))
            self._launch("ftmesh_int8_dequantize_accumulate", self._grid(n), args, stream)
        return acc

    # -- float16 / bfloat16 -----------------------------------------------------------------
    def _half(self, dtype: str) -> str:
        if dtype not in _HALF:
            raise LocalUsageError(f"dtype must be float16 or bfloat16, got {dtype!r}")
        return _HALF[dtype]

    def accumulate_half(self, acc: Any, x: Any, dtype: str, *, stream: Any = None) -> Any:
        """``acc += float32(x)`` in place (``x``: uint16 patterns of ``dtype``)."""
        cp, suffix = _cupy(), self._half(dtype)
        _check(x, cp.uint16, "x")
        _check(acc, cp.float32, "acc", int(x.size))
        if x.size:
            args = (acc, x, np.int64(x.size))
            self._launch(f"ftmesh_accumulate_{suffix}", self._grid(int(x.size)), args, stream)
        return acc

    def round_half(
        self, acc: Any, dtype: str, out: Any | None = None, *, stream: Any = None
    ) -> Any:
        """``acc`` rounded to ``dtype``, as uint16 patterns."""
        cp, suffix = _cupy(), self._half(dtype)
        _check(acc, cp.float32, "acc")
        out = cp.empty(acc.shape, cp.uint16) if out is None else out
        _check(out, cp.uint16, "out", int(acc.size))
        if acc.size:
            args = (out, acc, np.int64(acc.size))
            self._launch(f"ftmesh_round_{suffix}", self._grid(int(acc.size)), args, stream)
        return out

    def sum_half(
        self, a: Any, b: Any, dtype: str, out: Any | None = None, *, stream: Any = None
    ) -> Any:
        """``round(float32(a) + float32(b))`` as uint16 patterns (``out`` may be ``a``)."""
        cp, suffix = _cupy(), self._half(dtype)
        _check(a, cp.uint16, "a")
        _check(b, cp.uint16, "b", int(a.size))
        out = cp.empty(a.shape, cp.uint16) if out is None else out
        _check(out, cp.uint16, "out", int(a.size))
        if a.size:
            args = (out, a, b, np.int64(a.size))
            self._launch(f"ftmesh_sum_{suffix}", self._grid(int(a.size)), args, stream)
        return out


_ENTRIES = {
    "int8_codec.cu": ("ftmesh_int8_quantize", "ftmesh_int8_dequantize_accumulate"),
    "half_accumulate.cu": tuple(
        f"ftmesh_{op}_{s}" for s in ("f16", "bf16") for op in ("accumulate", "round", "sum")
    ),
}
"""The kernels each source defines; the NVRTC test checks the PTX holds exactly these."""
