// Blockwise int8 codec with error feedback (the int8 bullet of docs/DESIGN-NOTES.md,
// "Interfaces agreed"); the NumPy reference is ftmesh/native/reference.py.
//
// Theory of operation: one CUDA block encodes one codec block of `block_size` float32
// elements (the last codec block may be short). Pass 1 reduces max|v| and a "non-finite
// seen" flag in shared memory; max is exact in any order, so the scale is the reference's
// bit for bit. Pass 2 quantizes. Every float operation is an explicit round-to-nearest
// intrinsic (__fadd_rn, __fdiv_rn, ...): these are never contracted into FMAs and never
// relaxed by fast-math, which is what makes the output identical to NumPy's float32.
//
//   v      = x + residual                       (residual optional: error feedback)
//   scale  = float32(max|v|) / 127.0f           (float32 division, round to nearest)
//   q      = clip(rint(v / scale), -127, 127)   (rint = round half to even)
//   x'     = float32(q) * scale
//   residual <- v - x'
//
// A block whose scale is 0 encodes q = 0 (and keeps v in the residual). A block holding a
// NaN or an infinity is "poisoned": its scale is what max|v| / 127 gives there (+inf, or NaN
// if the block holds a NaN, written as 0x7fc00000), every q is 0, so the block decodes to
// NaN (0 * inf), loudly (a GradScaler sees the overflow), and its residual is reset to 0 so
// that the poison is not carried into later steps. This is ftmesh.compression.int8's rule;
// the bits of a NaN are not part of it (NumPy keeps an input NaN's payload, CUDA does not).
//
// Sizes are `long long`: a run may hold more than 2^31 elements.

#define FTMESH_THREADS 256
#define FTMESH_CANONICAL_NAN 0x7fc00000u

// 0 for a finite value, 1 for an infinity, 2 for a NaN.
__device__ __forceinline__ int ftmesh_nonfinite(float v) {
    const unsigned int bits = __float_as_uint(v) & 0x7fffffffu;
    return bits < 0x7f800000u ? 0 : (bits == 0x7f800000u ? 1 : 2);
}

extern "C" __global__ void ftmesh_int8_quantize(
    const float* __restrict__ x,
    float* __restrict__ residual,      // may be NULL: no error feedback
    float* __restrict__ scales,        // one per codec block
    signed char* __restrict__ q,       // one per element
    long long n,
    int block_size)
{
    __shared__ float s_max[FTMESH_THREADS];
    __shared__ int s_bad[FTMESH_THREADS];
    const long long b = blockIdx.x;
    const long long start = b * (long long)block_size;
    long long stop = start + block_size;
    if (stop > n) stop = n;
    const int t = threadIdx.x;

    float m = 0.0f;
    int bad = 0;
    for (long long i = start + t; i < stop; i += blockDim.x) {
        float v = x[i];
        if (residual != 0) v = __fadd_rn(v, residual[i]);
        const int kind = ftmesh_nonfinite(v);
        if (kind) bad |= kind;
        else m = fmaxf(m, fabsf(v));
    }
    s_max[t] = m;
    s_bad[t] = bad;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step >>= 1) {
        if (t < step) {
            s_max[t] = fmaxf(s_max[t], s_max[t + step]);
            s_bad[t] = s_bad[t] | s_bad[t + step];
        }
        __syncthreads();
    }
    const bool poisoned = s_bad[0] != 0;
    const float scale = (s_bad[0] & 2) ? __uint_as_float(FTMESH_CANONICAL_NAN)
                      : (s_bad[0] & 1) ? __uint_as_float(0x7f800000u)
                                       : __fdiv_rn(s_max[0], 127.0f);
    if (t == 0) scales[b] = scale;

    for (long long i = start + t; i < stop; i += blockDim.x) {
        if (poisoned) {
            q[i] = 0;
            if (residual != 0) residual[i] = 0.0f;
            continue;
        }
        float v = x[i];
        if (residual != 0) v = __fadd_rn(v, residual[i]);
        int qi = 0;
        if (scale != 0.0f) {
            qi = __float2int_rn(__fdiv_rn(v, scale));
            qi = qi > 127 ? 127 : (qi < -127 ? -127 : qi);
        }
        q[i] = (signed char)qi;
        if (residual != 0) residual[i] = __fsub_rn(v, __fmul_rn((float)qi, scale));
    }
}

// acc[i] += float32(q[i]) * scales[i / block_size]: one member's encoded run added into a
// float32 sum (a shard owner's accumulation, or a member's decode into zeros).
extern "C" __global__ void ftmesh_int8_dequantize_accumulate(
    const float* __restrict__ scales,
    const signed char* __restrict__ q,
    float* __restrict__ acc,
    long long n,
    int block_size)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float s = scales[i / block_size];
        acc[i] = __fadd_rn(acc[i], __fmul_rn((float)q[i], s));
    }
}
