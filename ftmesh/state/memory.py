"""Large buffers whose pages are mapped up front, in the kernel, in small pages.

A fresh buffer's pages are mapped lazily: the first write to each page faults. When the kernel
copies into such a buffer (``recv_into`` of a state transfer) the faults land inside the copy,
and on a virtual machine each one may exit to the host. Worse, NumPy asks for transparent huge
pages on large arrays, and a guest with free page reporting (the virtio balloon, common on
cloud VMs) hands the host back exactly its free 2 MiB blocks: a huge page is then almost always
memory the host must back again, while small pages mostly come from memory still backed.
Measured on this project's 2-core VM, 256 MiB, 8 s after the last large free: a NumPy array
(huge pages) filled at 0.4-0.6 GB/s, the same populated with small pages at 2.3-3.0 GB/s; a
joiner's first 128 MiB fetch spent 300 ms of 370 ms faulting its receive buffer.

``mapped_zeros`` maps a private anonymous region and opts out of huge pages; ``populate`` asks
the kernel to map all its pages at once (``MADV_POPULATE_WRITE``, Linux >= 5.14), which never
changes the contents, so it can run in a thread while data is received into the buffer.
Elsewhere these are plain ``np.zeros``. The ``madvise`` calls go through ctypes, which releases
the GIL, in slices, so the mesh's own thread keeps running meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import sys
import threading
from typing import Any

import numpy as np

from ..errors import LocalUsageError

MADV_POPULATE_WRITE = 23
"""Linux 5.14+: map the pages of a range writable now, as if written to."""
MAP_MIN_BYTES = 1 << 20
"""Smaller buffers come from ``np.zeros``: the saving would not pay for a mapping."""
POPULATE_SLICE_BYTES = 64 << 20
"""Bytes per ``madvise`` call."""

_madvise: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def _mappable(nbytes: int) -> bool:
    return _madvise is not None and nbytes >= MAP_MIN_BYTES


def populate(buf: np.ndarray[Any, np.dtype[np.uint8]]) -> bool:
    """Map every page of ``buf`` (from ``mapped_zeros``) now, front to back, keeping its
    contents: safe while other threads write into it. False where the kernel cannot."""
    global _madvise
    madvise = _madvise  # another thread may clear it
    if madvise is None:
        return False
    addr, nbytes = int(buf.ctypes.data), buf.nbytes
    if addr % mmap.PAGESIZE:
        raise LocalUsageError("populate needs a page-aligned buffer (from mapped_zeros)")
    for at in range(addr, addr + nbytes, POPULATE_SLICE_BYTES):
        if madvise(at, min(POPULATE_SLICE_BYTES, addr + nbytes - at), MADV_POPULATE_WRITE):
            if ctypes.get_errno() == errno.EINVAL:  # a kernel older than 5.14: don't ask again
                _madvise = None
            return False
    return True


def mapped_zeros(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A zeroed, writable ``uint8`` array of ``nbytes``, in small pages that are not mapped
    yet (``populate`` maps them); ``np.zeros`` where that cannot help. Freed when the last
    view of it goes."""
    if not _mappable(nbytes):
        return np.zeros(nbytes, dtype=np.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, dtype=np.uint8)


def populated_zeros(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``mapped_zeros`` with every page already mapped where the kernel can."""
    buf = mapped_zeros(nbytes)
    if _mappable(nbytes):
        populate(buf)
    return buf


def prepared_zeros(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``mapped_zeros`` whose pages a background thread starts mapping now; returns at once.
    Use it straight away (writes race the thread harmlessly) or later, when it is warm."""
    buf = mapped_zeros(nbytes)
    if _mappable(nbytes):
        threading.Thread(target=populate, args=(buf,), name="ftmesh-populate", daemon=True).start()
    return buf
