// float16 / bfloat16 accumulation in float32; the NumPy reference is
// ftmesh/native/reference.py.
//
// Theory of operation: half-precision values travel as their 16-bit patterns
// (unsigned short), so no CUDA header is needed and NVRTC compiles this file on a machine
// with no CUDA toolkit. Widening to float32 is exact (float16 through the PTX cvt
// instruction, bfloat16 by a shift). Narrowing rounds to nearest, ties to even:
// float16 through `cvt.rn.f16.f32` (IEEE, subnormals kept, overflow to inf), bfloat16 with
// the integer form of the same rounding. NaN results are canonical: float16 writes 0x7e00,
// bfloat16 0x7fc0, whatever the NaN's sign and payload (a NaN made by an operation has
// another sign on x86 than on a GPU). Each float operation is an
// explicit round-to-nearest intrinsic, so results equal NumPy's float32 arithmetic bit for
// bit. Sums of two halves computed in float32 and rounded once are the correctly rounded
// half sums (float32 has more than 2p+2 bits for both formats, so the double rounding is
// innocuous).

__device__ __forceinline__ float ftmesh_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short ftmesh_f32_to_f16(float f) {
    const unsigned int bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7e00u;
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float ftmesh_bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ unsigned short ftmesh_f32_to_bf16(float f) {
    const unsigned int bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
    return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#define FTMESH_GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

#define FTMESH_HALF_KERNELS(NAME, TO_F32, FROM_F32)                                        \
    /* acc[i] += float32(x[i]) */                                                          \
    extern "C" __global__ void ftmesh_accumulate_##NAME(                                   \
        float* __restrict__ acc, const unsigned short* __restrict__ x, long long n) {      \
        FTMESH_GRID_STRIDE(i, n) { acc[i] = __fadd_rn(acc[i], TO_F32(x[i])); }             \
    }                                                                                      \
    /* out[i] = round(acc[i]) */                                                           \
    extern "C" __global__ void ftmesh_round_##NAME(                                        \
        unsigned short* __restrict__ out, const float* __restrict__ acc, long long n) {    \
        FTMESH_GRID_STRIDE(i, n) { out[i] = FROM_F32(acc[i]); }                            \
    }                                                                                      \
    /* out[i] = round(float32(a[i]) + float32(b[i])): the ring's reduce-on-arrival */      \
    extern "C" __global__ void ftmesh_sum_##NAME(                                          \
        unsigned short* out, const unsigned short* a, const unsigned short* b,             \
        long long n) {                                                                     \
        FTMESH_GRID_STRIDE(i, n) { out[i] = FROM_F32(__fadd_rn(TO_F32(a[i]), TO_F32(b[i]))); } \
    }

FTMESH_HALF_KERNELS(f16, ftmesh_f16_to_f32, ftmesh_f32_to_f16)
FTMESH_HALF_KERNELS(bf16, ftmesh_bf16_to_f32, ftmesh_f32_to_bf16)
