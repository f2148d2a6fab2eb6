// bfloat16 helpers shared by attention.cpp and linear.cpp: 16-lane vector types, torch's
// float <-> bfloat16 conversions, and the bf16-pair dot-product step of AVX512-BF16's VDPBF16PS
// (the instruction, and its portable emulation with the same bits but for subnormals, which the
// instruction flushes).
#pragma once

#include <immintrin.h>

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

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
static inline v16 dp_hw(v16 acc, v16i a, uint32_t b) {
    return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32((int)b));
}

}  // namespace
