"""Data-plane configuration: one frozen object, every field with its unit and trade-off."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class CollectiveConfig:
    """A data plane's settings. These defaults are a bare data plane's; a mesh's differ in
    three fields (``ftmesh.mesh.core.MESH_COLLECTIVE``, ``MeshConfig.collective``'s
    default, says which and why)."""

    chunk_bytes: int = 4 << 20
    """Largest pipeline chunk (bytes). Each ring step is cut into chunks so that a chunk can be
    forwarded as soon as it is reduced, overlapping reduction with the wire; a segment is cut
    into at least ``schedule.MIN_CHUNKS`` (4) chunks while they stay at least 256 KiB, so
    mid-size buffers still overlap. Larger: fewer passes through the engine's loop, fewer
    wake-ups and system calls per byte; smaller: finer overlap. 4 MiB (it was 1 MiB): in three
    runs of a 64 MiB / 4-member allreduce on a loaded 2-core host, 1 MiB chunks moved 0.77,
    0.96 and 0.98 of 4 MiB's busbw (same runs, ``--alt-chunk``; docs/STATUS.md): its 16 MiB
    segments are 4 chunks. A 16 MiB buffer's 4 MiB segments are cut as before, into 4
    chunks of 1 MiB. Every member of a ring must use the same value."""

    io_timeout: float = 30.0
    """Seconds a collective may go without any progress (no byte sent or received) before it is
    aborted. It bounds every wait on a neighbour; a stalled peer is reported after this long.
    Too small aborts healthy rounds on an overloaded host; too large delays fault recovery."""

    start_wait: float = 600.0
    """Seconds a collective waits for a ring neighbour that declares itself busy between
    steps (evaluating, saving, logging: ``DataPlane.busy``, which a ``Mesh`` reads from the
    neighbour's published progress) to *start* it. Liveness is membership's to judge
    meanwhile: a suspected, dead or departed neighbour, or a view change, ends the wait at
    once, and a crash closes the connection; so this bounds only a member that stays alive,
    busy, for longer. A neighbour that does not declare itself busy keeps ``io_timeout``, and
    so does every neighbour of a bare data plane (no ``busy``). Below ``io_timeout`` it counts
    as ``io_timeout``. Larger: longer evaluations between steps; smaller: such a member fails
    the others' step sooner."""

    poll_interval: float = 0.2
    """Seconds an engine thread blocked on a socket sleeps before it wakes to look for an abort
    (``DataPlane.abort_view``, or a neighbour's abort notice arriving on the reverse direction of
    a ring connection) and to count towards ``io_timeout``. It bounds how long an abort takes to
    reach a member whose neighbour has stopped sending. Costs one wake-up per interval of a
    blocked thread and nothing while data flows; capped at ``io_timeout``."""

    connect_timeout: float = 10.0
    """Seconds to connect to and authenticate with a ring neighbour (retries included)."""

    view_timeout: float = 10.0
    """Seconds to wait for both ring neighbours to confirm they hold the same view epoch. A
    mismatch usually means gossip has not converged yet, so we wait this long before raising
    ``ViewMismatchError``."""

    socket_buffer_bytes: int = 4 << 20
    """SO_SNDBUF/SO_RCVBUF (bytes) for data connections; 0 keeps the kernel's autotuning. Large
    buffers let the kernel move bytes while this process is busy reducing a chunk. The kernel
    caps the value at net.core.{r,w}mem_max."""

    inline_max_bytes: int = 2 << 20
    """Unused since the engine runs every collective on one thread (see ``engine``); kept so
    that existing configurations still load."""

    max_cached_views: int = 2
    """How many views keep their ring connections open. The current view and the previous one
    (a straggler may still finish a round on it); older ones are closed."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < 4096 or self.chunk_bytes > 1 << 30:
            raise ConfigError(f"chunk_bytes must be in [4 KiB, 1 GiB], got {self.chunk_bytes}")
        for name in ("io_timeout", "poll_interval", "connect_timeout", "view_timeout"):
            v = getattr(self, name)
            if not v > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {v}")
        if not 0 <= self.start_wait < float("inf"):
            raise ConfigError(f"start_wait must be >= 0 seconds, got {self.start_wait}")
        if self.socket_buffer_bytes < 0:
            raise ConfigError("socket_buffer_bytes must be >= 0")
        if self.max_cached_views < 1:
            raise ConfigError("max_cached_views must be >= 1")
