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


MIN_CHUNKS = 4
"""Chunks per segment at least, while each stays at least ``MIN_CHUNK_BYTES``: a ring step
is forwarded chunk by chunk, so a segment sent whole (a 4 MiB segment under a 4 MiB
``chunk_bytes``) would leave the next member idle until all of it arrived."""
MIN_CHUNK_BYTES = 256 << 10


def chunks_per_segment(seg_elems: int, itemsize: int, chunk_bytes: int) -> int:
    """Chunks of at most ``chunk_bytes`` (the engine's scratch holds one), and at least
    ``MIN_CHUNKS`` of at least ``MIN_CHUNK_BYTES`` where the segment is large enough."""
    nbytes = seg_elems * itemsize
    return max(1, -(-nbytes // chunk_bytes), min(MIN_CHUNKS, nbytes // MIN_CHUNK_BYTES))


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


Piece = tuple[int, int]
"""``(shard, piece)``: a piece of a shard of the one-shot allreduce (see ``one_shot``)."""


@dataclass(frozen=True, slots=True)
class OneShot:
    """A member's schedule of the one-shot compressed allreduce (``one_shot``), in byte offsets
    of one wire buffer, and what each send and receive carries. Every send and receive is one
    piece (an encoded run), so the codec hooks act piece by piece."""

    sched: Schedule
    size: int
    """Bytes of the wire buffer."""
    encode_at: list[Piece | None]
    """Per send: the piece of this member's contribution to encode into its bytes first."""
    owned_at: list[tuple[int, int] | None]
    """Per receive: ``(step, piece)`` when it is a piece of this member's own shard, received
    at reduce-scatter ``step`` (from the member ``step + 1`` places to the left)."""
    final_at: list[Piece | None]
    """Per receive: the piece of an owner's encoded sum it brings (allgather)."""
    final: list[list[tuple[int, int]]]
    """``final[j][p]``: byte range of piece ``p`` of the encoded sum of shard ``j``."""


def one_shot(pieces: list[list[int]], rank: int) -> OneShot:
    """The one-shot reduce-scatter + allgather over a ring (``ftmesh.collective.compressed``).
    ``pieces[j][p]``: encoded bytes of piece ``p`` of shard ``j``, which member ``j`` owns.

    Reduce-scatter: at step 0 member ``r`` sends its encoded shards for ``r+1, r+2, ..., r-1``
    (one bundle, in that order); at step ``t`` it receives the bundle of member ``r-1-t``,
    whose first shard is its own, and at step ``t+1`` forwards the rest unchanged, each piece
    as soon as it has arrived. After N-1 steps every owner holds every member's shard of its
    own, each having crossed the ring once. Allgather: the ring steps over the owners' encoded
    sums, forwarded unchanged; an owner sends a piece of its sum once the last bundle's piece
    of it is in. One send or receive per piece, so sender and receiver cut alike."""
    n = len(pieces)
    sched = Schedule()
    if n <= 1:
        return OneShot(sched, 0, [], [], [], [[] for _ in range(n)])
    off = 0

    def lay(shard: int) -> list[tuple[int, int]]:
        """Room for one shard's pieces at the end of the buffer."""
        nonlocal off
        out = []
        for nbytes in pieces[shard]:
            out.append((off, off + nbytes))
            off += nbytes
        return out

    outbox = [(d, lay(d)) for d in ((rank + k) % n for k in range(1, n))]
    bundles = [
        [(d, lay(d)) for d in ((rank + k) % n for k in range(n - 1 - t))] for t in range(n - 1)
    ]
    final = [lay(j) for j in range(n)]

    owned_at: list[tuple[int, int] | None] = []
    final_at: list[Piece | None] = []
    recv_index: dict[tuple[int, int, int], int] = {}  # (step, shard, piece) -> receive

    def receive(key: tuple[int, int, int], a: int, b: int) -> None:
        step, shard, p = key
        recv_index[key] = len(sched.recvs)
        sched.recvs.append(Recv(a, b, reduce=False))
        owned_at.append((step, p) if step < n - 1 and shard == rank else None)
        final_at.append((shard, p) if step == n - 1 else None)

    for t, bundle in enumerate(bundles):
        for d, ranges in bundle:
            for p, (a, b) in enumerate(ranges):
                receive((t, d, p), a, b)
    for k in range(n - 1):  # (step n - 1 stands for the whole allgather)
        j = (rank - k - 1) % n
        for p, (a, b) in enumerate(final[j]):
            receive((n - 1, j, p), a, b)

    encode_at: list[Piece | None] = []

    def send(a: int, b: int, after: int, enc: Piece | None) -> None:
        sched.sends.append(Send(a, b, from_input=False))
        sched.send_after.append(after)
        encode_at.append(enc)

    for d, ranges in outbox:
        for p, (a, b) in enumerate(ranges):
            send(a, b, 0, (d, p))
    for t in range(n - 2):  # forward what is not ours of the bundle received at step t
        for d, ranges in bundles[t][1:]:
            for p, (a, b) in enumerate(ranges):
                send(a, b, recv_index[(t, d, p)] + 1, None)
    for k in range(n - 1):  # allgather: our sum first, then what arrived one step before
        j = (rank - k) % n
        for p, (a, b) in enumerate(final[j]):
            # our sum's piece p is complete with the last bundle's piece p (received last)
            need = recv_index[(n - 2, rank, p)] if k == 0 else recv_index[(n - 1, j, p)]
            send(a, b, need + 1, None)
    return OneShot(sched, off, encode_at, owned_at, final_at, final)
