"""What a collective is (``Kind``, ``CollectiveOp``), array adapters and reduction kernels.

``CollectiveOp`` is the one description of a collective that every layer passes around: the
session (``session``), the planner (``DataPlane.plan``) and the GPU epochs (``epochs``).

Theory of operation: the ring engine only sees flat, C-contiguous NumPy arrays and raw byte
views of them. ``stage()`` turns what the user passed (a NumPy array or a torch tensor, any
layout, CPU or CUDA) into such a flat array, sharing memory whenever the input already is
contiguous host memory, and returns a ``commit`` callback that copies the result back when a
staging copy was needed (non-contiguous or CUDA inputs). bfloat16 travels as its uint16 bit
pattern and is reduced by torch; float16 is reduced by torch when it is installed because NumPy's
float16 arithmetic is ~20x slower.

Reductions are elementwise ``out = op(a, b)`` on equal-length chunks. Each chunk is reduced by
exactly one member per ring step and the final value is computed once and then copied round the
ring, so every member ends with the same bits whatever the kernel.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..compression import Int8Compression, as_compression
from ..errors import LocalUsageError

Array = npt.NDArray[Any]
Reducer = Callable[[Array, Array, Array], None]

REDUCE_OPS = ("sum", "avg", "min", "max")


class Kind(enum.Enum):
    """The collectives every backend offers."""

    ALLREDUCE = "allreduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    BARRIER = "barrier"


@dataclass(frozen=True, kw_only=True)
class CollectiveOp:
    """One collective, without its buffer: what every member of the view must call alike.

    ``op``: the reduction (``REDUCE_OPS``) of an allreduce or reduce-scatter. ``root``: the
    node id whose buffer a broadcast sends. ``compression``: an ``Int8Compression`` (allreduce
    only; it carries the error-feedback residual from one call to the next). ``io_timeout``:
    raises the data plane's for this collective (never lowers it), where members legitimately
    arrive far apart (a barrier after a long state fetch)."""

    kind: Kind
    op: str = "sum"
    root: str = ""
    compression: Int8Compression | None = None
    io_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.kind in (Kind.ALLREDUCE, Kind.REDUCE_SCATTER) and self.op not in REDUCE_OPS:
            raise LocalUsageError(f"unknown reduce op {self.op!r}; use one of {REDUCE_OPS}")
        if self.compression is not None and self.kind is not Kind.ALLREDUCE:
            raise LocalUsageError(f"compression applies to allreduce, not {self.kind.value}")
        if self.kind is Kind.BROADCAST and not self.root:
            raise LocalUsageError("a broadcast needs its root's node id")

    @classmethod
    def allreduce(cls, op: str = "sum", compression: Any = None) -> CollectiveOp:
        """``compression`` as callers give it: None, ``"int8"`` or an ``Int8Compression``."""
        return cls(kind=Kind.ALLREDUCE, op=op, compression=as_compression(compression))


_NUMPY_DTYPES = {
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
}
SUPPORTED_DTYPES = (*_NUMPY_DTYPES, "bfloat16")


def _torch() -> Any:
    import torch

    return torch


def _is_tensor(x: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_available() -> bool:
    try:
        _torch()
    except ImportError:
        return False
    return True


@dataclass
class Staged:
    """A user input seen as a flat host array. ``flat`` may share memory with the input."""

    flat: Array
    dtype: str
    shape: tuple[int, ...]
    commit: Callable[[], None] | None
    """Copies ``flat`` back into the user's object; None when ``flat`` is the user's memory."""


def stage(x: object, *, writable: bool) -> Staged:
    """View ``x`` as a flat contiguous host array (see module doc)."""
    if isinstance(x, np.ndarray):
        name = x.dtype.name
        if name not in _NUMPY_DTYPES:
            raise LocalUsageError(f"unsupported dtype {name}; use one of {SUPPORTED_DTYPES}")
        if writable and not x.flags.writeable:
            raise LocalUsageError("in-place collective on a read-only array")
        shape = tuple(int(d) for d in x.shape)
        if x.flags.c_contiguous:
            return Staged(x.reshape(-1), name, shape, None)
        host = np.ascontiguousarray(x).reshape(-1)

        def commit_np() -> None:
            x[...] = host.reshape(shape)

        return Staged(host, name, shape, commit_np if writable else None)
    if _is_tensor(x):
        return _stage_tensor(x, writable=writable)
    raise LocalUsageError(f"expected a NumPy array or torch tensor, got {type(x).__name__}")


def _stage_tensor(t: Any, *, writable: bool) -> Staged:
    torch = _torch()
    name = str(t.dtype).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        raise LocalUsageError(f"unsupported dtype {name}; use one of {SUPPORTED_DTYPES}")
    shape = tuple(int(d) for d in t.shape)
    src = t.detach()
    direct = src.device.type == "cpu" and src.is_contiguous()
    host = src if direct else src.contiguous().cpu()
    host_bits = host.view(torch.uint16) if name == "bfloat16" else host
    flat = host_bits.reshape(-1).numpy()
    if direct or not writable:
        return Staged(flat, name, shape, None)

    def commit_t() -> None:
        with torch.no_grad():
            t.copy_(host)

    return Staged(flat, name, shape, commit_t)


def empty_like_input(x: object, shape: tuple[int, ...]) -> tuple[object, Staged]:
    """A new output of the same kind (NumPy/torch, dtype, device) as ``x`` with ``shape``."""
    if isinstance(x, np.ndarray):
        out: object = np.empty(shape, dtype=x.dtype)
    else:
        torch = _torch()
        t: Any = x
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
    return out, stage(out, writable=True)


def _torch_view(a: Array, dtype: str) -> Any:
    torch = _torch()
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def reducer(op: str, dtype: str) -> Reducer:
    """``fn(a, b, out)`` computing ``out = op(a, b)`` elementwise. ``avg`` reduces as ``sum``;
    the division happens once, at the member that owns the final value."""
    if op not in REDUCE_OPS:
        raise LocalUsageError(f"unknown reduce op {op!r}; use one of {REDUCE_OPS}")
    if dtype == "bfloat16" or (dtype == "float16" and _torch_available()):
        torch = _torch()
        tfn = {"sum": torch.add, "avg": torch.add, "min": torch.minimum, "max": torch.maximum}[op]

        def reduce_torch(a: Array, b: Array, out: Array) -> None:
            tfn(_torch_view(a, dtype), _torch_view(b, dtype), out=_torch_view(out, dtype))

        return reduce_torch
    nfn = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum}[op]

    def reduce_np(a: Array, b: Array, out: Array) -> None:
        nfn(a, b, out=out)

    return reduce_np


def scaler(dtype: str, divisor: int) -> Callable[[Array], None]:
    """In-place ``x /= divisor`` for ``avg``; floating dtypes only."""
    if dtype in ("bfloat16", "float16") and _torch_available():

        def scale_torch(a: Array) -> None:
            _torch_view(a, dtype).div_(divisor)

        return scale_torch
    if dtype not in ("float16", "float32", "float64"):
        raise LocalUsageError(f"op='avg' needs a floating dtype, got {dtype}; use 'sum'")

    def scale_np(a: Array) -> None:
        np.divide(a, a.dtype.type(divisor), out=a)

    return scale_np


FLOAT32_CONVERTIBLE = ("float16", "bfloat16", "float32")
"""Dtypes that ``as_float32``/``store_float32`` convert (the compressed allreduce's inputs)."""


def as_float32(flat: Array, dtype: str) -> npt.NDArray[np.float32]:
    """``flat`` (a staged array of ``dtype``) as float32 values: the array itself for float32,
    else an exact conversion (bfloat16 bits shifted into the high half of a float32)."""
    if dtype == "float32":
        return flat
    if dtype == "float16":
        return flat.astype(np.float32)
    if dtype == "bfloat16":
        return (flat.astype(np.uint32) << np.uint32(16)).view(np.float32)
    raise LocalUsageError(f"no float32 conversion for {dtype}")


def store_float32(src: npt.NDArray[np.float32], dst: Array, dtype: str) -> None:
    """Write the float32 values ``src`` into ``dst`` (a staged array of ``dtype``, same
    length), rounding to nearest even (bfloat16 via torch, which staged it)."""
    if dtype == "float32":
        if dst is not src:
            dst[...] = src
    elif dtype == "float16":
        dst[...] = src.astype(np.float16)
    elif dtype == "bfloat16":
        torch = _torch()
        bits = torch.from_numpy(src).to(torch.bfloat16).view(torch.uint16)
        dst[...] = bits.numpy()
    else:
        raise LocalUsageError(f"no float32 conversion for {dtype}")
