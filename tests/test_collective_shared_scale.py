"""The shared-scale int8 allreduce (``ftmesh.collective.shared_scale``): the codec steps in
memory (Hypothesis: the error bound, no integer overflow at any N, error feedback), then the
real two rounds on in-process rings over loopback sockets. (A loss in either round:
``test_collective_compressed``, with the one-shot path.)"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_collective_compressed import half_precision_avg
from test_collective_inproc import on_all, ring_of

from ftmesh.collective import InputMismatchError, shared_scale
from ftmesh.compression import Int8Codec, Int8Compression

SHARED = {"shared_scale_from": 0}  # every size takes the shared-scale path (from 3 members)


def _digest(a: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def simulate(codec: Int8Codec, contribs: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The rounds in memory: max-reduce the block maxima, quantize, add the integers (as the
    ring would, in the lanes' dtype), decode. Returns the result and each member's error."""
    n = len(contribs)
    lane, levels = shared_scale.lanes(n)
    nb = codec.blocks(contribs[0].size)
    maxima = np.zeros(nb, np.float32)
    for c in contribs:
        m = np.empty(nb, np.float32)
        codec.block_maxabs_into(c, m)
        np.maximum(maxima, m, out=maxima)
    scales = codec.shared_scales(maxima, levels)
    total = np.zeros(contribs[0].size, lane)
    errors = []
    for c in contribs:
        q = np.empty(c.size, lane)
        err = np.empty(c.size, np.float32)
        codec.quantize_into(c, scales, levels, q, err)
        assert np.abs(q.astype(np.int64)).max(initial=0) <= levels
        np.add(total, q, out=total)  # wraps on overflow: the bound below would catch it
        errors.append(err)
    out = np.empty(contribs[0].size, np.float32)
    codec.dequantize_into(total, scales, out)
    return out, errors


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    size=st.sampled_from([1, 2, 255, 256, 257, 1000, 4099]),
    block=st.sampled_from([1, 4, 256]),
    seed=st.integers(0, 2**32 - 1),
)
def test_integer_sums_stay_in_range_and_within_the_bound(
    n: int, size: int, block: int, seed: int
) -> None:
    """N members each quantize to L = 127 // N (or 32767 // N) levels of the largest value any
    of them holds in the block: the integer sum cannot overflow, and the decoded sum is within
    N half-steps of the exact one (the errors each member keeps add up to the difference)."""
    rng = np.random.default_rng(seed)
    contribs = [
        (rng.standard_normal(size) * rng.uniform(0.01, 100)).astype(np.float32) for _ in range(n)
    ]
    codec = Int8Codec(block)
    out, errors = simulate(codec, contribs)
    exact = np.sum([c.astype(np.float64) for c in contribs], axis=0)
    _, levels = shared_scale.lanes(n)
    top = max(float(np.abs(c).max()) for c in contribs)
    assert np.abs(out - exact).max() <= n * top / (2 * levels) * 1.01 + 1e-5 * n * top
    for e in errors:
        assert np.abs(e).max() <= top / (2 * levels) * 1.01
    # what was lost is exactly what the members keep for the next round
    kept = np.sum([e.astype(np.float64) for e in errors], axis=0)
    np.testing.assert_allclose(out + kept, exact, rtol=0, atol=1e-5 * n * top)


def test_lanes_widen_when_int8_levels_run_out() -> None:
    assert shared_scale.lanes(3) == (np.dtype(np.int8), 42)
    assert shared_scale.lanes(8) == (np.dtype(np.int8), 15)
    assert shared_scale.lanes(9) == (np.dtype(np.int16), 3640)


@pytest.mark.parametrize("n", [3, 4, 5, 9])
async def test_shared_scale_allreduce_on_a_ring(n: int) -> None:
    """Awkward sizes, a tail and all three float dtypes: identical bits on every member, the
    tail exact, within the bound, with the residuals carried from one call to the next."""
    pytest.importorskip("torch")
    _, levels = shared_scale.lanes(n)
    async with ring_of(n) as (dps, view):
        for size, tail in ((1, 0), (n + 1, 1), (257, 3), (5003, 0), (70_001, 2)):
            comps = [Int8Compression(exact_tail=tail, **SHARED) for _ in range(n)]
            rng = np.random.default_rng(size)
            for _ in range(2):  # the second round starts from the first one's residuals
                arrs = [rng.uniform(-1, 1, size).astype(np.float32) for _ in range(n)]
                owed = [c.residual(size) for c in comps]
                contribs = [a + r for a, r in zip(arrs, owed, strict=True)]
                exact = np.sum([c.astype(np.float64) for c in contribs], axis=0)
                top = max(float(np.abs(c).max()) for c in contribs)
                res = await on_all(
                    dps, lambda i, dp, a=arrs, c=comps: dp.allreduce(view, a[i], "sum", c[i])
                )
                assert all(not isinstance(r, Exception) for r in res), res
                assert len({_digest(a) for a in arrs}) == 1
                got = arrs[0].astype(np.float64)
                if tail:
                    np.testing.assert_allclose(got[-tail:], exact[-tail:], rtol=1e-5, atol=1e-6 * n)
                assert np.abs(got - exact).max() <= n * top / (2 * levels) * 1.01 + 1e-5
        await half_precision_avg(dps, view, lambda: Int8Compression(**SHARED), 1.0 / levels + 0.01)


async def test_a_non_finite_block_stays_non_finite_everywhere() -> None:
    """A NaN or an inf in one member's block makes that block NaN on every member (as
    ``GradScaler`` needs to skip the step); the other blocks are unaffected and no residual
    turns NaN."""
    async with ring_of(3) as (dps, view):
        comps = [Int8Compression(block_size=4, **SHARED) for _ in range(3)]
        arrs = [np.full(12, 0.5, np.float32) for _ in range(3)]
        arrs[1][5] = np.inf
        arrs[2][9] = np.nan
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, arrs[i], "sum", comps[i]))
        assert all(not isinstance(r, Exception) for r in res), res
        for a in arrs:
            assert np.isnan(a[4:12]).all() and np.allclose(a[:4], 1.5)
        for c in comps:
            assert np.isfinite(c.residual(12)).all()  # type: ignore[arg-type]


async def test_members_must_agree_on_the_scheme_and_a_failed_round_keeps_the_residual() -> None:
    """A member on the one-shot scheme (another ``shared_scale_from``) or without compression
    is refused in the first round; nobody's residual moves; the next agreed round works."""
    async with ring_of(3) as (dps, view):
        comps = [Int8Compression(**SHARED) for _ in range(3)]
        arrs = [np.full(1000, i + 0.3, np.float32) for i in range(3)]
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, arrs[i], "sum", comps[i]))
        assert all(not isinstance(r, Exception) for r in res), res
        before = [c.residual(1000).copy() for c in comps]  # type: ignore[union-attr]
        for other in (None, Int8Compression()):  # uncompressed; one-shot (1000 < 2**18)
            specs: list[Any] = [comps[0], comps[1], other]
            res = await on_all(dps, lambda i, dp, s=specs: dp.allreduce(view, arrs[i], "sum", s[i]))
            assert all(isinstance(r, InputMismatchError) for r in res), res
            assert any("shared-scale" in str(r) for r in res), res
        for c, b in zip(comps, before, strict=True):
            np.testing.assert_array_equal(c.residual(1000), b)
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, arrs[i], "sum", comps[i]))
        assert all(not isinstance(r, Exception) for r in res), res
