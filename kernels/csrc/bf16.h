// bfloat16 helpers shared by the attention kernels and linear.cpp: 16-lane vector types, torch's
// float <-> bfloat16 conversions, the bf16-pair dot-product step of AVX512-BF16's VDPBF16PS (the
// instruction, and emulations with the same bits but for subnormals, which the instruction
// flushes), and the ISA levels the kernels are compiled for.
//
// ISA levels (agentspec.kernels.cpu_isa.ISA_LEVELS has the same order; isa.cpp picks one):
//   0 scalar      portable C++ (the compiler's baseline vectors), mul + add
//   1 neon        Arm (aarch64 baseline), FMA
//   2 avx2        x86-64-v3: AVX2 + FMA, 256-bit vectors
//   3 avx512      x86-64-v4: AVX-512 F/BW/DQ/VL + FMA, 512-bit vectors, VDPBF16PS emulated
//   4 avx512bf16  x86-64-v4 + AVX512-BF16: the VDPBF16PS instruction
// Every level computes the same bits: a bf16 x bf16 product is exact in float32 (8-bit by 8-bit
// significands), so fma(a, b, acc) == acc + a * b rounded once, exactly what the instruction and
// the scalar emulation compute; only products below float32's normal range (|a * b| < 2^-126),
// which the instruction flushes to zero and the scalar path rounds, could differ.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define AGENTSPEC_X86 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#define AGENTSPEC_NEON 1
#endif

#include <cstdint>
#include <cstring>

namespace {

// GCC vector extensions: 16 floats, lowered to one zmm, two ymm or four xmm per dispatch variant;
// every operation is elementwise IEEE, so each lane computes the same bits in every variant.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16i load16i(const void* p) { v16i x; std::memcpy(&x, p, sizeof x); return x; }

// bfloat16 <-> float as torch converts them (round to nearest even; NaN -> 0x7FC0)
static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// 16 floats to bfloat16 as float_to_bf16 rounds them, the first n lanes stored
static inline void store_bf16(uint16_t* dst, v16 x, int n = 16) {
    const v16u u = (v16u)x;
    v16u r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    r = ((u & 0x7fffffffu) > 0x7f800000u) ? v16u{} + 0x7FC0u : r;
    uint16_t tmp[16];
    for (int l = 0; l < 16; ++l) tmp[l] = (uint16_t)r[l];
    std::memcpy(dst, tmp, sizeof(uint16_t) * n);
}

// acc[l] += a.hi[l] * b.hi + a.lo[l] * b.lo, as VDPBF16PS computes it: the products of two
// bfloat16 values are exact in float32, then two float32 adds, high pair first.
static inline v16 dp_emul(v16 acc, v16i a, uint32_t b) {
    const float bhi = bf16_to_float((uint16_t)(b >> 16)), blo = bf16_to_float((uint16_t)(b & 0xffffu));
    const v16 ahi = (v16)(a & (int32_t)0xffff0000u);
    const v16 alo = (v16)(a << 16);
    acc = acc + ahi * bhi;
    acc = acc + alo * blo;
    return acc;
}

#if defined(AGENTSPEC_X86)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
static inline v16 dp_hw(v16 acc, v16i a, uint32_t b) {
    return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32((int)b));
}

// VDPBF16PS's operands for the AVX512-BF16 attention kernels (prefill_bf16.cpp, attention_dp.inc):
// one bfloat16 pair broadcast to every lane, and 16 cache values as bfloat16 zero-extended to 32
// bits (a float32 cache's rounded to nearest even: exact for the bfloat16 values it holds)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
static inline __m512bh bf16_pair_bcast(uint32_t pair) {
    return (__m512bh)_mm512_set1_epi32((int)pair);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
static inline __m512i bf16_zext16(const float* p) {
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p)));
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
static inline __m512i bf16_zext16(const uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The emulation with fused multiply-adds (same bits: the products are exact), 512-bit vectors
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
static inline v16 dp_fma512(v16 acc, v16i a, uint32_t b) {
    const __m512 bhi = _mm512_set1_ps(bf16_to_float((uint16_t)(b >> 16)));
    const __m512 blo = _mm512_set1_ps(bf16_to_float((uint16_t)(b & 0xffffu)));
    const __m512i ai = (__m512i)a;
    const __m512 ahi = _mm512_castsi512_ps(_mm512_and_si512(ai, _mm512_set1_epi32((int)0xffff0000u)));
    const __m512 alo = _mm512_castsi512_ps(_mm512_slli_epi32(ai, 16));
    __m512 r = _mm512_fmadd_ps(ahi, bhi, (__m512)acc);
    return (v16)_mm512_fmadd_ps(alo, blo, r);
}

// AVX2 + FMA: the 16 bf16 pairs of one VDPBF16PS step (a panel row of weights or of keys /
// values) as their high and low bf16 halves widened to float32 (exact), two 8-lane halves each;
// dp256 adds the high product first, as the instruction does. The AVX2 loops use these on
// 256-bit accumulators directly (16-lane vector-extension values would live on the stack).
struct Pairs256 {
    __m256 h0, h1, l0, l1;
};

__attribute__((target("avx2,fma"))) static inline Pairs256 load_pairs256(const uint32_t* p) {
    const __m256i m = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i w0 = _mm256_loadu_si256((const __m256i*)p), w1 = _mm256_loadu_si256((const __m256i*)(p + 8));
    return {_mm256_castsi256_ps(_mm256_and_si256(w0, m)), _mm256_castsi256_ps(_mm256_and_si256(w1, m)),
            _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16))};
}

__attribute__((target("avx2,fma"))) static inline __m256 dp256(__m256 acc, __m256 h, __m256 l, __m256 bh,
                                                               __m256 bl) {
    return _mm256_fmadd_ps(l, bl, _mm256_fmadd_ps(h, bh, acc));
}
#endif

#if defined(AGENTSPEC_NEON)
// Arm: the emulation with NEON fused multiply-adds, the 16 lanes as four quarters
static inline v16 dp_neon(v16 acc, v16i a, uint32_t b) {
    const float32x4_t bhi = vdupq_n_f32(bf16_to_float((uint16_t)(b >> 16)));
    const float32x4_t blo = vdupq_n_f32(bf16_to_float((uint16_t)(b & 0xffffu)));
    uint32x4_t a4[4];
    float32x4_t c4[4];
    std::memcpy(a4, &a, sizeof a4);
    std::memcpy(c4, &acc, sizeof c4);
    for (int h = 0; h < 4; ++h) {
        const float32x4_t ahi = vreinterpretq_f32_u32(vandq_u32(a4[h], vdupq_n_u32(0xffff0000u)));
        const float32x4_t alo = vreinterpretq_f32_u32(vshlq_n_u32(a4[h], 16));
        c4[h] = vfmaq_f32(vfmaq_f32(c4[h], ahi, bhi), alo, blo);
    }
    v16 r;
    std::memcpy(&r, c4, sizeof r);
    return r;
}
#endif

}  // namespace
