"""Buffers mapped up front (``ftmesh.state.memory``): contents, and that pages really are
mapped (resident) where the kernel supports ``MADV_POPULATE_WRITE``."""

from __future__ import annotations

import ctypes
import os
import platform
import threading

import numpy as np
import pytest

from ftmesh.state import memory
from ftmesh.state.memory import (
    MAP_MIN_BYTES,
    mapped_zeros,
    populate,
    populated_zeros,
    prepared_zeros,
)


def _kernel_at_least(major: int, minor: int) -> bool:
    if platform.system() != "Linux":
        return False
    nums = platform.release().split("-")[0].split(".")
    return (int(nums[0]), int(nums[1])) >= (major, minor)


POPULATES = _kernel_at_least(5, 14)
needs_populate = pytest.mark.skipif(
    not POPULATES, reason="needs Linux >= 5.14 (MADV_POPULATE_WRITE)"
)


def _resident_fraction(buf: np.ndarray) -> float:
    """Share of ``buf``'s pages that are mapped in memory (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    pages = -(-buf.nbytes // page)
    vec = (ctypes.c_ubyte * pages)()
    rc = libc.mincore(ctypes.c_void_p(buf.ctypes.data), ctypes.c_size_t(buf.nbytes), vec)
    assert rc == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec) / pages


def test_small_buffers_are_plain_zeros() -> None:
    for buf in (mapped_zeros(100), populated_zeros(100), prepared_zeros(MAP_MIN_BYTES - 1)):
        assert buf.dtype == np.uint8 and buf.flags.writeable and not buf.any()


def test_large_buffers_are_zeroed_writable_and_page_aligned() -> None:
    n = 8 * MAP_MIN_BYTES + 123
    for make in (mapped_zeros, populated_zeros, prepared_zeros):
        buf = make(n)
        assert buf.shape == (n,) and buf.flags.writeable and not buf.any()
        if memory._madvise is not None:
            assert buf.ctypes.data % os.sysconf("SC_PAGE_SIZE") == 0
        buf[-1] = 7
        assert buf[-1] == 7


@needs_populate
def test_populate_maps_every_page_without_changing_contents() -> None:
    n = 64 << 20
    buf = mapped_zeros(n)
    buf[:4096] = 5  # data written before populate survives it
    assert _resident_fraction(buf) < 0.01
    assert populate(buf)
    assert _resident_fraction(buf) == 1.0
    assert (buf[:4096] == 5).all() and not buf[4096:].any()


@needs_populate
def test_writes_racing_the_background_thread_are_kept() -> None:
    n = 128 << 20
    buf = prepared_zeros(n)
    pattern = np.arange(n // 8, dtype=np.uint64)
    buf.view(np.uint64)[:] = pattern  # at once, while the thread maps pages
    for t in threading.enumerate():
        if t.name == "ftmesh-populate":
            t.join(timeout=10)
    assert (buf.view(np.uint64) == pattern).all()


def test_populate_refuses_a_buffer_not_from_mapped_zeros() -> None:
    if memory._madvise is None:
        pytest.skip("no madvise on this platform")
    buf = mapped_zeros(4 * MAP_MIN_BYTES)
    with pytest.raises(ValueError):
        populate(buf[1:])
