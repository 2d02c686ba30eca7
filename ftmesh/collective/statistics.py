"""What the data plane counts about its collectives, for ``DataPlane.statistics()``.

Collectives run in the trio thread, in the caller's thread or on the job thread
(``ftmesh.mesh.blocking``), so the recorder takes a lock: once per collective, not per chunk, which
costs well under a microsecond next to the collective itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import FtmeshError
from ..stats import CollectiveStatistics, Histogram
from .errors import (
    InputMismatchError,
    PeerStalledError,
    RingPeerLostError,
    ViewMismatchError,
    ViewSupersededError,
)

ABORT_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (PeerStalledError, "stalled"),
    (RingPeerLostError, "lost"),
    (ViewSupersededError, "superseded"),
    (ViewMismatchError, "view_mismatch"),
    (InputMismatchError, "input_mismatch"),
    (FtmeshError, "error"),
)
"""How a failed collective is counted, most specific first (``ftmesh_collective_aborts_total``
``kind`` label)."""


def abort_kind(exc: BaseException) -> str:
    for cls, kind in ABORT_KINDS:
        if isinstance(exc, cls):
            return kind
    return "interrupted"


class CollectiveRecorder:
    """Counts completed collectives (duration, bytes) per ``(op, backend)`` and failures per
    abort kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[tuple[str, str], Histogram] = {}
        self._bytes: dict[tuple[str, str], int] = {}
        self._aborts: dict[str, int] = {}

    @contextmanager
    def timed(self, op: str, backend: str, nbytes: int) -> Iterator[None]:
        """Time the collective run in the block; count it as an abort if the block raises."""
        start = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            kind = abort_kind(exc)
            with self._lock:
                self._aborts[kind] = self._aborts.get(kind, 0) + 1
            raise
        seconds = time.perf_counter() - start
        key = (op, backend)
        with self._lock:
            hist = self._seconds.get(key)
            if hist is None:
                hist = self._seconds[key] = Histogram()
            hist.observe(seconds)
            self._bytes[key] = self._bytes.get(key, 0) + nbytes

    def snapshot(self) -> CollectiveStatistics:
        with self._lock:
            return CollectiveStatistics(
                seconds={k: h.snapshot() for k, h in self._seconds.items()},
                bytes_total=dict(self._bytes),
                aborts_total=dict(self._aborts),
            )
