"""The CUDA kernels of native/ without a GPU: each compiles with NVRTC (for compute_80 and
compute_90, with the options CuPy uses on a GPU) to exactly its listed entry points and
only round-to-nearest float instructions; their NumPy references (the CPU path and the
oracle the GPU check compares against) agree with independent oracles (torch's conversions,
a scalar re-implementation of the int8 codec) under Hypothesis."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ftmesh.native import (
    KERNEL_ARCHES,
    KERNEL_OPTIONS,
    KERNEL_SOURCES,
    nvrtc,
    read_source,
    reference,
    source_dir,
)
from ftmesh.native.launchers import _ENTRIES

torch = pytest.importorskip("torch")


def test_every_cu_file_is_listed() -> None:
    on_disk = sorted(p.name for p in source_dir().glob("*.cu"))
    assert on_disk == sorted(KERNEL_SOURCES) == sorted(_ENTRIES)


@pytest.mark.parametrize("arch", KERNEL_ARCHES)
@pytest.mark.parametrize("name", KERNEL_SOURCES)
def test_kernel_compiles_with_nvrtc(name: str, arch: str) -> None:
    out = nvrtc.compile_source(read_source(name), name, arch, KERNEL_OPTIONS)
    assert sorted(out.entries()) == sorted(_ENTRIES[name])
    assert f".target sm_{arch.split('_')[1]}" in out.ptx
    float_ops = set(
        re.findall(r"\b((?:add|sub|mul|div|fma|cvt|max|abs)(?:\.\w+)*\.f32)\b", out.ptx)
    )
    assert float_ops, "no float instruction found: the PTX check would be vacuous"
    assert not [op for op in float_ops if op.startswith("fma")], float_ops
    assert not [op for op in float_ops if ".approx" in op or ".ftz" in op or ".full" in op]
    if name == "int8_codec.cu":
        assert "div.rn.f32" in float_ops and "cvt.rni.s32.f32" in out.ptx


def test_a_broken_kernel_fails_with_the_compiler_log() -> None:
    with pytest.raises(nvrtc.NvrtcError) as info:
        nvrtc.compile_source(
            'extern "C" __global__ void k() { undefined_x = 1; }',
            "bad.cu",
            "compute_90",
            KERNEL_OPTIONS,
        )
    assert "undefined_x" in info.value.log


# -- float16 / bfloat16 -----------------------------------------------------------------

f32_bits = hnp.arrays(np.uint32, st.integers(1, 200), elements=st.integers(0, 2**32 - 1))
u16_bits = hnp.arrays(np.uint16, st.integers(1, 200), elements=st.integers(0, 2**16 - 1))
EDGES = np.array(
    [
        0,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00001,
        0xFFFFFFFF,
        0x7F7FFFFF,
        0x477FEFFF,
        0x477FF000,
        0x33000000,
        0x33000001,
        0x00000001,
        0x3F808000,
        0x3F818000,
    ],
    np.uint32,
)


def _torch_bits(f: np.ndarray, dtype: object) -> np.ndarray:
    return torch.from_numpy(f).to(dtype).view(torch.int16).numpy().view(np.uint16)


@settings(max_examples=60, deadline=None)
@given(f32_bits)
def test_narrowing_matches_torch(bits: np.ndarray) -> None:
    f = np.concatenate([bits, EDGES]).view(np.float32)
    nan = np.isnan(f)
    bf = reference.f32_to_bf16(f)
    assert np.array_equal(bf[~nan], _torch_bits(f, torch.bfloat16)[~nan])
    assert (bf[nan] == 0x7FC0).all()  # torch's own NaN bits vary (0x7fc0, 0xffff)
    h = reference.f32_to_f16(f)
    assert np.array_equal(h[~nan], _torch_bits(f, torch.float16)[~nan])
    assert (h[nan] == 0x7E00).all()


@settings(max_examples=60, deadline=None)
@given(u16_bits, st.data())
def test_half_sum_and_accumulate(a: np.ndarray, data: st.DataObject) -> None:
    b = data.draw(hnp.arrays(np.uint16, a.shape, elements=st.integers(0, 2**16 - 1)))
    for dtype, tdt in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        ta, tb = (torch.from_numpy(v.view(np.int16)).view(tdt) for v in (a, b))
        want = (ta.float() + tb.float()).to(tdt).view(torch.int16).numpy().view(np.uint16)
        got = reference.sum_half(a, b, dtype)
        keep = ~np.isnan((ta.float() + tb.float()).numpy())
        assert np.array_equal(got[keep], want[keep])
        widen = reference.f16_to_f32 if dtype == "float16" else reference.bf16_to_f32
        assert np.array_equal(np.isnan(widen(got)), ~keep)
        acc = np.arange(a.size, dtype=np.float32)
        start = acc.copy()
        reference.accumulate_half(acc, a, dtype)
        widened = ta.float().numpy()
        both = ~np.isnan(widened)
        assert np.array_equal(acc[both], (start + widened)[both])


# -- int8 block codec ----------------------------------------------------------------------


def _scalar_codec(
    x: np.ndarray, r: np.ndarray | None, bs: int
) -> tuple[list[np.float32], list[int], list[np.float32] | None]:
    """The agreed definition, one element at a time with float32 scalars."""
    f = np.float32
    v = [f(x[i]) + (f(r[i]) if r is not None else f(0)) for i in range(x.size)]
    scales: list[np.float32] = []
    qs: list[int] = []
    res: list[np.float32] | None = [] if r is not None else None
    for s in range(0, len(v), bs):
        blk = v[s : s + bs]
        if not all(np.isfinite(e) for e in blk):
            nan = any(np.isnan(e) for e in blk)
            scales.append(np.uint32(0x7FC00000).view(np.float32) if nan else f(np.inf))
            qs += [0] * len(blk)
            if res is not None:
                res += [f(0)] * len(blk)
            continue
        scale = f(max(abs(e) for e in blk)) / f(127.0)
        scales.append(scale)
        for e in blk:
            q = 0 if scale == 0 else int(min(max(np.rint(e / scale), -127), 127))
            qs.append(q)
            if res is not None:
                res.append(f(e - f(f(q) * scale)))
    return scales, qs, res


floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
finite32 = st.floats(-(2.0**100), 2.0**100, width=32)


@settings(max_examples=80, deadline=None)
@given(
    hnp.arrays(np.float32, st.integers(1, 70), elements=st.one_of(finite32, floats32)),
    st.integers(1, 33),
    st.booleans(),
    st.data(),
)
def test_int8_reference_matches_scalar_definition(
    x: np.ndarray, bs: int, feedback: bool, data: st.DataObject
) -> None:
    r = (
        data.draw(hnp.arrays(np.float32, x.shape, elements=st.floats(-1e3, 1e3, width=32)))
        if feedback
        else None
    )
    want_s, want_q, want_r = _scalar_codec(x, r, bs)
    r_ref = None if r is None else r.copy()
    scales, q = reference.int8_quantize(x, r_ref, bs)
    assert np.array_equal(scales.view(np.uint32), np.array(want_s, np.float32).view(np.uint32))
    assert q.tolist() == want_q
    if r_ref is not None:
        assert np.array_equal(r_ref.view(np.uint32), np.array(want_r, np.float32).view(np.uint32))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 600), elements=finite32), st.sampled_from([1, 7, 256]))
def test_int8_decode_error_is_half_a_step_and_feedback_keeps_it(x: np.ndarray, bs: int) -> None:
    residual = np.zeros_like(x)
    scales, q = reference.int8_quantize(x, residual, bs)
    assert scales.size == reference.n_blocks(x.size, bs) and np.abs(q.astype(int)).max() <= 127
    decoded = reference.int8_dequantize(scales, q, bs)
    step = np.repeat(scales, bs)[: x.size].astype(np.float64)
    err = np.abs(x.astype(np.float64) - decoded)
    normal = step >= 2.0**-126  # a subnormal (or zero) scale has fewer bits than the bound needs
    assert (err[normal] <= step[normal] * 0.5 * (1 + 1e-5)).all()
    # error feedback: what was sent plus what was kept is what was meant (to rounding)
    np.testing.assert_allclose(decoded + residual, x, rtol=1e-6, atol=1e-30)


def test_int8_poisoned_block_decodes_to_nan_and_drops_its_residual() -> None:
    x = np.array([1.0, np.inf, 3.0, 4.0, 5.0, -6.0], np.float32)
    residual = np.full(6, 0.25, np.float32)
    scales, q = reference.int8_quantize(x, residual, block_size=3)
    assert scales[0] == np.inf  # max|v| / 127 of a block holding an infinity
    assert scales[1] == np.float32(5.75) / np.float32(127)
    assert q[:3].tolist() == [0, 0, 0] and residual[:3].tolist() == [0.0, 0.0, 0.0]
    decoded = reference.int8_dequantize(scales, q, 3)
    assert np.isnan(decoded[:3]).all() and np.isfinite(decoded[3:]).all()
    zeros = np.zeros(5, np.float32)
    s0, q0 = reference.int8_quantize(zeros, None, 2)
    assert (s0 == 0).all() and (q0 == 0).all()


def test_int8_wire_layout_sizes() -> None:
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    scales, q = reference.int8_quantize(x)
    assert scales.dtype == np.float32 and scales.size == 4 and q.dtype == np.int8
    wire = scales.astype("<f4").tobytes() + q.tobytes()
    assert len(wire) == 4 * 4 + 1000
