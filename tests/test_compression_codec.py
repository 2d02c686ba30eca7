"""The int8 block codec: its format bit for bit (against a scalar reference written from the
agreed text in docs/DESIGN-NOTES.md), its per-block error bound, and error feedback."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ftmesh.compression import Int8Codec, Int8Compression, as_compression
from ftmesh.errors import ConfigError, LocalUsageError

f32 = np.float32


def reference_encode(x: np.ndarray, block: int) -> bytes:
    """The agreed format, one value at a time with float32 scalars."""
    scales, values = [], []
    for b0 in range(0, x.size, block):
        blk = x[b0 : b0 + block]
        m = f32(0.0)
        for v in blk:
            a = f32(abs(v))
            m = a if (np.isnan(a) or a > m) and not np.isnan(m) else m
        with np.errstate(all="ignore"):
            scale = f32(m / f32(127.0))
        scales.append(scale)
        ok = bool(np.isfinite(scale) and scale > 0)
        for v in blk:
            if not ok:
                values.append(0)
                continue
            with np.errstate(all="ignore"):
                t = float(np.rint(f32(v / scale)))  # float32 division, half to even
            values.append(int(min(127.0, max(-127.0, t))))
    return np.array(scales, "<f4").tobytes() + np.array(values, np.int8).tobytes()


def nan_canonical(buf: bytes, n: int, block: int) -> bytes:
    """``buf`` with every NaN scale written as the one quiet NaN: NaN bits are not part of the
    format (NumPy keeps an input NaN's payload, the codec's paths need not)."""
    nb = -(-n // block)
    scales = np.frombuffer(buf[: 4 * nb], "<f4").copy()
    scales[np.isnan(scales)] = np.float32("nan")
    return scales.tobytes() + buf[4 * nb :]


def reference_decode(buf: bytes, n: int, block: int) -> np.ndarray:
    nb = -(-n // block)
    scales = np.frombuffer(buf[: 4 * nb], "<f4")
    q = np.frombuffer(buf[4 * nb :], np.int8)
    with np.errstate(all="ignore"):
        return np.array([f32(f32(q[i]) * scales[i // block]) for i in range(n)], np.float32)


any_f32 = hnp.arrays(
    np.float32,
    st.integers(0, 70),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
)
finite_f32 = hnp.arrays(
    np.float32,
    st.integers(0, 600),
    elements=st.floats(-(2.0**100), 2.0**100, width=32) | st.floats(-1.0, 1.0, width=32),
)


@settings(max_examples=150, deadline=None)
@given(x=any_f32, block=st.sampled_from([1, 2, 3, 7, 16, 256]))
def test_encode_matches_the_agreed_format_bit_for_bit(x: np.ndarray, block: int) -> None:
    codec = Int8Codec(block)
    got = codec.encode(x)
    assert got.size == codec.encoded_bytes(x.size) == 4 * codec.blocks(x.size) + x.size
    want_bytes = nan_canonical(reference_encode(x, block), x.size, block)
    assert nan_canonical(got.tobytes(), x.size, block) == want_bytes
    dec = codec.decode(got, x.size)
    want = reference_decode(got.tobytes(), x.size, block)
    np.testing.assert_array_equal(dec, want)  # NaNs compare equal here
    # a non-finite value poisons its whole block (NaN), so a GradScaler still sees it; a
    # finite block decodes finite (but for values within 127 ulps of float32's maximum)
    for b0 in range(0, x.size, block):
        blk, out = x[b0 : b0 + block], dec[b0 : b0 + block]
        if not np.isfinite(blk).all():
            assert np.isnan(out).all()
        elif np.abs(blk).max() < 3e38:
            assert np.isfinite(out).all()


@settings(max_examples=200, deadline=None)
@given(x=finite_f32, block=st.sampled_from([1, 5, 64, 256, 4096]))
def test_per_block_error_bound(x: np.ndarray, block: int) -> None:
    codec = Int8Codec(block)
    res = np.empty_like(x)
    buf = np.empty(codec.encoded_bytes(x.size), np.uint8)
    codec.encode_into(x, buf, res)
    dec = codec.decode(buf, x.size)
    np.testing.assert_array_equal(res, x - dec)  # the residual is exactly what was lost
    scales = codec.block_scales(buf, x.size)
    tiny = np.finfo(np.float32).tiny
    for k, b0 in enumerate(range(0, x.size, block)):
        blk, err = x[b0 : b0 + block], np.abs(x[b0 : b0 + block] - dec[b0 : b0 + block])
        m = float(np.max(np.abs(blk)))
        assert scales[k] == f32(f32(m) / f32(127.0))
        # half a quantization step, plus float32 rounding; subnormal scales lose precision
        bound = 0.5 * float(scales[k]) + 4 * float(np.spacing(f32(m))) + 128 * tiny
        assert float(err.max()) <= bound, (k, m, float(err.max()), bound)


def test_rounding_is_half_to_even_and_layout_is_scales_then_values() -> None:
    codec = Int8Codec(4)
    x = np.array([127.0, 2.5, 3.5, -2.5, 0, 0, 0, 0, 1e-3], np.float32)
    buf = codec.encode(x)
    assert np.frombuffer(buf[:12].tobytes(), "<f4").tolist() == [1.0, 0.0, f32(1e-3) / f32(127)]
    assert buf[12:].view(np.int8).tolist() == [127, 2, 4, -2, 0, 0, 0, 0, 127]


def test_settings_are_checked() -> None:
    for bad in (0, -1, 1 << 21, 2.0, True):
        with pytest.raises(ConfigError, match="block_size"):
            Int8Codec(bad)  # type: ignore[arg-type]
    with pytest.raises(LocalUsageError, match="unknown compression"):
        as_compression("int4")
    assert as_compression(None) is None and as_compression("none") is None
    comp = Int8Compression(4096)
    assert as_compression(comp) is comp and comp.name == "int8/4096"
    comp.residual(10)
    with pytest.raises(LocalUsageError, match="one Int8Compression per tensor"):
        comp.residual(11)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 120),
    n=st.integers(1, 700),
    block=st.sampled_from([3, 32, 256]),
)
def test_error_feedback_keeps_the_accumulated_error_bounded(
    seed: int, steps: int, n: int, block: int
) -> None:
    """One member's stream through the codec: with the residual fed back, the decoded values
    add up to the inputs' sum minus the last residual, whatever the number of steps."""
    rng = np.random.default_rng(seed)
    comp = Int8Compression(block)
    codec = comp.codec
    total_in = np.zeros(n)
    total_out = np.zeros(n)
    buf = np.empty(codec.encoded_bytes(n), np.uint8)
    for _ in range(steps):
        x = (rng.standard_normal(n) * rng.uniform(0.01, 10)).astype(np.float32)
        res = comp.residual(n)
        assert res is not None
        c = x + res
        new = comp.next_residual(n)
        codec.encode_into(c, buf, new)
        comp.commit(new)
        total_in += x
        total_out += codec.decode(buf, n)
    last = comp.residual(n)
    assert last is not None
    err = total_out - total_in
    # exactly -residual, up to the float32 rounding of x + residual in each step
    slack = 1e-6 * steps * (np.abs(total_in).max() + 10)
    np.testing.assert_allclose(err, -last, rtol=0, atol=slack)
    assert comp.residual_norm() == float(np.max(np.abs(last)))


@settings(max_examples=100, deadline=None)
@given(x=any_f32, block=st.sampled_from([1, 3, 16, 256]))
def test_the_cuda_kernels_reference_is_this_codec(x: np.ndarray, block: int) -> None:
    """``ftmesh.native.reference`` (what #14's CUDA kernels are checked against, bit for bit)
    gives the same scales, values and residuals as this codec (NaN bits aside)."""
    from ftmesh.native import reference

    codec = Int8Codec(block)
    buf = np.empty(codec.encoded_bytes(x.size), np.uint8)
    res = np.empty_like(x)
    codec.encode_into(x, buf, res)
    ref_res = np.zeros_like(x)
    with np.errstate(over="ignore"):  # decoding within 127 ulps of float32's max overflows
        scales, q = reference.int8_quantize(x, ref_res, block)
    np.testing.assert_array_equal(codec.block_scales(buf, x.size), scales)
    np.testing.assert_array_equal(buf[4 * codec.blocks(x.size) :].view(np.int8), q)
    np.testing.assert_array_equal(res, ref_res)
