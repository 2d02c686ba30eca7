"""The int8-compressed allreduce (``allreduce(x, op, compression=...)``) on the TCP ring.

Theory of operation (the one-shot pattern of ZeRO++ and torchft, on a ring). Summing int8
values that carry different scales is meaningless, and re-quantizing a partial sum at every
hop of a ring reduce-scatter compounds N-1 quantization errors; so no partial sum is ever
re-quantized:

1. The buffer (as float32, plus this member's error-feedback residual) is cut into N shards
   on block boundaries; shard ``j`` belongs to the member of rank ``j``. An exact tail
   (``Int8Compression(exact_tail=k)``: the last k elements, e.g. counters) joins the last
   shard as float32, added like an uncompressed allreduce does.
2. Reduce-scatter: each member encodes its N-1 shards of the others (int8 + one float32 scale
   per block, ``ftmesh.compression.int8``) and sends them round the ring as one bundle; each
   member keeps the first shard of the bundle it receives (its own) and forwards the rest
   unchanged (``schedule.one_shot``). Every encoded shard crosses the ring once, hop by hop.
3. The owner decodes the N-1 shards of its own, adds them in float32 to its own
   (unquantized) contribution, in arrival order, and encodes the sum once.
4. Allgather: the owners' encoded sums travel the ring unchanged; every member decodes the
   same bytes, so every member ends with bitwise-identical values (``avg`` then divides by N,
   the same float32 operation everywhere).

Each element is thus quantized at most twice, whatever N: by the member that sends it and by
its owner. Both errors go to the member's residual (``ftmesh.compression.feedback``), which is
updated only in ``finish``, i.e. when the collective completed on this member: a collective
that aborts leaves the residual as it was, and the retry, on the same or another view, sends
the same contribution (a step that fails after a completed collective goes back to the
residual it started with: ``Int8Compression.attempt``). On a view of one member nothing is
quantized (no wire): the result is the input plus the residual, which is then zero.

Cost and choice: each link carries ``N(N-1)/2`` encoded shards (``(N-1)/2`` encoded buffers)
in the reduce-scatter plus ``(N-1)/N`` of the encoded buffer in the allgather, against
``2(N-1)/N`` float32 buffers for the plain ring: ``16/(N+2)`` times less (about 4x at N=2,
2.7x at N=4, 1.6x at N=8, break-even near N=14, where every member logs a warning once
per view size (``wire_ratio``; the allreduce still runs); the scales cost 1.6 % at the
default block size). That is why buffers of ``Int8Compression.shared_scale_from`` values
and more on views of 3 or more take ``shared_scale`` instead (agreed scales, integer sums on
the plain ring: about 3.9x at any N, for one more small round).

Shards travel in pieces (``PIECE_ELEMS`` values, whole blocks, one encoded run and one frame
each); encoding, decoding and the owner's sums run inside the engine's loop
(``Buffers.on_send``/``on_recv``) a piece at a time, while the kernel's socket buffers keep
the wire busy, and an owner sends a piece of its sum as soon as the last member's piece of
it has arrived.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..compression import Int8Compression
from ..compression.int8 import F32, U8
from ..errors import LocalUsageError
from .engine import Buffers
from .ops import FLOAT32_CONVERTIBLE, Staged, as_float32, store_float32
from .schedule import OneShot, Schedule, one_shot, segment_bounds

COMPRESSED_OPS = ("sum", "avg")
"""Reductions a compressed allreduce supports: min and max of quantized values are not what
the caller asked for."""


def check_compressible(op: str, dtype: str) -> None:
    """Refuse what the compressed allreduce cannot do, naming it."""
    if op not in COMPRESSED_OPS:
        raise LocalUsageError(
            f"compressed allreduce supports op {' or '.join(COMPRESSED_OPS)}, not {op!r}"
        )
    if dtype not in FLOAT32_CONVERTIBLE:
        raise LocalUsageError(
            f"compressed allreduce takes {', '.join(FLOAT32_CONVERTIBLE)} data, not {dtype}"
        )


PIECE_ELEMS = 1 << 18
"""Elements per piece (rounded down to whole blocks): each shard travels as encoded runs of
this many values, one frame each, so a member encodes, forwards, sums and decodes piece by
piece while the rest is on the wire (262,144 values = 266 KB encoded at block size 256).
Part of the protocol: members compare it in the collective's header."""


def wire_ratio(members: int, block_size: int) -> float:
    """Bytes a link carries in a plain float32 ring allreduce over those of this one (each
    link: ``2(N-1)/N`` float32 buffers against ``(N-1)/N (N/2+1)`` encoded ones): about
    ``16/(N+2)``, below 1 from N = 14 on, where compressing moves *more* bytes."""
    per_elem = 1 + 4 / block_size  # int8 + its share of a float32 scale
    return 16 / (per_elem * (members + 2))


def shard_bounds(n: int, members: int, block_size: int) -> list[int]:
    """Element offsets of the N shards: whole blocks split as ``np.array_split`` does."""
    blocks = -(-n // block_size)
    return [min(b * block_size, n) for b in segment_bounds(blocks, members)]


def piece_elems(block_size: int) -> int:
    """Elements of a piece (the last piece of a shard may be shorter)."""
    return max(1, PIECE_ELEMS // block_size) * block_size


def codec_header(comp: Int8Compression) -> str:
    """What members compare before they exchange encoded pieces: codec, piece size, tail."""
    pe = piece_elems(comp.codec.block_size)
    return f"{comp.name} pieces={pe} exact_tail={comp.exact_tail}"


def prepare(
    comp: Int8Compression,
    st: Staged,
    op: str,
    members: int,
    rank: int,
) -> tuple[Schedule, Buffers, Callable[[], None]]:
    """This member's schedule, wire buffers (with the codec hooks) and ``finish`` (residual
    update, copy-back) of a compressed allreduce of ``st``, in place."""
    check_compressible(op, st.dtype)
    n = int(st.flat.size)
    if comp.exact_tail > n:
        raise LocalUsageError(f"exact_tail={comp.exact_tail} is longer than the {n} elements")
    xf = as_float32(st.flat, st.dtype)
    comp.begin()
    residual = comp.residual(n)
    new_residual = comp.next_residual(n)
    if members == 1:
        return Schedule(), Buffers(st.flat, st.flat), _single(comp, st, xf, residual)
    run = _Run(comp, st, xf, residual, new_residual, op, members, rank)
    bufs = Buffers(run.wire, run.wire, on_send=run.on_send, on_recv=run.on_recv)
    return run.layout.sched, bufs, run.finish


def _single(comp: Int8Compression, st: Staged, xf: F32, residual: F32 | None) -> Callable[[], None]:
    def finish() -> None:
        if residual is not None and residual.size:
            np.add(xf, residual, out=xf)
            store_float32(xf, st.flat, st.dtype)
            comp.commit(np.zeros_like(residual))
        else:
            comp.commit(None)
        if st.commit is not None:
            st.commit()

    return finish


class _Run:
    """One compressed allreduce on one member: the wire buffer and the engine hooks."""

    def __init__(
        self,
        comp: Int8Compression,
        st: Staged,
        xf: F32,
        residual: F32 | None,
        new_residual: F32 | None,
        op: str,
        members: int,
        rank: int,
    ) -> None:
        self.comp, self.codec, self.st, self.xf = comp, comp.codec, st, xf
        self.residual, self.new_residual = residual, new_residual
        self.avg, self.members, self.rank = op == "avg", members, rank
        n = int(xf.size)
        quantized = n - comp.exact_tail
        bounds = shard_bounds(quantized, members, self.codec.block_size)
        step = piece_elems(self.codec.block_size)
        # pieces[j][p] = (lo, hi): elements of piece p of shard j; the exact tail is the
        # last shard's last piece ("raw": float32 bytes, added without quantization)
        self.pieces = [
            [(a, min(a + step, bounds[j + 1])) for a in range(bounds[j], bounds[j + 1], step)]
            for j in range(members)
        ]
        if quantized < n:
            self.pieces[-1].append((quantized, n))
        self.quantized = quantized
        sizes = [[self._bytes(lo, hi) for lo, hi in ps] for ps in self.pieces]
        self.layout: OneShot = one_shot(sizes, rank)
        self.wire = comp.workspace("wire", self.layout.size, np.uint8)
        self.base = bounds[rank]
        end = n if rank == members - 1 else bounds[rank + 1]
        self.owned = comp.workspace("owned", end - self.base, np.float32)  # the owner's sums
        self.scratch: F32 = comp.workspace("piece", max(step, comp.exact_tail), np.float32)

    def _bytes(self, lo: int, hi: int) -> int:
        return 4 * (hi - lo) if lo >= self.quantized else self.codec.encoded_bytes(hi - lo)

    def _encode(self, values: F32, lo: int, hi: int, dst: U8) -> None:
        """Encode ``values`` (elements ``lo:hi``) into ``dst``; the error goes to the new
        residual (the exact tail has none)."""
        res = None if self.new_residual is None else self.new_residual[lo:hi]
        if lo >= self.quantized:
            dst.view("<f4")[...] = values
            if res is not None:
                res[...] = 0.0
        else:
            self.codec.encode_into(values, dst, res)

    def _decode(self, src: U8, lo: int, out: F32, *, add: bool = False) -> None:
        if lo < self.quantized:
            self.codec.decode_into(src, out, add=add)
        elif add:
            out += src.view("<f4")
        else:
            out[...] = src.view("<f4")

    def _contribution(self, lo: int, hi: int) -> F32:
        """This member's float32 contribution to elements ``lo:hi``: values plus residual."""
        if self.residual is None:
            return self.xf[lo:hi]
        return np.add(self.xf[lo:hi], self.residual[lo:hi], out=self.scratch[: hi - lo])

    def on_send(self, i: int) -> None:
        piece = self.layout.encode_at[i]
        if piece is not None:  # a piece of ours for another owner: encode it now
            lo, hi = self.pieces[piece[0]][piece[1]]
            s = self.layout.sched.sends[i]
            self._encode(self._contribution(lo, hi), lo, hi, self.wire[s.start : s.stop])

    def on_recv(self, i: int) -> None:
        layout = self.layout
        own = layout.owned_at[i]
        if own is not None:  # a member's piece of our shard: add it to our sum
            step, p = own
            lo, hi = self.pieces[self.rank][p]
            acc = self.owned[lo - self.base : hi - self.base]
            if step == 0:
                acc[...] = self._contribution(lo, hi)
            r = layout.sched.recvs[i]
            self._decode(self.wire[r.start : r.stop], lo, acc, add=True)
            if step == self.members - 2:  # every member's piece is in: encode the sum once
                a, b = layout.final[self.rank][p]
                self._encode(acc, lo, hi, self.wire[a:b])
                self._output(self.rank, p)
        fin = layout.final_at[i]
        if fin is not None:
            self._output(*fin)

    def _output(self, j: int, p: int) -> None:
        """Decode the owner's encoded sum of piece ``p`` of shard ``j`` into the result."""
        lo, hi = self.pieces[j][p]
        a, b = self.layout.final[j][p]
        out = self.xf[lo:hi]
        self._decode(self.wire[a:b], lo, out)
        if self.avg:
            np.divide(out, np.float32(self.members), out=out)
        if self.xf is not self.st.flat:
            store_float32(out, self.st.flat[lo:hi], self.st.dtype)

    def finish(self) -> None:
        self.comp.commit(self.new_residual)
        if self.st.commit is not None:
            self.st.commit()
