"""Compile CUDA C++ to PTX with NVRTC through ctypes: no GPU, driver or toolkit needed.

This is how CI checks that every kernel in ``native/`` compiles (for ``compute_80`` and
``compute_90``): the pip package ``nvidia-cuda-nvrtc-cu12`` (in the ``dev`` extra) ships
``libnvrtc.so.12`` and nothing else, and it has no Python binding, so the few entry points
needed are declared here. On a GPU machine CuPy's ``RawModule`` compiles the same sources
with the same options (``ftmesh.native.KERNEL_OPTIONS``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import FtmeshError

LIBRARY_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


class NvrtcError(FtmeshError):
    """NVRTC is missing, or a kernel did not compile (``log`` holds the compiler's output)."""

    def __init__(self, msg: str, log: str = "") -> None:
        super().__init__(f"{msg}\n{log}" if log else msg)
        self.log = log


@dataclass(frozen=True)
class Compiled:
    ptx: str
    log: str

    def entries(self) -> list[str]:
        """Names of the kernels (``.entry``) in the PTX."""
        out = []
        for line in self.ptx.splitlines():
            parts = line.split()
            if ".entry" in parts:
                out.append(parts[parts.index(".entry") + 1].rstrip("("))
        return out


def _candidates() -> list[str]:
    found: list[str] = []
    env = os.environ.get("FTMESH_NVRTC_LIBRARY")
    if env:
        found.append(env)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for pattern in ("cuda_nvrtc/lib/libnvrtc.so*", "cu*/lib/libnvrtc.so*"):
            for path in sorted(glob.glob(os.path.join(root, pattern)), reverse=True):
                name = Path(path).name
                if "builtins" not in name and ".alt." not in name:
                    found.append(path)
    found.extend(LIBRARY_NAMES)
    system = ctypes.util.find_library("nvrtc")
    if system:
        found.append(system)
    return found


_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The NVRTC shared library (the pip package's first, then the system's)."""
    global _lib
    if _lib is not None:
        return _lib
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            errors.append(str(exc))
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _lib = lib
        return lib
    raise NvrtcError(
        "libnvrtc not found: install the dev extra (nvidia-cuda-nvrtc-cu12) or set "
        "FTMESH_NVRTC_LIBRARY; tried " + "; ".join(errors[-3:])
    )


def version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(code: int, what: str, log: str = "") -> None:
    if code != 0:
        msg = library().nvrtcGetErrorString(code)
        text = msg.decode() if isinstance(msg, bytes) else str(code)
        raise NvrtcError(f"{what} failed: {text}", log)


def compile_source(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> Compiled:
    """Compile ``source`` for virtual architecture ``arch`` (e.g. ``compute_90``) to PTX;
    raises ``NvrtcError`` with the compiler log if it does not compile."""
    lib = library()
    prog = ctypes.c_void_p()
    _check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture={arch}", *options]
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        code = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        _check(code, f"compiling {name} for {arch}", log)
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return Compiled(ptx.value.decode(), log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
