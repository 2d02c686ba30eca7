"""Where the ``native/`` kernel sources are, and the options every compile uses (its own
module, so that ``launchers`` imports it and the package face imports ``launchers`` lazily
with no cycle between them)."""

from __future__ import annotations

from pathlib import Path

from ..errors import FtmeshError

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
    ``native/``; in a wheel, package data)."""
    return Path(__file__).resolve().parent / "cuda"


def read_source(name: str) -> str:
    path = source_dir() / name
    try:
        return path.read_text()
    except OSError as exc:
        raise NativeUnavailableError(
            f"CUDA kernel source {path} not found: install ftmesh from a wheel or a checkout"
        ) from exc
