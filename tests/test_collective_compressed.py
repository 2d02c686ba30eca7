"""The int8-compressed allreduce: a pure simulation of every member's schedule and codec hooks
(Hypothesis: identical outputs, bounded quantization, error feedback across view changes), then
the real thing on in-process rings of N = 1..5 over loopback sockets."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from test_collective_inproc import on_all, ring_of

from ftmesh.collective import InputMismatchError, Peer, RingPeerLostError, RingView
from ftmesh.collective import compressed as comp_mod
from ftmesh.collective.ops import CollectiveOp, stage
from ftmesh.compression import Int8Compression
from ftmesh.errors import LocalUsageError


@contextlib.contextmanager
def pieces_of(elems: int) -> Iterator[None]:
    """Cut shards into pieces of ``elems`` values (whole blocks) instead of 2**18, so that
    small buffers travel as many pieces."""
    saved = comp_mod.PIECE_ELEMS
    comp_mod.PIECE_ELEMS = elems
    try:
        yield
    finally:
        comp_mod.PIECE_ELEMS = saved


def simulate(arrs: list[np.ndarray], comps: list[Int8Compression], op: str = "sum") -> None:
    """Every member's compressed allreduce in memory, in place: bytes move between the
    members' wire buffers as the engine would move them (in order, honouring send_after)."""
    n = len(arrs)
    runs = []
    for r in range(n):
        sched, bufs, finish = comp_mod.prepare(comps[r], stage(arrs[r], writable=True), op, n, r)
        runs.append((sched, bufs, finish))
    inflight: list[list[np.ndarray]] = [[] for _ in range(n)]
    sent, recvd = [0] * n, [0] * n
    for _ in range(100_000):
        moved = False
        for r, (sched, bufs, _) in enumerate(runs):
            while sent[r] < len(sched.sends) and sched.send_after[sent[r]] <= recvd[r]:
                s = sched.sends[sent[r]]
                if bufs.on_send is not None:
                    bufs.on_send(sent[r])
                inflight[(r + 1) % n].append(bufs.acc[s.start : s.stop].copy())
                sent[r] += 1
                moved = True
            while inflight[r] and recvd[r] < len(sched.recvs):
                rv = sched.recvs[recvd[r]]
                got = inflight[r].pop(0)
                assert got.size == rv.stop - rv.start  # sender and receiver cut alike
                bufs.acc[rv.start : rv.stop] = got
                if bufs.on_recv is not None:
                    bufs.on_recv(recvd[r])
                recvd[r] += 1
                moved = True
        if not moved:
            break
    for r, (sched, _, finish) in enumerate(runs):
        assert sent[r] == len(sched.sends) and recvd[r] == len(sched.recvs)
        assert not inflight[r]
        finish()


def bound(arrs: list[np.ndarray], comps: list[Int8Compression]) -> float:
    """Largest error a compressed sum may have: every member's quantization of its share
    (half a step of the largest value it sends) and the owner's of the sum."""
    n = len(arrs)
    top = max(float(np.abs(a).max(initial=0)) for a in arrs) + max(c.residual_norm() for c in comps)
    return (n - 1) * top / 254 + n * top * 1.01 / 254 + 1e-6 * n * top


sizes = st.sampled_from([0, 1, 2, 3, 5, 7, 255, 256, 257, 511, 1000, 1031, 4099])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5),
    size=sizes,
    block=st.sampled_from([1, 4, 256]),
    piece=st.sampled_from([1, 300, 1 << 18]),
    op=st.sampled_from(["sum", "avg"]),
    tail=st.sampled_from([0, 0, 1, 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_member_gets_identical_bits_within_the_bound(
    n: int, size: int, block: int, piece: int, op: str, tail: int, seed: int
) -> None:
    tail = min(tail, size)
    rng = np.random.default_rng(seed)
    arrs = [
        (rng.standard_normal(size) * rng.uniform(0.01, 100)).astype(np.float32) for _ in range(n)
    ]
    exact = np.sum([a.astype(np.float64) for a in arrs], axis=0)
    comps = [Int8Compression(block, exact_tail=tail) for _ in range(n)]
    limit = bound(arrs, comps)
    with pieces_of(piece):
        simulate(arrs, comps, op)
    for a in arrs[1:]:
        assert a.tobytes() == arrs[0].tobytes()
    got = arrs[0].astype(np.float64) * (n if op == "avg" else 1)
    if tail:  # the exact tail: float32 sums, as an uncompressed allreduce makes them
        np.testing.assert_allclose(got[-tail:], exact[-tail:], rtol=1e-5, atol=0)
    assert float(np.abs(got - exact).max(initial=0)) <= limit * (1.0001 if op == "sum" else 1.01)
    if n == 1:
        np.testing.assert_array_equal(got, exact)  # no wire, no quantization


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(5, 60),
    size=sizes.filter(lambda s: s > 0),
    block=st.sampled_from([4, 256]),
)
def test_error_feedback_bounds_the_accumulated_error_across_view_changes(
    seed: int, steps: int, size: int, block: int
) -> None:
    """Five members with their own Int8Compression; every step a random subset of them (a
    view of 1..5, so shard owners change) allreduces. What the outputs add up to differs from
    what the inputs add up to by exactly the residuals still held (up to float32 rounding),
    which stay within one round's quantization error however many steps run."""
    rng = np.random.default_rng(seed)
    comps = [Int8Compression(block) for _ in range(5)]
    total_in = np.zeros(size)
    total_out = np.zeros(size)
    scale = 1.0
    for _ in range(steps):
        members = sorted(rng.choice(5, size=int(rng.integers(1, 6)), replace=False))
        arrs = [(rng.standard_normal(size) * scale).astype(np.float32) for _ in members]
        for a in arrs:
            total_in += a
        with pieces_of(97):
            simulate(arrs, [comps[m] for m in members], "sum")
        total_out += arrs[0]
    owed = np.zeros(size)
    for c in comps:
        r = c.residual(size)
        assert r is not None
        owed += r
        # a residual is at most half a step of what its member quantized: its share (values
        # up to ~5 sigma plus a residual) or, as an owner, a sum of up to 5 shares
        assert c.residual_norm() <= 5 * 6.0 * 1.02 / 254
    np.testing.assert_allclose(total_out - total_in, -owed, rtol=0, atol=1e-5 * steps)


def test_refused_dtypes_and_ops_name_what_was_refused() -> None:
    comp = Int8Compression()
    for dtype in ("float64", "int32", "uint8"):
        with pytest.raises(LocalUsageError, match=dtype):
            comp_mod.prepare(comp, stage(np.zeros(4, dtype), writable=True), "sum", 2, 0)
    for op in ("min", "max"):
        with pytest.raises(LocalUsageError, match=op):
            comp_mod.prepare(comp, stage(np.zeros(4, np.float32), writable=True), op, 2, 0)


# -- on real sockets --------------------------------------------------------------------------


def _digest(a: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
async def test_compressed_allreduce_on_a_ring(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Awkward sizes and all three float dtypes: identical results on every member, within the
    bound, with the residuals carried from one call to the next."""
    pytest.importorskip("torch")
    monkeypatch.setattr(comp_mod, "PIECE_ELEMS", 4096)  # several pieces per shard
    async with ring_of(n) as (dps, view):
        for size in (0, 1, n + 1, 257, 5003, 70_001):  # 70,001: many pieces
            comps = [Int8Compression() for _ in range(n)]
            rng = np.random.default_rng(size)
            for _ in range(2):  # the second round starts from the first one's residuals
                arrs = [rng.uniform(-1, 1, size).astype(np.float32) for _ in range(n)]
                owed = [c.residual(size) for c in comps]  # what the last round still owes
                exact = np.sum([a + r for a, r in zip(arrs, owed, strict=True)], axis=0)
                limit = bound(arrs, comps)
                res = await on_all(
                    dps, lambda i, dp, a=arrs, c=comps: dp.allreduce(view, a[i], "sum", c[i])
                )
                assert all(not isinstance(r, Exception) for r in res), res
                assert len({_digest(a) for a in arrs}) == 1
                assert float(np.abs(arrs[0] - exact).max(initial=0)) <= limit
        await half_precision_avg(dps, view, lambda: "int8", 0.03)


async def half_precision_avg(
    dps: list[Any], view: RingView, compression: Callable[[], Any], tol: float
) -> None:
    """A compressed ``avg`` of float16 arrays (they travel as float32 values) and of bfloat16
    torch tensors: identical on every member and within ``tol`` of the mean."""
    torch = pytest.importorskip("torch")
    n = len(dps)
    for dtype in ("float16", "bfloat16"):
        base = [np.random.default_rng(i).uniform(-1, 1, 3001) for i in range(n)]
        if dtype == "float16":
            xs: list[Any] = [b.astype(np.float16) for b in base]
        else:
            xs = [torch.tensor(b, dtype=torch.bfloat16) for b in base]
        comps = [compression() for _ in range(n)]
        res = await on_all(
            dps, lambda i, dp, xs=xs, c=comps: dp.allreduce(view, xs[i], "avg", c[i])
        )
        assert all(not isinstance(r, Exception) for r in res), res
        outs = [np.asarray(x.float() if dtype == "bfloat16" else x, np.float64) for x in xs]
        assert len({o.tobytes() for o in outs}) == 1
        assert np.abs(outs[0] - np.mean(base, axis=0)).max() < tol


async def test_members_must_agree_on_compression_and_a_failed_round_keeps_the_residual() -> None:
    async with ring_of(3) as (dps, view):
        comps = [Int8Compression() for _ in range(3)]
        arrs = [np.full(1000, i + 0.3, np.float32) for i in range(3)]
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, arrs[i], "sum", comps[i]))
        assert all(not isinstance(r, Exception) for r in res), res
        before = [c.residual(1000).copy() for c in comps]  # type: ignore[union-attr]
        # member 2 does not compress, then member 2 uses another block size: both refused
        for other in (None, Int8Compression(4096)):
            specs: list[Any] = [comps[0], comps[1], other]
            res = await on_all(dps, lambda i, dp, s=specs: dp.allreduce(view, arrs[i], "sum", s[i]))
            assert all(isinstance(r, InputMismatchError) for r in res), res
            assert "compression=int8/256" in str(res[1]) or "compression=int8/256" in str(res[0])
        for c, b in zip(comps, before, strict=True):
            np.testing.assert_array_equal(c.residual(1000), b)  # the failed rounds changed nothing
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, arrs[i], "sum", comps[i]))
        assert all(not isinstance(r, Exception) for r in res), res
        with trio.fail_after(5), pytest.raises(LocalUsageError, match="int64"):
            await dps[0].allreduce(view, np.zeros(3, np.int64), "sum", "int8")


@pytest.mark.parametrize("stall", ["one-shot", "shared: scales round", "shared: integer round"])
async def test_a_round_aborted_by_a_loss_keeps_residuals_and_the_retry_succeeds(stall: str) -> None:
    """m2 agrees on the view and then never takes part (a SIGSTOPped peer), or on the
    shared-scale path it runs the scales round and then freezes; the survivors' compressed
    allreduce is aborted (``abort_view``), raises ``RingPeerLostError`` and leaves their
    residuals as they were; the retry on the view without m2 gives identical bits."""
    shared = {"shared_scale_from": 0 if stall.startswith("shared") else 1 << 18}
    async with ring_of(4) as (dps, view):
        comps = [Int8Compression(**shared) for _ in range(4)]
        size = 20_000
        warm = [np.random.default_rng(i).uniform(-1, 1, size).astype(np.float32) for i in range(4)]
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, warm[i], "sum", comps[i]))
        assert all(not isinstance(r, Exception) for r in res), res
        before = [c.residual(size).copy() for c in comps]  # type: ignore[union-attr]
        survivors = [0, 1, 3]
        xs = {i: np.full(size, 0.1 * (i + 1), np.float32) for i in survivors}
        out: dict[int, Any] = {}

        async def member(i: int) -> None:
            try:
                out[i] = await dps[i].allreduce(view, xs[i], "sum", comps[i])
            except Exception as exc:
                out[i] = exc

        async def frozen_after_scales() -> None:
            plan = dps[2].plan(
                view, CollectiveOp.allreduce("sum", comps[2]), np.zeros(size, np.float32)
            )
            plan.then = None  # run the scales round, never the integer one
            await dps[2].run_plan(plan)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                if stall.endswith("integer round"):
                    nursery.start_soon(frozen_after_scales)
                else:
                    nursery.start_soon(dps[2].open_ring, view)  # agrees, never takes part
                for i in survivors:
                    nursery.start_soon(member, i)
                await trio.sleep(0.5)  # let them block on the stalled member
                for i in survivors:
                    dps[i].abort_view(view.epoch, "m2", "declared dead by the test")
        for i in survivors:
            assert isinstance(out[i], RingPeerLostError), (i, out[i])
            np.testing.assert_array_equal(comps[i].residual(size), before[i])
        smaller = RingView.of(Peer(dps[i].node_id, *dps[i].address) for i in survivors)
        want = sum(float(xs[i][0]) + before[i].astype(np.float64) for i in survivors)
        res = await on_all(
            [dps[i] for i in survivors],
            lambda k, dp: dp.allreduce(smaller, xs[survivors[k]], "sum", comps[survivors[k]]),
        )
        assert all(not isinstance(r, Exception) for r in res), res
        assert len({xs[i].tobytes() for i in survivors}) == 1
        assert np.abs(xs[0] - want).max() <= 3 * 1.05 / 127


async def test_a_view_too_big_for_compression_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """From 14 members on, the one-shot ring moves more bytes than an uncompressed one: the
    allreduce still works, and each member says so once (not a silent slowdown)."""
    assert comp_mod.wire_ratio(4, 256) > 2.6 and comp_mod.wire_ratio(13, 256) > 1
    assert comp_mod.wire_ratio(14, 256) < 1
    n = 14
    async with ring_of(n) as (dps, view):
        for _ in range(2):
            arrs = [np.full(300, float(i), np.float32) for i in range(n)]
            with caplog.at_level("WARNING", logger="ftmesh.collective.dataplane"):
                res = await on_all(
                    dps, lambda i, dp, a=arrs: dp.allreduce(view, a[i], "sum", "int8")
                )
            assert all(not isinstance(r, Exception) for r in res), res
            assert len({_digest(a) for a in arrs}) == 1
            assert np.abs(arrs[0] - sum(range(n))).max() < 1
    warned = [r for r in caplog.records if "turn compression off" in r.getMessage()]
    assert len(warned) == n, [r.getMessage() for r in warned]  # once per member, not per call
    assert "view of 14 members moves 1.02x the bytes" in warned[0].getMessage()
