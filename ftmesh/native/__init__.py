"""CUDA kernels of ``native/`` and their NumPy references.

Theory of operation: the kernel sources live in ``native/*.cu`` at the root of the source
tree (one concern per file, each with its definition in its header); ``ftmesh/native/cuda``
links to them, so the wheel carries them as package data. ``kernels()`` compiles
them with CuPy's ``RawModule`` on first use, with ``KERNEL_OPTIONS``, and returns launchers
that take CuPy arrays (torch CUDA tensors go through ``cupy.asarray``/DLPack, zero-copy).
CuPy is imported there and only there: ``import ftmesh``, ``ftmesh.native.reference`` (the
NumPy references, which are the CPU path and the test oracle) and ``ftmesh.native.nvrtc``
(the compile check CI runs without a GPU) all work without it.

The sources are read from ``ftmesh/native/cuda`` (a checkout, an editable install or a
wheel alike); an install without them raises ``NativeUnavailableError`` with that reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import FtmeshError

if TYPE_CHECKING:
    from .launchers import NativeKernels

KERNEL_SOURCES = ("int8_codec.cu", "half_accumulate.cu")
"""Every ``.cu`` file of ``native/``; CI compiles each one for ``KERNEL_ARCHES``."""
KERNEL_ARCHES = ("compute_80", "compute_90")
KERNEL_OPTIONS = ("--std=c++17", "--fmad=false")
"""No FMA contraction (a fused multiply-add rounds once where NumPy rounds twice) and no
fast-math: the kernels must equal their NumPy references bit for bit. The kernels also use
explicit ``__f*_rn`` intrinsics, which hold whatever the options."""


class NativeUnavailableError(FtmeshError):
    """The CUDA kernels cannot run here (no CuPy, no GPU, or no kernel sources)."""


def source_dir() -> Path:
    """The kernel sources of this install: ``ftmesh/native/cuda`` (in a checkout, a link to
    ``native/``)."""
    return Path(__file__).resolve().parent / "cuda"


def read_source(name: str) -> str:
    path = source_dir() / name
    try:
        return path.read_text()
    except OSError as exc:
        raise NativeUnavailableError(
            f"CUDA kernel source {path} not found: the kernels need a source checkout"
        ) from exc


_kernels: NativeKernels | None = None


def kernels() -> NativeKernels:
    """The compiled kernels (compiled once per process). Raises ``NativeUnavailableError``
    without CuPy or a GPU."""
    global _kernels
    if _kernels is None:
        from .launchers import NativeKernels

        _kernels = NativeKernels.compile()
    return _kernels


__all__ = [
    "KERNEL_ARCHES",
    "KERNEL_OPTIONS",
    "KERNEL_SOURCES",
    "NativeUnavailableError",
    "kernels",
    "read_source",
    "source_dir",
]
