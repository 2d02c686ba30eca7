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


@dataclass(frozen=True, slots=True)
class OneShot:
    """A member's schedule of the one-shot compressed allreduce (``one_shot``), in byte offsets
    of one wire buffer, and where its regions lie."""

    sched: Schedule
    size: int
    """Bytes of the wire buffer."""
    outbox: list[tuple[int, int, int]]
    """``(shard, start, stop)`` of this member's encoded shards, in the order they leave."""
    encode_upto: list[int]
    """Per send: how many ``outbox`` shards must be encoded before it goes."""
    inbox: list[tuple[int, int]]
    """Per reduce-scatter step: the byte range of this member's own shard in the bundle it
    receives then (a shard of the member ``step + 1`` places to the left)."""
    owned_at: list[int]
    """Per receive: the reduce-scatter step whose own shard it completes, else -1."""
    final: list[int]
    """Byte offsets of the owners' encoded sums, shard ``j`` at ``final[j]:final[j + 1]``."""
    final_at: list[int]
    """Per receive: the shard whose encoded sum it completes, else -1."""


def one_shot(sizes: list[int], rank: int, *, chunk_bytes: int) -> OneShot:
    """The one-shot reduce-scatter + allgather over a ring, for shards of ``sizes[j]`` encoded
    bytes owned by member ``j`` (see ``ftmesh.collective.compressed``).

    Reduce-scatter: at step 0 member ``r`` sends its encoded shards for ``r+1, r+2, ..., r-1``
    (one bundle, in that order); at step ``t`` it receives the bundle of member ``r-1-t``, whose
    first shard is its own, and at step ``t+1`` forwards the rest unchanged. After N-1 steps
    every owner holds every member's shard of its own, each having crossed the ring once.
    Allgather: the ring steps ``N-1..2N-3`` over the owners' encoded sums, forwarded unchanged.
    Every region is cut into chunks of at most ``chunk_bytes`` (at least one chunk, possibly
    empty) by its length only, so a sender and its receiver cut alike."""
    n = len(sizes)
    sched = Schedule()
    nothing = OneShot(sched, 0, [], [], [], [], [0] * (n + 1), [])
    if n <= 1:
        return nothing
    off = 0

    def region(length: int) -> int:
        nonlocal off
        start, off = off, off + length
        return start

    outbox: list[tuple[int, int, int]] = []
    for k in range(1, n):
        d = (rank + k) % n
        s = region(sizes[d])
        outbox.append((d, s, s + sizes[d]))
    bundles = []  # per step t: (start, own_stop, stop) of the received bundle
    for t in range(n - 1):
        dests = [(rank + k) % n for k in range(n - 1 - t)]
        length = sum(sizes[d] for d in dests)
        s = region(length)
        bundles.append((s, s + sizes[rank], s + length))
    final = []
    for j in range(n):
        final.append(region(sizes[j]))
    final.append(off)

    def cut(start: int, stop: int) -> list[tuple[int, int]]:
        length = stop - start
        k = max(1, -(-length // chunk_bytes))
        return [(start + length * c // k, start + length * (c + 1) // k) for c in range(k)]

    # receives: the bundles, then the owners' sums in allgather order
    owned_at: list[int] = []
    final_at: list[int] = []

    def receive(start: int, stop: int, own_stop: int, step: int, shard: int) -> list[int]:
        """Receive region ``start:stop`` in chunks; returns their indices."""
        pieces = cut(start, stop)
        idx = []
        for c, (a, b) in enumerate(pieces):
            idx.append(len(sched.recvs))
            sched.recvs.append(Recv(a, b, reduce=False))
            # the first chunk reaching own_stop completes this member's shard of a bundle
            first_done = b >= own_stop and (c == 0 or pieces[c - 1][1] < own_stop)
            owned_at.append(step if step >= 0 and first_done else -1)
            final_at.append(shard if c == len(pieces) - 1 else -1)
        return idx

    bundle_recvs = [receive(s, e, own, t, -1) for t, (s, own, e) in enumerate(bundles)]
    rs_recvs = len(sched.recvs)
    final_recvs: dict[int, list[int]] = {}
    for k in range(n - 1):
        j = (rank - k - 1) % n
        final_recvs[j] = receive(final[j], final[j + 1], final[j], -1, j)

    def after(idx: list[int], b: int) -> int:
        """Receives to complete before sending bytes up to ``b`` of the region received in
        chunks ``idx`` (at least its first chunk)."""
        need = [i for i in idx if sched.recvs[i].start < b]
        return (need[-1] if need else idx[0]) + 1

    encode_upto: list[int] = []
    box_start, box_stop = outbox[0][1], outbox[-1][2]
    for _a, b in cut(box_start, box_stop):
        sched.sends.append(Send(_a, b, from_input=False))
        sched.send_after.append(0)
        last = b >= box_stop
        encode_upto.append(len(outbox) if last else sum(1 for _, s0, _ in outbox if s0 < b))
    for t in range(n - 2):  # forward what is not ours of the bundle received at step t
        _s, own, e = bundles[t]
        for a, b in cut(own, e):
            sched.sends.append(Send(a, b, from_input=False))
            sched.send_after.append(after(bundle_recvs[t], b))
            encode_upto.append(len(outbox))
    for k in range(n - 1):  # allgather: our sum first, then what arrived one step before
        j = (rank - k) % n
        for a, b in cut(final[j], final[j + 1]):
            sched.sends.append(Send(a, b, from_input=False))
            sched.send_after.append(rs_recvs if k == 0 else after(final_recvs[j], b))
            encode_upto.append(len(outbox))
    inbox = [(s, own) for s, own, _ in bundles]
    return OneShot(sched, off, outbox, encode_upto, inbox, owned_at, final, final_at)
