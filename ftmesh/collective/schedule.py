"""Ring schedules: which byte ranges each member sends and receives, in order. Pure, no I/O.

Theory of operation (bandwidth-optimal ring, as in Patarasuk & Yuan 2009 and NCCL): the buffer
of ``n`` elements is cut into N segments (``np.array_split`` sizes). At ring step ``t`` member
``r`` sends segment ``(r-t-1) mod N`` to its right neighbour and receives segment
``(r-t-2) mod N`` from its left one. Steps ``0..N-2`` are the reduce-scatter: the received piece
is combined with the local one, so after them member ``r`` holds the fully reduced segment
``r`` (reduced along the fixed chain r+1, r+2, ..., r — the same order for everyone, computed
once). Steps ``N-1..2N-3`` are the allgather: the received final segment is written in place
and forwarded. Every member sends 2(N-1)/N of the buffer.

Each segment is further cut into ``C`` chunks (the same C for every segment, some possibly
empty), and the schedule is flattened to one list of sends and one of receives. With that
layout, the send ``j`` forwards exactly what the receive ``j - C`` produced, which gives the only
dependency the engine must honour: send ``j`` waits until ``send_after[j]`` receives are done.
Reduction thus overlaps the wire chunk by chunk.

Broadcast is a pipelined chain from the root (each link carries the buffer once); barrier is
the reduce-scatter schedule on an empty buffer, whose N-1 steps make every member wait for
every other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Recv:
    start: int
    """First element (of the accumulator) this receive fills."""
    stop: int
    reduce: bool
    """Combine with the local data (reduce-scatter) instead of overwriting (allgather)."""
    final: bool = False
    """This receive completes a reduced value owned by this member (``avg`` divides here)."""


@dataclass(frozen=True, slots=True)
class Send:
    start: int
    stop: int
    from_input: bool
    """Send from the input buffer rather than from the accumulator (first reduce-scatter step
    of an out-of-place reduce-scatter)."""


@dataclass(slots=True)
class Schedule:
    sends: list[Send] = field(default_factory=list)
    send_after: list[int] = field(default_factory=list)
    recvs: list[Recv] = field(default_factory=list)


def segment_bounds(n: int, parts: int) -> list[int]:
    """Element offsets of ``np.array_split(range(n), parts)``: the first ``n % parts`` segments
    get one element more."""
    q, r = divmod(n, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < r else 0))
    return out


def chunks_per_segment(seg_elems: int, itemsize: int, chunk_bytes: int) -> int:
    return max(1, -(-seg_elems * itemsize // chunk_bytes))


def ring(
    bounds: list[int],
    rank: int,
    *,
    first_step: int,
    last_step: int,
    itemsize: int,
    chunk_bytes: int,
) -> Schedule:
    """Steps ``first_step..last_step`` (inclusive) of the ring over segments ``bounds``.

    Allreduce: 0..2N-3; reduce-scatter: 0..N-2; allgather: N-1..2N-3 (``bounds`` then being
    the members' blocks of the output)."""
    nseg = len(bounds) - 1
    sched = Schedule()
    if nseg == 1 or first_step > last_step:
        return sched
    widest = max(bounds[i + 1] - bounds[i] for i in range(nseg))
    c_count = chunks_per_segment(widest, itemsize, chunk_bytes)
    j = 0
    for t in range(first_step, last_step + 1):
        send_seg = (rank - t - 1) % nseg
        recv_seg = (rank - t - 2) % nseg
        reduce = t < nseg - 1
        for c in range(c_count):
            s0, s1 = bounds[send_seg], bounds[send_seg + 1]
            r0, r1 = bounds[recv_seg], bounds[recv_seg + 1]
            sl, rl = s1 - s0, r1 - r0
            sched.sends.append(Send(s0 + sl * c // c_count, s0 + sl * (c + 1) // c_count, t == 0))
            sched.send_after.append(0 if t == first_step else j - c_count + 1)
            sched.recvs.append(
                Recv(
                    r0 + rl * c // c_count,
                    r0 + rl * (c + 1) // c_count,
                    reduce,
                    final=reduce and t == nseg - 2,
                )
            )
            j += 1
    return sched


def chain(
    n: int, rank: int, root: int, nmembers: int, *, itemsize: int, chunk_bytes: int
) -> Schedule:
    """Pipelined broadcast along the ring from ``root``: receive chunk k, then forward it."""
    sched = Schedule()
    if nmembers == 1:
        return sched
    k = chunks_per_segment(n, itemsize, chunk_bytes)
    dist = (rank - root) % nmembers
    for c in range(k):
        a, b = n * c // k, n * (c + 1) // k
        if dist > 0:
            sched.recvs.append(Recv(a, b, reduce=False))
        if dist < nmembers - 1:
            sched.sends.append(Send(a, b, from_input=False))
            sched.send_after.append(c + 1 if dist > 0 else 0)
    return sched
