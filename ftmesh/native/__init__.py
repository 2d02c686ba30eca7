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

from typing import TYPE_CHECKING

from .sources import (
    KERNEL_ARCHES,
    KERNEL_OPTIONS,
    KERNEL_SOURCES,
    NativeUnavailableError,
    read_source,
    source_dir,
)

if TYPE_CHECKING:
    from .launchers import NativeKernels

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
